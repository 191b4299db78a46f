"""Run directories (a run never writes into another's) and checkpoints that resume from the newest valid one."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from turnrl.cli import app, run_training
from turnrl.config import ConfigError, TrainConfig, load_config
from turnrl.train.checkpoint import (
    MANIFEST,
    checkpoint_problem,
    load_checkpoint_model,
    prune_checkpoints,
    select_checkpoint,
)
from turnrl.train.runs import find_checkpoint, prepare_run, runs_under


def _files(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp_path / "runs"), "steps": 3,
        "prompts_per_step": 2, "seed": 5, "save_every": 1, "rollout": {"env": "single_turn", "n": 2,
                                                                      "max_new_tokens": 4},
        "engine": {"max_batch_size": 2}, "optim": {"lr": 1e-3}, "reward": {"function": f"{tmp_path / 'reward.py'}:reward"},
        "trainer": {"keep_checkpoints": None},  # every checkpoint: the tests below damage and resume them
    }))
    return config


def _train(config: Path, *overrides: str, overwrite: bool = False) -> tuple[list[dict], str]:
    out = io.StringIO()
    cfg = load_config(TrainConfig, config, list(overrides))
    history = run_training(cfg, console=Console(file=out, width=300), overwrite=overwrite)
    return history, out.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run directory) of one 3-step run with a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("runs")
    config = _files(tmp)
    _train(config)
    [run] = runs_under(tmp / "runs")
    return config, run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / run.name
    shutil.copytree(run, copy)
    return copy


@pytest.mark.filterwarnings("ignore")
def test_each_run_gets_its_own_directory_and_leaves_the_others_alone(trained, tmp_path):
    config, run = trained
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    assert (ckpts / "latest").read_text() == "step_000003" and (run / "config.yaml").exists()
    first = _copy(run, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    lines = (first / "metrics.jsonl").read_text()

    # the same config again, shorter (the README's second command), with the same output_dir
    history, printed = _train(config, f"output_dir={first.parent}", "steps=1", "save_every=0")
    second = [r for r in runs_under(first.parent) if r != first]
    assert len(second) == 1 and f"run directory: {second[0]}" in printed
    assert (first.parent / "latest-run").resolve() == second[0].resolve()  # the newest run, by a link
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*")} == before  # not one file of the first run touched
    assert (first / "metrics.jsonl").read_text() == lines
    assert (second[0] / "checkpoints" / "latest").read_text() == "step_000001"
    assert [m["step"] for m in history if "train/loss" in m or "train/samples" in m] == [1.0]
    [step] = [m for m in history if "train/samples" in m]
    [line] = [x for x in printed.splitlines() if x.startswith("peak memory: ")]  # in the final summary
    assert float(line.split()[2]) >= round(step["memory/peak_rss_gb"], 2) and line.endswith("(this process's maximum RSS)")
    assert 0.2 < step["memory/peak_rss_gb"] < 100


def test_a_non_empty_run_dir_is_refused_without_resume_or_overwrite(trained, tmp_path):
    config, run = trained
    result = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(run)])
    assert result.exit_code == 2
    assert "is not empty (checkpoints up to step_000003)" in result.output and "--resume" in result.output
    assert "--overwrite" in result.output
    with pytest.raises(ConfigError, match="--overwrite replaces the run in --run-dir"):
        prepare_run(load_config(TrainConfig, config), overwrite=True)


def test_overwrite_deletes_only_what_a_run_writes(trained, tmp_path):
    config, run = trained
    copy = _copy(run, tmp_path)
    (copy / "notes.txt").write_text("mine")
    cfg = load_config(TrainConfig, config, [f"run_dir={copy}"])
    assert prepare_run(cfg, overwrite=True) == copy
    assert sorted(p.name for p in copy.iterdir()) == ["notes.txt"]


def test_resume_paths_name_a_run_a_checkpoint_or_a_directory_of_runs(trained, tmp_path):
    config, run = trained
    for given, run_dir, resume in [
        (run, run, True),
        (run.parent, run, True),  # a directory of runs: its newest
        (run / "checkpoints" / "step_000002", run, str(run / "checkpoints" / "step_000002")),
    ]:
        cfg = load_config(TrainConfig, config, [f"resume={given}"])
        assert prepare_run(cfg) == run_dir and cfg.run_dir == str(run_dir) and cfg.resume == resume
    cfg = load_config(TrainConfig, config, ["resume=true"])
    assert prepare_run(cfg) == run  # no path: the newest run under output_dir
    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        prepare_run(load_config(TrainConfig, config, [f"resume={tmp_path}"]))
    # `--resume PATH`: the one argument that is not key=value
    result = CliRunner().invoke(app, ["train", str(config), "steps=1", "--resume", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "not a checkpoint folder" in result.output
    result = CliRunner().invoke(app, ["train", str(config), "oops"])
    assert result.exit_code == 2 and "override 'oops': expected dotted.key=value" in result.output


def _keep_only(run: Path, *names: str) -> Path:
    """`run` with only the checkpoints `names` (the others deleted)."""
    for ckpt in (run / "checkpoints").glob("step_*"):
        if ckpt.name not in names:
            shutil.rmtree(ckpt)
    return run


def test_resume_with_nothing_to_resume_is_refused_naming_what_is_missing(trained, tmp_path):
    """Before, each of these printed "(resuming)" and trained from scratch (in a new or the half-written run)."""
    config, run = trained
    crashed = tmp_path / "crashed"  # a run that died before its first checkpoint
    crashed.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run / name, crashed / name)
    broken = _keep_only(_copy(run, tmp_path), "step_000003")  # its only checkpoint truncated
    _truncate(_weights(broken / "checkpoints" / "step_000003")[0])
    cases = [
        ([f"output_dir={tmp_path / 'none'}", "--resume"], f"there is no earlier run to resume: output_dir "
                                                           f"{tmp_path / 'none'} does not exist"),
        ([f"output_dir={tmp_path / 'folders'}", "--resume"], "holds no run directory"),  # none of them a run
        (["--run-dir", str(tmp_path / "empty"), "--resume"], f"run directory {tmp_path / 'empty'} does not exist, "
                                                             "so there is nothing to resume"),
        (["--resume", str(crashed)], f"run {crashed} has no checkpoint, so there is nothing to resume"),
        (["--resume", str(broken)], "has no complete checkpoint (step_000003 broken)"),
    ]
    (tmp_path / "folders" / "notes").mkdir(parents=True)
    for args, said in cases:
        result = CliRunner().invoke(app, ["train", str(config), *args])
        assert result.exit_code == 2, (args, result.output)
        text = " ".join(result.output.split())
        assert said in text and "(resuming)" not in text, (args, text)
        assert "start" in text and "without --resume" in text
    assert not (tmp_path / "none").exists() and not (tmp_path / "empty").exists()  # nothing was created


@pytest.mark.filterwarnings("ignore")
def test_resume_of_a_run_whose_every_checkpoint_fails_its_checksum_is_refused(trained, tmp_path):
    config, run = trained
    copy = _keep_only(_copy(run, tmp_path), "step_000003")
    _flip(_weights(copy / "checkpoints" / "step_000003")[0])  # sizes match: only the checksum finds it
    result = CliRunner().invoke(app, ["train", str(config), "--resume", str(copy)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"resume: run {copy} has no valid checkpoint to resume from (skipped step_000003: state/" in text
    assert "does not match its checksum" in text and "start a new run without --resume" in text
    assert json.loads((copy / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3  # not trained again


@pytest.mark.filterwarnings("ignore")
def test_a_run_keeps_its_newest_checkpoints(tmp_path):
    """trainer.keep_checkpoints (default 2): a checkpoint every step, the two newest kept."""
    config = _files(tmp_path)
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "trainer"}))
    result = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000003"]  # before: 1, 2 and 3
    assert select_checkpoint(tmp_path / "run") == (ckpts / "step_000003", [])


def test_pruning_never_deletes_the_newest_valid_checkpoint(trained, tmp_path):
    _, run = trained
    copy = _copy(run, tmp_path)
    ckpts = copy / "checkpoints"
    _truncate(_weights(ckpts / "step_000003")[0])  # the newest is broken: step 2 is the newest valid one
    assert prune_checkpoints(ckpts, 1) == ["step_000001"]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000003"]
    assert select_checkpoint(copy)[0] == ckpts / "step_000002"  # the run can still resume

    copy = _copy(run, tmp_path / "b")
    ckpts = copy / "checkpoints"
    for name in ("step_000003", "step_000002"):
        _flip(_weights(ckpts / name)[0])  # sizes intact: only their checksums say they are broken
    assert prune_checkpoints(ckpts, 2) == []  # step 1, the only valid one, stays beside the two newest
    assert prune_checkpoints(ckpts, 1) == ["step_000002"]
    assert select_checkpoint(copy)[0] == ckpts / "step_000001"


# ---- corrupted checkpoints: the newest valid one is chosen, and the skipped one is named ------------------
def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _weights(ckpt: Path) -> list[Path]:
    return sorted((ckpt / "state").glob("*.distcp"))


CORRUPTIONS = {
    "truncated weights": (lambda c: _truncate(_weights(c)[0]), "truncated or overwritten"),
    "empty weights": (lambda c: _weights(c)[0].write_bytes(b""), "has 0 of its"),
    "truncated HF weights": (lambda c: _truncate(c / "model" / "model.safetensors"), "model/model.safetensors has"),
    "truncated trainer state": (lambda c: _truncate(c / "trainer_state.pt"), "trainer_state.pt has"),
    "deleted weights": (lambda c: [p.unlink() for p in _weights(c)], ".distcp is missing"),
    "flipped byte": (lambda c: _flip(_weights(c)[0]), "does not match its checksum"),
    "latest names a missing dir": (lambda c: shutil.rmtree(c), "latest names 'step_000003', which does not exist"),
    "latest names an empty dir": (lambda c: [shutil.rmtree(c), c.mkdir()], "skipped step_000003: is empty"),
}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_valid_one(trained, tmp_path, corruption):
    _, run = trained
    copy = _copy(run, tmp_path)
    assert select_checkpoint(copy) == (copy / "checkpoints" / "step_000003", [])
    damage, said = CORRUPTIONS[corruption]
    damage(copy / "checkpoints" / "step_000003")
    path, notes = select_checkpoint(copy)
    assert path == copy / "checkpoints" / "step_000002"
    assert said in "; ".join(notes), notes
    assert find_checkpoint(copy) == (path, notes)  # what `turnrl eval RUN` takes


@pytest.mark.filterwarnings("ignore")
def test_resume_skips_a_truncated_checkpoint_says_so_in_one_line_and_continues_the_run(trained, tmp_path):
    config, run = trained
    copy = _copy(run, tmp_path)
    _truncate(_weights(copy / "checkpoints" / "step_000003")[0])
    history, printed = _train(config, f"resume={copy}", "steps=4", "save_every=0")
    [line] = [x for x in printed.splitlines() if x.startswith("resume:")]
    assert "skipped step_000003: state/" in line and line.endswith("resuming from step_000002")
    assert f"resumed from {copy / 'checkpoints' / 'step_000002'} (step 2" in printed
    assert "moved the newer step_000003 to checkpoints/superseded/" in printed
    trained_steps = [m["step"] for m in history if "train/samples" in m]
    assert trained_steps == [1.0, 2.0, 3.0, 4.0]  # 1-2 from the checkpoint's history, 3-4 trained again
    ckpts = copy / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000004" and select_checkpoint(copy) == (ckpts / "step_000004", [])
    assert [p.name for p in (ckpts / "superseded").glob("*/step_*")] == ["step_000003"]  # kept, out of the way
    assert checkpoint_problem(ckpts / "step_000004") is None


def test_checkpoints_are_published_whole_with_a_manifest(trained):
    _, run = trained
    ckpts = run / "checkpoints"
    assert not list(ckpts.glob(".tmp-*"))  # staging folders are renamed into place
    manifest = json.loads((ckpts / "step_000002" / MANIFEST).read_text())["files"]
    assert "trainer_state.pt" in manifest and any(name.startswith("state/") for name in manifest)
    # only the final checkpoint has Hugging Face weights: the others keep what resuming needs, once
    assert not any(name.endswith(".safetensors") for name in manifest)
    assert (ckpts / "step_000003" / "model" / "model.safetensors").exists()
    # the sharded state holds each weight once (a tied embedding too) and AdamW's two moments: 3 x 4 bytes each
    from turnrl.models import load_model

    params = sum(p.numel() for p in load_model("tiny-qwen3").parameters())
    state = sum(f["bytes"] for n, f in manifest.items() if n.startswith("state/"))
    assert state == pytest.approx(3 * 4 * params, rel=0.01)


def test_a_checkpoint_without_hf_weights_loads_from_its_sharded_state(trained, tmp_path):
    import torch

    _, run = trained
    ckpts = run / "checkpoints"
    final = ckpts / "step_000003"
    saved = load_checkpoint_model(final)  # its Hugging Face weights
    shutil.copytree(final, tmp_path / "step_000003", ignore=shutil.ignore_patterns("*.safetensors"))
    from_state = load_checkpoint_model(tmp_path / "step_000003")  # the same policy, made from state/
    middle = load_checkpoint_model(ckpts / "step_000002")
    probe = torch.arange(300, 316)[None]
    with torch.no_grad():
        torch.testing.assert_close(from_state(probe).logits, saved(probe).logits)
        assert not torch.allclose(middle(probe).logits, saved(probe).logits)  # step 2's policy, not step 3's


# ---- turnrl eval: a checkpoint, a run or a directory of runs; --out; greedy and sampled ---------------------
@pytest.mark.filterwarnings("ignore")
def test_eval_writes_where_out_says_and_says_so(trained, tmp_path):
    from turnrl.cli import run_evaluation

    config, run = trained
    cfg = load_config(TrainConfig, config, [f"eval_data={run.parent.parent / 'rows.jsonl'}"])
    out = tmp_path / "scores" / "eval.jsonl"
    printed = io.StringIO()
    metrics = run_evaluation(cfg, checkpoint=run.parent, out=out, console=Console(file=printed, width=300),
                             sampled_n=2)
    text = printed.getvalue()
    assert f"evaluating {run / 'checkpoints' / 'step_000003'}" in text  # a directory of runs: the newest one's
    assert "(greedy): 4 trajectories" in text and "(sampled at T=1): 8 trajectories" in text  # progress, in a file
    sampled = tmp_path / "scores" / "eval-sampled.jsonl"
    assert f"wrote {out} (4 trajectories), {sampled} (8 trajectories)" in text
    greedy_rows = [json.loads(x) for x in out.read_text().splitlines()]
    sampled_rows = [json.loads(x) for x in sampled.read_text().splitlines()]
    assert len(greedy_rows) == 4 and {r["sampling"]["temperature"] for r in greedy_rows} == {0.0}
    assert len(sampled_rows) == 8 and {r["sampling"]["temperature"] for r in sampled_rows} == {1.0}
    assert metrics["eval/trajectories"] == 4 and metrics["eval/sampled_trajectories"] == 8
    assert not (run / "trajectories" / "eval_cli.jsonl").exists()


@pytest.mark.filterwarnings("ignore")
def test_eval_of_a_checkpoint_without_hf_weights_and_the_flags(trained, tmp_path):
    config, run = trained
    rows = str(run.parent.parent / "rows.jsonl")
    middle = run / "checkpoints" / "step_000002"  # no Hugging Face weights: made from its sharded state
    result = CliRunner().invoke(app, ["eval", str(config), f"eval_data={rows}", "--checkpoint", str(middle),
                                      "--no-greedy", "--sampled-n", "1"])
    assert result.exit_code == 0, result.output
    default = run / "eval" / "step_000002-sampled.jsonl"  # beside the run, named after the checkpoint
    assert f"wrote {default} (4 trajectories)" in result.output and not (run / "eval" / "step_000002.jsonl").exists()
    for args, said in [(["--checkpoint", str(tmp_path / "nowhere")], "does not exist (expected e.g."),
                       (["--no-greedy"], "--no-greedy leaves nothing to evaluate")]:
        result = CliRunner().invoke(app, ["eval", str(config), f"eval_data={rows}", *args])
        assert result.exit_code == 2 and said in result.output, result.output


@pytest.mark.filterwarnings("ignore")
def test_eval_of_a_checkpoint_under_a_config_naming_another_model_uses_the_checkpoints_own(trained, tmp_path,
                                                                                           qwen3_tokenizer):
    """A config whose model is SmolLM2 and a checkpoint of tiny-qwen3: before, SmolLM2's tokenizer fed tiny-qwen3's
    weights (score 0, no word); now the checkpoint is evaluated with its own tokenizer and template, and that is said."""
    config, run = trained
    rows = str(run.parent.parent / "rows.jsonl")
    out = tmp_path / "eval.jsonl"
    result = CliRunner().invoke(app, ["eval", str(config), f"eval_data={rows}", "model=smollm2-135m-instruct",
                                      "--checkpoint", str(run), "--out", str(out), "--sampled-n", "0"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "was trained from tiny-qwen3, not smollm2-135m-instruct (the config's model): evaluating it with its " \
           "own tokenizer" in text
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(trajs) == 4
    for traj in trajs:  # Qwen3's tokens (SmolLM2's <|im_start|> is id 1, Qwen3's 151644)
        assert qwen3_tokenizer.decode(traj["prompt_ids"]).startswith("<|im_start|>user\nSay ")
        assert traj["prompt_ids"][0] == qwen3_tokenizer.convert_tokens_to_ids("<|im_start|>")
