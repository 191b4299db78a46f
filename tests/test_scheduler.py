"""ms-swift scheduler hooks on the one turn loop: a scripted engine with the real Qwen3 tokenizer.

Every test goes through `rollout()` (a RolloutManager with the scheduler agent) and names its scheduler by its
registered name, so the same scenarios can be re-run through the Ray and server modes by swapping `rollout()`.
"""

from __future__ import annotations

import asyncio
import socket
import textwrap
import threading
import time

import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.agents.scheduler import MultiTurnScheduler, RolloutFailure, multi_turns, scheduler_agent
from turnrl.agents.schedulers_builtin import RemoteEnvScheduler
from turnrl.config import RolloutConfig, TrainConfig
from turnrl.render import ChatRenderer
from turnrl.rewards import bind_reward, boxed_answer_reward
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.train.samples import group_advantages
from turnrl.types import BranchKind, RolloutStatus, SegmentSource, TerminationReason

MODEL, TEMPLATE, ENV = SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.ENV
ROW = {"prompt": "What is 2+2?", "answer": "4"}


def rollout(tok, script, scheduler, rows=None, *, n=1, max_turns=4, max_new_tokens=64, reward=None,
            env_config=None, latency_s=0.0, trajectory_timeout_s=None):
    """Single-process rollout through the scheduler agent (Ray / server modes: swap this function)."""
    engine = ScriptedEngine(tok, script, latency_s=latency_s)
    limits = RolloutLimits(max_turns=max_turns, max_new_tokens=max_new_tokens, trajectory_timeout_s=trajectory_timeout_s)
    manager = RolloutManager(
        engine, ChatRenderer(tok), agents={**AGENTS, "scheduler": scheduler_agent(scheduler)},
        default_agent="scheduler", limits=limits, env_config=env_config, reward_fn=reward, concurrency=8,
    )
    groups = asyncio.run(run_groups(manager, rows or [ROW], n=n))
    return [t for g in groups for t in g], engine


def replies(*texts):
    return lambda rid, turn, prompt: texts[min(turn, len(texts)) - 1]


def spans(traj, tok):
    """(source, mask, decoded text) of each run of equal mask within each segment."""
    out = []
    for seg in traj.segments:
        start = 0
        for k in range(1, len(seg.token_ids) + 1):
            if k == len(seg.token_ids) or seg.loss_mask[k] != seg.loss_mask[start]:
                out.append((seg.source, seg.loss_mask[start], tok.decode(seg.token_ids[start:k])))
                start = k
    return out


def engine_logprobs(n):
    return [-(k + 1) / 100 for k in range(n)]


# ---- schedulers under test (registered by name) -----------------------------------------------------
class Retry(MultiTurnScheduler):
    """'Wrong, try again.' until the reply holds the row's answer (read from data_dict)."""

    def check_finished(self, request, response, turn):
        return request.data_dict["answer"] in response.message.content or super().check_finished(request, response, turn)

    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "Wrong, try again."})
        return {"infer_request": request}


class Endless(MultiTurnScheduler):
    """Never finishes by itself: only max_turns stops it."""

    steps: list[int] = []

    def check_finished(self, request, response, turn):
        return False

    def step(self, request, response, turn):
        Endless.steps.append(turn)
        request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": request}


class DoneOnTurnTwo(MultiTurnScheduler):
    """`done` from on_turn_end decides, whatever check_finished and a length stop say."""

    async def on_turn_end(self, request, response, turn):
        return {"done": turn == 2, "rollout_infos": {f"finish_{turn}": str(response.finish_reason)}}

    def check_finished(self, request, response, turn):
        return True

    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "Go on."})
        return {"infer_request": request}


