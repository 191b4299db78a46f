"""The chat proxy: chat requests in, exact tokens recorded per session, trajectories out.

An external agent (a plain `openai` or `anthropic` client loop, LangGraph, the OpenAI Agents SDK, a coding-agent
CLI) talks to `/v1` or `/sessions/{id}/v1` as if it were OpenAI or Anthropic. Each API's module (openai.py,
responses.py, anthropic.py) turns its body into a `ChatCall`, the proxy's own terms, so one path records every
call: the exact prompt token ids sent to the engine, the completion token ids and their sampling logprobs.
Nothing recorded is ever re-tokenized text. docs/serving.md tells the rules in full; in short:

- Sessions (`ChatProxy.resolve`, the session rule): a call names its session by the URL, the X-Session-Id header,
  the body's `user` or `metadata.session_id`; a call naming none continues the open session whose conversation
  its messages extend (`_continues`), else opens a new one. A session is open until a reward is posted
  (`set_reward`: FINISHED) or it idles past `session_ttl_s` (`reap`: ABORTED).
- Prompt tokens (`ChatProxy._prompt`; masks are born with the tokens, as in `drive`): a request that continues
  an earlier call (its messages, then the reply returned for it, then new messages; compared after
  normalisation, `_canonical`) gets that call's prompt + completion tokens as recorded, the template's turn
  closing and the observation delta of the new messages; any other request is rendered afresh.
- Trajectories (`assemble_trajectories`): a call whose prompt extends an open trajectory's token stream is
  appended to it (the tokens between are mask-0 segments, the completion mask 1 with its logprobs); one that
  extends none starts a new branch of the same episode tree (`episode_id`, the session id; the same reward):
  a `subagent` branch of the trajectory that spawned it when a header marks it (chat_routes.subagent_of) or
  its system prompt or tools are another agent's, else a `fork` of the trajectory it shares the longest token
  prefix with (`parent.at`).
- Replies (`ChatProxy._reply`): tool calls parsed from the completion text (`tool_parser`); reasoning in
  `reasoning_content`; stop strings and streaming in turnrl/serve/streaming.py.

Tokenisation runs in a worker thread, off the event loop that serves every other request. Engine calls run on
the session's event loop (`loop=`, the RolloutManager's), so the engine is used exactly as `drive` uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from turnrl.engines.base import Engine
from turnrl.reasoning import split_reasoning
from turnrl.render import ChatRenderer, RenderError
from turnrl.rollout.builder import TrajectoryBuilder
from turnrl.rollout.episode import derive_seed
from turnrl.rollout.tree import branch, common_prefix
from turnrl.serve.payload import INLINE_PREPARE_CHARS, copied, text_size
from turnrl.serve.streaming import ReplyStream, StopMatch, StopWatch, TextStream
from turnrl.tools.parsers import get_parser
from turnrl.types import (
    BranchKind,
    FinishReason,
    GenerateOutput,
    GenerateSpan,
    Message,
    SamplingParams,
    SegmentSource,
    TerminationReason,
    Trajectory,
    TurnRecord,
    is_real,
)

log = logging.getLogger(__name__)

KEEP_REPLIES = 10_000
"""Replies a proxy remembers by id (`ChatProxy.remember`), oldest forgotten first."""


class ChatRequestError(ValueError):
    """A chat request this proxy cannot serve; the message is shown to the client (HTTP `status`, 400 by
    default), `param` names the request field at fault."""

    def __init__(self, message: str, code: str = "invalid_request", *, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.code, self.param, self.status = code, param, status


class SessionNotFound(KeyError):
    """No session with this id (HTTP 404)."""


class SessionStatus(StrEnum):
    OPEN = "open"
    FINISHED = "finished"
    """A reward was posted (or came in a call's metadata): the episode is over, its trajectories final."""
    ABORTED = "aborted"
    """Idle past the proxy's `session_ttl_s`: abandoned; its trajectories end ABORTED with the reason."""


@dataclass
class RecordedCall:
    """One model call: exactly what the engine was given and what it returned."""

    index: int
    """0-based position in the session, in completion order."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    messages: list[Message]
    """The request's messages, in chat-completions form (Responses and Anthropic requests are converted)."""
    tools: list[dict] | None
    reply: Message
    """The assistant message returned to the client (when streamed: what the chunks add up to)."""
    base_len: int | None = None
    """When the prompt continues an earlier call: the length of that call's prompt + completion."""
    delta_sources: list[tuple[SegmentSource, int]] = field(default_factory=list)
    """How `prompt_ids[base_len:]` splits by source (template closing, then the observation)."""
    cached_prompt_tokens: int = 0
    gen_time_s: float = 0.0
    start_ns: int = 0
    """When the engine call started (ns since the epoch), for the turn's trace span."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Tool-call parse errors, request sampling fields that were ignored, the API and session rule, ..."""
    stop: str | None = None
    """The request's stop string that ended the reply: `completion_ids` runs through the token that completed
    it, `reply` holds the text before it (OpenAI's and Anthropic's semantics)."""


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
    last_active: float = field(default_factory=time.time)
    status: SessionStatus = SessionStatus.OPEN
    reward: float | None = None
    """The episode's reward, posted from outside (`POST /sessions/<id>/reward`, or a call's metadata)."""
    turn_rewards: list[float] | None = None
    """Per-turn rewards (one per model call, in call order), when posted as a list."""
    end_reason: str | None = None
    rule: str = "opened"
    """How the session was named when it was opened (path, header, user, metadata, continued, new, opened)."""
    warned_tools: set[str] = field(default_factory=set)
    """Tools not offered to the model (hosted, deferred) that the log has already named for this session."""

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "status": str(self.status), "calls": len(self.calls), "reward": self.reward,
                "turn_rewards": self.turn_rewards, "created": self.created, "last_active": self.last_active,
                "end_reason": self.end_reason, "rule": self.rule}


