"""ms-swift's `MultiTurnScheduler` hooks, run by the one turn loop (`turnrl.rollout.drive`).

Porting an ms-swift scheduler means changing its imports (docs/from-ms-swift.md):

    from turnrl.agents.scheduler import MultiTurnScheduler, multi_turns

    class Retry(MultiTurnScheduler):
        def check_finished(self, request, response, turn):
            return "\\\\boxed{4}" in response.message.content or super().check_finished(request, response, turn)

        def step(self, request, response, turn):
            request.messages.append({"role": "user", "content": "Wrong, try again."})
            return {"infer_request": request}

    multi_turns["retry"] = Retry        # turnrl rollout --plugin retry.py --scheduler retry

The hooks do not get a loop of their own. `SchedulerEnv` is a turn-aware env for `drive` (it implements
`step_turn`, so it sees tokens and decides itself whether a length-truncated turn ends the episode):

    drive: generate ─▶ SchedulerEnv.step_turn(turn)
        request.messages gets the reply (a new assistant message, or appended to the one being continued)
        on_turn_end(request, response, turn)  → done?, rollout_infos?, reward?   (`reward`: a turnrl extra)
        check_finished(...)                    → stop?  (`done` overrides it; max_turns stops whatever they say)
        step(...)                              → next request (+ token edits: ids, mask, logprobs)
        next request against the stream's messages (`Turn.messages`; plan_next):
          the last assistant message extended   → continuation: the new text is appended to the same model
                                                  segment with mask 0 (the stop token of the turn is dropped)
          messages appended                     → observation delta (chat-template tokens, mask 0)
          anything else (history rewritten)     → this sample ends (TerminationReason.SPLIT) and the episode
                                                  continues in a new sample rendered afresh from the request
        (an assistant message is the same with or without the template's pre-fill, which the hooks never see:
        Qwen3's empty `<think></think>` with thinking off does not rewrite history)
    Token edits become one `TokenEdit` that the TrajectoryBuilder applies loudly (ids/mask mismatch →
    FAILED/invalid_output; a logprob count mismatch → importance correction off for that trajectory, with the
    reason in `Trajectory.warnings`).

`run(request, runner)` is the full-control path (ms-swift's `run()` override, which here works in every
mode). `SchedulerRunner.generate` takes the same `Episode` steps that `drive` loops over (generate, apply the
step, observe), so limits, validation and traces are the same; a history that is not a prefix of the next
request starts a new sample (trajectory splitting).

All samples of one episode share `episode_id` (each later one is a `split` branch of the sample before it: its
`parent`, docs/trees.md) and the episode's `rollout_infos` (with
`num_turns`, the episode's model turns, and, when it was split, `episode_turn_rewards`: the env rewards of all
its samples, which a reward function's `turn_rewards` then are, so `reward: env` scores the episode); the
reward function scores the episode once, on its last sample, and every sample takes that reward.

One scheduler instance serves every trajectory of a RolloutManager, as in ms-swift: keep per-trajectory state
keyed by `request.uuid` and drop it in `on_trajectory_end`, which always runs (also after a failure).

Plugins: `--plugin FILE.py` (repeatable; `RolloutConfig.plugins`) files are imported by
`turnrl.build.build_rollout_manager` before the scheduler name is resolved. The paths travel in the config,
so every process that builds a RolloutManager with `build_rollout_manager` (the CLI, Ray rollout workers,
`turnrl serve`) imports them itself; ms-swift's "plugin not imported in the rollout workers" stall cannot
happen there.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from turnrl.data import prompt_messages
from turnrl.envs.base import EpisodeEnv, error_with_frames, maybe_await
from turnrl.multimodal import IMAGE_PLACEHOLDER, image_ref, split_placeholders
from turnrl.rollout.episode import Episode, EpisodeEnd, RolloutContext, drive
from turnrl.rollout.manager import Agent
from turnrl.rollout.tree import branch
from turnrl.types import (
    BranchKind,
    FinishReason,
    Message,
    RolloutStatus,
    StepResult,
    TerminationReason,
    TokenEdit,
    Trajectory,
    Turn,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# What the hooks see
# ---------------------------------------------------------------------------------------------------
@dataclass
class RolloutRequest:
    """What the model is asked next (ms-swift's `RolloutInferRequest`)."""

    messages: list[Message]
    """The conversation. While the hooks of a turn run, its last message is the model's reply."""
    tools: list[dict] | None = None
    """Tool schemas rendered into the prompt (the row's `tools` column, when it is a list)."""
    images: list[Any] = field(default_factory=list)
    """The row's images, then those `step()` added. Images live in message content parts (`{"type": "image",
    ...}`); a `step()` may also add one the ms-swift way, appending it here with an `<image>` tag in its new
    message (the tag becomes an image part). Removing or replacing images here is an error."""
    data_dict: dict[str, Any] = field(default_factory=dict)
    """The dataset row, every column (always passed; ms-swift needs --vllm_server_pass_dataset)."""
    uuid: str = ""
    """The trajectory id: the key for per-trajectory state."""


RolloutInferRequest = RolloutRequest
"""ms-swift's name for RolloutRequest."""


@dataclass
class ChatMessage:
    role: str
    content: str
    tool_calls: list[dict] | None = None


@dataclass
class TurnResponse:
    """One generate call (ms-swift's `ChatCompletionResponseChoice`, flattened: `choices` is not needed)."""

    text: str
    """The reply text of this call, without the end-of-turn token. On a continuation: only the new part."""
    token_ids: list[int]
    """Exactly the tokens the engine returned, its stop token included."""
    logprobs: list[float]
    """One sampling logprob per token (ms-swift: `choice.logprobs['content'][i]['logprob']`)."""
    finish_reason: FinishReason
    """stop / length / abort (a str enum: `response.finish_reason == "length"` works)."""
    content_token_ids: list[int]
    """`token_ids` without the trailing end-of-turn token: what `text` decodes from. Build edited tokens from
    these (with `logprobs[:len(content_token_ids)]`) when the assistant message goes on after them."""

    @property
    def message(self) -> ChatMessage:
        return ChatMessage("assistant", self.text)

    @classmethod
    def of(cls, turn: Turn, end_of_turn_ids: frozenset[int]) -> TurnResponse:
        content = list(turn.token_ids)
        while content and content[-1] in end_of_turn_ids:
            content.pop()
        return cls(turn.text, list(turn.token_ids), list(turn.logprobs), turn.finish_reason, content)


class EpisodeOver(Exception):
    """Raised by `SchedulerRunner.generate` when the episode cannot go on: max_turns, a token budget, an engine
    error. A `run()` override may let it propagate; the trajectories built so far are kept."""


class RolloutFailure(RuntimeError):
    """The error `on_trajectory_end` receives when the episode ended FAILED without a Python exception
    (engine error, env timeout, invalid token edits). `reason` is the TerminationReason."""

    def __init__(self, reason: TerminationReason | None, message: str | None):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


STEP_KEYS = {"infer_request", "response_token_ids", "response_loss_mask", "rollout_logprobs", "rollout_infos"}
TURN_END_KEYS = {"done", "rollout_infos", "reward"}
EDIT_KEYS = ("response_token_ids", "response_loss_mask", "rollout_logprobs")


# ---------------------------------------------------------------------------------------------------
# The base class users subclass
# ---------------------------------------------------------------------------------------------------
class MultiTurnScheduler:
    """Customise a rollout by overriding hooks (module docstring). Every hook may be sync or async.

    Partial control: implement `step()` and optionally `check_finished()`, `on_turn_end()`,
    `on_trajectory_start()`, `on_trajectory_end()`. Full control: override `run()`.
    """

    max_turns: int | None = None
    """Model turns per episode. A subclass may set its own; the rollout's `max_turns` also applies (the smaller
    wins) and the driver enforces it whatever the hooks return."""

    def __init__(self, max_turns: int | None = None, *, tokenizer: Any = None, renderer: Any = None,
                 env_config: dict[str, Any] | None = None, **kwargs: Any):
        caps = [m for m in (type(self).max_turns, max_turns) if m is not None]
        self.max_turns = min(caps) if caps else None
        self.tokenizer = tokenizer
        """The policy's tokenizer (for token edits)."""
        self.renderer = renderer
        """The ChatRenderer of the rollout (`encode`, `decode`, `end_of_turn_ids`)."""
        self.env_config = dict(env_config or {})
        """The rollout's `env_config` (e.g. `gym_env`, `base_url`)."""

    def hook_response(self, response: TurnResponse) -> Any:
        """What the hooks (`on_turn_end`, `check_finished`, `step`) receive for a turn: the `TurnResponse` itself.
        turnrl.compat.swift's scheduler gives ms-swift's `ChatCompletionResponseChoice` instead."""
        return response

    async def on_trajectory_start(self, requests: list[RolloutRequest]) -> None:
        """Before the first turn; may rewrite `requests[0]` in place (e.g. inject an env's first observation)."""

    async def on_turn_end(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict | None:
        """After each turn (the reply is in `request.messages`). May return `done` (overrides check_finished),
        `rollout_infos` (merged into the episode's) and `reward` (recorded as this turn's env reward)."""
        return None

    def check_finished(self, request: RolloutRequest, response: TurnResponse, turn: int) -> bool:
        """Stop on a length-truncated turn or at max_turns."""
        if response.finish_reason == FinishReason.LENGTH:
            return True
        return self.max_turns is not None and turn >= self.max_turns

    def step(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        """The next request: `{"infer_request": ..., "response_token_ids"?, "response_loss_mask"?,
        "rollout_logprobs"?, "rollout_infos"?}`. Token fields replace this turn's tokens (mask 0 on injected
        tokens; one logprob per mask-1 token)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step() (or finish in check_finished)")

    async def on_trajectory_end(self, requests: list[RolloutRequest], error: BaseException | None = None) -> None:
        """Always runs once per trajectory, also after a failure (`error`). Release resources here."""

    async def run(self, request: RolloutRequest, runner: SchedulerRunner) -> list[Trajectory]:
        """The episode. The default maps the hooks onto `drive`; override for full control, calling
        `await runner.generate(request)` per turn and returning `await runner.finish()`."""
        return await runner.run_hooks(request)


# ---------------------------------------------------------------------------------------------------
# How the next request extends the token stream
# ---------------------------------------------------------------------------------------------------
def plan_next(turn: Turn, nxt: list[Message], response: TurnResponse, edit: TokenEdit | None, renderer: Any
              ) -> tuple[StepResult, bool]:
    """The StepResult that takes the token stream from `turn.messages` (the conversation as the stream holds it,
    this reply included) to the next request's messages, and whether the sample must be split instead.

    The hooks were shown each reply without what the chat template pre-filled before it (Qwen3 with thinking
    off: `<think>\n\n</think>\n\n`), and a template drops that block from history anyway, so an assistant
    message with or without its pre-fill is the same message: a request that only appends continues the sample
    (the stream keeps the tokens the model saw, as `drive` does). Anything else rewrites history and splits."""
    prefills = _template_prefills(renderer)
    conversation = turn.messages
    last = conversation[-1]["content"]
    prior = last[: len(last) - len(turn.text)]  # the assistant message before this call (its pre-fill, or more)
    edited_ids = edit.token_ids if edit is not None else None
    token_backed = edited_ids is not None
    reply = prior + (renderer.assistant_text(edited_ids) if edited_ids is not None else response.text)
    head = conversation[:-1]
    if len(nxt) == len(conversation) and _same(nxt[:-1], head, prefills) and nxt[-1].get("role") == "assistant":
        content = nxt[-1].get("content")
        content = content if isinstance(content, str) else None
        shown = next((r for r in (reply, _without_prefill(reply, prefills))
                      if content is not None and content.startswith(r)), None)
        if content is not None and shown is not None:
            tip = content[len(shown):]
        elif token_backed:  # token-backed reply: the tokens are the message (as ms-swift >= PR #10012)
            tip = ""
        else:
            return StepResult(done=True, termination_reason=TerminationReason.SPLIT, edit=edit), True
        if edit is None and response.content_token_ids != response.token_ids:
            edit = TokenEdit(token_ids=response.content_token_ids)  # go on after the text, not its stop token
        return StepResult(observation=tip, continuation=True, edit=edit), False
    if (len(nxt) > len(conversation) and _same(nxt[:len(head)], head, prefills)
            and nxt[len(head)].get("role") == "assistant"
            and (_same([nxt[len(head)]], [{"role": "assistant", "content": reply}], prefills) or token_backed)):
        new = copy.deepcopy(nxt[len(conversation):])
        if new[-1].get("role") == "assistant":
            raise ValueError("the next request ends with an assistant message after new messages (a prefill); "
                             "the default loop cannot continue it — override run() instead")
        return StepResult(observation=new, edit=edit), False
    return StepResult(done=True, termination_reason=TerminationReason.SPLIT, edit=edit), True


def _template_prefills(renderer: Any) -> tuple[str, ...]:
    """What the chat template pre-fills at the start of an assistant turn (per tool/no-tool profile), longest first."""
    profiles = getattr(renderer, "profiles", {}).values()
    return tuple(sorted({p.prefill for p in profiles if p.error is None and p.prefill}, key=len, reverse=True))


def _without_prefill(text: str, prefills: tuple[str, ...]) -> str:
    return next((text[len(p):] for p in prefills if text.startswith(p)), text)


def _same(a: list[Message], b: list[Message], prefills: tuple[str, ...] = ()) -> bool:
    """The same messages, an assistant message's template pre-fill aside (plan_next)."""
    def norm(m: Message) -> dict:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "assistant" and isinstance(m.get("content"), str):
            m["content"] = _without_prefill(m["content"], prefills)
        return m

    return len(a) == len(b) and all(norm(x) == norm(y) for x, y in zip(a, b, strict=True))


def _checked(value: Any, hook: str, allowed: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{hook}() must return a dict (keys {sorted(allowed)}), got {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise ValueError(f"{hook}() returned unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return value


def _next_request(result: dict[str, Any], current: RolloutRequest, images_before: list[Any], messages_before: int
                  ) -> RolloutRequest:
    """The request `step()` returned (`images_before`, `messages_before`: `current`'s images and message count
    before the call, which may have changed them in place), with the images it added placed (`_place_new_images`)."""
    nxt = result.get("infer_request")
    if isinstance(nxt, dict):
        nxt = RolloutRequest(**{"uuid": current.uuid, "data_dict": current.data_dict, "images": current.images, **nxt})
    if not isinstance(nxt, RolloutRequest):
        raise TypeError(f"step() must return {{'infer_request': RolloutRequest, ...}}, got {type(nxt).__name__}")
    _place_new_images(nxt, images_before, messages_before)
    return nxt


def _place_new_images(request: RolloutRequest, images_before: list[Any], messages_before: int) -> None:
    """ms-swift's way of adding an image in `step()` (its DeepEyes plugin): append it to `request.images` and
    write an `<image>` tag into the new message, which ms-swift's template replaces with the next image. Here each
    tag of the new messages becomes an image content part, in order; the counts must match, and the images there
    before must stay (ms-swift keeps them: they are in the context already)."""
    images = list(request.images)
    kept = len(images) >= len(images_before) and all(
        a is b or (isinstance(a, str) and a == b) for a, b in zip(images, images_before, strict=False))
    if not kept:
        raise ValueError(f"step() removed or replaced images of request.images (it had {len(images_before)}, now "
                         f"{len(images)}); append new ones only, each with an '{IMAGE_PLACEHOLDER}' tag in a new "
                         "message, or put them into message content parts ({'type': 'image', 'image': ...})")
    added = images[len(images_before):]
    if not added:
        return
    tagged = [m for m in request.messages[messages_before:]
              if isinstance(m.get("content"), str) and IMAGE_PLACEHOLDER in m["content"]]
    tags = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in tagged)
    if tags != len(added):
        raise ValueError(f"step() appended {len(added)} image(s) to request.images, but the messages it added have "
                         f"{tags} '{IMAGE_PLACEHOLDER}' tags; write one tag per new image where it goes (as ms-swift "
                         "needs), or put the images into message content parts ({'type': 'image', 'image': ...})")
    for message in tagged:
        n = message["content"].count(IMAGE_PLACEHOLDER)
        message["content"] = split_placeholders(message["content"], added[:n], "step()")
        added = added[n:]


def _edit_of(result: dict[str, Any]) -> TokenEdit | None:
    """ms-swift's three token fields of a `step()` result as one TokenEdit (None when it has none)."""
    ids, mask, logprobs = (result.get(k) for k in EDIT_KEYS)
    if ids is None and mask is None and logprobs is None:
        return None
    return TokenEdit(ids, mask, logprobs)


# ---------------------------------------------------------------------------------------------------
# The default path: the hooks as a turn-aware env of drive
# ---------------------------------------------------------------------------------------------------
class SchedulerEnv:
    """A turn-aware env (`step_turn`) that calls the scheduler's hooks; one per sample of an episode."""

    def __init__(self, runner: SchedulerRunner, request: RolloutRequest):
        self.runner, self.request = runner, request
        self.tools = request.tools
        self.next_request: RolloutRequest | None = None
        """Set when the scheduler rewrote the history: the episode goes on from it in a new sample."""

    async def step_turn(self, turn: Turn) -> StepResult:
        runner, scheduler, request = self.runner, self.runner.scheduler, self.request
        n = runner.turns + turn.turn
        response = TurnResponse.of(turn, runner.ctx.renderer.end_of_turn_ids)
        shown = scheduler.hook_response(response)
        if turn.continued:
            request.messages[-1]["content"] += response.text
        else:
            request.messages.append({"role": "assistant", "content": response.text})
        hook = _checked(await maybe_await(scheduler.on_turn_end(request, shown, n)), "on_turn_end", TURN_END_KEYS)
        runner.merge_infos(hook.get("rollout_infos"), "on_turn_end")
        reward = hook.get("reward")
        finished = bool(await maybe_await(scheduler.check_finished(request, shown, n)))
        if "done" in hook:
            finished = bool(hook["done"])
        if finished or n >= runner.max_turns:
            return StepResult(reward=reward, done=True, termination_reason=self._stop_reason(hook, response, n))
        images_before, messages_before = list(request.images), len(request.messages)  # step() may change both
        result = _checked(await maybe_await(scheduler.step(request, shown, n)), "step", STEP_KEYS)
        nxt = _next_request(result, request, images_before, messages_before)
        runner.merge_infos(result.get("rollout_infos"), "step")
        step, split = plan_next(turn, nxt.messages, response, _edit_of(result), runner.ctx.renderer)
        step.reward = reward
        if split:
            if nxt.messages and nxt.messages[-1].get("role") == "assistant":
                raise ValueError("step() rewrote the history and ends it with an assistant message; a new sample "
                                 "starts from a fresh prompt and cannot continue it — override run() instead")
            self.next_request = nxt
        self.request = nxt
        return step

    def _stop_reason(self, hook: dict, response: TurnResponse, n: int) -> TerminationReason | None:
        if hook.get("done"):
            return TerminationReason.ENV_DONE
        if response.finish_reason == FinishReason.LENGTH:
            return None  # drive reports the length stop (or the token budget) itself
        if n >= self.runner.max_turns:
            return TerminationReason.MAX_TURNS
        return TerminationReason.ENV_DONE


class _RequestTools:
    """The env of a `run()` sample: it is never stepped (run() makes its own turns); it only carries the request's
    tools into the prompt."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools

    def step(self, response_text: str) -> StepResult:
        raise RuntimeError("a run() override drives its own turns")


# ---------------------------------------------------------------------------------------------------
# One episode
# ---------------------------------------------------------------------------------------------------
class SchedulerRunner:
    """One episode of a scheduler: its samples, its rollout infos, its turn count.

    The default path drives each sample with `drive` (hooks in a `SchedulerEnv`). The `run()` path takes the same
    `Episode` steps one by one: `response = await runner.generate(request)` per turn (`new_sample=True` forces a
    new sample), `runner.edit_last_turn(...)` for ms-swift's token fields, `runner.rollout_infos` for infos, and
    `return await runner.finish()`.
    """

    def __init__(self, ctx: RolloutContext, scheduler: MultiTurnScheduler):
        self.ctx, self.scheduler = ctx, scheduler
        self.max_turns = ctx.limits.max_turns
        self.trajectories: list[Trajectory] = []
        self.rollout_infos: dict[str, Any] = {}
        """The episode's rollout infos; every sample gets them (plus `num_turns`), reward functions by name."""
        self.turns = 0
        """Model turns of the samples finished so far."""
        self._episode: Episode | None = None
        """The sample a run() override is taking turn by turn."""
        self._edit: TokenEdit | None = None

    def merge_infos(self, infos: Any, where: str) -> None:
        if not infos:
            return
        if not isinstance(infos, dict):
            raise TypeError(f"{where}() rollout_infos must be a dict, got {type(infos).__name__}")
        infos = dict(infos)
        if isinstance(infos.get("images"), list):  # ms-swift's override of the sample's images (DeepEyes): here
            infos["images"] = [image_ref(im) for im in infos["images"]]  # they are in the stream; keep references
        for key, value in infos.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise TypeError(f"{where}() rollout_infos[{key!r}] is not JSON-serialisable "
                                f"({type(value).__name__}); trajectories are written as JSON") from None
        self.rollout_infos.update(infos)

    def _sample_ctx(self) -> RolloutContext:
        """The context of the next sample: the turns left; a later sample of a split episode gets its own id (the
        engine's request id), same row and group."""
        k = len(self.trajectories)
        limits = dataclasses.replace(self.ctx.limits, max_turns=self.max_turns - self.turns)
        if k == 0:
            self.ctx.limits = limits
            return self.ctx
        return dataclasses.replace(self.ctx, trajectory_id=f"{self.ctx.trajectory_id}.{k}", limits=limits,
                                   partial=None)

    def _add(self, traj: Trajectory) -> None:
        self.turns += traj.num_turns
        self.trajectories.append(traj)

    # ---- the default path --------------------------------------------------------------------------
    async def run_hooks(self, request: RolloutRequest) -> list[Trajectory]:
        """Hooks mapped onto drive; a rewritten history continues the episode in a new sample."""
        nxt: RolloutRequest | None = request
        while nxt is not None and self.turns < self.max_turns:
            env = SchedulerEnv(self, nxt)
            self._add(await drive(self._sample_ctx(), env, copy.deepcopy(nxt.messages)))
            nxt = env.next_request
        return self.trajectories

    # ---- the run() path ----------------------------------------------------------------------------
    async def generate(self, request: RolloutRequest, *, new_sample: bool = False) -> TurnResponse:
        """One model turn on `request`. If the request extends the conversation so far, only the new part is
        appended (mask 0); otherwise, or with `new_sample`, the current sample ends and a new one starts."""
        if self._episode is not None:
            await self._go_on(self._episode, request, new_sample)
        episode = self._episode or await self._start(request)
        turn = await self._step(episode.generate(episode.trajectory.num_turns + 1))
        self._edit = None
        return TurnResponse.of(turn, self.ctx.renderer.end_of_turn_ids)

    async def _go_on(self, episode: Episode, request: RolloutRequest, new_sample: bool) -> None:
        """Take the current sample to `request`: observe what it appends, or end the sample (split, max_turns)."""
        last = episode.last_turn
        if last.turn >= episode.limits.max_turns:
            await self._end_sample(StepResult(done=True, termination_reason=TerminationReason.MAX_TURNS,
                                              edit=self._edit))
            raise EpisodeOver(f"max_turns={self.max_turns} reached")
        if list(request.images) != list(self.ctx.sample.get("images") or []):
            raise ValueError("request.images changed; put images into message content parts instead")
        if new_sample:
            step, split = StepResult(done=True, termination_reason=TerminationReason.SPLIT, edit=self._edit), True
        else:
            response = TurnResponse.of(last, self.ctx.renderer.end_of_turn_ids)
            step, split = plan_next(last, request.messages, response, self._edit, self.ctx.renderer)
        if split:
            await self._end_sample(step)
        else:
            await self._step(self._apply_and_observe(episode, step))

    def edit_last_turn(self, response_token_ids: list[int] | None = None, response_loss_mask: list[int] | None = None,
                       rollout_logprobs: list[float] | None = None) -> None:
        """ms-swift's token fields for the turn `generate` last returned; applied and validated with what comes next."""
        if self._episode is None or not self._episode.trajectory.num_turns:
            raise RuntimeError("edit_last_turn() needs a turn: call generate() first")
        self._edit = _edit_of({"response_token_ids": response_token_ids, "response_loss_mask": response_loss_mask,
                               "rollout_logprobs": rollout_logprobs})

    async def finish(self) -> list[Trajectory]:
        """End the current sample (env_done, or length if the last turn was cut) and return every sample."""
        if self._episode is not None:
            await self._end_sample(StepResult(done=True, edit=self._edit))
        return self.trajectories

    async def abort(self) -> None:
        """Drop a sample still in progress (the agent calls this when the episode raised)."""
        episode, self._episode = self._episode, None
        if episode is not None:
            episode.end(TerminationReason.CANCELLED)
            await episode.close()

    async def _start(self, request: RolloutRequest) -> Episode:
        if self.turns >= self.max_turns:
            raise EpisodeOver(f"max_turns={self.max_turns} reached")
        if request.messages and request.messages[-1].get("role") == "assistant":
            raise ValueError("a new sample starts from a fresh prompt (generation prompt added), so its messages "
                             "cannot end with an assistant message to continue")
        episode = self._episode = Episode(self._sample_ctx())
        await self._step(episode.start(EpisodeEnv(_RequestTools(request.tools)), copy.deepcopy(request.messages)))
        return episode

    @staticmethod
    async def _apply_and_observe(episode: Episode, step: StepResult) -> None:
        episode.apply(step)
        await episode.observe(step)

    async def _step(self, work: Awaitable[T]) -> T:
        """One Episode step; when it ends the sample (a limit, an engine error, a render error), the sample is
        finished and the run() override gets EpisodeOver."""
        try:
            return await work
        except EpisodeEnd as end:
            await self._end_sample(None, end.reason, end.message)
        except (asyncio.CancelledError, EpisodeOver):
            raise
        except Exception as e:
            log.info("trajectory %s: %s raised", self.ctx.trajectory_id, type(e).__name__, exc_info=True)  # -v
            await self._end_sample(None, TerminationReason.ENV_ERROR, error_with_frames(e))
        traj = self.trajectories[-1]
        raise EpisodeOver(f"the sample ended: {traj.termination_reason}{': ' + traj.error if traj.error else ''}")

    async def _end_sample(self, step: StepResult | None, reason: TerminationReason = TerminationReason.ENV_DONE,
                          message: str | None = None) -> None:
        """Finish the current sample: with the last turn's final step (its edits applied), or with `reason`."""
        episode, self._episode = self._episode, None
        assert episode is not None
        try:
            if step is not None and episode.started:
                episode.apply(step)
                reason = episode.done_reason(step)
            episode.end(reason, message)
        except EpisodeEnd as end:
            episode.end(end.reason, end.message)
        finally:
            await episode.close()
        self._add(episode.result())

    # ---- the end of an episode ---------------------------------------------------------------------
    def finalize(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Give every sample the episode id and infos; a failed sample fails its whole episode (the samples share
        one reward, which an unfinished episode cannot give)."""
        infos = {**self.rollout_infos, "num_turns": self.turns}
        episode_rewards = [r for t in trajectories for r in t.turn_rewards]
        if len(trajectories) > 1 and episode_rewards:  # a split episode: scored on every sample's env rewards
            infos["episode_turn_rewards"] = episode_rewards
        failed = next((t for t in trajectories if t.status == RolloutStatus.FAILED), None)
        for k, traj in enumerate(trajectories):
            traj.episode_id = self.ctx.trajectory_id
            if k and traj.parent is None:  # the episode went on from the sample before, its history rewritten
                branch(traj, trajectories[k - 1], BranchKind.SPLIT)
            traj.rollout_infos = dict(infos)
            if failed is not None and traj.status != RolloutStatus.FAILED:
                traj.finish(failed.termination_reason or TerminationReason.ENV_ERROR,
                            f"sample {failed.id} of this episode failed: {failed.error}")
        return trajectories


# ---------------------------------------------------------------------------------------------------
# The agent and the registry
# ---------------------------------------------------------------------------------------------------
SCHEDULERS: dict[str, type[MultiTurnScheduler]] = {}
"""Schedulers by name. The built-ins (math_tip_trick, thinking_tips, gym, remote_env and ms-swift's names for
them) are registered by turnrl.agents.schedulers_builtin, which the `turnrl.agents` package imports (so they are
there whenever this module is); plugins add theirs: `multi_turns["name"] = MyScheduler`."""

multi_turns = SCHEDULERS
"""ms-swift's name for the registry, so `multi_turns['name'] = Cls` in a plugin ports unchanged."""


def get_scheduler(spec: str | type[MultiTurnScheduler]) -> type[MultiTurnScheduler]:
    """A registered name, a `path.py:Class` / `pkg.module:Class` spec, or the class itself."""
    if isinstance(spec, type):
        return spec
    if spec in SCHEDULERS:
        return SCHEDULERS[spec]
    if ":" in spec:
        from turnrl.loading import load_object

        cls = load_object(spec, what="scheduler")
        if not isinstance(cls, type):
            raise AttributeError(f"scheduler {spec!r}: {cls!r} is not a class")
        return cls
    raise ValueError(f"unknown scheduler {spec!r}; registered: {', '.join(sorted(SCHEDULERS))}. A plugin file "
                     "(--plugin FILE.py) registers more with multi_turns['name'] = MyScheduler, or pass path.py:Class")


def build_scheduler(cls: type[MultiTurnScheduler], ctx: RolloutContext) -> MultiTurnScheduler:
    """Instantiate with what the rollout offers: max_turns, tokenizer, renderer, env_config (only the arguments
    the constructor names, unless it takes **kwargs, as ms-swift does with `tokenizer`)."""
    offered = {"max_turns": ctx.limits.max_turns, "tokenizer": ctx.renderer.tokenizer, "renderer": ctx.renderer,
               "env_config": dict(ctx.env_config)}
    params = inspect.signature(cls).parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        offered = {k: v for k, v in offered.items() if k in names}
    return cls(**offered)


def first_request(ctx: RolloutContext, sample: dict[str, Any]) -> RolloutRequest:
    """The row as a request. A trailing assistant message (the row's reference reply) is dropped, as ms-swift's
    `remove_response` does (for `messages` rows, turnrl.data.prompt_messages already has)."""
    messages = prompt_messages(sample)
    if "prompt" in sample and len(messages) > 1 and messages[-1].get("role") == "assistant":
        messages.pop()
    tools = sample.get("tools")
    if isinstance(tools, str) and tools.strip().startswith("["):  # ms-swift rows may hold the tools as JSON text
        tools = json.loads(tools)
    tools = tools if isinstance(tools, list) else None
    return RolloutRequest(messages, tools, list(sample.get("images") or []), dict(sample), ctx.trajectory_id)


def scheduler_agent(spec: str | type[MultiTurnScheduler]) -> Agent:
    """The Agent that runs a scheduler. The class is resolved now (an unknown name fails at build time); the one
    shared instance is built on the first trajectory, which brings the tokenizer and limits."""
    cls = get_scheduler(spec)
    instance: list[MultiTurnScheduler] = []

    async def scheduler(ctx: RolloutContext, sample: dict[str, Any]) -> list[Trajectory]:
        if not instance:
            instance.append(build_scheduler(cls, ctx))
        return await run_episode(instance[0], ctx, sample)

    scheduler.__name__ = f"scheduler[{getattr(cls, '__name__', spec)}]"
    return scheduler


async def run_episode(scheduler: MultiTurnScheduler, ctx: RolloutContext, sample: dict[str, Any]) -> list[Trajectory]:
    """on_trajectory_start → run (default: the hooks on drive) → on_trajectory_end, which always runs once."""
    if scheduler.max_turns is not None and scheduler.max_turns < ctx.limits.max_turns:
        ctx.limits = dataclasses.replace(ctx.limits, max_turns=scheduler.max_turns)
    requests = [first_request(ctx, sample)]
    runner = SchedulerRunner(ctx, scheduler)
    try:
        await maybe_await(scheduler.on_trajectory_start(requests))
        try:
            result = await scheduler.run(requests[0], runner)
        except EpisodeOver:  # a limit or an engine error ended a run() override: keep what was built
            result = None
        collected = await runner.finish()
        trajectories: list[Trajectory] = (collected if result is None else [result] if isinstance(result, Trajectory)
                                          else list(result))
        if not trajectories or not all(isinstance(t, Trajectory) for t in trajectories):
            raise TypeError(f"{type(scheduler).__name__}.run() must return a non-empty list of Trajectory "
                            "(return await runner.finish())")
        runner.finalize(trajectories)
    except BaseException as e:  # the manager turns the exception into a FAILED trajectory
        await runner.abort()
        await _end(scheduler, requests, e, [], ctx.trajectory_id)
        raise
    failed = next((t for t in trajectories if t.status == RolloutStatus.FAILED), None)
    error = None if failed is None else RolloutFailure(failed.termination_reason, failed.error)
    await _end(scheduler, requests, error, trajectories, ctx.trajectory_id)
    return trajectories


async def _end(scheduler: MultiTurnScheduler, requests: list[RolloutRequest], error: BaseException | None,
               trajectories: list[Trajectory], trajectory_id: str) -> None:
    """on_trajectory_end; its own failure is logged and recorded, never hiding the rollout's outcome or error."""
    try:
        await maybe_await(scheduler.on_trajectory_end(requests, error))
    except Exception as e:
        log.warning("trajectory %s: on_trajectory_end raised %s: %s", trajectory_id, type(e).__name__, e)
        for traj in trajectories:
            traj.warnings.append(f"on_trajectory_end raised {type(e).__name__}: {e}")

