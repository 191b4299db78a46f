"""Context compaction in the turn loop (`rollout.context`): summarize and drop_observations branches, budgets across
branches, an env asking for it, one reward per episode. Scripted engine, real Qwen3 tokenizer."""

from __future__ import annotations

from fakes import ScriptedEngine
from test_rollout import make_ctx

from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.rollout.context import DEFAULT_INSTRUCTION, DROPPED, SUMMARY_HEADER, ContextPolicy, Strategy
from turnrl.rollout.episode import drive
from turnrl.rollout.tree import tree_stats
from turnrl.types import BranchKind, RolloutStatus, SegmentSource, StepResult, TerminationReason

LONG = " ".join(f"line{k}" for k in range(60))  # ~120 tokens of tool output


class LongOutputEnv:
    """Every step answers a long output; done when the reply says DONE. `ask_on` asks for compaction at that step."""

    def __init__(self, ask_on: int | None = None):
        self.steps, self.ask_on = 0, ask_on

    def reset(self):
        return None

    def step(self, text):
        self.steps += 1
        if "DONE" in text:
            return StepResult(reward=1.0, done=True)
        return StepResult(f"output {self.steps}: {LONG}", compact=self.steps == self.ask_on)

    def format_observation(self, observation):
        return {"role": "user", "content": observation}


def script(rid, turn, prompt):
    """Summarise when asked; finish once working from a summary (or with outputs dropped); else look further."""
    last = prompt[prompt.rfind("<|im_start|>user"):]
    if DEFAULT_INSTRUCTION in last:
        return "Summary: outputs 1 and 2 listed lines."
    if SUMMARY_HEADER.strip() in prompt or DROPPED in prompt:
        return "DONE"
    return "Looking."


def _limits(**context):
    return RolloutLimits(max_turns=6, max_new_tokens=16, context=ContextPolicy(**context))


async def test_summarize_compacts_into_a_branch_that_starts_from_the_task_and_the_summary(qwen3_tokenizer):
    tok = qwen3_tokenizer
    engine = ScriptedEngine(tok, script)
    ctx = make_ctx(engine, tok, limits=_limits(max_tokens=300))
    last = await drive(ctx, LongOutputEnv())
    [first] = ctx.branches
    assert first.termination_reason == TerminationReason.SPLIT and first.status == RolloutStatus.COMPLETED
    assert last.termination_reason == TerminationReason.ENV_DONE and last.id == "t0.c1"
    assert last.parent.id == "t0" and last.parent.kind == BranchKind.COMPACTION
    assert {first.episode_id, last.episode_id} == {"t0"}
    # the first branch: two turns and output 1, then the instruction (mask 0) and the summary (mask 1)
    assert first.num_turns == 3 and first.turns[-1].extra == {"compaction": "summary"}
    summary = first.segments[-1]
    assert summary.source == SegmentSource.MODEL and summary.loss_mask == [1] * len(summary)
    assert tok.decode(summary.token_ids).startswith("Summary: outputs 1 and 2")
    assert DEFAULT_INSTRUCTION in tok.decode(first.segments[-2].token_ids)
    assert "output 1:" in tok.decode(first.stream) and "output 2:" not in tok.decode(first.stream)
    # the next branch: the task, the summary and output 2 (which did not fit); it shares the system/task tokens
    prompt = tok.decode(last.prompt_ids)
    assert "What is 2+2?" in prompt and "Summary: outputs 1 and 2 listed lines." in prompt
    assert "output 1:" not in prompt and "output 2:" in prompt
    assert prompt.index("Summary:") < prompt.index("output 2:")
    at = last.parent.at
    assert first.stream[:at] == last.stream[:at] and at >= len(ChatRenderer(tok).encode("<|im_start|>user\nWhat is"))
    assert last.num_turns == 1 and last.turns[0].turn == 1 and engine.released == ["t0", "t0.c1"]
    assert tree_stats([first, last]) == {"branches_per_episode": 2.0, "compactions_per_episode": 1.0}
    for traj in (first, last):
        traj.validate()


