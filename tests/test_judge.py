"""rewards.judge: the LLM-as-judge reward, on a scripted judge engine (fast) and on SmolLM2 as a real judge (slow)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.config import ConfigError, JudgeConfig, RewardConfig, load_config
from turnrl.render import ChatRenderer
from turnrl.rewards.judge import Judge, JudgeError
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.types import RolloutStatus, StepResult, TerminationReason

TEMPLATE = "Question: {{ question }}\nReference: {{ answer }}\nReply: {{ response }}\nGive Score: 0-10."
CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
ROW = {"question": "What is 2+2?", "answer": "4"}


def judge_with(tokenizer, replies, **kwargs) -> tuple[Judge, ScriptedEngine]:
    """A judge whose engine replies `replies(prompt_text)`."""
    engine = ScriptedEngine(tokenizer, lambda rid, turn, prompt: replies(prompt))
    return Judge(engine, ChatRenderer(tokenizer), kwargs.pop("template", TEMPLATE), **kwargs), engine


def test_the_prompt_holds_the_messages_and_the_dataset_columns(qwen3_tokenizer):
    judge, _ = judge_with(qwen3_tokenizer, lambda p: "Score: 1",
                          template="{{ conversation }}\n--\n{{ sample.answer }}/{{ answer }}/{{ responses | length }}"
                                   "/{{ reply }}")
    assert judge.prompt(CONVERSATION, ROW, reply="x") == "user: What is 2+2?\nassistant: 4\n--\n4/4/1/x"
    judge, _ = judge_with(qwen3_tokenizer, lambda p: "Score: 1")
    with pytest.raises(JudgeError, match="'question'.*neither a column of the row"):
        judge.prompt(CONVERSATION, {"answer": "4"})  # TEMPLATE wants {{ question }}
    with pytest.raises(ValueError, match="judge template"):
        judge_with(qwen3_tokenizer, lambda p: "", template="{{ unclosed")


@pytest.mark.parametrize(("reply", "score"), [
    ("The reply is right. Score: 7", 0.7),
    ("score = 10", 1.0),
    ("**Score:** 3.5\nThe end.", 0.35),
    ("<think>\nScore: 9 maybe\n</think>\n\nOn reflection, Score: 2", 0.2),  # reasoning is never parsed
])
def test_score_parsing(qwen3_tokenizer, reply, score):
    judge, _ = judge_with(qwen3_tokenizer, lambda p: reply)
    verdict = asyncio.run(judge.score(CONVERSATION, ROW))
    assert verdict.score == pytest.approx(score) and verdict.text == reply


@pytest.mark.parametrize(("reply", "error"), [
    ("I cannot judge this.", "no score in the reply"),
    ("Score: 11", "outside score_range"),
    ("<think>Score: 5</think>", "no score in the reply"),
])
def test_an_unusable_verdict_is_an_error_never_zero(qwen3_tokenizer, reply, error):
    judge, _ = judge_with(qwen3_tokenizer, lambda p: reply)
    with pytest.raises(JudgeError, match=error):
        asyncio.run(judge.score(CONVERSATION, ROW))


def test_labels(qwen3_tokenizer):
    judge, _ = judge_with(qwen3_tokenizer, lambda p: "Correct? Yes.", labels={"yes": 1, "no": 0}, score_range=(0, 1))
    assert asyncio.run(judge.score(CONVERSATION, ROW)).score == 1.0
    judge, _ = judge_with(qwen3_tokenizer, lambda p: "Maybe.", labels={"yes": 1, "no": 0}, score_range=(0, 1))
    with pytest.raises(JudgeError, match="none of the labels"):
        asyncio.run(judge.score(CONVERSATION, ROW))


def single_turn_rollout(tokenizer, policy_replies, reward_fn):
    engine = ScriptedEngine(tokenizer, lambda rid, turn, prompt: policy_replies[rid.split("-")[0]])
    manager = RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, default_agent="single_turn",
                             limits=RolloutLimits(max_turns=1, max_new_tokens=32), reward_fn=reward_fn)
    rows = [{"id": k, "prompt": "What is 2+2?", "question": "What is 2+2?", "answer": "4"} for k in policy_replies]
    return {t.group_id: t for g in asyncio.run(run_groups(manager, rows)) for t in g}


def test_as_a_reward_function_a_failed_verdict_leaves_the_reward_none_with_the_error(qwen3_tokenizer):
    verdicts = {"Reply: 4": "Score: 10", "Reply: 5": "Score: 0", "Reply: four": "hmm"}
    judge, _ = judge_with(qwen3_tokenizer, lambda p: next(v for k, v in verdicts.items() if k in p))
    trajs = single_turn_rollout(qwen3_tokenizer, {"a": "4", "b": "5", "c": "four"}, judge)
    assert trajs["a"].reward == 1.0 and trajs["b"].reward == 0.0
    assert trajs["c"].reward is None and "no score in the reply" in trajs["c"].reward_error


def test_identical_prompts_are_judged_once_in_memory_and_across_runs(qwen3_tokenizer, tmp_path):
    cache = tmp_path / "judge.jsonl"
    judge, engine = judge_with(qwen3_tokenizer, lambda p: "Score: 6", cache_path=cache)

    async def twice():
        first = await asyncio.gather(*(judge.score(CONVERSATION, ROW) for _ in range(3)))  # concurrent: one call
        return first, await judge.score(CONVERSATION, ROW)

    first, again = asyncio.run(twice())
    assert len(engine.calls) == 1 and again.cached and {v.score for v in first} == {0.6}
    other = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]
    asyncio.run(judge.score(other, ROW))
    assert len(engine.calls) == 2
    reloaded, engine2 = judge_with(qwen3_tokenizer, lambda p: "Score: 1", cache_path=cache)
    assert asyncio.run(reloaded.score(CONVERSATION, ROW)).score == 0.6 and not engine2.calls
    uncached, engine3 = judge_with(qwen3_tokenizer, lambda p: "Score: 1", cache=False)
    asyncio.run(uncached.score(CONVERSATION, ROW))
    asyncio.run(uncached.score(CONVERSATION, ROW))
    assert len(engine3.calls) == 2


def test_a_timed_out_call_is_an_error_and_is_not_cached(qwen3_tokenizer):
    judge, engine = judge_with(qwen3_tokenizer, lambda p: "Score: 5", timeout_s=0.1)
    engine.latency_s = 1.0
    with pytest.raises(JudgeError, match="no verdict within timeout_s=0.1"):
        asyncio.run(judge.score(CONVERSATION, ROW))
    engine.latency_s = 0.0
    assert asyncio.run(judge.score(CONVERSATION, ROW)).score == 0.5 and len(engine.calls) == 2
    assert engine.released == ["judge-1", "judge-2"]  # the engine's cache entry is freed either way


def test_calls_run_concurrently_up_to_max_concurrency(qwen3_tokenizer):
    inflight, peak = [0], [0]

    class Counting(ScriptedEngine):
        async def generate(self, prompt_ids, params, *, request_id, images=None):
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
            try:
                return await super().generate(prompt_ids, params, request_id=request_id)
            finally:
                inflight[0] -= 1

    engine = Counting(qwen3_tokenizer, lambda rid, turn, p: "Score: 4", latency_s=0.2)
    judge = Judge(engine, ChatRenderer(qwen3_tokenizer), TEMPLATE, max_concurrency=4)
    conversations = [[CONVERSATION[0], {"role": "assistant", "content": str(k)}] for k in range(8)]

    async def all_of_them():
        return await asyncio.gather(*(judge.score(c, ROW) for c in conversations))

    t0 = time.perf_counter()
    verdicts = asyncio.run(all_of_them())
    elapsed = time.perf_counter() - t0
    assert len(verdicts) == 8 and peak[0] == 4 and elapsed < 1.2  # two waves of 0.2 s, not eight


class JudgedEnv:
    """Scores every reply with the judge (per-turn rewards); stops after two turns."""

    def __init__(self, sample, judge):
        self.sample, self.judge, self.turn, self.history = sample, judge, 0, [{"role": "user", "content": "2+2?"}]

    async def step(self, text):
        self.turn += 1
        self.history.append({"role": "assistant", "content": text})
        verdict = await self.judge.score(self.history, self.sample, reply=text, turn=self.turn)
        done = self.turn == 2
        return StepResult(observation=None if done else "Again.", reward=verdict.score, done=done)

    def format_observation(self, observation):
        return {"role": "user", "content": observation}


def test_per_turn_scores_inside_an_env(qwen3_tokenizer):
    judge, _ = judge_with(qwen3_tokenizer, lambda p: "Score: 9" if "turn 1" in p else ("Score: 3" if "4" in p else "?"),
                          template="turn {{ turn }}: {{ reply }}")
    policy = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, p: {"a": "4", "b": "5"}[rid.split("-")[0]])
    manager = RolloutManager(policy, ChatRenderer(qwen3_tokenizer), agents=AGENTS, default_agent="env_agent",
                             env_factory=lambda sample, config: JudgedEnv(sample, judge),
                             limits=RolloutLimits(max_turns=2, max_new_tokens=16))
    trajs = {t.group_id: t for g in asyncio.run(run_groups(manager, [{"id": "a", "prompt": "2+2?"},
                                                                      {"id": "b", "prompt": "2+2?"}])) for t in g}
    assert trajs["a"].turn_rewards == [0.9, 0.3] and trajs["a"].status == RolloutStatus.COMPLETED
    # turn 2 of "b" gets no score: the step fails, so the trajectory does (never a 0 reward)
    assert trajs["b"].status == RolloutStatus.FAILED and trajs["b"].termination_reason == TerminationReason.ENV_ERROR
    assert "no score in the reply" in trajs["b"].error


def test_judge_config(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        RewardConfig(function="judge")
    path = tmp_path / "c.yaml"
    path.write_text("model: m\ntrain_data: d\nreward: {function: judge, judge: {model: tiny-qwen3, template: t, "
                    "score_rang: [0, 1]}}\n")
    from turnrl.config import TrainConfig

    with pytest.raises(ConfigError, match="did you mean 'score_range'"):
        load_config(TrainConfig, path)


def test_build_judge_runs_an_embedded_judge_and_a_template_file(tmp_path):
    from turnrl.build import build_judge

    template = tmp_path / "judge.jinja"
    template.write_text("Reply: {{ response }}\nScore it.")
    judge = build_judge(JudgeConfig(model="tiny-qwen3", template=str(template), max_new_tokens=8, timeout_s=None))
    try:
        assert judge.prompt(CONVERSATION, ROW) == "Reply: 4\nScore it."
        with pytest.raises(JudgeError, match="no score in the reply"):  # a random model writes no score
            asyncio.run(judge.score(CONVERSATION, ROW))
        assert judge.stats["calls"] == 1
    finally:
        judge.close()
        judge.close()


REAL_TEMPLATE = ("Here is a question and a student's answer.\nQuestion: {{ question }}\nCorrect answer: {{ answer }}\n"
                 "Student's answer: {{ response }}\nDoes the student's answer match the correct answer? Reply with "
                 "one word: yes or no.")


@pytest.mark.slow
def test_smollm2_as_a_real_judge():
    from turnrl.build import build_judge

    cfg = JudgeConfig(model="smollm2-135m-instruct", template=REAL_TEMPLATE, labels={"yes": 1, "no": 0},
                      score_range=(0, 1), max_new_tokens=16)
    judge = build_judge(cfg)
    rows = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "What is 3 + 4?", "answer": "7"}]
    try:
        async def verdicts():
            out = []
            for row, reply in [(rows[0], "Paris"), (rows[0], "London"), (rows[1], "7"), (rows[1], "12")]:
                messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": reply}]
                try:
                    out.append((await judge.score(messages, row)).score)
                except JudgeError as e:
                    out.append(str(e))
            return out

        scores = asyncio.run(verdicts())
    finally:
        judge.close()
    # the pipeline end to end on a real model: every verdict is a parsed label or a JudgeError that says why
    assert all(s in (0.0, 1.0) or "none of the labels" in s for s in scores), scores
    assert judge.stats["calls"] == 4