class Calculator(MultiTurnScheduler):
    """ms-swift's ToolCallScheduler shape: the tool result continues the assistant message, masked, token-backed."""

    def check_finished(self, request, response, turn):
        return "Action:" not in response.text or super().check_finished(request, response, turn)

    def step(self, request, response, turn):
        result = "\nObservation: 4\n"
        tool_ids = self.tokenizer(result, add_special_tokens=False)["input_ids"]
        request.messages[-1]["content"] += result
        ids = response.content_token_ids
        return {"infer_request": request, "response_token_ids": ids + tool_ids,
                "response_loss_mask": [1] * len(ids) + [0] * len(tool_ids),
                "rollout_logprobs": response.logprobs[: len(ids)], "rollout_infos": {"tool_calls": 1}}


class BadMask(MultiTurnScheduler):
    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "x"})
        return {"infer_request": request, "response_token_ids": response.token_ids, "response_loss_mask": [1]}


class Logprobs(MultiTurnScheduler):
    """Token edits with the right logprob count, or one short on rows marked `bad`."""

    def step(self, request, response, turn):
        ids = response.content_token_ids
        short = 1 if request.data_dict.get("bad") else 0
        request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": request, "response_token_ids": ids,
                "rollout_logprobs": response.logprobs[: len(ids) - short]}


class Nudge(MultiTurnScheduler):
    """A plain-text continuation: the next request extends the assistant message."""

    def check_finished(self, request, response, turn):
        return turn >= 2

    def step(self, request, response, turn):
        request.messages[-1]["content"] += " Let me verify."
        return {"infer_request": request}


EVENTS: list[tuple] = []


class Lifecycle(MultiTurnScheduler):
    async def on_trajectory_start(self, requests):
        EVENTS.append(("start", requests[0].uuid))
        if requests[0].data_dict.get("explode_start"):
            raise RuntimeError("start failed")

    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "More."})
        return {"infer_request": request}

    async def on_trajectory_end(self, requests, error=None):
        EVENTS.append(("end", requests[0].uuid, error))
        if requests[0].data_dict.get("explode_end"):
            raise RuntimeError("cleanup failed")


class Compress(MultiTurnScheduler):
    """Rewrites the history (drops the first reply): the default loop splits the episode."""

    def check_finished(self, request, response, turn):
        return turn >= 2

    def step(self, request, response, turn):
        request.messages = [request.messages[0], {"role": "user", "content": "Summary: you said 5. Try again."}]
        return {"infer_request": request}


class AskTwice(MultiTurnScheduler):
    """A run() override whose history only grows: one sample, observation deltas."""

    async def run(self, request, runner):
        response = await runner.generate(request)
        runner.rollout_infos["first"] = response.text
        runner.edit_last_turn(response_token_ids=response.content_token_ids)  # ms-swift's token fields in run()
        request.messages += [{"role": "assistant", "content": response.text}, {"role": "user", "content": "Sure?"}]
        await runner.generate(request)
        return await runner.finish()


multi_turns.update({
    "test_retry": Retry, "test_endless": Endless, "test_done": DoneOnTurnTwo, "test_calculator": Calculator,
    "test_bad_mask": BadMask, "test_logprobs": Logprobs, "test_nudge": Nudge, "test_lifecycle": Lifecycle,
    "test_compress": Compress, "test_ask_twice": AskTwice,
})


# ---- the default loop -------------------------------------------------------------------------------
def test_default_loop_appends_observations_token_exactly(qwen3_tokenizer):
    tok = qwen3_tokenizer
    [traj], engine = rollout(tok, replies("It is 5.", "It is 4."), "test_retry")
    assert (traj.status, traj.termination_reason, traj.num_turns) == (
        RolloutStatus.COMPLETED, TerminationReason.ENV_DONE, 2)
    assert spans(traj, tok) == [
        (MODEL, 1, "It is 5.<|im_end|>"), (TEMPLATE, 0, "\n"),
        (ENV, 0, "<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"),
        (MODEL, 1, "It is 4.<|im_end|>")]
    assert engine.calls[1].prompt_ids == traj.prompt_ids + traj.response_ids[: -len(traj.segments[-1])]
    assert traj.episode_id == traj.id and traj.rollout_infos == {"num_turns": 2}
    assert traj.messages[-1] == {"role": "assistant", "content": "It is 4."}


