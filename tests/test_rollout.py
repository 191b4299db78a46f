"""The turn loop on a scripted engine with the real Qwen3 and SmolLM2 tokenizers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS, agent_registry
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutContext, RolloutLimits, RolloutManager, drive, run_groups
from turnrl.types import (
    FinishReason,
    RolloutStatus,
    SamplingParams,
    Segment,
    SegmentSource,
    StepResult,
    TerminationReason,
    TokenEdit,
    Trajectory,
)


class FeedbackEnv:
    """Says 'Wrong, try again.' until the reply contains the answer; optional failure modes."""

    def __init__(self, answer="4", raise_on_turn=None, sleep_s=0.0, fail_times=0, slime_tuple=False):
        self.answer, self.raise_on_turn, self.sleep_s, self.fail_times = answer, raise_on_turn, sleep_s, fail_times
        self.slime_tuple, self.turn, self.closed = slime_tuple, 0, False

    def reset(self):
        return None

    async def step(self, text):
        if self.fail_times > 0:
            self.fail_times -= 1
            raise ConnectionError("flaky env")
        self.turn += 1
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        if self.raise_on_turn == self.turn:
            raise ValueError(f"env exploded on turn {self.turn}")
        correct = self.answer in text
        if self.slime_tuple:
            return ("Wrong, try again." if not correct else None), correct, {"correct": correct}
        return StepResult("Wrong, try again." if not correct else None, reward=float(correct), done=correct)

    def format_observation(self, observation):
        return {"role": "user", "content": observation}

    def close(self):
        self.closed = True


def make_ctx(engine, tokenizer, *, limits=None, sample=None, tid="t0", chat_template_kwargs=None,
             sanity_mode="strict"):
    return RolloutContext(
        sanity_mode=sanity_mode,
        engine=engine, renderer=ChatRenderer(tokenizer, chat_template_kwargs), sampling=SamplingParams(),
        limits=limits or RolloutLimits(max_turns=4, max_new_tokens=64), trajectory_id=tid, group_id="g0",
        sample_index=0, sample=sample or {"prompt": "What is 2+2?"},
    )


def replies(*texts):
    return lambda rid, turn, prompt: texts[min(turn, len(texts)) - 1]


def spans(traj, tokenizer):
    """(source, mask value, decoded text) for each maximal run of equal mask within each segment."""
    out = []
    for seg in traj.segments:
        start = 0
        for k in range(1, len(seg.token_ids) + 1):
            if k == len(seg.token_ids) or seg.loss_mask[k] != seg.loss_mask[start]:
                out.append((seg.source, seg.loss_mask[start], tokenizer.decode(seg.token_ids[start:k])))
                start = k
    return out


@pytest.mark.parametrize("tok_name", ["qwen3_tokenizer", "smol_tokenizer"])
async def test_two_turn_feedback_spans_are_exact(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    # a Qwen3 model in thinking mode always opens with a reasoning block; SmolLM2 never does
    think = "<think>\nAdd them.\n</think>\n\n" if tok_name == "qwen3_tokenizer" else ""
    engine = ScriptedEngine(tok, replies(think + "It is 5.", think + "It is 4."))
    env = FeedbackEnv()
    traj = await drive(make_ctx(engine, tok), env)

    assert traj.status == RolloutStatus.COMPLETED and traj.termination_reason == TerminationReason.ENV_DONE
    assert traj.num_turns == 2 and env.closed and engine.released == ["t0"]
    got = spans(traj, tok)
    assert [(s, m) for s, m, _ in got] == [
        (SegmentSource.MODEL, 1), (SegmentSource.TEMPLATE, 0), (SegmentSource.ENV, 0), (SegmentSource.MODEL, 1)]
    assert got[0][2] == think + "It is 5.<|im_end|>" and got[3][2] == think + "It is 4.<|im_end|>"
    assert got[1][2] == "\n"  # the template's newline after <|im_end|>: boundary repair, masked
    assert got[2][2] == "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    # mask-1 tokens are exactly the engine's, with its logprobs; mask-0 tokens carry none
    assert traj.rollout_logprobs[: len(traj.segments[0])] == [-(k + 1) / 100 for k in range(len(traj.segments[0]))]
    assert all(lp is None for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 0)
    # every call saw exactly the stream so far (token in, token out)
    assert engine.calls[0].prompt_ids == traj.prompt_ids
    assert engine.calls[1].prompt_ids == traj.prompt_ids + traj.response_ids[: -len(traj.segments[-1])]
    assert traj.turn_rewards == [0.0, 1.0]
    if think:  # Qwen3 drops the reasoning of turns before the last user message in a full render
        assert traj.metrics["render_harmless"] == 1.0 and traj.info["render_check"]["strippable"] is True
        assert traj.metrics["render_mismatch"] == 0.0
    else:  # the strict full re-render agrees token for token
        assert traj.metrics["render_mismatch"] == 0.0
    assert traj.messages[-1] == {"role": "assistant", "content": think + "It is 4."}
    traj.validate()


async def test_max_turns_is_completed(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("no idea"))
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=RolloutLimits(max_turns=3)), FeedbackEnv())
    assert (traj.status, traj.termination_reason, traj.num_turns) == (
        RolloutStatus.COMPLETED, TerminationReason.MAX_TURNS, 3)
    assert traj.segments[-1].source == SegmentSource.MODEL  # no observation after the last turn


async def test_length_stop_is_truncated(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("word " * 50))
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=RolloutLimits(max_new_tokens=8)), FeedbackEnv())
    assert (traj.status, traj.termination_reason) == (RolloutStatus.TRUNCATED, TerminationReason.LENGTH)
    assert len(traj.response_ids) == 8 and traj.num_turns == 1


async def test_token_budget_caps_each_call_and_truncates(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong answer here", "still wrong " * 20))
    limits = RolloutLimits(max_turns=5, max_new_tokens=64, token_budget=40)
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=limits), FeedbackEnv())
    assert (traj.status, traj.termination_reason) == (RolloutStatus.TRUNCATED, TerminationReason.TOKEN_BUDGET)
    first_len = len(traj.segments[0])
    injected = sum(len(s) for s in traj.segments[1:3])
    assert engine.calls[0].params.max_new_tokens == 40  # min(64, 40)
    assert engine.calls[1].params.max_new_tokens == 40 - first_len - injected
    assert len(traj.response_ids) == 40


async def test_observation_that_does_not_fit_ends_without_it(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("no"))
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=RolloutLimits(token_budget=6)), FeedbackEnv())
    assert traj.termination_reason == TerminationReason.TOKEN_BUDGET
    assert [s.source for s in traj.segments] == [SegmentSource.MODEL]


async def test_env_exception_fails_the_trajectory_with_message(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong", "wrong"))
    env = FeedbackEnv(raise_on_turn=2)
    traj = await drive(make_ctx(engine, qwen3_tokenizer), env)
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.ENV_ERROR)
    assert "env exploded on turn 2" in traj.error and env.closed
    assert traj.num_turns == 2  # the content up to the failure is kept


async def test_env_timeout(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong"))
    limits = RolloutLimits(env_timeout_s=0.05)
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=limits), FeedbackEnv(sleep_s=1.0))
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.TIMEOUT)
    assert "env_timeout_s=0.05" in traj.error


async def test_env_retries_recover_a_flaky_step(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("4"))
    limits = RolloutLimits(env_retries=2)
    traj = await drive(make_ctx(engine, qwen3_tokenizer, limits=limits), FeedbackEnv(fail_times=2))
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.metrics["env_retries"] == 2
    traj = await drive(make_ctx(engine, qwen3_tokenizer, tid="t1"), FeedbackEnv(fail_times=1))
    assert traj.termination_reason == TerminationReason.ENV_ERROR and "flaky env" in traj.error


async def test_engine_error(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong", None))
    traj = await drive(make_ctx(engine, qwen3_tokenizer), FeedbackEnv())
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.ENGINE_ERROR)
    assert "scripted engine failure" in traj.error and traj.num_turns == 1


async def test_slime_tuple_and_env_given_reason(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("nope", "4"))
    traj = await drive(make_ctx(engine, qwen3_tokenizer), FeedbackEnv(slime_tuple=True))
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.num_turns == 2
    assert traj.turns[1].env.info == {"correct": True}
    assert traj.turns[1].generate.finish_reason == "stop"

    class NoToolCall:
        def step(self, text):
            return StepResult(done=True, termination_reason=TerminationReason.NO_TOOL_CALL)

    traj = await drive(make_ctx(engine, qwen3_tokenizer, tid="t2"), NoToolCall())
    assert (traj.status, traj.termination_reason) == (RolloutStatus.COMPLETED, TerminationReason.NO_TOOL_CALL)


async def test_bad_step_return_value_is_env_error(qwen3_tokenizer):
    class Bad:
        def step(self, text):
            return "not a step result"

    traj = await drive(make_ctx(ScriptedEngine(qwen3_tokenizer, replies("x")), qwen3_tokenizer), Bad())
    assert traj.termination_reason == TerminationReason.ENV_ERROR and "StepResult" in traj.error


async def test_qwen3_no_thinking_stream_is_strictly_consistent(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("It is 5.", "It is 4."))
    ctx = make_ctx(engine, qwen3_tokenizer, chat_template_kwargs={"enable_thinking": False})
    traj = await drive(ctx, FeedbackEnv())
    text = qwen3_tokenizer.decode(traj.prompt_ids + traj.response_ids)
    assert text.count("<think>\n\n</think>\n\n") == 2  # each generation prompt carries the empty think block
    # the template drops empty think blocks of earlier turns in a full render: a strippable difference only
    assert traj.info["render_check"]["strippable"] is True


def _manager(engine, tokenizer, env_factory, **kw):
    return RolloutManager(
        engine, ChatRenderer(tokenizer), agents=AGENTS, default_agent="env_agent", env_factory=env_factory,
        limits=RolloutLimits(max_turns=3, max_new_tokens=32), **kw,
    )


async def test_one_failing_env_does_not_fail_the_batch(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong", "4"))

    def build_env(sample, config):
        if sample["id"] == "bad":
            raise RuntimeError("cannot build this env")
        return FeedbackEnv(raise_on_turn=1 if sample["id"] == "boom" else None)

    rows = [{"id": "a", "prompt": "2+2?"}, {"id": "bad", "prompt": "x"}, {"id": "boom", "prompt": "y"}]
    groups = await run_groups(_manager(engine, qwen3_tokenizer, build_env, concurrency=4), rows, n=2)
    by_row = {g[0].group_id: g for g in groups}
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(t.status == RolloutStatus.COMPLETED and t.num_turns == 2 for t in by_row["a"])
    assert all(t.termination_reason == TerminationReason.ENV_ERROR for t in by_row["bad"] + by_row["boom"])
    assert "cannot build this env" in by_row["bad"][0].error
    assert [t.sample_index for t in by_row["a"]] == [0, 1]


async def test_stream_batches_hands_over_what_finished_together_once_each(qwen3_tokenizer):
    """A Ray rollout worker sends the driver one object per batch: every trajectory exactly once, in the order
    they finished, each batch what finished since the last; `stream` is the same trajectories one at a time."""
    engine = ScriptedEngine(qwen3_tokenizer, replies("4"))

    def build_env(sample, config):
        return FeedbackEnv(sleep_s=0.3 if sample["id"] == "slow" else 0.0)

    rows = [{"id": f"r{i}", "prompt": "2+2?"} for i in range(6)] + [{"id": "slow", "prompt": "2+2?"}]
    manager = _manager(engine, qwen3_tokenizer, build_env)
    batches = [batch async for batch in manager.stream_batches(rows, n=2)]
    ids = [t.id for batch in batches for t in batch]
    assert all(batches) and len(ids) == len(set(ids)) == 14
    assert len(batches) < 12  # the fast trajectories finish in the same few loop rounds: they travel together
    assert {t.group_id for t in batches[-1]} == {"slow"}  # the slow row's come last, alone
    one_by_one = [t.id async for t in _manager(engine, qwen3_tokenizer, build_env).stream(rows, n=2)]
    assert sorted(one_by_one) == sorted(ids) and set(one_by_one[-2:]) == {"slow-0", "slow-1"}


async def test_trajectory_timeout_keeps_content(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("wrong"))
    manager = _manager(engine, qwen3_tokenizer, lambda s, c: FeedbackEnv(sleep_s=5))
    manager.limits.trajectory_timeout_s = 0.3
    [[traj]] = await run_groups(manager, [{"prompt": "q"}], n=1)
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.TIMEOUT)
    assert traj.num_turns == 1 and traj.response_ids  # what was generated is kept


async def test_rewards_are_streamed_and_errors_are_not_zero(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("4"))
    seen = []

    def reward_fn(traj):
        seen.append(traj.id)
        if traj.sample["id"] == "r1":
            raise KeyError("solution")
        return 1.0

    manager = _manager(engine, qwen3_tokenizer, lambda s, c: FeedbackEnv(), reward_fn=reward_fn)
    groups = await run_groups(manager, [{"id": "r0", "prompt": "a"}, {"id": "r1", "prompt": "b"}], n=2)
    assert [t.reward for t in groups[0]] == [1.0, 1.0]
    assert [t.reward for t in groups[1]] == [None, None] and "KeyError" in groups[1][0].reward_error
    assert len(seen) == 4


async def test_a_failed_trajectory_is_not_scored_zero(qwen3_tokenizer):
    """A failure (here the env's step raises) has no outcome to score: its reward stays None, not the 0.0 an
    `env`-style reward function would give it; it is counted by its status and never trained."""
    engine = ScriptedEngine(qwen3_tokenizer, replies("4"))
    scored = []
    manager = _manager(engine, qwen3_tokenizer, lambda s, c: FeedbackEnv(raise_on_turn=1),
                       reward_fn=lambda traj: scored.append(traj.id) or 0.0)
    [[traj]] = await run_groups(manager, [{"id": "r0", "prompt": "a"}])
    assert traj.status == RolloutStatus.FAILED and traj.reward is None and traj.reward_error is None
    assert scored == []


async def test_unknown_agent_lists_registered(qwen3_tokenizer):
    manager = _manager(ScriptedEngine(qwen3_tokenizer, replies("x")), qwen3_tokenizer, None)
    with pytest.raises(ValueError, match="unknown agent_name 'nope'.*env_agent"):
        await run_groups(manager, [{"prompt": "a", "agent_name": "nope"}])
    with pytest.raises(ValueError, match="expected"):
        agent_registry(["not-a-spec"])


async def test_single_turn_agent(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("Paris."))
    manager = _manager(engine, qwen3_tokenizer, None)
    [[traj]] = await run_groups(manager, [{"prompt": "Capital of France?", "agent_name": "single_turn"}])
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.num_turns == 1


async def test_ignore_strippable_accepts_qwen3_reasoning_history(qwen3_tokenizer):
    think = "<think>\nAdd them.\n</think>\n\n"
    engine = ScriptedEngine(qwen3_tokenizer, replies(think + "It is 5.", think + "It is 4."))
    traj = await drive(make_ctx(engine, qwen3_tokenizer, sanity_mode="ignore_strippable"), FeedbackEnv())
    assert traj.metrics["render_mismatch"] == 0.0 and "render_check" not in traj.info


async def test_a_row_repeated_in_a_batch_gets_distinct_ids(qwen3_tokenizer):
    # an epoch boundary can put the same row twice into one training batch
    engine = ScriptedEngine(qwen3_tokenizer, replies("4"))
    manager = _manager(engine, qwen3_tokenizer, lambda s, c: FeedbackEnv())
    row = {"id": "r1", "prompt": "2+2?"}
    groups = await run_groups(manager, [row, {"id": "r0", "prompt": "x"}, row], n=2, id_prefix="s3-")
    assert [[t.id for t in g] for g in groups] == [["s3-r1-0", "s3-r1-1"], ["s3-r0-0", "s3-r0-1"],
                                                   ["s3-r1#1-0", "s3-r1#1-1"]]


async def test_real_engine_on_tiny_qwen3_spans_and_invariants(tiny_qwen3, qwen3_tokenizer):
    """The same loop on the real embedded engine: mask-1 runs are exactly what the engine returned, mask-0
    runs decode to exactly the template closing and the observation."""
    import copy

    from turnrl.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(copy.deepcopy(tiny_qwen3), max_batch_size=4)
    outputs = []
    real_generate = engine.generate

    async def recording_generate(prompt_ids, params, *, request_id, images=None):
        out = await real_generate(prompt_ids, params, request_id=request_id, images=images)
        outputs.append(out)
        return out

    engine.generate = recording_generate
    try:
        ctx = make_ctx(engine, qwen3_tokenizer, limits=RolloutLimits(max_turns=3, max_new_tokens=12),
                       sanity_mode="disable")
        # a random model rarely emits <|im_end|>: let every token id stop a turn, so each turn is one sampled
        # token and the closing is injected whole (a stop other than the end-of-turn token)
        ctx.sampling = SamplingParams(seed=3, stop_token_ids=tuple(range(151936)))
        traj = await drive(ctx, FeedbackEnv(answer="never-said"))
    finally:
        engine.close()
    traj.validate()
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 3)
    model = [s for s in traj.segments if s.source == SegmentSource.MODEL]
    assert [s.token_ids for s in model] == [o.token_ids for o in outputs]
    assert [s.logprobs for s in model] == [o.logprobs for o in outputs]
    for s in traj.segments:
        if s.source == SegmentSource.ENV:
            assert qwen3_tokenizer.decode(s.token_ids) == (
                "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n")
        if s.source == SegmentSource.TEMPLATE:
            assert qwen3_tokenizer.decode(s.token_ids) in ("\n", "<|im_end|>\n")
    # the second turn reused the first turn's KV: only the new tokens were prefilled
    assert outputs[1].cached_prompt_tokens == len(traj.prompt_ids) + len(outputs[0].token_ids) - 1


# ---- the trajectory format: typed turn records, named fields, version-1 files --------------------------------
V1_FILE = Path(__file__).parent / "data" / "trajectories_v1.jsonl"
"""Written by `turnrl rollout` at commit 6e72bcd (format version 1): an arithmetic env run whose reward function
raised, and a math_tip_trick scheduler run (episode ids, rollout infos)."""


def test_version_1_files_load_with_their_info_keys_as_fields():
    rows = [json.loads(line) for line in V1_FILE.read_text().splitlines()]
    assert {r["format_version"] for r in rows} == {1}
    trajs = [Trajectory.from_json(r) for r in rows]
    for row, traj in zip(rows, trajs, strict=True):
        traj.validate()
        assert "turns" not in traj.info and len(traj.turns) == len(row["info"]["turns"]) == traj.num_turns
        first = row["info"]["turns"][0]
        assert traj.turns[0].generate.tokens == first["generate"]["tokens"]
        assert traj.turns[0].generate.finish_reason == FinishReason(first["generate"]["finish_reason"])
    env_run, sched_run = trajs[:2], trajs[2:]
    assert all(t.reward is None and "missing_column" in t.reward_error for t in env_run)
    assert all(t.episode_id == t.id and t.rollout_infos["num_turns"] == t.num_turns for t in sched_run)
    again = Trajectory.from_json(json.loads(json.dumps(trajs[0].to_json())))  # and v2 round-trips
    assert again.to_json() == trajs[0].to_json() and again.to_json()["format_version"] == 3


async def test_turn_records_round_trip_as_the_documented_shape(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, replies("It is 5.", "It is 4."))
    traj = await drive(make_ctx(engine, qwen3_tokenizer), FeedbackEnv())
    row = traj.to_json()
    assert [sorted(t) for t in row["turns"]] == [["env", "generate", "observation_tokens", "turn"]] * 2
    assert row["turns"][0]["generate"]["finish_reason"] == "stop" and row["turns"][0]["env"]["attempts"] == 1
    assert Trajectory.from_json(row).turns == traj.turns


def test_a_trajectory_keeps_its_first_error_and_appends_later_ones():
    traj = Trajectory(id="t", group_id="g", sample_index=0, prompt_ids=[1])
    traj.finish(TerminationReason.ENV_ERROR, "ValueError: the real cause")
    traj.finish(TerminationReason.ENV_ERROR, "RuntimeError: cleanup failed afterwards")
    assert traj.error == "ValueError: the real cause"
    assert traj.warnings == ["RuntimeError: cleanup failed afterwards"]


# ---- weight updates in the middle of a turn ---------------------------------------------------------------------
class UpdatingEngine(ScriptedEngine):
    """A scripted engine that meets a weight update inside its first call: `abort` returns the first 3 tokens as
    preempted (the driver resubmits), `keep` returns the whole reply with the tokens after the 3rd from version 1."""

    def __init__(self, tokenizer, script, pause):
        super().__init__(tokenizer, script)
        self.pause = pause

    async def generate(self, prompt_ids, params, *, request_id, images=None):
        out = await super().generate(prompt_ids, params, request_id=request_id, images=images)
        if len(self.calls) > 1:  # the resubmission: the rest of the reply, from the new weights
            return dataclasses.replace(out, token_ids=out.token_ids[3:], logprobs=out.logprobs[3:], policy_version=1)
        if self.pause == "abort":
            return dataclasses.replace(out, token_ids=out.token_ids[:3], logprobs=out.logprobs[:3],
                                       finish_reason=FinishReason.ABORT, preempted=True)
        versions = [0] * 3 + [1] * (len(out.token_ids) - 3)
        return dataclasses.replace(out, policy_version=1, token_versions=versions)


@pytest.mark.parametrize("pause", ["abort", "keep"])
async def test_a_turn_goes_on_across_a_weight_update_with_each_segment_versioned(qwen3_tokenizer, pause):
    engine = UpdatingEngine(qwen3_tokenizer, replies("It is 4, I am sure of it."), pause)
    traj = await drive(make_ctx(engine, qwen3_tokenizer), FeedbackEnv())
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 1
    model = [s for s in traj.segments if s.source == SegmentSource.MODEL]
    assert [(s.policy_version, s.turn) for s in model] == [(0, 1), (1, 1)] and len(model[0]) == 3
    text = qwen3_tokenizer.decode([t for s in model for t in s.token_ids])
    assert text == "It is 4, I am sure of it.<|im_end|>" and traj.messages[-1]["content"] == "It is 4, I am sure of it."
    if pause == "abort":  # the resubmitted call saw the prompt plus the tokens kept from the preempted one
        assert engine.calls[1].prompt_ids == traj.prompt_ids + model[0].token_ids
    assert traj.policy_versions == [0, 1] and len(traj.turns) == 1
    traj.validate()


async def test_a_scheduler_edit_of_a_turn_that_spans_versions_merges_its_segments(qwen3_tokenizer):
    engine = UpdatingEngine(qwen3_tokenizer, replies("It is 4, I am sure of it."), "keep")
    ctx = make_ctx(engine, qwen3_tokenizer)

    class CutAfterThree:  # token-aware: keeps the first 3 tokens of the turn, the rest masked out
        def step_turn(self, turn):
            mask = [1] * 3 + [0] * (len(turn.token_ids) - 3)
            return StepResult(done=True, edit=TokenEdit(list(turn.token_ids), mask))

    traj = await drive(ctx, CutAfterThree())
    [segment] = traj.segments
    assert segment.policy_version == 0 and segment.loss_mask[:4] == [1, 1, 1, 0]
    assert segment.logprobs[:3] == [-0.01, -0.02, -0.03] and segment.logprobs[3] is None
    traj.validate()


async def test_a_harmless_render_difference_is_explained_once_at_info_and_then_only_counted(qwen3_tokenizer, caplog,
                                                                                            monkeypatch):
    import turnrl.rollout.episode as rollout_module

    monkeypatch.setattr(rollout_module, "_EXPLAINED", set())
    think = "<think>\nAdd them.\n</think>\n\n"  # Qwen3 drops earlier reasoning in a full render: strippable
    engine = ScriptedEngine(qwen3_tokenizer, replies(think + "It is 5.", think + "It is 4."))
    manager = RolloutManager(engine, ChatRenderer(qwen3_tokenizer), agents=AGENTS,
                             env_factory=lambda sample, config: FeedbackEnv(), sanity_mode="strict",
                             limits=RolloutLimits(max_turns=4, max_new_tokens=64))
    with caplog.at_level("INFO", logger="turnrl.rollout"):
        trajs = [t async for t in manager.stream([{"prompt": "What is 2+2?"}], n=6)]
    assert sum(t.metrics["render_harmless"] for t in trajs) == 6  # every one is counted, as harmless ...
    assert sum(t.metrics["render_mismatch"] for t in trajs) == 0  # ... not as a mismatch (6 before)
    explained = [r for r in caplog.records if "re-render" in r.getMessage()]
    assert len(explained) == 1 and explained[0].levelname == "INFO"  # ... one is explained (a WARNING before) ...
    message = explained[0].getMessage()  # ... with what differs, whether it matters and the flag that accepts it
    assert "known to be harmless for this template (reasoning: a reasoning block the template drops" in message
    assert "ignore_strippable" in message and "first differing tokens, at stream position" in message


@pytest.mark.parametrize(("returned", "reward", "error"), [
    (0.5, 0.5, None), (True, 1.0, None), (3, 3.0, None), ({"score": 0.25, "acc": 1.0}, 0.25, None),
    ("1.0", None, "returned '1.0' (str); expected a finite number"), (float("nan"), None, "returned nan (float)"),
    (None, None, "returned None (NoneType)"), ({"acc": 1.0}, None, "returned {'acc': 1.0} (dict)"),
])
async def test_a_reward_that_is_not_a_finite_number_is_an_error_never_a_poisoned_group(returned, reward, error):
    from turnrl.rollout import score

    traj = Trajectory(id="t", group_id="g", sample_index=0, prompt_ids=[1])
    await score(traj, lambda t: returned)
    assert traj.reward == reward
    assert (traj.reward_error is None) if error is None else (error in traj.reward_error)
    if isinstance(returned, dict) and "score" in returned:
        assert traj.info["reward_extra"] == {"acc": 1.0}  # verl's extra keys are kept beside the score


def test_a_content_difference_is_a_warning_and_a_stream_without_model_tokens_is_not_checked(qwen3_tokenizer, caplog,
                                                                                              monkeypatch):
    from types import SimpleNamespace

    import turnrl.rollout.episode as rollout_module

    monkeypatch.setattr(rollout_module, "_EXPLAINED", set())
    renderer = ChatRenderer(qwen3_tokenizer)
    ctx = SimpleNamespace(sanity_mode=rollout_module.SanityMode.STRICT, renderer=renderer, sanity_check_every=1)
    said = [{"role": "user", "content": "What is 2+2?"}]
    prompt = renderer.initial(said, None).ids
    reply = qwen3_tokenizer("It is 5.<|im_end|>", add_special_tokens=False)["input_ids"]
    traj = Trajectory(id="t", group_id="g", sample_index=0, prompt_ids=prompt,
                      segments=[Segment(SegmentSource.MODEL, reply, [1] * len(reply), [-0.5] * len(reply), turn=1)])
    with caplog.at_level("INFO", logger="turnrl.rollout"):
        rollout_module._sanity_check(ctx, traj, [*said, {"role": "assistant", "content": "It is 6."}], None)
    assert traj.metrics == {"render_checked": 1.0, "render_mismatch": 1.0, "render_harmless": 0.0}
    [record] = [r for r in caplog.records if "re-render" in r.getMessage()]
    assert record.levelname == "WARNING" and "in content" in record.getMessage()
    assert "first differing tokens, at stream position" in record.getMessage()
    # a trajectory that failed before its first model call: its stream ends in the generation prompt, which a
    # re-render of the messages lacks (it was counted as a content mismatch before)
    failed = Trajectory(id="f", group_id="g", sample_index=0, prompt_ids=prompt)
    rollout_module._sanity_check(ctx, failed, said, None)
    assert failed.metrics == {} and "render_check" not in failed.info


@pytest.mark.parametrize("every", [1, 4])
async def test_sanity_check_every_n_checks_the_first_trajectories_then_one_id_hash_in_n(qwen3_tokenizer, monkeypatch,
                                                                                         every):
    """rollout.sanity_check_every: 1 checks every trajectory (the default); N > 1 the first SANITY_CHECK_FIRST of
    the process, then those whose id's crc32 is 0 mod N. An unchecked one has no render metrics and no
    info.render_check; `rollout/render_checked` is the fraction checked."""
    import zlib

    import turnrl.rollout.episode as rollout_module
    from turnrl.observe.stats import RolloutStats

    monkeypatch.setattr(rollout_module, "SANITY_CHECK_FIRST", 5)
    monkeypatch.setattr(rollout_module, "_sampled", 0)
    think = "<think>\nAdd them.\n</think>\n\n"  # every trajectory differs from its full render, harmlessly
    engine = ScriptedEngine(qwen3_tokenizer, replies(think + "It is 5.", think + "It is 4."))
    manager = RolloutManager(engine, ChatRenderer(qwen3_tokenizer), agents=AGENTS, concurrency=1,
                             env_factory=lambda sample, config: FeedbackEnv(), sanity_check_every=every,
                             limits=RolloutLimits(max_turns=4, max_new_tokens=64))
    trajs = [t async for t in manager.stream([{"prompt": "What is 2+2?"}], n=40)]
    checked = [t for t in trajs if t.metrics["render_checked"] == 1.0]
    for t in trajs:
        assert ("render_harmless" in t.metrics) == ("render_check" in t.info) == (t in checked)
        assert t.metrics.get("render_harmless", 1.0) == 1.0 and t.metrics.get("render_mismatch", 0.0) == 0.0
    by_hash = [t for t in trajs[5:] if zlib.crc32(t.id.encode()) % every == 0]
    assert checked == (trajs if every == 1 else trajs[:5] + by_hash)  # concurrency 1: they finish in order
    assert every == 1 or 5 < len(checked) < 40
    stats = RolloutStats()
    for t in trajs:
        stats.add(t)
    summary = stats.summary()
    assert summary["rollout/render_checked"] == len(checked) / 40
    assert summary["rollout/render_harmless"] == len(checked) and summary["rollout/render_mismatch"] == 0
    rows = {row for row in stats.table().columns[0]._cells}
    assert ("sanity-checked trajectories" in rows) == (every > 1)  # the console table says when it sampled
    with pytest.raises(ValueError, match="sanity_check_every must be >= 1"):
        RolloutManager(engine, ChatRenderer(qwen3_tokenizer), agents=AGENTS, sanity_check_every=0)


def test_the_first_rollout_of_a_process_freezes_the_start_up_heap_once(monkeypatch):
    """freeze_heap: gc.freeze once per process (the objects alive before the first rollout leave the collector's
    scans); TURNRL_GC_FREEZE=0 turns it off. Calls are counted, not the frozen objects: any thread may free a frozen
    object meanwhile (the count then falls), so an exact count is not stable."""
    import gc

    import turnrl.rollout.manager as manager_module

    calls = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append(1), real_freeze()))
    monkeypatch.setattr(manager_module, "_heap_frozen", False)
    monkeypatch.setattr(gc, "set_threshold", lambda *a: None)  # relax_gc_thresholds: its own test below
    monkeypatch.setenv("TURNRL_GC_FREEZE", "0")
    manager_module.freeze_heap()
    assert not calls and manager_module._heap_frozen
    monkeypatch.setattr(manager_module, "_heap_frozen", False)
    monkeypatch.delenv("TURNRL_GC_FREEZE")
    before = gc.get_freeze_count()
    manager_module.freeze_heap()
    assert calls == [1] and manager_module._heap_frozen
    assert gc.get_freeze_count() > before  # the heap alive now (thousands of objects) joined the frozen ones
    manager_module.freeze_heap()  # once per process
    assert calls == [1]


def test_a_rollout_process_relaxes_cpythons_default_gc_thresholds_and_keeps_its_own(monkeypatch):
    """relax_gc_thresholds (with freeze_heap): CPython's (700, 10, 10) become GC_THRESHOLDS; thresholds a process set
    itself stay; TURNRL_GC_THRESHOLD sets others or (0) keeps the defaults; a malformed value is named."""
    import gc

    import turnrl.rollout.manager as manager_module

    saved = gc.get_threshold()
    try:
        monkeypatch.delenv("TURNRL_GC_THRESHOLD", raising=False)
        gc.set_threshold(700, 10, 10)
        manager_module.relax_gc_thresholds()
        assert gc.get_threshold() == manager_module.GC_THRESHOLDS == (50_000, 20, 20)
        gc.set_threshold(1000, 5, 5)  # the process's own choice
        manager_module.relax_gc_thresholds()
        assert gc.get_threshold() == (1000, 5, 5)
        monkeypatch.setenv("TURNRL_GC_THRESHOLD", "20000,15,12")
        manager_module.relax_gc_thresholds()
        assert gc.get_threshold() == (20000, 15, 12)
        gc.set_threshold(700, 10, 10)
        monkeypatch.setenv("TURNRL_GC_THRESHOLD", "0")
        manager_module.relax_gc_thresholds()
        assert gc.get_threshold() == (700, 10, 10)
        for bad in ("50000,20", "a,b,c", "0,1,1"):
            monkeypatch.setenv("TURNRL_GC_THRESHOLD", bad)
            with pytest.raises(ValueError, match=f"TURNRL_GC_THRESHOLD must be three positive integers.*{bad!r}"):
                manager_module.relax_gc_thresholds()
        assert gc.get_threshold() == (700, 10, 10)
        monkeypatch.setattr(manager_module, "_heap_frozen", False)
        for _ in range(2):  # through freeze_heap: every rollout that starts fails with the name, not only the first
            with pytest.raises(ValueError, match="TURNRL_GC_THRESHOLD"):
                manager_module.freeze_heap()
        assert not manager_module._heap_frozen
    finally:
        gc.set_threshold(*saved)
