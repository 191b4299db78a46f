"""`turnrl sft`: SFT samples are the trajectories RL records (token for token), the loss is on assistant tokens only,
--filter on trajectory JSONL, packing, and a checkpoint `turnrl train` loads."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.agents.tool_agent import ToolAgentSettings
from turnrl.config import SFTConfig, TrainConfig
from turnrl.data import DataError
from turnrl.observe.stats import TrajectoryWriter
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.tools import ToolSet, function_tool
from turnrl.train.runs import runs_under
from turnrl.train.sft import load_sft_samples, parse_filter, reply_text, sft_trajectories
from turnrl.types import RolloutStatus, SegmentSource


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: first number
        b: second number
    """
    return str(a + b)


TOOLSET = ToolSet([add])
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def rl_trajectory(tokenizer, replies, prompt):
    """A trajectory of the tool agent on a scripted engine: what RL records for these replies."""
    settings = ToolAgentSettings.build(TOOLSET, "hermes", {})
    engine = ScriptedEngine(tokenizer, lambda rid, turn, text: replies[turn - 1])
    manager = RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, default_agent="tool_agent",
                             tools=settings, limits=RolloutLimits(max_turns=4, max_new_tokens=200))
    [[traj]] = asyncio.run(run_groups(manager, [{"prompt": prompt}]))
    return traj


def replayed(tokenizer, rows, toolset=TOOLSET):
    trajs, skipped = asyncio.run(sft_trajectories(rows, ChatRenderer(tokenizer), toolset=toolset))
    return trajs, skipped


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "smol_tokenizer"])
def test_sft_sample_of_a_tool_conversation_is_the_rl_trajectory_token_for_token(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    prompt = [{"role": "system", "content": "Use the add tool."}, {"role": "user", "content": "What is 2+3?"}]
    rl = rl_trajectory(tokenizer, [CALL, "The answer is 5."], prompt)
    assert rl.status == RolloutStatus.COMPLETED and rl.num_turns == 2
    row = {"id": "conv", "messages": rl.messages}  # the conversation as a chat-message SFT row
    [sft], skipped = replayed(tokenizer, [row])
    assert not skipped
    assert sft.prompt_ids == rl.prompt_ids
    assert sft.response_ids == rl.response_ids
    assert sft.loss_mask == rl.loss_mask
    assert [(s.source, len(s.token_ids)) for s in sft.segments] == [(s.source, len(s.token_ids)) for s in rl.segments]
    assert SegmentSource.TOOL in [s.source for s in sft.segments]


def test_only_assistant_tokens_carry_mask_one(qwen3_tokenizer):
    messages = [{"role": "user", "content": "Count with me."}, {"role": "assistant", "content": "One."},
                {"role": "user", "content": "Next?"}, {"role": "assistant", "content": "Two."}]
    [traj], _ = replayed(qwen3_tokenizer, [{"messages": messages}], toolset=None)
    trained = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = qwen3_tokenizer.encode
    assert trained == enc("One.", add_special_tokens=False) + [im_end] + enc("Two.", add_special_tokens=False) + [im_end]
    injected = qwen3_tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if not m])
    assert "Next?" in injected and "One." not in injected and "Count with me." in qwen3_tokenizer.decode(traj.prompt_ids)