def test_max_turns_safety_net(qwen3_tokenizer):
    Endless.steps.clear()
    [traj], _ = rollout(qwen3_tokenizer, replies("no"), "test_endless", max_turns=3)
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 3)
    assert Endless.steps == [1, 2]  # no step() after the last allowed turn
    assert traj.rollout_infos["num_turns"] == 3
    # a scheduler's own cap is honoured too: the smaller one wins
    [traj], _ = rollout(qwen3_tokenizer, replies("no"), type("Short", (Endless,), {"max_turns": 2}), max_turns=3)
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 2)


def test_done_from_on_turn_end_overrides_check_finished_and_length(qwen3_tokenizer):
    [traj], _ = rollout(qwen3_tokenizer, replies("word " * 30, "ok"), "test_done", max_new_tokens=6)
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.ENV_DONE, 2)
    assert traj.rollout_infos == {"finish_1": "length", "finish_2": "stop", "num_turns": 2}
    # the truncated turn never emitted <|im_end|>: the template's whole closing is added, masked
    assert [s.source for s in traj.segments] == [MODEL, TEMPLATE, ENV, MODEL]
    assert qwen3_tokenizer.decode(traj.segments[1].token_ids) == "<|im_end|>\n"


# ---- token edits ------------------------------------------------------------------------------------
def test_token_edits_continue_one_segment_with_masked_tool_output(qwen3_tokenizer):
    tok = qwen3_tokenizer
    [traj], _ = rollout(tok, replies("Action: add 2 2", " The answer is 4."), "test_calculator")
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.num_turns == 2
    assert spans(traj, tok) == [(MODEL, 1, "Action: add 2 2"), (MODEL, 0, "\nObservation: 4\n"),
                                (MODEL, 1, " The answer is 4.<|im_end|>")]
    n1 = len(tok("Action: add 2 2", add_special_tokens=False)["input_ids"])
    n_tool = len(tok("\nObservation: 4\n", add_special_tokens=False)["input_ids"])
    n2 = len(traj.response_ids) - n1 - n_tool
    assert traj.rollout_logprobs == engine_logprobs(n1) + [None] * n_tool + engine_logprobs(n2)
    assert traj.messages[-1]["content"] == "Action: add 2 2\nObservation: 4\n The answer is 4."
    assert traj.rollout_infos == {"tool_calls": 1, "num_turns": 2} and not traj.warnings


def test_mask_length_mismatch_fails_the_trajectory_loudly(qwen3_tokenizer):
    [traj], _ = rollout(qwen3_tokenizer, replies("It is 5."), "test_bad_mask")
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.INVALID_OUTPUT)
    n = len(qwen3_tokenizer("It is 5.", add_special_tokens=False)["input_ids"]) + 1
    assert f"trajectory '{traj.id}'" in traj.error and f"{n} tokens" in traj.error
    assert "(response_loss_mask) 1 values" in traj.error


def test_logprob_count_mismatch_turns_correction_off_for_that_trajectory_only(qwen3_tokenizer):
    rows = [{"id": "good", "prompt": "a"}, {"id": "bad", "prompt": "b", "bad": True}]
    good, bad = rollout(qwen3_tokenizer, replies("It is 5.", "It is 4."), "test_logprobs", rows, max_turns=2)[0]
    assert bad.status == good.status == RolloutStatus.COMPLETED
    assert bad.rollout_logprobs is None and bad.metrics["logprob_issues"] == 1
    assert bad.warnings == ["turn 1: rollout_logprobs has 4 values for 5 mask-1 tokens"]
    assert good.rollout_logprobs is not None and "logprob_issues" not in good.info


