"""LLaVA-style VLMs (LlavaForConditionalGeneration: a fixed run of image tokens per image, 1-D positions) through the
renderer, the embedded engine, packing, SFT and checkpoints, on the built-in `tiny-llava` (random, SmolLM2's
tokenizer)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image, ImageDraw

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model, resolve_model
from turnrl.multimodal import VisionRenderer, build_processor
from turnrl.rollout import RolloutContext, RolloutLimits, drive
from turnrl.train.packing import pack_sequences, packed_token_logprobs, use_varlen_attention
from turnrl.types import RolloutStatus, SamplingParams, SegmentSource, StepResult, TerminationReason


def picture(colour: str, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse([4, 4, 30, 30], fill=colour)
    return image


class LookAgain:
    """Turn 1 → a user message with an image; turn 2 → done (turn-aware: length stops do not end it)."""

    def __init__(self, image):
        self.image, self.turn = image, 0

    def step_turn(self, turn) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": [{"type": "image", "image": self.image},
                                                            {"type": "text", "text": "And this one?"}]}])
        return StepResult(None, reward=1.0, done=True, termination_reason=TerminationReason.ENV_DONE)


@pytest.fixture(scope="module")
def llava():
    processor = build_processor(resolve_model("tiny-llava"))
    renderer = VisionRenderer(processor)
    model = load_model("tiny-llava")
    engine = EmbeddedEngine(model, image_processor=processor.image_processor,
                            eos_token_ids=sorted(renderer.end_of_turn_ids))
    yield model, renderer, engine
    engine.close()


async def test_a_llava_trajectory_keeps_both_stores_and_the_trainer_recomputes_the_engines_logprobs(llava, tmp_path):
    model, renderer, engine = llava
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    picture("red", (64, 64)).save(first)
    picture("blue", (80, 48)).save(second)  # resized to the tower's 64x64 like every image
    prompt = [{"role": "user", "content": [{"type": "image", "image": str(first)}, {"type": "image", "image": str(first)},
                                           {"type": "text", "text": "Two pictures. What is in them?"}]}]
    ctx = RolloutContext(engine=engine, renderer=renderer, sampling=SamplingParams(temperature=1.0, seed=3),
                         limits=RolloutLimits(max_turns=2, max_new_tokens=6), trajectory_id="llava-0", group_id="g",
                         sample_index=0, sample={"prompt": prompt})
    traj = await drive(ctx, LookAgain(picture("blue", (80, 48))), prompt)

    assert (traj.status, traj.num_turns) == (RolloutStatus.COMPLETED, 2), traj.error
    assert [s.source for s in traj.segments] == [SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.ENV,
                                                 SegmentSource.MODEL]
    stream = traj.prompt_ids + traj.response_ids
    # adjacent images are one run of 2 x 16 image tokens in the stream; the parity check splits it per image
    assert renderer.tokens_per_image == 16 and renderer.placeholder_runs(stream) == [16, 16, 16]
    assert traj.mm_train_inputs["pixel_values"].shape == (3, 3, 64, 64) and "image_grid_thw" not in traj.mm_train_inputs
    assert traj.metrics["render_mismatch"] == 0.0 and traj.metrics["cached_prompt_tokens"] > 0

    trainer_model = copy.deepcopy(model)
    use_varlen_attention(trainer_model)
    mask = traj.loss_mask
    rollout = torch.tensor([lp for lp, m in zip(traj.rollout_logprobs, mask, strict=True) if m])
    rows = pack_sequences([([1, 2, 3], [4, 5], [1, 1]), (traj.prompt_ids, traj.response_ids, mask)], 100_000,
                          [None, traj.mm_train_inputs])
    with torch.no_grad():
        logp = packed_token_logprobs(trainer_model, rows[0])[rows[0].target_seq == 1]
    torch.testing.assert_close(logp, rollout, atol=1e-4, rtol=0)


async def test_a_missing_image_is_refused_before_it_joins_a_batch(llava):
    from turnrl.engines.base import InvalidRequest

    _, renderer, engine = llava
    rendered = renderer.initial([{"role": "user", "content": [{"type": "image", "image": picture("red", (64, 64))},
                                                              {"type": "text", "text": "Hi"}]}])
    with pytest.raises(InvalidRequest, match="the prompt has 1 images but 0 were sent"):
        await engine.generate(rendered.ids, SamplingParams(max_new_tokens=2), request_id="x", images=[])


def write_colour_rows(tmp_path) -> None:
    """sft.jsonl in tmp_path: four one-colour pictures and their colour, as chat rows with an image."""
    rows = []
    for k, colour in enumerate(["red", "blue", "green", "black"]):
        picture(colour, (64, 64)).save(tmp_path / f"{k}.png")
        rows.append({"images": [f"{k}.png"], "messages": [{"role": "user", "content": "<image>Which colour?"},
                                                          {"role": "assistant", "content": colour}]})
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sft_on_image_rows_trains_and_turnrl_train_loads_the_llava_checkpoint(tmp_path):
    from turnrl.build import build_trainer
    from turnrl.cli import run_sft
    from turnrl.config import SFTConfig, TrainConfig

    write_colour_rows(tmp_path)
    cfg = SFTConfig.model_validate({
        "model": "tiny-llava", "train_data": str(tmp_path / "sft.jsonl"), "output_dir": str(tmp_path / "run"),
        "steps": 3, "sft": {"batch_size": 4},
        "optim": {"lr": 1e-3, "lr_scale": {"vision_tower": 10, "multi_modal_projector": 10}}})
    history = run_sft(cfg)
    losses = [m["train/loss"] for m in history if "train/loss" in m]
    assert losses[-1] < losses[0]
    model_dir = tmp_path / "run" / "model"
    assert (model_dir / "preprocessor_config.json").exists() and (model_dir / "chat_template.jinja").exists()

    (tmp_path / "rl.jsonl").write_text(json.dumps({"prompt": "<image>Which colour?", "images": ["0.png"]}) + "\n")
    train_cfg = TrainConfig.model_validate({
        "model": str(model_dir), "train_data": str(tmp_path / "rl.jsonl"), "output_dir": str(tmp_path / "rl"),
        "steps": 1, "prompts_per_step": 1, "rollout": {"agent": "single_turn", "n": 2, "max_new_tokens": 3},
        "reward": {"function": "format"}, "algo": {"kl_coef": 0.01}})
    trainer, stack = build_trainer(train_cfg)
    try:
        assert trainer.learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-6)
        import asyncio

        history = asyncio.run(trainer.train())
    finally:
        stack.close()
    assert [m["train/samples"] for m in history if "train/samples" in m] == [2.0]


def test_lr_scale_makes_optimizer_groups_and_refuses_a_name_that_matches_nothing():
    from turnrl.train.learner import param_groups

    model = load_model("tiny-llava")
    groups = param_groups(model, 1e-5, {"vision_tower": 50, "multi_modal_projector": 50})
    assert sorted(g["lr"] for g in groups) == pytest.approx([1e-5, 5e-4])
    scaled = next(g for g in groups if g["lr"] > 1e-5)["params"]
    assert len(scaled) == sum(1 for n, _ in model.named_parameters() if "vision_tower" in n or "projector" in n)
    with pytest.raises(ValueError, match=r"\['vit'\] match no trainable parameter"):
        param_groups(model, 1e-5, {"vit": 2})


def test_optim_freeze_trains_only_the_vision_side_and_its_checkpoint_exports_from_state(tmp_path):
    """LLaVA's first stage (ms-swift's freeze_llm): the language model stays the base's, bit for bit, in the
    trained model and in a Hugging Face directory exported from the sharded state, which leaves it out."""
    from safetensors.torch import load_file

    from turnrl.cli import run_sft
    from turnrl.config import SFTConfig
    from turnrl.train.checkpoint import export_checkpoint

    write_colour_rows(tmp_path)
    cfg = SFTConfig.model_validate({
        "model": "tiny-llava", "train_data": str(tmp_path / "sft.jsonl"), "output_dir": str(tmp_path / "run"),
        "steps": 2, "sft": {"batch_size": 4}, "optim": {"lr": 1e-2, "freeze": ["language_model", "lm_head"]}})
    history = run_sft(cfg)
    assert [m["train/loss"] for m in history if "train/loss" in m]
    base = load_model("tiny-llava").state_dict()
    ckpt = max((tmp_path / "run" / "latest-run" / "checkpoints").glob("step_*"))  # the run's own directory
    exported = export_checkpoint(ckpt, tmp_path / "export")
    for trained in (load_model(str(tmp_path / "run" / "model")).state_dict(),
                    load_model(str(exported)).state_dict()):
        lm = [k for k in base if "language_model" in k or k.startswith("lm_head")]
        vision = [k for k in base if "vision_tower" in k or "multi_modal_projector" in k]
        assert lm and vision
        assert all(torch.equal(trained[k], base[k]) for k in lm)
        assert not all(torch.equal(trained[k], base[k]) for k in vision)
    state_keys = {k for f in exported.glob("*.safetensors") for k in load_file(f)}
    assert any("language_model" in k for k in state_keys)  # the export is a whole model


def test_optim_freeze_refuses_a_name_that_matches_nothing_and_freezing_everything():
    from turnrl.models import freeze

    model = load_model("tiny-llava")
    with pytest.raises(ValueError, match=r"optim.freeze: \['llm'\] match no parameter"):
        freeze(model, ["llm"])
    with pytest.raises(ValueError, match="nothing would train"):
        freeze(model, ["model", "lm_head"])