def test_structured_tool_calls_train_on_the_text_the_template_renders(qwen3_tokenizer):
    renderer = ChatRenderer(qwen3_tokenizer)
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    text = reply_text(renderer, prompt, call, TOOLSET.schemas)
    # Qwen3 renders the last assistant turn with an empty reasoning block before the call
    assert text.endswith('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    assert text.startswith("<think>") and "<|im_end|>" not in text
    rl = rl_trajectory(qwen3_tokenizer, [text, "5."], prompt)  # a model that wrote exactly that text
    assert rl.num_turns == 2 and rl.messages[2]["role"] == "tool"
    row = {"messages": [*prompt, call, {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5."}]}
    [sft], _ = replayed(qwen3_tokenizer, [row])
    assert (sft.prompt_ids, sft.response_ids, sft.loss_mask) == (rl.prompt_ids, rl.response_ids, rl.loss_mask)


def test_a_bad_row_is_skipped_alone_with_its_reason(qwen3_tokenizer):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    twice = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"},
                          {"role": "assistant", "content": "b"}]}
    no_reply = {"messages": [{"role": "user", "content": "Hi"}]}
    trajs, skipped = replayed(qwen3_tokenizer, [good, twice, no_reply], toolset=None)
    assert len(trajs) == 1 and skipped == {"bad row: DataError": 2}


# ---- --filter on trajectory JSONL ---------------------------------------------------------------------
def write_rollouts(tokenizer, path):
    trajs = []
    for k, (reply, reward) in enumerate([("5", 1.0), ("6", 0.0), ("7", None), ("5!", 1.0)]):
        traj = rl_trajectory(tokenizer, [reply], [{"role": "user", "content": "What is 2+3?"}])
        traj.id, traj.reward = f"t{k}", reward
        trajs.append(traj)
    failed = rl_trajectory(tokenizer, ["5"], [{"role": "user", "content": "What is 2+3?"}])
    failed.id, failed.reward, failed.status = "failed", 1.0, RolloutStatus.FAILED
    with TrajectoryWriter(path) as w:
        for t in [*trajs, failed]:
            w.write(t)
    return trajs


def test_filter_keeps_rewarded_trajectories_as_recorded(qwen3_tokenizer, tmp_path):
    trajs = write_rollouts(qwen3_tokenizer, tmp_path / "rollouts.jsonl")
    samples, report = load_sft_samples(tmp_path / "rollouts.jsonl", ChatRenderer(qwen3_tokenizer),
                                       filter_expr="reward>=1")
    # t0 and t3 pass; t1 (0.0) and t2 (no reward) are filtered; the FAILED one passes the filter but never trains
    assert report["filtered_out"] == 2 and report["skipped"] == {"status failed": 1} and len(samples) == 2
    for sample, traj in zip(samples, [trajs[0], trajs[3]], strict=True):
        assert (sample.prompt_ids, sample.response_ids, sample.loss_mask) == (
            traj.prompt_ids, traj.response_ids, traj.loss_mask)


def test_filter_expressions():
    keep = parse_filter("reward>=1 and status==completed and sample.level < 3")
    assert keep({"reward": 1.0, "status": "completed", "sample": {"level": 2}})
    assert not keep({"reward": 0.5, "status": "completed", "sample": {"level": 2}})
    assert not keep({"reward": None, "status": "completed", "sample": {"level": 2}})
    assert not keep({"reward": 1.0, "status": "failed", "sample": {"level": 2}})
    assert not keep({"reward": 1.0, "status": "completed"})
    with pytest.raises(ValueError, match="expected FIELD OP VALUE"):
        parse_filter("reward => 1")
    with pytest.raises(ValueError, match="only == and != do"):
        parse_filter("status>=completed")


def test_a_filter_field_no_row_has_is_an_error(qwen3_tokenizer, tmp_path):
    write_rollouts(qwen3_tokenizer, tmp_path / "r.jsonl")
    with pytest.raises(DataError, match="'rewrad' is in no row"):
        load_sft_samples(tmp_path / "r.jsonl", ChatRenderer(qwen3_tokenizer), filter_expr="rewrad>=1")


# ---- the loss, packing, checkpoints ---------------------------------------------------------------------
CONVERSATIONS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                 {"role": "assistant", "content": f"{2 * i}"},
                                 {"role": "user", "content": "Sure?"},
                                 {"role": "assistant", "content": f"Yes: {i} + {i} = {2 * i}."}]}
    for i in range(6)
]


def sft_config(tmp_path, **overrides) -> SFTConfig:
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    return SFTConfig.model_validate({"model": "tiny-qwen3", "train_data": str(data),
                                     "output_dir": str(tmp_path / "run"), "sft": {"batch_size": 6},
                                     "optim": {"lr": 1e-3}, "rollout": {"sanity_check": "ignore_strippable"},
                                     **overrides})