def test_text_continuation_is_one_model_segment(qwen3_tokenizer):
    tok = qwen3_tokenizer
    [traj], engine = rollout(tok, replies("It is 5.", " Actually, it is 4."), "test_nudge")
    assert [s.source for s in traj.segments] == [MODEL]
    assert spans(traj, tok) == [(MODEL, 1, "It is 5."), (MODEL, 0, " Let me verify."),
                                (MODEL, 1, " Actually, it is 4.<|im_end|>")]
    # the stop token of turn 1 is dropped: the model goes on after its text, not after <|im_end|>
    assert tok.decode(engine.calls[1].prompt_ids).endswith("assistant\nIt is 5. Let me verify.")
    assert traj.messages[-1]["content"] == "It is 5. Let me verify. Actually, it is 4."
    n1 = len(tok("It is 5.", add_special_tokens=False)["input_ids"])
    assert traj.rollout_logprobs[:n1] == engine_logprobs(n1)


# ---- lifecycle and isolation ------------------------------------------------------------------------
def test_on_trajectory_end_runs_once_also_after_failures(qwen3_tokenizer):
    EVENTS.clear()
    rows = [{"id": "ok", "prompt": "a"}, {"id": "boom", "prompt": "b"}, {"id": "start", "prompt": "c", "explode_start": True},
            {"id": "endfail", "prompt": "d", "explode_end": True}]

    def script(rid, turn, prompt):
        return None if rid in ("boom-0", "endfail-0") and turn == 2 else "fine"

    trajs, _ = rollout(qwen3_tokenizer, script, "test_lifecycle", rows, max_turns=2)
    by = {t.group_id: t for t in trajs}
    assert len(trajs) == 4 and by["ok"].status == RolloutStatus.COMPLETED  # one failure never fails the batch
    ends = {e[1]: e[2] for e in EVENTS if e[0] == "end"}
    assert sorted(e[1] for e in EVENTS if e[0] == "end") == ["boom-0", "endfail-0", "ok-0", "start-0"]  # once each
    assert ends["ok-0"] is None
    assert by["boom"].termination_reason == TerminationReason.ENGINE_ERROR
    assert isinstance(ends["boom-0"], RolloutFailure) and ends["boom-0"].reason == TerminationReason.ENGINE_ERROR
    assert by["start"].termination_reason == TerminationReason.ENV_ERROR and "start failed" in by["start"].error
    assert str(ends["start-0"]) == "start failed"
    # a failing cleanup hook is recorded but does not hide the rollout's own error
    assert by["endfail"].termination_reason == TerminationReason.ENGINE_ERROR
    assert by["endfail"].warnings == ["on_trajectory_end raised RuntimeError: cleanup failed"]


class SlowTwice(Lifecycle):
    """Lifecycle events around a run() override (its turns are driven in a task of their own)."""

    async def run(self, request, runner):
        await runner.generate(request)
        request.messages.append({"role": "user", "content": "More."})
        await runner.generate(request)
        return await runner.finish()


@pytest.mark.parametrize("scheduler", [Lifecycle, SlowTwice])
def test_a_timed_out_trajectory_still_runs_on_trajectory_end(qwen3_tokenizer, scheduler):
    EVENTS.clear()
    [traj], _ = rollout(qwen3_tokenizer, replies("slow"), scheduler, latency_s=0.2, trajectory_timeout_s=0.3)
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.TIMEOUT)
    ends = [e for e in EVENTS if e[0] == "end"]
    assert len(ends) == 1 and isinstance(ends[0][2], asyncio.CancelledError)


def test_data_dict_reaches_hooks_and_rollout_infos_reach_rewards(qwen3_tokenizer):
    class Scored(MultiTurnScheduler):
        async def on_turn_end(self, request, response, turn):
            return {"done": True, "rollout_infos": {"hits": len(request.data_dict["topic"])}}

    def reward(hits, topic, num_turns, rollout_infos):  # rollout infos and dataset columns by name
        assert rollout_infos["hits"] == hits
        return hits * 10 + num_turns

    row = {"prompt": "Tell me", "topic": "ab"}
    [traj], _ = rollout(qwen3_tokenizer, replies("ok"), Scored, [row], reward=bind_reward(reward))
    assert traj.reward == 21