async def test_drop_observations_keeps_the_last_outputs_and_the_history(qwen3_tokenizer):
    tok = qwen3_tokenizer
    ctx = make_ctx(ScriptedEngine(tok, script), tok, limits=_limits(max_tokens=350, strategy="drop_observations"))
    last = await drive(ctx, LongOutputEnv())
    [first] = ctx.branches
    assert last.parent.kind == BranchKind.COMPACTION and last.termination_reason == TerminationReason.ENV_DONE
    prompt = tok.decode(last.prompt_ids)
    assert prompt.count(DROPPED) == 1 and "output 1:" not in prompt and "output 2:" in prompt
    assert prompt.count("Looking.") == 2  # the model turns stay, as prompt now (they were trained in the first)
    assert first.num_turns == 2 and first.stream[: last.parent.at] == last.stream[: last.parent.at]


async def test_an_env_can_ask_and_budgets_count_across_branches(qwen3_tokenizer):
    tok = qwen3_tokenizer
    limits = RolloutLimits(max_turns=2, max_new_tokens=16, context=ContextPolicy())  # no window: only the env asks
    ctx = make_ctx(ScriptedEngine(tok, lambda *a: "Looking." if DEFAULT_INSTRUCTION not in a[2][-400:] else "S."),
                   tok, limits=limits)
    last = await drive(ctx, LongOutputEnv(ask_on=1))
    [first] = ctx.branches
    # turn 1, the summary, then turn 2 in the next branch: max_turns=2 counts the episode's turns, not the summary
    assert (first.num_turns, last.num_turns, last.termination_reason) == (2, 1, TerminationReason.MAX_TURNS)
    assert last.parent.kind == BranchKind.COMPACTION


async def test_strategy_none_ends_the_episode_truncated_when_the_context_is_full(qwen3_tokenizer):
    tok = qwen3_tokenizer
    ctx = make_ctx(ScriptedEngine(tok, script), tok, limits=_limits(max_tokens=200, strategy=Strategy.NONE))
    traj = await drive(ctx, LongOutputEnv())
    assert not ctx.branches and traj.termination_reason == TerminationReason.TOKEN_BUDGET
    assert len(traj.stream) <= 200


async def test_the_manager_returns_every_branch_with_the_episode_reward(qwen3_tokenizer):
    tok = qwen3_tokenizer
    seen = []

    def reward(traj):
        seen.append(traj.id)
        return 1.0 if "DONE" in tok.decode(traj.response_ids) else 0.0

    manager = RolloutManager(ScriptedEngine(tok, script), ChatRenderer(tok), agents={"env_agent": _env_agent},
                             limits=_limits(max_tokens=300), reward_fn=reward)
    trajs = [t async for t in manager.stream([{"id": "q", "prompt": "What is 2+2?"}])]
    assert [t.id for t in trajs] == ["q-0", "q-0.c1"] and seen == ["q-0.c1"]
    assert [t.reward for t in trajs] == [1.0, 1.0] and {t.episode_id for t in trajs} == {"q-0"}


async def _env_agent(ctx, sample):
    return await drive(ctx, LongOutputEnv())


async def test_metrics_and_the_progress_line_count_branches_and_compactions(qwen3_tokenizer):
    from turnrl.observe.stats import RolloutStats
    from turnrl.train.evaluation import format_step_line

    tok = qwen3_tokenizer
    ctx = make_ctx(ScriptedEngine(tok, script), tok, limits=_limits(max_tokens=300))
    last = await drive(ctx, LongOutputEnv())
    flat = await drive(make_ctx(ScriptedEngine(tok, lambda *a: "DONE"), tok, tid="t1"), LongOutputEnv())
    stats = RolloutStats()
    for traj in [*ctx.branches, last, flat]:
        stats.add(traj)
    s = stats.summary()
    assert (s["rollout/episodes"], s["rollout/branches_per_episode"], s["rollout/compactions_per_episode"]) == (
        2.0, 1.5, 0.5)
    line = format_step_line({**s, "step": 1, "time/step_s": 1.0}, 10)
    assert "branches 1.50/ep  compactions 0.50/ep" in line


