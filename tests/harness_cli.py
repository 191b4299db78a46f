#!/usr/bin/python3
"""A small coding-agent CLI for the harness tests (the system python, standard library only): it speaks the OpenAI
chat-completions API at $OPENAI_BASE_URL with one tool, `write_file`, runs the calls the model makes in its working
directory, and stops at the model's first reply without a call. $FAKE_MODE makes it misbehave: `hang` (never
answers, nor do its children), `exit` (fails at once), `crash` (fails after its first model call), `silent` (exits
0 without calling the model)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

TOOLS = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a file (path relative to the working directory).",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}]


def chat(messages):
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages, "tools": TOOLS}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]["message"]


def main():
    mode = os.environ.get("FAKE_MODE", "")
    print(f"fake agent in {os.getcwd()} as {os.environ.get('USER')}", flush=True)
    if mode == "exit":
        print("fake agent: no API key configured, giving up", flush=True)
        sys.exit(3)
    if mode == "silent":
        return
    if mode == "hang":
        subprocess.Popen(["sleep", "1000"], start_new_session=True)
        print("fake agent: thinking...", flush=True)
        time.sleep(1000)
    messages = [{"role": "user", "content": sys.argv[1]}]
    for _ in range(6):
        reply = chat(messages)
        messages.append(reply)
        if mode == "crash":
            raise RuntimeError("fake agent: segfault in the tool runner")
        if not reply.get("tool_calls"):
            print(reply.get("content"), flush=True)
            return
        for call in reply["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            with open(args["path"], "w") as f:
                f.write(args["content"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"wrote {args['path']}"})


main()