# ---- splitting --------------------------------------------------------------------------------------
def test_history_rewrite_splits_the_episode(qwen3_tokenizer):
    tok = qwen3_tokenizer
    first, second = rollout(tok, replies("It is 5.", "It is 4."), "test_compress")[0]
    assert (first.id, second.id) == ("0-0", "0-0.1")
    assert first.termination_reason == TerminationReason.SPLIT and first.status == RolloutStatus.COMPLETED
    assert second.termination_reason == TerminationReason.ENV_DONE
    assert first.episode_id == second.episode_id == "0-0"
    assert first.rollout_infos == second.rollout_infos == {"num_turns": 2}
    assert first.parent is None and (second.parent.id, second.parent.kind) == ("0-0", BranchKind.SPLIT)
    at = second.parent.at  # the streams agree up to the rewritten message, and differ from there
    assert first.stream[:at] == second.stream[:at] and first.stream[at] != second.stream[at]
    prompt = tok.decode(second.prompt_ids)  # rendered afresh from the rewritten history
    assert "Summary: you said 5." in prompt and "It is 5." not in prompt
    assert [s.source for s in second.segments] == [MODEL] and second.segments[0].turn == 1


def test_run_override_with_a_growing_history_stays_one_sample(qwen3_tokenizer):
    tok = qwen3_tokenizer
    [traj], engine = rollout(tok, replies("It is 4.", "Yes."), "test_ask_twice")
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.num_turns == 2
    assert [s.source for s in traj.segments] == [MODEL, TEMPLATE, ENV, MODEL]
    assert engine.calls[1].prompt_ids == traj.prompt_ids + traj.response_ids[: -len(traj.segments[-1])]
    assert traj.rollout_infos == {"first": "It is 4.", "num_turns": 2}
    # the edit dropped the stop token of turn 1, so the template's whole closing is added (masked)
    assert tok.decode(traj.segments[0].token_ids) == "It is 4." and tok.decode(traj.segments[1].token_ids) == "<|im_end|>\n"
    assert traj.rollout_logprobs[: len(traj.segments[0])] == engine_logprobs(len(traj.segments[0]))


def test_thinking_tips_one_sample_per_turn_and_split_rewards(qwen3_tokenizer):
    tok = qwen3_tokenizer
    answers = {"0-0": "<think>\nHmm.\n</think>\n\nIt is \\boxed{5}.", "0-0.1": "<think>\nRecheck.\n</think>\n\nIt is \\boxed{4}.",
               "0-1": "<think>\nEasy.\n</think>\n\nIt is \\boxed{5}.", "0-1.1": "<think>\nSure.\n</think>\n\n\\boxed{6}"}
    trajs, engine = rollout(tok, lambda rid, turn, prompt: answers[rid], "thinking_tips", n=2,
                            reward=bind_reward(boxed_answer_reward))
    assert [t.id for t in trajs] == ["0-0", "0-0.1", "0-1", "0-1.1"]
    first, second = trajs[:2]
    assert first.termination_reason == TerminationReason.SPLIT and second.termination_reason == TerminationReason.ENV_DONE
    assert first.rollout_infos == second.rollout_infos == {
        "correct": True, "final_response": answers["0-0.1"], "tip_given": True, "num_turns": 2}
    prompt = tok.decode(second.prompt_ids)  # the second turn sees its history without the earlier reasoning
    assert "It is \\boxed{5}." in prompt and "Hmm." not in prompt and "Your answer is not correct." in prompt
    assert [c.prompt_ids for c in engine.calls if c.request_id == "0-0.1"] == [second.prompt_ids]
    # the reward function scores each episode once, on its last sample (where it ended); the split shares it
    cfg = TrainConfig(model="m", train_data="d")
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    # the episode's outcome, read from rollout_infos, gives every sample the same reward
    episode_reward = bind_reward(lambda correct: float(correct))
    for t in trajs:
        t.reward = episode_reward(t)
    scored, _ = group_advantages([trajs], cfg)
    advantage = {t.id: a for t, a in scored}
    assert advantage["0-0"] == advantage["0-0.1"] > 0 > advantage["0-1"] == advantage["0-1.1"]