async def test_the_viewer_draws_an_episode_as_its_tree(qwen3_tokenizer, tmp_path):
    import json

    from rich.console import Console

    from turnrl.observe.viewer import _pieces, print_trajectories, write_html

    tok = qwen3_tokenizer
    ctx = make_ctx(ScriptedEngine(tok, script), tok, limits=_limits(max_tokens=300))
    last = await drive(ctx, LongOutputEnv())
    other = await drive(make_ctx(ScriptedEngine(tok, lambda *a: "DONE"), tok, tid="t1"), LongOutputEnv())
    path = tmp_path / "t.jsonl"  # the branch first, its root later: the viewer puts the root first
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in (last, other, ctx.branches[0])))
    console = Console(record=True, width=200)
    print_trajectories(path, console)
    text = console.export_text()
    root, branch_at, flat = text.index("t0  status="), text.index("└─ t0.c1  compaction of t0 at"), text.index("t1  ")
    assert root < branch_at < flat
    pieces = _pieces(last.to_json(), tok)  # the branch from where it leaves its parent
    assert pieces[0] == ("shared", f"⟨{last.parent.at} tokens shared with t0⟩")
    assert "".join(t for _, t in pieces[1:]) == tok.decode(last.stream[last.parent.at:])
    write_html(path, tmp_path / "t.html")
    page = (tmp_path / "t.html").read_text()
    assert "margin-left:2em" in page and "compaction of t0" in page


async def test_the_recipe_env_needs_its_summary(smol_tokenizer):
    """examples/compaction: page 2 overflows the recipe's window, the question is answered from the summary; a
    summary that keeps the code is rewarded, one that drops it is not."""
    import importlib.util
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent / "examples" / "compaction"
    spec = importlib.util.spec_from_file_location("compaction_env", root / "env.py")
    env_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env_mod)
    context = yaml.safe_load((root / "config.yaml").read_text())["rollout"]["context"]
    tok = smol_tokenizer  # the recipe's model's
    for keeps, reward in ((True, 1.0), (False, 0.0)):
        def reply(rid, turn, prompt, keeps=keeps):
            last = prompt[prompt.rfind("<|im_start|>user"):]
            if "context is full" in last:
                return "The access code is 4321." if keeps else "A report of log lines."
            if "Summary of the work so far" in prompt and "last page" in last:
                code = prompt.split("access code is ")[-1][:4] if keeps else "0000"
                return code
            return "I have read this page of the report and noted what matters. Please show me the next page now."

        limits = RolloutLimits(max_turns=4, max_new_tokens=40, context=ContextPolicy(**context))
        ctx = make_ctx(ScriptedEngine(tok, reply), tok, limits=limits, sample={"prompt": "Read.", "code": "4321"})
        last = await drive(ctx, env_mod.build_env({"code": "4321", "seed": 3}, {}))
        [first] = ctx.branches
        assert last.parent.kind == BranchKind.COMPACTION and "4321" in tok.decode(first.prompt_ids + first.response_ids)
        assert "NOTE" not in tok.decode(last.prompt_ids) and last.turn_rewards == [reward]


def test_after_summary_carries_the_observation_a_tool_output_as_a_user_message():
    from turnrl.rollout.context import after_summary, drop_observations

    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Task"}]
    out = after_summary(first, "<think>\nhm\n</think>\n\nkept 42", [{"role": "tool", "name": "grep", "content": "x"}])
    assert out == [*first, {"role": "user", "content": SUMMARY_HEADER + "kept 42"},
                   {"role": "user", "content": "Output of grep:\nx"}]
    talk = [*first, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "o1"},
            {"role": "assistant", "content": "b"}, {"role": "tool", "content": "o2"}]
    assert [m["content"] for m in drop_observations(talk, 1)] == ["S", "Task", "a", DROPPED, "b", "o2"]
    assert [m["content"] for m in drop_observations(talk, 0)] == ["S", "Task", "a", DROPPED, "b", DROPPED]
    assert drop_observations(talk, 2) is None