@dataclass
class ChatCall:
    """One model call in the proxy's own terms (chat-completions messages and tools), whichever API it came
    through (each API module's `parse`: turnrl/serve/openai.py, responses.py, anthropic.py)."""

    messages: list[Message]
    tools: list[dict] | None = None
    tool_choice: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """Validated request fields, by SamplingParams' names (temperature, top_p, top_k, seed, max_new_tokens), and
    `stop` (a list of strings)."""
    reward: Any = None
    """`metadata.reward` of the request: this is the episode's last call; its reward (a number or per-turn list)."""
    model: str | None = None
    continue_final: bool = False
    """The last message is an assistant's pre-filled text, to be continued (Anthropic's prefill): the prompt
    leaves that turn open, and the reply is the continuation only."""
    not_offered: list[str] = field(default_factory=list)
    """Tools of the request the model is not shown: hosted ones (web_search, ...) this server cannot run, deferred
    ones (turnrl.serve.tools)."""
    subagent: dict[str, Any] | None = None
    """Set when a header marks the call as a harness sub-agent's (chat_routes.subagent_of): its trajectory is a
    `subagent` branch of the session's episode."""


class ChatProxy:
    """Serves chat requests per session on a token-level `Engine`, recording exact tokens.

    Args:
        engine: any Engine (embedded, router, HTTP, SGLang, a scripted fake).
        renderer: the policy's chat template.
        model_name: reported in responses and `/v1/models`.
        tool_parser: the tool-call format of the model's text (`hermes`, `qwen3_coder`).
        sampling: defaults for sessions without fixed sampling.
        create_sessions: a request to an unknown session id opens it (`turnrl serve`); False answers 404, so
            only sessions opened with `open_session` exist (the training gateway).
        session_ttl_s: an open session idle for longer is closed as ABORTED (None: never).
        keep_finished: finished and aborted sessions kept for `GET /sessions` and their trajectories (oldest
            dropped first).
    """

    def __init__(self, engine: Engine, renderer: ChatRenderer, *, model_name: str = "turnrl",
                 tool_parser: str = "hermes", sampling: SamplingParams | None = None, create_sessions: bool = True,
                 session_ttl_s: float | None = None, keep_finished: int = 1000):
        self.engine, self.renderer, self.model_name = engine, renderer, model_name
        self.tool_parser, self.create_sessions = tool_parser, create_sessions
        self.session_ttl_s, self.keep_finished = session_ttl_s, keep_finished
        get_parser(tool_parser)  # fail on an unknown name now, not on the first call
        self.sampling = sampling or SamplingParams()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._streams = "on_token" in inspect.signature(engine.generate).parameters
        self._replies: OrderedDict[str, tuple[str, list[Message]]] = OrderedDict()

    # ---- sessions --------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None, **settings: Any) -> Session:
        """A new session (`settings`: the Session fields loop, sampling, max_new_tokens, max_calls)."""
        session = Session(id=session_id or uuid.uuid4().hex, **settings)
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id!r} is already open")
            self._sessions[session.id] = session
        return session

    def session(self, session_id: str, *, create: bool = False, rule: str = "path") -> Session:
        with self._lock:
            if session_id not in self._sessions:
                if not create:
                    raise SessionNotFound(session_id)
                self._sessions[session_id] = Session(id=session_id, rule=rule)
                log.info("session %s opened (named by %s)", session_id, rule)
            return self._sessions[session_id]

    def close_session(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def trajectories(self, session_id: str, **ids: Any) -> list[Trajectory]:
        """The session's calls assembled into trajectories (see `assemble_trajectories` for `ids`), with the
        reward posted from outside and, for an aborted session, its end."""
        session = self.session(session_id)
        end = (TerminationReason.CANCELLED, session.end_reason) if session.status == SessionStatus.ABORTED else None
        trajectories = assemble_trajectories(session, end=end, **ids)
        _apply_rewards(session, trajectories)
        return trajectories

    def resolve(self, named: str | None, rule: str, messages: list[Message]) -> Session:
        """The session of a call to a root endpoint (the session rule, docs/serving.md): `named` by the path,
        X-Session-Id, `user` or `metadata.session_id` (`rule` says which); else the open session whose
        conversation these messages extend; else a new one."""
        if named:
            return self.session(named, create=self.create_sessions, rule=rule)
        if not self.create_sessions:  # the training gateway: only the sessions it opened, by their URL
            raise ChatRequestError("this server serves only the sessions it opened: use the base_url "
                                   "/sessions/<id>/v1 it gave you", code="session_required", status=404)
        with self._lock:
            candidates = sorted((s for s in self._sessions.values() if s.status == SessionStatus.OPEN),
                                key=lambda s: s.last_active, reverse=True)
        for session in candidates:
            if any(_continues(messages, call) for call in reversed(session.calls)):
                log.info("session %s continued (its conversation is extended by the request)", session.id)
                return session
        return self.session(f"ep-{uuid.uuid4().hex[:16]}", create=True, rule="new")

    def set_reward(self, session_id: str, reward: Any, *, done: bool = True) -> Session:
        """Attach an episode reward (a number) or per-turn rewards (a list, one per call) to a session; `done`
        finishes it. Raises ChatRequestError naming `reward` for anything else."""
        session = self.session(session_id)
        scalar, per_turn = _reward_value(reward, len(session.calls))
        session.reward, session.turn_rewards = scalar, per_turn
        if done:
            session.status, session.end_reason = SessionStatus.FINISHED, "reward posted"
        self._forget_old()
        return session

    def reap(self, now: float | None = None) -> list[Session]:
        """Close open sessions idle past `session_ttl_s` as ABORTED (returns them: the caller releases their
        engine caches). Called at every request, so no timer thread is needed: nothing can observe a session
        between two requests."""
        if not self.session_ttl_s:
            return []
        now = time.time() if now is None else now
        reaped = [s for s in self.sessions() if s.status == SessionStatus.OPEN and s.loop is None
                  and now - s.last_active > self.session_ttl_s]
        for s in reaped:
            s.status = SessionStatus.ABORTED
            s.end_reason = f"idle for {now - s.last_active:.0f} s (session_ttl_s={self.session_ttl_s:g})"
            log.warning("session %s aborted: %s", s.id, s.end_reason)
        if reaped:
            self._forget_old()
        return reaped

    # ---- replies by id (the Responses API's previous_response_id) ----------------------------------
    def remember(self, reply_id: str, call: RecordedCall, session_id: str) -> None:
        """Keep the conversation `call` ended (its messages and reply) under the id its client got, with its
        session, for a later request that names it (the newest `KEEP_REPLIES`)."""
        self._replies[reply_id] = (session_id, [*call.messages, call.reply])
        while len(self._replies) > KEEP_REPLIES:
            self._replies.popitem(last=False)

    def recall(self, reply_id: str) -> tuple[str, list[Message]] | None:
        """(session id, conversation) of a remembered reply id; None when it is unknown (or forgotten)."""
        return self._replies.get(reply_id)

    def _forget_old(self) -> None:
        with self._lock:
            done = [s for s in self._sessions.values() if s.status != SessionStatus.OPEN]
            for s in sorted(done, key=lambda s: s.last_active)[: max(0, len(done) - self.keep_finished)]:
                del self._sessions[s.id]

    # ---- a model call ----------------------------------------------------------------------------
    async def complete(self, session: Session, chat: ChatCall,
                       on_delta: Callable[[str, Any], None] | None = None) -> tuple[RecordedCall, str]:
        """Run one model call of `session` and record it; returns (the call, the OpenAI finish_reason).

        With `on_delta(kind, value)` the reply is streamed as it is generated: ("start", prompt token count), then
        ("reasoning" | "content", text) decoded incrementally from the sampled token ids (ReplyStream); tool calls
        come whole in the recorded reply at the end."""
        _check_callable(session)
        session.last_active = time.time()
        # a long conversation is tokenised off the event loop (it serves the others); a short one here: cheaper
        inline = text_size(chat.messages, INLINE_PREPARE_CHARS) < INLINE_PREPARE_CHARS
        prepared = self._prepare(session, chat) if inline else await asyncio.to_thread(self._prepare, session, chat)
        (prompt_ids, base_len, delta_sources), (params, notes) = prepared
        stop_strings = chat.sampling.get("stop") or []
        stops = StopWatch(self.renderer, stop_strings)
        stream = ReplyStream(self.renderer, chat.tools, chat.tool_choice, on_delta, stop_strings) if on_delta else None
        if on_delta:
            on_delta("start", len(prompt_ids))
        t0, start_ns = time.perf_counter(), time.time_ns()
        out = await self._generate(session, prompt_ids, params, stream.push if stream else None, stops)
        out, stopped = stops.cut(out)
        text = stopped.text if stopped else self.renderer.assistant_text(out.token_ids)
        reply, finish, parse_notes = self._reply(text, out.finish_reason, chat.tools, chat.tool_choice,
                                                 len(session.calls))
        if stream is not None:
            reply = stream.finish(text, reply)
        call = RecordedCall(
            index=len(session.calls), prompt_ids=list(prompt_ids), completion_ids=list(out.token_ids),
            logprobs=list(out.logprobs), finish_reason=out.finish_reason, policy_version=out.policy_version,
            # copies: an in-process caller goes on appending to its lists, and the record must not change
            messages=copied(chat.messages), tools=copied(chat.tools), reply=reply, base_len=base_len,
            delta_sources=delta_sources,
            cached_prompt_tokens=out.cached_prompt_tokens, gen_time_s=time.perf_counter() - t0, start_ns=start_ns,
            notes={**notes, **parse_notes, **({"stop": stopped.stop} if stopped else {}),
                   **({"tools_not_offered": sorted(set(chat.not_offered))} if chat.not_offered else {}),
                   **({"subagent": chat.subagent} if chat.subagent else {})},
            stop=stopped.stop if stopped else None,
        )
        _warn_not_offered(session, chat.not_offered)
        session.calls.append(call)
        session.last_active = time.time()
        if chat.reward is not None:
            self.set_reward(session.id, chat.reward)
        return call, finish

    async def complete_tokens(self, session: Session, prompt_ids: list[int], sampling: dict[str, Any],
                              stop_token_ids: tuple[int, ...] = ()) -> RecordedCall:
        """One token-level call of `session` (vLLM's `/inference/v1/generate`, turnrl/serve/inference.py): the
        prompt ids as given, nothing rendered; recorded as a chat call is (its exact prompt, completion and
        logprobs), with no messages and the completion's text as the reply. `sampling` as `complete` takes it;
        `stop_token_ids` are added to the end-of-turn tokens."""
        _check_callable(session)
        session.last_active = time.time()
        params, notes = await asyncio.to_thread(self._sampling, session, sampling)
        if stop_token_ids:
            params = dataclasses.replace(params, stop_token_ids=tuple(sorted({*params.stop_token_ids,
                                                                              *stop_token_ids})))
        t0, start_ns = time.perf_counter(), time.time_ns()
        out = await _on_loop(session.loop, self.engine.generate(prompt_ids, params, request_id=session.id))
        text = self.renderer.assistant_text(out.token_ids)
        call = RecordedCall(
            index=len(session.calls), prompt_ids=list(prompt_ids), completion_ids=list(out.token_ids),
            logprobs=list(out.logprobs), finish_reason=out.finish_reason, policy_version=out.policy_version,
            messages=[], tools=None, reply={"role": "assistant", "content": text},
            cached_prompt_tokens=out.cached_prompt_tokens, gen_time_s=time.perf_counter() - t0, start_ns=start_ns,
            notes={**notes, "api": "generate"},
        )
        session.calls.append(call)
        session.last_active = time.time()
        return call

    def resolve_tokens(self, named: str | None, rule: str, prompt_ids: list[int]) -> Session:
        """The session of a token-level call: `named` (the path or X-Session-Id), else the open session one of
        whose calls (its prompt and completion) this prompt extends, else a new one (the session rule on tokens)."""
        if named or not self.create_sessions:
            return self.resolve(named, rule, [])
        with self._lock:
            candidates = sorted((s for s in self._sessions.values() if s.status == SessionStatus.OPEN),
                                key=lambda s: s.last_active, reverse=True)
        for session in candidates:
            for call in reversed(session.calls):
                n, m = len(call.prompt_ids), len(call.completion_ids)
                if n + m <= len(prompt_ids) and prompt_ids[:n] == call.prompt_ids and \
                        prompt_ids[n:n + m] == call.completion_ids:
                    log.info("session %s continued (its token stream is extended by the request)", session.id)
                    return session
        return self.session(f"ep-{uuid.uuid4().hex[:16]}", create=True, rule="new")

    async def text_completion(self, prompt_ids: list[int], sampling: dict[str, Any],
                              on_text: Callable[[str], None] | None = None) -> tuple[GenerateOutput, str, StopMatch | None]:
        """A legacy text completion of `prompt_ids` (no chat template, no session, nothing recorded): (the output
        cut at a stop string, its text, the stop match). `on_text` gets the text as it is generated."""
        session = Session(id=f"cmpl-{uuid.uuid4().hex}")
        params, _ = await asyncio.to_thread(self._sampling, session, sampling)  # it ends at an end-of-turn token
        stops = StopWatch(self.renderer, sampling.get("stop") or [])
        stream = TextStream(self.renderer, stops.stops, on_text) if on_text else None
        try:
            out = await self._generate(session, prompt_ids, params, stream.push if stream else None, stops)
        finally:
            await self.engine.release(session.id)
        out, stopped = stops.cut(out)
        text = stopped.text if stopped else self.renderer.assistant_text(out.token_ids)
        if stream is not None:
            stream.finish(text)
        return out, text, stopped

    def count_tokens(self, chat: ChatCall) -> int:
        """Prompt tokens of a conversation rendered afresh with the chat template (Anthropic's count_tokens)."""
        try:
            return len(self.renderer.initial_ids([_for_template(m) for m in chat.messages], chat.tools))
        except Exception as e:  # a template error is the request's fault (bad roles, bad tools)
            raise ChatRequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                                   param="messages") from e

    async def _generate(self, session: Session, prompt_ids: list[int], params: SamplingParams,
                        stream: Callable[[int], None] | None, stops: StopWatch) -> GenerateOutput:
        """The engine's output; an engine that streams tokens (`generate(on_token=)`) streams them to `stream`
        and ends the call as soon as `stops` sees a stop string, others are cut afterwards (`StopWatch.cut`)."""
        if not self._streams or (stream is None and not stops.stops):
            out = await _on_loop(session.loop, self.engine.generate(prompt_ids, params, request_id=session.id))
            if stream is not None:  # an engine without token streaming: the text follows the whole output
                for token in out.token_ids:
                    stream(token)
            return out
        loop = asyncio.get_running_loop()

        def on_token(token: int) -> bool:  # called on the session's loop, which may be another thread's
            if stream is not None:
                loop.call_soon_threadsafe(stream, token)
            return stops.push(token)

        engine: Any = self.engine  # an engine that streams (self._streams): EmbeddedEngine's on_token
        out = await _on_loop(session.loop, engine.generate(prompt_ids, params, request_id=session.id,
                                                           on_token=on_token))
        await asyncio.sleep(0)  # the pushes scheduled before the output arrived run first
        return out

    def _prepare(self, session: Session, chat: ChatCall) -> tuple[tuple[list[int], int | None, list[tuple[SegmentSource, int]]],
                                                              tuple[SamplingParams, dict[str, Any]]]:
        """The call's prompt and its sampling, in one hand-over to a worker thread (not one each)."""
        return self._prompt(session, chat), self._sampling(session, chat.sampling)

    def _prompt(self, session: Session, chat: ChatCall) -> tuple[list[int], int | None, list[tuple[SegmentSource, int]]]:
        """(prompt ids, base_len, delta_sources): continue a recorded call when the messages do (module doc); a
        pre-filled assistant turn is rendered afresh, left open."""
        messages, tools = chat.messages, chat.tools
        rendered = [_for_template(m) for m in messages]
        tools_key = _tools_key(tools)
        for call in [] if chat.continue_final else reversed(list(session.calls)):
            if _tools_key(call.tools) != tools_key or not _continues(messages, call):
                continue
            new = rendered[len(call.messages) + 1:]
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
            if chat.continue_final:
                return self.renderer.continuation_ids(rendered, tools), None, []
            return self.renderer.initial_ids(rendered, tools), None, []
        except Exception as e:  # a template error is the request's fault (bad roles, bad tools)
            raise ChatRequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                                   param="messages") from e

    def _sampling(self, session: Session, asked: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
        base = session.sampling or self.sampling
        fields: dict[str, Any] = {}
        notes: dict[str, Any] = {}
        given = {k: asked[k] for k in ("temperature", "top_p", "top_k", "seed") if asked.get(k) is not None}
        if given.get("top_p") == 0:  # OpenAI allows it: the smallest nucleus, greedy (CHAT_SAMPLING_RULES)
            given.update(top_p=1.0, top_k=1)
        if session.sampling is None:
            fields.update(given)
        else:  # training: the trainer's sampling is the policy; the agent may not change it
            fields["seed"] = derive_seed(base.seed, session.id, len(session.calls) + 1)
            ignored = {k: v for k, v in given.items() if k != "seed" and v != getattr(base, k)}
            if ignored:
                notes["ignored_request_sampling"] = ignored
        cap = session.max_new_tokens or base.max_new_tokens
        wanted = asked.get("max_new_tokens")
        fields["max_new_tokens"] = min(cap, wanted) if wanted else cap
        stops = set(base.stop_token_ids) | self.renderer.end_of_turn_ids | self._one_token_stops(asked.get("stop"))
        fields["stop_token_ids"] = tuple(sorted(stops))
        try:
            return dataclasses.replace(base, **fields), notes
        except (TypeError, ValueError) as e:
            raise ChatRequestError(f"bad sampling fields: {e}") from None

    def _one_token_stops(self, stop: list[str] | None) -> set[int]:
        """The token ids of the stop strings that are one token: the engine stops on them itself (an engine
        without token streaming too); every stop string is also matched in the decoded text (StopWatch)."""
        encoded = [self.renderer.encode(text) for text in stop or ()]
        return {ids[0] for ids in encoded if len(ids) == 1}

    def _reply(self, text: str, finish_reason: FinishReason, tools: list[dict] | None, tool_choice: Any, index: int
               ) -> tuple[Message, str, dict[str, Any]]:
        """The assistant message of the completion's `text`, the OpenAI finish_reason, and notes (parse errors)."""
        finish = "stop" if finish_reason == FinishReason.STOP else "length"  # abort: the reply is cut short
        if tools and tool_choice != "none":
            parsed = get_parser(self.tool_parser, tools).parse(text)
            reasoning: str | None = parsed.reasoning
            content = parsed.content
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


def _check_callable(session: Session) -> None:
    """Refuse a call to a closed session, or one past its `max_calls` (setting `limit_reached`)."""
    if session.status != SessionStatus.OPEN:
        raise ChatRequestError(f"session {session.id!r} is {session.status} ({session.end_reason}); "
                               "use a new session id", code="session_closed", status=409)
    if session.max_calls is not None and len(session.calls) >= session.max_calls:
        session.limit_reached = True
        raise ChatRequestError(f"session {session.id!r} reached its limit of {session.max_calls} model calls "
                               "(rollout.max_turns)", code="turn_limit")


def _warn_not_offered(session: Session, names: list[str]) -> None:
    """Say once per session which of its tools the model is not shown (turnrl.serve.tools: hosted, deferred)."""
    new = sorted(set(names) - session.warned_tools)
    if new:
        session.warned_tools.update(new)
        log.warning("session %s: tools %s are not offered to the model (hosted by the model provider, which this "
                    "server is not, or deferred); its calls go on without them", session.id, ", ".join(new))


async def _on_loop(loop: asyncio.AbstractEventLoop | None, coro: Any) -> Any:
    """Await `coro` on `loop` (the session's), from whatever loop the HTTP server runs on."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the session's event loop is closed (its rollout has ended)")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def _continues(messages: list[Message], call: RecordedCall) -> bool:
    """The messages are the call's messages, then the reply it returned, then at least one new message."""
    n = len(call.messages)
    if len(messages) <= n + 1 or _canonical(messages[n]) != _canonical(call.reply):
        return False
    return all(_canonical(a) == _canonical(b) for a, b in zip(messages[:n], call.messages, strict=True))


# ---------------------------------------------------------------------------------------------------
# Rewards posted from outside
# ---------------------------------------------------------------------------------------------------
def _reward_value(reward: Any, calls: int, where: str = "reward") -> tuple[float | None, list[float] | None]:
    """(episode reward, per-turn rewards) of a posted reward: a number, or a list with one number per call
    (the episode's reward is then their sum). A string holding JSON is read (metadata values are strings)."""
    if isinstance(reward, str):
        try:
            reward = json.loads(reward)
        except json.JSONDecodeError:
            raise ChatRequestError(f"{where} must be a number or a list of numbers, got the string {reward!r}",
                                   param=where) from None
    if is_real(reward):
        return float(reward), None
    if isinstance(reward, list) and all(is_real(r) for r in reward):
        if len(reward) != calls:
            raise ChatRequestError(f"{where}: {len(reward)} per-turn rewards for {calls} model calls; give one per "
                                   "call (in call order) or a single number", param=where)
        return float(sum(reward)), [float(r) for r in reward]
    raise ChatRequestError(f"{where} must be a finite number or a list of finite numbers (one per model call), "
                           f"got {reward!r}"[:300], param=where)


def _apply_rewards(session: Session, trajectories: list[Trajectory]) -> None:
    if session.reward is None:
        return
    turn_of_call = {}
    if session.turn_rewards is not None:  # each trajectory gets the rewards of its own calls
        turn_of_call = {c.index: r for c, r in zip(session.calls, session.turn_rewards, strict=True)}
    for traj in trajectories:
        traj.reward = session.reward
        if turn_of_call:
            traj.turn_rewards = [turn_of_call[t.extra["call"]] for t in traj.turns]


# ---------------------------------------------------------------------------------------------------
# Messages: normalisation for the template, canonical form for matching
# ---------------------------------------------------------------------------------------------------
def message_text(content: Any, where: str = "content") -> str:
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
                raise ChatRequestError(f"{where}: only text parts are supported by this text model, got a {kind!r} "
                                       "part", param=where)
            parts.append(part.get("text") or "")
        return "".join(parts)
    raise ChatRequestError(f"{where} must be a string or a list of text parts, got {type(content).__name__}",
                           param=where)


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
    out: Message = {"role": role, "content": message_text(message.get("content"))}
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
    return role, message_text(message.get("content")), calls, message.get("tool_call_id")


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


# ---------------------------------------------------------------------------------------------------
# Sessions to trajectories
# ---------------------------------------------------------------------------------------------------
def assemble_trajectories(
    session: Session, *, group_id: str | None = None, sample_index: int = 0, sample: dict[str, Any] | None = None,
    agent: str = "openai_agent", end: tuple[TerminationReason, str | None] | None = None,
) -> list[Trajectory]:
    """Merge the session's calls into validated trajectories: one episode tree (rule in the module docstring).

    The first trajectory's id is the session id, later ones `<session id>.<k>`; all carry
    `episode_id = session.id`, and each later one a `parent` (`_parent_of`). Each ends by its last call (length →
    TRUNCATED/length, abort → ABORTED/cancelled, a reply with tool calls → COMPLETED/env_done: the agent stopped,
    else COMPLETED/no_tool_call) unless `end` gives the episode's (reason, error) for all of them.
    """
    builders: list[TrajectoryBuilder] = []
    last_call: dict[int, RecordedCall] = {}  # builder index -> its latest call
    parents: dict[int, tuple[int, BranchKind]] = {}  # builder index -> (its parent's, why it branched)
    for call in session.calls:
        k = _extended([b.token_ids for b in builders], call.prompt_ids)
        if k is None:
            k = len(builders)
            traj = Trajectory(id=session.id if k == 0 else f"{session.id}.{k}", group_id=group_id or session.id,
                              sample_index=sample_index, prompt_ids=list(call.prompt_ids), sample=sample or {},
                              agent=agent, episode_id=session.id, info={"split_index": k})
            if builders:
                parents[k] = _parent_of(call, builders, last_call, session.calls[0])
            builders.append(TrajectoryBuilder(traj))
        else:
            _add_observation(builders[k], call)
        _add_call(builders[k], call)
        last_call[k] = call
    trajectories = []
    for k, builder in enumerate(builders):
        builder.trajectory.info["episode_trajectories"] = len(builders)
        if k in parents:  # `at` on the final streams: the parent may have gone on with the same tokens
            parent, kind = parents[k]
            branch(builder.trajectory, builders[parent].trajectory, kind)
        reason, error = end or (_natural_end(last_call[k]), None)
        trajectories.append(builder.finish(reason, error))
    return trajectories


def _parent_of(call: RecordedCall, builders: list[TrajectoryBuilder], last_call: dict[int, RecordedCall],
               first: RecordedCall) -> tuple[int, BranchKind]:
    """(index of the trajectory a call that extends none branches from, why). A sub-agent's call (named by a header:
    chat_routes.subagent_of; or a conversation with another system prompt or other tools than the episode's first
    call, as Claude Code's Agent tool starts) branches from the trajectory whose latest call is waiting on a tool
    call: the one that spawned it. Any other call forks the trajectory it shares the longest token prefix with (its
    history was rewritten or retried)."""
    if "subagent" in call.notes or _agent_key(call) != _agent_key(first):
        waiting = [(c.index, k) for k, c in last_call.items() if c.reply.get("tool_calls")]
        return (max(waiting)[1] if waiting else 0), BranchKind.SUBAGENT
    shared = [common_prefix(call.prompt_ids, b.token_ids) for b in builders]
    return max(range(len(builders)), key=lambda k: (shared[k], k)), BranchKind.FORK


def _agent_key(call: RecordedCall) -> tuple:
    """What tells one agent's conversations from another's: its system messages and its tools."""
    system = tuple(_canonical(m) for m in call.messages if m.get("role") in ("system", "developer"))
    return system, _tools_key(call.tools)


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
    # a token-level call has no messages: its reply follows the trajectory's earlier ones
    traj.messages = [*(call.messages if call.messages or not traj.messages else traj.messages), call.reply]
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