# ---- built-in schedulers ----------------------------------------------------------------------------
def test_math_tip_trick_wrong_then_right(qwen3_tokenizer):
    tok = qwen3_tokenizer
    wrong = "<think>\nQuick.\n</think>\n\nIt is \\boxed{5} for sure."
    [traj], engine = rollout(tok, replies(wrong, " Oops: 2+2 is \\boxed{4}."), "math_tip_trick",
                             reward=bind_reward(boxed_answer_reward))
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.num_turns == 2
    kept = "<think>\nQuick.\n</think>\n\nIt is \\boxed{5}"
    assert spans(traj, tok) == [(MODEL, 1, kept), (MODEL, 0, "\n\nWait, let me double-check this."),
                                (MODEL, 1, " Oops: 2+2 is \\boxed{4}.<|im_end|>")]
    n_kept = len(tok(kept, add_special_tokens=False)["input_ids"])
    assert traj.rollout_logprobs[:n_kept] == engine_logprobs(n_kept)  # cut to match the kept tokens
    assert traj.reward == 1.0 and "for sure" not in traj.messages[-1]["content"]
    # right the first time: no tip
    [traj], _ = rollout(tok, replies("It is \\boxed{4}."), "math_tip_trick")
    assert traj.num_turns == 1 and "double-check" not in traj.messages[-1]["content"]


FROZENLAKE_PATH = ["down", "down", "right", "right", "down", "right"]


def test_gym_frozenlake_reaches_the_goal(qwen3_tokenizer):
    row = {"prompt": "Play.", "env_config": {"name": "frozenlake", "seed": 0}}
    script = lambda rid, turn, prompt: f"<think>\nGo.\n</think>\n\n{FROZENLAKE_PATH[turn - 1]}"  # noqa: E731
    # the row's env name beats the global one
    [traj], _ = rollout(qwen3_tokenizer, script, "gym", [row], max_turns=8, env_config={"gym_env": "nope"})
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.ENV_DONE, 6)
    infos = traj.rollout_infos
    assert infos["total_reward"] == 1.0 and infos["step_rewards"] == [0.0] * 5 + [1.0] and infos["gym_done"]
    assert traj.turn_rewards == infos["step_rewards"]
    assert traj.messages[0]["role"] == "system" and "frozen lake" in traj.messages[0]["content"]
    assert traj.messages[1]["content"].startswith("PFFF\nFHFH\nFFFH\nHFFG")
    assert traj.messages[-2]["content"] == "SFFF\nFHFH\nFFFH\nHFPG\nYour move?"  # the last observation before G


def test_gym_length_stop_does_not_end_the_episode_and_unknown_env_fails(qwen3_tokenizer):
    moves = ["down " * 20] + FROZENLAKE_PATH[1:]
    [traj], _ = rollout(qwen3_tokenizer, replies(*moves), "gym", [{"prompt": "Play."}], max_turns=8,
                        max_new_tokens=8, env_config={"gym_env": "frozenlake"})
    assert traj.turns[0].generate.finish_reason == "length"
    assert traj.termination_reason == TerminationReason.ENV_DONE and traj.rollout_infos["total_reward"] == 1.0
    [traj], _ = rollout(qwen3_tokenizer, replies("down"), "gym", [{"prompt": "Play."}], env_config={"gym_env": "nope"})
    assert traj.termination_reason == TerminationReason.ENV_ERROR
    assert "unknown gym env 'nope'; registered text envs: FrozenLake-v1, frozenlake" in traj.error


