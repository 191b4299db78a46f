"""The chat APIs against the request bodies the real CLIs sent (tests/data/harness_requests/, captured by
`TURNRL_CAPTURE_HARNESS=tests/data/harness_requests pytest -m slow tests/test_harness_clis.py`): Claude Code 2.1.328
(Anthropic Messages, also with a sub-agent of its Agent tool), Codex CLI 0.171.0 (Responses, with its namespace and
hosted tools, and with a sub-agent) and opencode 1.18.33 (chat completions). Each CLI's requests are replayed in
order on a session of `turnrl serve`'s app over the same scripted policy, so each echoes the replies it got: every
one is answered (no 400), the conversation continues the recorded tokens, and the trajectories are what the CLI's
run gave. Runs in the default suite: the CLIs themselves are not needed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fakes import ScriptedEngine
from harness_policy import claude_subagent_policy, codex_subagent_policy, harness_policy
from test_harness import assert_token_exact

from turnrl.render import ChatRenderer
from turnrl.serve import anthropic, responses
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.sessions import ChatProxy
from turnrl.types import SegmentSource

CAPTURED = Path(__file__).parent / "data" / "harness_requests"


def captured(name: str) -> list[dict]:
    return json.loads((CAPTURED / f"{name}.json").read_text())


@pytest.mark.parametrize(("name", "policy", "pieces"), [
    ("claude-code", harness_policy, [2]),        # its agent's two calls, one continuing the other
    ("claude-code-subagent", claude_subagent_policy, [2, 3]),  # the main agent, and the one its Agent tool ran
    ("codex", harness_policy, [2]),
    ("codex-subagent", codex_subagent_policy, [3, 2]),  # the main agent, and the sub-agent it spawned
    ("opencode", harness_policy, [1, 2]),        # the title call, and the agent's two calls
])
def test_every_request_a_real_cli_sent_is_served_and_continues_its_tokens(qwen3_tokenizer, name, policy, pieces):
    bodies = captured(name)
    engine = ScriptedEngine(qwen3_tokenizer, policy())
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer), model_name="turnrl-policy")
    server = ServerThread(create_app(engine, proxy, model_name="turnrl-policy", token_level=False, max_body_mb=64))
    url = server.start()
    try:
        for request in bodies:
            answer = httpx.post(f"{url}/sessions/replay/v1{request['path']}", json=request["body"], timeout=60)
            assert answer.status_code == 200, answer.text[:500]
            assert "error" not in answer.text.split("\n", 1)[0]
        trajectories = proxy.trajectories("replay")
    finally:
        server.stop()
    assert sorted(t.num_turns for t in trajectories) == sorted(pieces)
    for traj in trajectories:
        assert all(turn.extra["continued"] for turn in traj.turns[1:])  # built on the recorded tokens
        assert_token_exact(traj, engine)
    assert any(s.source == SegmentSource.TOOL for t in trajectories for s in t.segments)


def test_claude_codes_requests_in_the_proxys_terms():
    """Its top-level system blocks, then the user turn, then its environment as a `system` message inside
    `messages`; its deferred placeholder tool is not offered; thinking, context_management, output_config and
    metadata.user_id are accepted."""
    first = captured("claude-code")[0]["body"]
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(first)
    call = anthropic.call_from_anthropic(first)
    assert [m["role"] for m in call.messages] == ["system", "user", "system"]
    assert "You are a Claude agent" in call.messages[0]["content"]
    assert call.messages[2]["content"].startswith("# Environment")
    names = [t["function"]["name"] for t in call.tools or []]
    assert "Write" in names and "Bash" in names and "DeferredToolPlaceholder" not in names
    assert call.not_offered == ["DeferredToolPlaceholder"]


def test_codexs_requests_in_the_proxys_terms():
    """Its namespace's tools are functions named `multi_agent_v1__<name>`; web_search is not offered; include,
    reasoning, prompt_cache_key, client_metadata and store are accepted; a function_call it echoes with a namespace
    is that function again."""
    bodies = captured("codex-subagent")
    call = responses.call_from_responses(bodies[0]["body"])
    names = [t["function"]["name"] for t in call.tools or []]
    assert {"exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"} <= set(names)
    assert "web_search" not in names and call.not_offered == ["web_search"]
    echoed = responses.call_from_responses(bodies[1]["body"])
    [spawn] = [c for m in echoed.messages for c in m.get("tool_calls") or []]
    assert spawn["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert [m["role"] for m in call.messages[:4]] == ["developer", "developer", "user", "user"]