def manual_nll(model, samples) -> float:
    """Token-mean NLL of the mask-1 tokens, from a plain unpacked forward of each whole sequence."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = model(input_ids=ids, turnrl_cu_seqlens=[0, ids.shape[1]]).logits[0].float().log_softmax(-1)
        for k, m in enumerate(s.loss_mask):
            if m:
                pos = len(s.prompt_ids) + k
                total -= float(logp[pos - 1, ids[0, pos]])
                count += 1
    return total / count


def test_sft_loss_is_the_nll_of_assistant_tokens_packed_or_not(tmp_path):
    from turnrl.build import build_sft

    losses = []
    for micro in (4096, 64):  # everything in one packed row, then about one sequence per row
        trainer, stack = build_sft(sft_config(tmp_path, optim={"lr": 1e-3, "micro_batch_tokens": micro}))
        try:
            assert len(trainer.learner.pack(trainer.samples, list(range(6)))) == (1 if micro == 4096 else 6)
            expected = manual_nll(trainer.learner.policy, trainer.samples)
            metrics = trainer.update(trainer.samples)
            losses.append(metrics["train/loss"])
            assert metrics["train/loss"] == pytest.approx(expected, rel=1e-4)
            assert metrics["train/tokens"] == sum(len(s.prompt_ids) + len(s.response_ids) for s in trainer.samples)
        finally:
            stack.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_sft_trains_and_turnrl_train_loads_its_checkpoint_as_model(tmp_path):
    from safetensors.torch import load_file

    from turnrl.build import build_trainer
    from turnrl.cli import run_sft

    cfg = sft_config(tmp_path, steps=4)
    history = run_sft(cfg)
    losses = [m["train/loss"] for m in history if "train/loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0]
    model_dir = tmp_path / "run" / "model"  # output_dir/model: the run's model, through the run directory's link
    [run] = runs_under(tmp_path / "run")
    assert model_dir.is_symlink() and (model_dir / "config.json").exists() and (run / "curves.png").exists()
    saved = load_file(model_dir / "model.safetensors")

    rows = tmp_path / "rl.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    train_cfg = TrainConfig.model_validate({
        "model": str(model_dir), "train_data": str(rows), "output_dir": str(tmp_path / "rl"), "steps": 1,
        "prompts_per_step": 1, "rollout": {"agent": "single_turn", "n": 2, "max_new_tokens": 4},
        "reward": {"function": "format"}, "algo": {"kl_coef": 0.01}})
    trainer, stack = build_trainer(train_cfg)
    try:
        policy = trainer.learner.policy.state_dict()
        assert all(torch.equal(policy[k], v) for k, v in saved.items() if k in policy)
        engine = stack.engine.model.state_dict()
        assert torch.equal(engine["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
        history = asyncio.run(trainer.train())
    finally:
        stack.close()
    assert [m["step"] for m in history if "train/samples" in m] == [1.0]


def _sft(*args: str):
    from typer.testing import CliRunner

    from turnrl.cli import app

    result = CliRunner().invoke(app, ["sft", *args])
    return result.exit_code, " ".join(result.output.split())


def _trained_steps(run) -> list[float]:
    return [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in m]


@pytest.mark.filterwarnings("ignore")
def test_sft_reruns_follow_the_run_directory_rules_of_train(tmp_path):
    """Before, a second `turnrl sft` overwrote the first's checkpoints and appended to its metrics.jsonl, and there
    was no --run-dir, --resume or --overwrite. Now each run has its own directory, output_dir/model links the model
    of the run that saved last, and the rules (and refusals) are `turnrl train`'s."""
    out = tmp_path / "run"
    config = tmp_path / "sft.yaml"
    config.write_text(json.dumps(sft_config(tmp_path).model_dump(mode="json")))
    code, said = _sft(str(config), "steps=3", "save_every=1")
    assert code == 0, said
    [first] = runs_under(out)
    assert f"run directory: {first} sft:" in said and (first / "config.yaml").exists()
    assert sorted(p.name for p in (first / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert (out / "model").resolve() == (first / "checkpoints" / "step_000003" / "model").resolve()
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}

    code, said = _sft(str(config), "steps=2")  # the same command again: a second run beside the first
    assert code == 0, said
    [_, second] = runs_under(out)
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before and _trained_steps(first) == [1, 2, 3]
    assert (out / "latest-run").resolve() == second.resolve() and _trained_steps(second) == [1, 2]
    assert (out / "model").resolve() == (second / "checkpoints" / "step_000002" / "model").resolve()

    code, said = _sft(str(config), "--run-dir", str(first))
    assert code == 2 and f"run directory {first} is not empty (checkpoints up to step_000003)" in said
    code, said = _sft(str(config), "steps=4", "--resume")  # the newest run, from its newest checkpoint
    assert code == 0 and f"run directory: {second} (resuming)" in said, said
    assert f"resumed from {second / 'checkpoints' / 'step_000002'} (step 2" in said
    assert _trained_steps(second) == [1, 2, 3, 4] and runs_under(out) == [first, second]
    code, said = _sft(str(config), "steps=1", "--run-dir", str(first), "--overwrite")
    assert code == 0 and _trained_steps(first) == [1], said
    assert sorted(p.name for p in (first / "checkpoints").glob("step_*")) == ["step_000001"]

    code, said = _sft(str(config), f"output_dir={tmp_path / 'none'}", "--resume")  # before: trained from scratch
    assert code == 2 and "there is no earlier run to resume" in said and not (tmp_path / "none").exists()
