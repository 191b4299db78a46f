"""The OpenAI-compatible proxy: chat requests in, exact tokens recorded per session, trajectories out.

An external agent (a plain `openai` client loop, LangGraph, anything) talks to `/sessions/{id}/v1` as if it were
OpenAI. For every call the proxy records the exact prompt token ids it sent to the engine, the completion
token ids and their sampling logprobs. Nothing recorded is ever re-tokenized text.

How a request becomes prompt tokens (masks are born with the tokens, as in `drive`):
- If the request continues an earlier call of the session — its messages start with that call's messages,
  followed by the assistant message this proxy returned for it, then new messages (tool results, a user
  turn) — the prompt is that call's prompt + completion tokens, exactly as recorded, plus the template's
  turn closing and the observation delta of the new messages (`ChatRenderer.observation_ids`, the same
  dummy-prefix rendering `drive` uses). Messages are compared after normalisation (content None == "",
  text parts joined, tool-call arguments compared as parsed JSON), so a client that echoes the reply back
  in its own shape still matches. The most recent matching call wins.
- Otherwise (the agent rewrote or dropped history, changed tools, or it is the first call) the request is
  rendered afresh with the chat template.

How a session becomes trajectories (`assemble_trajectories`): calls are taken in the order they completed.
A call whose prompt extends an open trajectory's token stream (prompt + everything after it) exactly is
appended to it: the tokens between the stream and the prompt become mask-0 segments (template closing,
then tool/env observation), the completion a mask-1 model segment with its logprobs. A call that extends no
open trajectory starts a new one. So an agent that keeps its history yields one trajectory; one that drops
or rewrites history yields several, which share `episode_id` (the session id) and the episode's
reward.

Replies: tool calls are parsed from the completion text (`tool_parser`, hermes by default) into OpenAI
`tool_calls` (finish_reason "tool_calls"); reasoning goes to `reasoning_content`; a malformed call is returned as
the text the model wrote (the parse errors are kept in the trajectory's turn notes). `tool_choice: "none"`
turns parsing off; "required" or a named tool is treated as "auto" (decoding is not constrained). Refused with a
400 that names the field: `stream: true`, `n > 1`, non-text content parts, multi-token `stop` strings.

Engine calls run on the caller's event loop: a session opened with `loop=` (the RolloutManager's loop) has its
engine calls scheduled there even when the HTTP server runs in another thread, so the engine is used exactly
as `drive` uses it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from turnrl.engines.base import Engine
from turnrl.reasoning import split_reasoning
from turnrl.render import ChatRenderer, RenderError
from turnrl.rollout import TrajectoryBuilder, derive_seed
from turnrl.tools.parsers import get_parser
from turnrl.types import (
    FinishReason,
    GenerateOutput,
    GenerateSpan,
    Message,
    SamplingParams,
    SegmentSource,
    TerminationReason,
    Trajectory,
    TurnRecord,
)

log = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant", "tool"}


class ChatRequestError(ValueError):
    """A chat request this proxy cannot serve; the message is shown to the client (HTTP 400)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


class SessionNotFound(KeyError):
    """No session with this id (HTTP 404)."""


@dataclass
class RecordedCall:
    """One chat completion: exactly what the engine was given and what it returned."""

    index: int
    """0-based position in the session, in completion order."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    messages: list[Message]
    """The request's messages as the client sent them."""
    tools: list[dict] | None
    reply: Message
    """The assistant message returned to the client."""
    base_len: int | None = None
    """When the prompt continues an earlier call: the length of that call's prompt + completion."""
    delta_sources: list[tuple[SegmentSource, int]] = field(default_factory=list)
    """How `prompt_ids[base_len:]` splits by source (template closing, then the observation)."""
    cached_prompt_tokens: int = 0
    gen_time_s: float = 0.0
    start_ns: int = 0
    """When the engine call started (ns since the epoch), for the turn's trace span."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Tool-call parse errors, request sampling fields that were ignored, ..."""