# ---- remote env -------------------------------------------------------------------------------------
def frozenlake_app(stats):
    """A tiny OpenEnv-style server around the FrozenLake text env, one session per /reset."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from turnrl.envs.frozenlake import FrozenLakeText

    app, sessions = FastAPI(), {}

    @app.post("/reset")
    async def reset(body: dict):
        if stats["fail_resets"] > 0:  # the client retries
            stats["fail_resets"] -= 1
            return JSONResponse({"error": "warming up"}, status_code=503)
        env = FrozenLakeText()
        observation, _ = env.reset(seed=body.get("seed"))
        session = f"s{len(stats['opened'])}"
        sessions[session] = env
        stats["opened"].append(session)
        stats["max_live"] = max(stats["max_live"], len(sessions))
        await asyncio.sleep(0.05)  # keep sessions open long enough to overlap
        return {"session_id": session, "observation": {"board": observation}, "reward": None, "done": False}

    @app.post("/step")
    async def step(body: dict):
        observation, reward, terminated, truncated, _ = sessions[body["session_id"]].step(body["action"]["message"])
        return {"observation": {"board": observation}, "reward": reward, "done": terminated or truncated}

    @app.post("/close")
    async def close(body: dict):
        sessions.pop(body["session_id"]).close()
        return {}

    return app


@pytest.fixture(scope="module")
def remote_env():
    import uvicorn

    stats = {"fail_resets": 1, "opened": [], "max_live": 0}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(frozenlake_app(stats), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", stats
    server.should_exit = True
    thread.join(5)


class BoardEnv(RemoteEnvScheduler):
    backoff_s = 0.01

    def format_observation(self, observation):
        return observation["board"]


multi_turns["test_board_env"] = BoardEnv


def test_remote_env_over_http(qwen3_tokenizer, remote_env):
    url, stats = remote_env
    script = lambda rid, turn, prompt: FROZENLAKE_PATH[turn - 1]  # noqa: E731
    trajs, _ = rollout(qwen3_tokenizer, script, "test_board_env", [{"prompt": "Play.", "env_config": {"seed": 0}}],
                       n=4, max_turns=8, env_config={"base_url": url, "max_concurrent_envs": 2})
    assert [t.termination_reason for t in trajs] == [TerminationReason.ENV_DONE] * 4
    assert all(t.rollout_infos["total_reward"] == 1.0 and t.num_turns == 6 for t in trajs)
    assert trajs[0].messages[0]["content"].startswith("PFFF\nFHFH")  # format_observation override
    assert len(stats["opened"]) == 4 and stats["fail_resets"] == 0  # the 503 was retried
    assert stats["max_live"] <= 2  # the session cap held


# ---- registry and plugins ---------------------------------------------------------------------------
def test_plugin_file_registers_a_scheduler_for_build(tmp_path, qwen3_tokenizer):
    from turnrl.build import build_rollout_manager

    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from turnrl.agents.scheduler import MultiTurnScheduler, multi_turns

        class OneMore(MultiTurnScheduler):
            def step(self, request, response, turn):
                request.messages.append({"role": "user", "content": "One more."})
                return {"infer_request": request}

        multi_turns["one_more_plugin"] = OneMore
    """))
    engine, renderer = ScriptedEngine(qwen3_tokenizer, replies("ok")), ChatRenderer(qwen3_tokenizer)
    cfg = RolloutConfig(scheduler="one_more_plugin", plugins=[str(plugin)], max_turns=2, max_new_tokens=16)
    manager = build_rollout_manager(cfg, engine, renderer)
    assert manager.default_agent == "scheduler"
    [[traj]] = asyncio.run(run_groups(manager, [{"prompt": "hi"}]))
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 2)
    with pytest.raises(ValueError, match="unknown scheduler 'nope'; registered: .*math_tip_trick.*one_more_plugin"):
        build_rollout_manager(RolloutConfig(scheduler="nope"), engine, renderer)