@dataclass
class Session:
    """The calls of one agent episode (or one external conversation)."""

    id: str
    loop: asyncio.AbstractEventLoop | None = None
    """Run engine calls on this event loop (None: on the server's own loop)."""
    sampling: SamplingParams | None = None
    """Fixed sampling for every call (training); None honours the request's temperature/top_p/seed."""
    max_new_tokens: int | None = None
    """Cap on each call's completion (the request's max_tokens may lower it)."""
    max_calls: int | None = None
    """Model calls allowed; the next one is refused (and `limit_reached` set)."""
    calls: list[RecordedCall] = field(default_factory=list)
    limit_reached: bool = False
    created: float = field(default_factory=time.time)


class ChatProxy:
    """Serves OpenAI chat completions per session on a token-level `Engine`, recording exact tokens.

    Args:
        engine: any Engine (embedded, router, HTTP, SGLang, a scripted fake).
        renderer: the policy's chat template.
        model_name: reported in responses and `/v1/models`.
        tool_parser: the tool-call format of the model's text (`hermes`, `qwen3_coder`).
        sampling: defaults for sessions without fixed sampling.
        create_sessions: a request to an unknown session id opens it (`turnrl serve`); False answers 404, so
            only sessions opened with `open_session` exist (the training gateway).
    """

    def __init__(self, engine: Engine, renderer: ChatRenderer, *, model_name: str = "turnrl",
                 tool_parser: str = "hermes", sampling: SamplingParams | None = None, create_sessions: bool = True):
        self.engine, self.renderer, self.model_name = engine, renderer, model_name
        self.tool_parser, self.create_sessions = tool_parser, create_sessions
        get_parser(tool_parser)  # fail on an unknown name now, not on the first call
        self.sampling = sampling or SamplingParams()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    # ---- sessions --------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, **settings: Any) -> Session:
        """A new session (`settings`: the Session fields loop, sampling, max_new_tokens, max_calls)."""
        session = Session(id=session_id or uuid.uuid4().hex, **settings)
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id!r} is already open")
            self._sessions[session.id] = session
        return session

    def session(self, session_id: str, *, create: bool = False) -> Session:
        with self._lock:
            if session_id not in self._sessions:
                if not create:
                    raise SessionNotFound(session_id)
                self._sessions[session_id] = Session(id=session_id)
            return self._sessions[session_id]

    def close_session(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def trajectories(self, session_id: str, **ids: Any) -> list[Trajectory]:
        """The session's calls assembled into trajectories (see `assemble_trajectories` for `ids`)."""
        return assemble_trajectories(self.session(session_id), **ids)

    # ---- the chat completion ---------------------------------------------------------------------
    async def chat_completion(self, session_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one OpenAI `chat.completions.create` request body; returns the response body."""
        messages, tools = _validate_request(request)
        session = self.session(session_id, create=self.create_sessions)
        if session.max_calls is not None and len(session.calls) >= session.max_calls:
            session.limit_reached = True
            raise ChatRequestError(f"session {session.id!r} reached its limit of {session.max_calls} model calls "
                                   "(rollout.max_turns)", code="turn_limit")
        prompt_ids, base_len, delta_sources = self._prompt(session, messages, tools)
        params, notes = self._sampling(session, request)
        t0, start_ns = time.perf_counter(), time.time_ns()
        out = await _on_loop(session.loop, self.engine.generate(prompt_ids, params, request_id=session.id))
        reply, finish, parse_notes = self._reply(out, tools, request.get("tool_choice"), len(session.calls))
        call = RecordedCall(
            index=len(session.calls), prompt_ids=list(prompt_ids), completion_ids=list(out.token_ids),
            logprobs=list(out.logprobs), finish_reason=out.finish_reason, policy_version=out.policy_version,
            # copies: an in-process caller goes on appending to its lists, and the record must not change
            messages=copy.deepcopy(messages), tools=copy.deepcopy(tools), reply=reply, base_len=base_len,
            delta_sources=delta_sources,
            cached_prompt_tokens=out.cached_prompt_tokens, gen_time_s=time.perf_counter() - t0, start_ns=start_ns,
            notes={**notes, **parse_notes},
        )
        session.calls.append(call)
        return self._response(call, finish, request)

    def _prompt(self, session: Session, messages: list[Message], tools: list[dict] | None
                ) -> tuple[list[int], int | None, list[tuple[SegmentSource, int]]]:
        """(prompt ids, base_len, delta_sources): continue a recorded call when the messages do (module doc)."""
        rendered = [_for_template(m) for m in messages]
        tools_key = _tools_key(tools)
        for call in reversed(list(session.calls)):
            n = len(call.messages)
            if len(messages) <= n + 1 or _tools_key(call.tools) != tools_key:
                continue
            if _canonical(messages[n]) != _canonical(call.reply):
                continue
            if any(_canonical(a) != _canonical(b) for a, b in zip(messages[:n], call.messages, strict=True)):
                continue
            new = rendered[n + 1:]
            try:
                observation = self.renderer.observation_ids(new, tools)
            except RenderError as e:  # this template cannot render these messages as a delta: render afresh
                log.info("session %s: rendering the whole conversation (%s)", session.id, e)
                break
            closing = self.renderer.turn_closing_ids(call.completion_ids)
            base = call.prompt_ids + call.completion_ids
            source = SegmentSource.TOOL if any(m["role"] == "tool" for m in new) else SegmentSource.ENV
            return base + closing + observation, len(base), [(SegmentSource.TEMPLATE, len(closing)),
                                                            (source, len(observation))]
        try:
            return self.renderer.initial_ids(rendered, tools), None, []
        except Exception as e:  # a template error is the request's fault (bad roles, bad tools)
            raise ChatRequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def _sampling(self, session: Session, request: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
        base = session.sampling or self.sampling
        fields: dict[str, Any] = {}
        notes: dict[str, Any] = {}
        asked = {k: request[k] for k in ("temperature", "top_p", "seed") if request.get(k) is not None}
        if session.sampling is None:
            fields.update(asked)
        else:  # training: the trainer's sampling is the policy; the agent may not change it
            fields["seed"] = derive_seed(base.seed, session.id, len(session.calls) + 1)
            ignored = {k: v for k, v in asked.items() if k != "seed" and v != getattr(base, k)}
            if ignored:
                notes["ignored_request_sampling"] = ignored
        cap = session.max_new_tokens or base.max_new_tokens
        wanted = request.get("max_completion_tokens") or request.get("max_tokens")
        fields["max_new_tokens"] = min(cap, int(wanted)) if wanted else cap
        stops = set(base.stop_token_ids) | self.renderer.end_of_turn_ids | self._stop_token_ids(request.get("stop"))
        fields["stop_token_ids"] = tuple(sorted(stops))
        try:
            return dataclasses.replace(base, **fields), notes
        except (TypeError, ValueError) as e:
            raise ChatRequestError(f"bad sampling fields: {e}") from None

    def _stop_token_ids(self, stop: Any) -> set[int]:
        """OpenAI `stop` strings, each of which must be one token (this proxy stops on token ids only)."""
        if stop is None:
            return set()
        ids = set()
        for text in [stop] if isinstance(stop, str) else list(stop):
            encoded = self.renderer.encode(text)
            if len(encoded) != 1:
                raise ChatRequestError(f"stop string {text!r} is {len(encoded)} tokens; this server stops on token ids, "
                                       "so each stop string must be exactly one token")
            ids.add(encoded[0])
        return ids

    def _reply(self, out: GenerateOutput, tools: list[dict] | None, tool_choice: Any, index: int
               ) -> tuple[Message, str, dict[str, Any]]:
        """The assistant message, the OpenAI finish_reason, and notes (parse errors)."""
        text = self.renderer.assistant_text(out.token_ids)
        finish = "stop" if out.finish_reason == FinishReason.STOP else "length"  # abort: the reply is cut short
        if tools and tool_choice != "none":
            parsed = get_parser(self.tool_parser, tools).parse(text)
            reasoning, content = parsed.reasoning, parsed.content
            notes = {"tool_call_errors": parsed.errors} if parsed.errors else {}
            if parsed.errors and not parsed.calls:
                content = split_reasoning(text)[1].strip()  # show the model's malformed call as it wrote it
            if parsed.calls:
                message: Message = {"role": "assistant", "content": content or None, "tool_calls": [
                    {"id": f"call_{index}_{i}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                    for i, c in enumerate(parsed.calls)
                ]}
                if finish == "stop":
                    finish = "tool_calls"
            else:
                message = {"role": "assistant", "content": content}
        else:
            reasoning, rest = split_reasoning(text)
            message, notes = {"role": "assistant", "content": rest.strip() if reasoning else text}, {}
        if reasoning:
            message["reasoning_content"] = reasoning
        return message, finish, notes

    def _response(self, call: RecordedCall, finish: str, request: dict[str, Any]) -> dict[str, Any]:
        logprobs: dict[str, Any] | None = None
        if request.get("logprobs"):
            logprobs = {"content": [
                {"token": self.renderer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(call.completion_ids, call.logprobs, strict=True)
            ]}
        prompt_tokens, completion_tokens = len(call.prompt_ids), len(call.completion_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model") or self.model_name,
            "choices": [{"index": 0, "message": copy.deepcopy(call.reply), "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": call.cached_prompt_tokens}},
        }


async def _on_loop(loop: asyncio.AbstractEventLoop | None, coro: Any) -> Any:
    """Await `coro` on `loop` (the session's), from whatever loop the HTTP server runs on."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the session's event loop is closed (its rollout has ended)")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


# ---------------------------------------------------------------------------------------------------
# Messages: validation, normalisation for the template, canonical form for matching
# ---------------------------------------------------------------------------------------------------
def _validate_request(request: dict[str, Any]) -> tuple[list[Message], list[dict] | None]:
    if request.get("stream"):
        raise ChatRequestError("stream=true is not supported: use stream=false (the proxy records whole replies)")
    if (request.get("n") or 1) != 1:
        raise ChatRequestError(f"n={request['n']} is not supported; send one request per sample")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES | {"developer"}:
            raise ChatRequestError(f"messages[{i}].role must be one of {sorted(ROLES | {'developer'})}, got {role!r}")
        _text(m.get("content"), f"messages[{i}].content")
    tools = request.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)):
        raise ChatRequestError('tools must be a list of {"type": "function", "function": {...}} objects')
    return messages, tools


def _text(content: Any, where: str = "content") -> str:
    """Message content as text: None is "", text parts are joined; other parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatRequestError(f"{where}: only text parts are supported by this proxy, got a {kind!r} part")
            parts.append(part.get("text") or "")
        return "".join(parts)
    raise ChatRequestError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def _for_template(message: Message) -> Message:
    """What the chat template gets: text content, parsed tool-call arguments, no null fields."""
    role = "system" if message["role"] == "developer" else message["role"]
    out: Message = {"role": role, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _canonical(message: Message) -> tuple:
    """What identifies a message for continuation matching (ids, reasoning and null fields aside)."""
    calls = tuple(
        (c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    role = "system" if message.get("role") == "developer" else message.get("role")
    return role, _text(message.get("content")), calls, message.get("tool_call_id")


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


# ---------------------------------------------------------------------------------------------------
# Sessions to trajectories
# ---------------------------------------------------------------------------------------------------
def assemble_trajectories(
    session: Session, *, group_id: str | None = None, sample_index: int = 0, sample: dict[str, Any] | None = None,
    agent: str = "openai_agent", end: tuple[TerminationReason, str | None] | None = None,
) -> list[Trajectory]:
    """Merge the session's calls into validated trajectories (rule in the module docstring).

    The first trajectory's id is the session id, later ones `<session id>.<k>`; all carry
    `episode_id = session.id`. Each ends by its last call (length → TRUNCATED/length, abort →
    ABORTED/cancelled, a reply with tool calls → COMPLETED/env_done: the agent stopped, else
    COMPLETED/no_tool_call) unless `end` gives the episode's (reason, error) for all of them.
    """
    builders: list[TrajectoryBuilder] = []
    last_call: dict[int, RecordedCall] = {}  # builder index -> its latest call
    for call in session.calls:
        k = _extended([b.token_ids for b in builders], call.prompt_ids)
        if k is None:
            k = len(builders)
            traj = Trajectory(id=session.id if k == 0 else f"{session.id}.{k}", group_id=group_id or session.id,
                              sample_index=sample_index, prompt_ids=list(call.prompt_ids), sample=sample or {},
                              agent=agent, episode_id=session.id, info={"split_index": k})
            builders.append(TrajectoryBuilder(traj))
        else:
            _add_observation(builders[k], call)
        _add_call(builders[k], call)
        last_call[k] = call
    trajectories = []
    for k, builder in enumerate(builders):
        builder.trajectory.info["episode_trajectories"] = len(builders)
        reason, error = end or (_natural_end(last_call[k]), None)
        trajectories.append(builder.finish(reason, error))
    return trajectories


def _extended(streams: list[list[int]], prompt_ids: list[int]) -> int | None:
    """Index of the token stream that `prompt_ids` extends (the longest, if several)."""
    best = None
    for k, stream in enumerate(streams):
        extends = len(stream) <= len(prompt_ids) and prompt_ids[: len(stream)] == stream
        if extends and (best is None or len(stream) > len(streams[best])):
            best = k
    return best


def _add_observation(builder: TrajectoryBuilder, call: RecordedCall) -> None:
    """The tokens between the trajectory's stream and the call's prompt, as mask-0 segments."""
    start, turn = len(builder.token_ids), builder.trajectory.num_turns
    delta = call.prompt_ids[start:]
    if call.base_len == start:  # the proxy built this prompt on exactly this stream: it knows the parts
        pos = start
        for source, n in call.delta_sources:
            builder.add_injected(call.prompt_ids[pos: pos + n], source, turn)
            pos += n
        builder.add_injected(call.prompt_ids[pos:], SegmentSource.ENV, turn)
        return
    trailing = []
    for m in reversed(call.messages):
        if m.get("role") == "assistant":
            break
        trailing.append(m)
    source = SegmentSource.TOOL if any(m.get("role") == "tool" for m in trailing) else SegmentSource.ENV
    builder.add_injected(delta, source, turn)


def _add_call(builder: TrajectoryBuilder, call: RecordedCall) -> None:
    traj = builder.trajectory
    out = GenerateOutput(call.completion_ids, call.logprobs, call.finish_reason, call.policy_version,
                         call.cached_prompt_tokens)
    if call.completion_ids:
        builder.add_model(out, traj.num_turns + 1)
    traj.num_turns += 1
    traj.messages = [*call.messages, call.reply]
    traj.turns.append(TurnRecord(traj.num_turns, GenerateSpan(
        call.start_ns, call.start_ns + int(call.gen_time_s * 1e9), prompt_tokens=len(call.prompt_ids),
        cached_prompt_tokens=call.cached_prompt_tokens, tokens=len(call.completion_ids),
        finish_reason=call.finish_reason, policy_version=call.policy_version,
    ), extra={"call": call.index, "continued": call.base_len is not None, **call.notes}))
    m = traj.metrics
    m["gen_time_s"] = m.get("gen_time_s", 0.0) + call.gen_time_s
    m["cached_prompt_tokens"] = m.get("cached_prompt_tokens", 0) + call.cached_prompt_tokens
    m["model_tokens"] = traj.num_model_tokens
    m["injected_tokens"] = traj.num_response_tokens - traj.num_model_tokens


def _natural_end(call: RecordedCall) -> TerminationReason:
    if call.finish_reason == FinishReason.LENGTH:
        return TerminationReason.LENGTH
    if call.finish_reason == FinishReason.ABORT:
        return TerminationReason.CANCELLED
    return TerminationReason.ENV_DONE if call.reply.get("tool_calls") else TerminationReason.NO_TOOL_CALL
