"""Vision-language trajectories: the two image stores, their parity checks, and rollout/trainer logprob parity.

A VLM trajectory keeps its images twice (turnrl.multimodal): the inference side (image refs in stream order,
sent with every generate call) and the training side (processor tensors per rendered chunk, merged once per
key at the end). These tests run three-turn trajectories with an image in the prompt, in an env observation
and in a tool response on the real embedded engine over random tiny VLMs, break each store on purpose, and
recompute the rollout's logprobs with the packed trainer forward.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
from pathlib import Path

import pytest
import torch
from fakes import ScriptedEngine
from PIL import Image, ImageDraw

from turnrl.data import DataError, load_rows, prompt_messages
from turnrl.engines.base import EngineError
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model, resolve_model
from turnrl.multimodal import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    ImageBuffer,
    VisionRenderer,
    build_processor,
)
from turnrl.observe.stats import TrajectoryWriter
from turnrl.render import Rendered
from turnrl.rollout import RolloutContext, RolloutLimits, drive
from turnrl.train.packing import pack_sequences, packed_token_logprobs, use_varlen_attention
from turnrl.types import RolloutStatus, SamplingParams, SegmentSource, StepResult, TerminationReason

FAMILIES = {"qwen3_vl": "tiny-qwen3-vl", "qwen2_5_vl": "tiny-qwen2.5-vl", "qwen2_vl": "tiny-qwen2-vl"}


# ---- images and an environment that shows them ----------------------------------------------------
def diagram(colour: str, size: tuple[int, int], mark: int = 0) -> Image.Image:
    """A small image; `mark` moves a black square so same-sized images differ in content."""
    image = Image.new("RGB", size, colour)
    ImageDraw.Draw(image).rectangle([4 + mark, 4, 20 + mark, 20], fill="black")
    return image


@pytest.fixture
def three_images(tmp_path: Path) -> list:
    """A file (the prompt's) and two in-memory images (an env observation's and a tool result's).
    Sizes differ, so each image needs its own number of placeholder tokens."""
    path = tmp_path / "prompt.png"
    diagram("red", (64, 96)).save(path)
    return [str(path), diagram("blue", (96, 64)), diagram("green", (64, 64))]


def image_prompt(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is x?"}]}]


class ShowImagesEnv:
    """Turn 1 → a user message with an image (via format_observation); turn 2 → a tool result with an image;
    turn 3 → done. Turn-aware (`step_turn`), so the random model's length stops do not end the episode."""

    def __init__(self, observation_image, tool_image):
        self.observation_image, self.tool_image, self.turn = observation_image, tool_image, 0

    def step_turn(self, turn) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            return StepResult({"look": self.observation_image})
        if self.turn == 2:
            return StepResult([{"role": "tool", "content": [{"type": "image", "image": self.tool_image},
                                                            {"type": "text", "text": "the tool's view"}]}])
        return StepResult(None, reward=1.0, done=True, termination_reason=TerminationReason.ENV_DONE)

    def format_observation(self, observation):
        if isinstance(observation, dict):  # the env's own observation type → a user message with an image part
            return {"role": "user", "content": [{"type": "image", "image": observation["look"]},
                                                {"type": "text", "text": "Look again."}]}
        return observation


class RecordingEngine:
    """Wraps an engine and keeps the `images` each generate call received."""

    def __init__(self, engine):
        self.engine, self.sent = engine, []

    async def generate(self, prompt_ids, params, *, request_id, images=None):
        self.sent.append(list(images or []))
        return await self.engine.generate(prompt_ids, params, request_id=request_id, images=images)

    async def release(self, request_id):
        await self.engine.release(request_id)


def context(engine, renderer, images, tid="t0", max_new_tokens=6, max_turns=3) -> RolloutContext:
    return RolloutContext(
        engine=engine, renderer=renderer, sampling=SamplingParams(temperature=1.0, seed=7),
        limits=RolloutLimits(max_turns=max_turns, max_new_tokens=max_new_tokens), trajectory_id=tid,
        group_id="g0", sample_index=0, sample={"prompt": image_prompt(images[0])},
    )


def placeholder_runs(ids: list[int], pad_id: int) -> list[int]:
    runs, n = [], 0
    for t in [*ids, -1]:
        if t == pad_id:
            n += 1
        elif n:
            runs, n = [*runs, n], 0
    return runs


# ---- the tiny VLMs -------------------------------------------------------------------------------
class Policy:
    def __init__(self, name: str):
        self.processor = build_processor(resolve_model(name))
        self.renderer = VisionRenderer(self.processor)
        self.model = load_model(name)
        self.engine = EmbeddedEngine(self.model, image_processor=self.processor.image_processor,
                                     eos_token_ids=sorted(self.renderer.end_of_turn_ids))


@pytest.fixture(scope="module")
def policies():
    made: dict[str, Policy] = {}

    def get(family: str) -> Policy:
        if family not in made:
            made[family] = Policy(FAMILIES[family])
        return made[family]

    yield get
    for p in made.values():
        p.engine.close()


@pytest.fixture(scope="module")
def qwen3_vl_renderer() -> VisionRenderer:
    return VisionRenderer(build_processor(resolve_model("tiny-qwen3-vl")))


# ---- a real three-turn trajectory ----------------------------------------------------------------
async def test_three_turn_trajectory_keeps_both_stores_in_step(policies, three_images, tmp_path):
    policy = policies("qwen3_vl")
    renderer, processor = policy.renderer, policy.processor
    engine = RecordingEngine(policy.engine)
    traj = await drive(context(engine, renderer, three_images), ShowImagesEnv(*three_images[1:]))

    assert (traj.status, traj.termination_reason, traj.num_turns) == (
        RolloutStatus.COMPLETED, TerminationReason.ENV_DONE, 3)
    assert [s.source for s in traj.segments] == [
        SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.ENV,
        SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.TOOL, SegmentSource.MODEL]
    # refs in stream order: a file keeps its path, an in-memory image is named by its pixels' sha256
    assert traj.images[0] == three_images[0]
    assert all(ref.startswith("sha256:") and len(ref) == 7 + 64 for ref in traj.images[1:])
    assert len(set(traj.images)) == 3
    # the inference side grew with the stream: each call got every image of its prompt, in order
    assert [len(sent) for sent in engine.sent] == [1, 2, 3]
    assert engine.sent[-1][0] == three_images[0] and engine.sent[-1][1:] == three_images[1:]

    # training side: one grid row per image, in stream order; pixel rows = t*h*w of each grid (16-pixel
    # patches, temporal patch 2: an image of HxW gives grid [1, H/16, W/16] after rounding to 32 pixels)
    mm = traj.mm_train_inputs
    assert set(mm) == {"pixel_values", "image_grid_thw"}
    assert mm["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 6], [1, 4, 4]]
    assert mm["pixel_values"].shape == (24 + 24 + 16, 3 * 2 * 16 * 16)
    # each image's rows are exactly what the processor makes of that image alone: order is the stream's
    rows = mm["pixel_values"].split([24, 24, 16])
    for k, image in enumerate(three_images):
        alone = processor.image_processor(images=[Image.open(image) if k == 0 else image], return_tensors="pt")
        assert torch.equal(rows[k], alone["pixel_values"]), f"image {k} out of place in the training tensors"
    # every placeholder run has the length its features need (grid / merge_size²): 6, 6, 4 tokens
    stream = traj.prompt_ids + traj.response_ids
    assert placeholder_runs(stream, renderer.image_pad_id) == [6, 6, 4]
    # images were placed where their messages are: prompt, the env's user turn, the tool response
    text = renderer.decode(stream)
    assert text.count(VISION_START) == 3 and "<tool_response>\n" + VISION_START in text
    # the full re-render agrees once placeholder runs are collapsed (no spurious render mismatch)
    assert traj.metrics["render_mismatch"] == 0.0
    # the JSONL row carries the refs, also inside the messages' image parts; the tensors stay in memory
    with TrajectoryWriter(tmp_path / "t.jsonl") as writer:
        writer.write(traj)
    row = json.loads((tmp_path / "t.jsonl").read_text())
    assert row["images"] == traj.images and "mm_train_inputs" not in row
    parts = [p for m in row["messages"] if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    assert [p["image"] for p in parts] == traj.images


# ---- deliberately broken stores: each fails the trajectory with a precise reason -----------------
def drop_placeholder_run(rendered: Rendered, renderer: VisionRenderer) -> Rendered:
    """The chunk's ids without its `<|vision_start|><|image_pad|>...<|vision_end|>` run (images kept)."""
    start = rendered.ids.index(renderer.vision_start_id)
    end = rendered.ids.index(renderer.tokenizer.convert_tokens_to_ids(VISION_END), start)
    return Rendered(rendered.ids[:start] + rendered.ids[end + 1:], rendered.images, rendered.mm_inputs)


def drop_one_pad(rendered: Rendered, renderer: VisionRenderer) -> Rendered:
    ids = list(rendered.ids)
    ids.remove(renderer.image_pad_id)
    return Rendered(ids, rendered.images, rendered.mm_inputs)


async def broken_rollout(renderer: VisionRenderer, images: list, monkeypatch, breakage: str):
    if breakage in ("missing_run", "short_run"):
        original = VisionRenderer.observation
        edit = drop_placeholder_run if breakage == "missing_run" else drop_one_pad
        calls = []

        def observation(self, messages, tools=None, **kwargs):  # breaks the first observation (the env's image)
            calls.append(1)
            rendered = original(self, messages, tools, **kwargs)
            return edit(rendered, self) if len(calls) == 1 else rendered

        monkeypatch.setattr(VisionRenderer, "observation", observation)
    elif breakage == "swapped":  # training tensors concatenated in the wrong order
        def merged(self):
            return {key: torch.cat([c[key] for c in reversed(self.chunks)]) for key in self.chunks[0]}

        monkeypatch.setattr(ImageBuffer, "merged", merged)
    elif breakage in ("inference_differs", "inference_short"):
        original_add = ImageBuffer.add

        def add(self, rendered):
            original_add(self, rendered)
            if len(self.chunks) == 2:  # the observation's image reaches the engine wrong, or not at all
                self.images[-1:] = [diagram("white", (8, 8))] if breakage == "inference_differs" else []

        monkeypatch.setattr(ImageBuffer, "add", add)
    # the scripted engine ignores images, so the end-of-trajectory parity checks are the only line of defence
    # (as with a server that would silently mis-serve)
    engine = ScriptedEngine(renderer.tokenizer, lambda rid, turn, prompt: "Let me look.")
    env = ShowImagesEnv(*images[1:])
    return await drive(context(engine, renderer, images, max_new_tokens=32), env)


@pytest.mark.parametrize(("breakage", "sizes", "message"), [
    ("missing_run", None,
     "the token stream has 2 image placeholder runs but the training tensors hold 3 images"),
    ("short_run", None, "image 1: 5 placeholder tokens in the stream but its features need 6"),
    # same-sized images: every count still agrees; only the pixels show the training order is wrong
    ("swapped", [(64, 64)] * 3, "image 0 is out of order"),
    ("swapped", None, "image 0: 6 placeholder tokens in the stream but its features need 4"),
    ("inference_differs", None, "image 1 differs between the inference side (sha256:"),
    ("inference_short", None, "2 images on the inference side but 3 on the training side"),
])
async def test_broken_stores_fail_the_trajectory(qwen3_vl_renderer, three_images, monkeypatch, breakage, sizes,
                                                 message):
    if sizes is not None:
        three_images = [diagram("gray", size, mark=8 * k) for k, size in enumerate(sizes)]
    traj = await broken_rollout(qwen3_vl_renderer, three_images, monkeypatch, breakage)
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.PARITY_ERROR)
    assert message in traj.error
    assert traj.mm_train_inputs is None  # never trained on
    assert len(traj.images) == (2 if breakage == "inference_short" else 3)


async def test_unbroken_scripted_rollout_passes(qwen3_vl_renderer, three_images):
    """The control for the broken cases: the same rollout without a breakage completes."""
    traj = await broken_rollout(qwen3_vl_renderer, three_images, None, "none")
    assert (traj.status, traj.termination_reason) == (RolloutStatus.COMPLETED, TerminationReason.ENV_DONE)
    assert traj.mm_train_inputs["image_grid_thw"].shape == (3, 3)


# ---- one allocation per key -----------------------------------------------------------------------
def test_merge_is_one_cat_per_key_never_per_turn(monkeypatch):
    buffer = ImageBuffer()
    for turn in range(5):  # one image per turn: 4·(turn+1) pixel rows
        pixels = torch.full((4 * (turn + 1), 8), float(turn))
        grid = torch.tensor([[1, 2, 2 * (turn + 1)]])
        buffer.add(Rendered([1], [diagram("white", (8, 8), mark=turn)], {"pixel_values": pixels, "image_grid_thw": grid}))
    calls: list[int] = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting_cat)
    merged = buffer.merged()
    assert calls == [5, 5]  # one cat per key (pixel_values, image_grid_thw), each over the 5 chunks
    assert merged["pixel_values"].shape == (4 * (1 + 2 + 3 + 4 + 5), 8)
    assert merged["pixel_values"][:4].eq(0).all() and merged["pixel_values"][-20:].eq(4).all()


async def test_rollout_merges_once_per_trajectory(qwen3_vl_renderer, three_images, monkeypatch):
    merges = []
    original = ImageBuffer.merged

    def counting_merged(self):
        merges.append(len(self.chunks))
        return original(self)

    monkeypatch.setattr(ImageBuffer, "merged", counting_merged)
    traj = await broken_rollout(qwen3_vl_renderer, three_images, None, "none")
    assert traj.num_turns == 3 and merges == [3]  # three chunks buffered, merged once at the end


# ---- trainer logprobs == engine logprobs ---------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "qwen2_vl"])
async def test_trainer_recomputes_the_engines_logprobs(policies, three_images, family):
    policy = policies(family)
    traj = await drive(context(policy.engine, policy.renderer, three_images, tid=f"lp-{family}", max_new_tokens=8),
                       ShowImagesEnv(*three_images[1:]))
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 3, traj.error
    assert traj.metrics["cached_prompt_tokens"] > 0  # turns 2 and 3 reused the trajectory's KV

    trainer_model = copy.deepcopy(policy.model)
    use_varlen_attention(trainer_model)
    mask = traj.loss_mask
    rollout = torch.tensor([lp for lp, m in zip(traj.rollout_logprobs, mask, strict=True) if m])

    def trainer_logprobs(mm) -> torch.Tensor:
        # packed with a text-free filler sequence first, so positions and pixels must be found per sequence
        filler = ([1, 2, 3], [4, 5], [1, 1])
        rows = pack_sequences([filler, (traj.prompt_ids, traj.response_ids, mask)], 100_000, [None, mm])
        with torch.no_grad():
            logp_N = packed_token_logprobs(trainer_model, rows[0], temperature=1.0)
        return logp_N[rows[0].target_seq == 1]

    assert len(rollout) == 3 * 8
    torch.testing.assert_close(trainer_logprobs(traj.mm_train_inputs), rollout, atol=1e-4, rtol=0)
    # the comparison sees the images: the prompt image's pixels replaced by the last image's change the logprobs
    wrong = dict(traj.mm_train_inputs)
    grid = wrong["image_grid_thw"]
    wrong["pixel_values"] = wrong["pixel_values"].clone()
    wrong["pixel_values"][: int(grid[0].prod())] = wrong["pixel_values"][: int(grid[0].prod())].flip(0)
    assert (trainer_logprobs(wrong) - rollout).abs().max() > 1e-4


# ---- data rows with <image> placeholders --------------------------------------------------------
def test_rows_with_image_placeholders_become_image_parts(tmp_path, qwen3_vl_renderer):
    diagram("red", (64, 64)).save(tmp_path / "a.png")
    buf = io.BytesIO()
    diagram("blue", (64, 32)).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    rows = [
        {"id": "file", "prompt": "<image>Find x.", "images": ["a.png"], "answer": "3"},
        {"id": "embedded", "prompt": "Compare <image> and <image>.", "images": ["data:image/png;base64," + b64, b64]},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows(tmp_path / "d.jsonl")
    assert prompt_messages(loaded[0]) == [{"role": "user", "content": [
        {"type": "image", "image": str(tmp_path / "a.png")}, {"type": "text", "text": "Find x."}]}]
    parts = prompt_messages(loaded[1])[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text", "image", "text"]
    rendered = qwen3_vl_renderer.initial(prompt_messages(loaded[1]))
    assert rendered.mm_inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 4]]  # both decode to 64 wide, 32 high
    assert placeholder_runs(rendered.ids, qwen3_vl_renderer.image_pad_id) == [2, 2]

    rows.append({"id": "bad", "prompt": "<image> and <image>", "images": ["a.png"]})
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"bad\.jsonl row 3: the prompt has 2 '<image>' placeholders but 'images' has 1"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text(json.dumps({"prompt": "<image>Find x.", "images": []}) + "\n")
    with pytest.raises(DataError, match=r"empty\.jsonl row 1: the prompt has 1 '<image>' placeholders but 'images' has 0"):
        load_rows(tmp_path / "empty.jsonl")


# ---- what the engine refuses ---------------------------------------------------------------------
async def test_text_engine_refuses_images(tiny_qwen3):
    engine = EmbeddedEngine(tiny_qwen3)
    try:
        with pytest.raises(EngineError, match="text-only model got images"):
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="r", images=["a.png"])
    finally:
        engine.close()


async def test_vlm_engine_refuses_a_prompt_whose_image_count_differs(policies, three_images):
    policy = policies("qwen3_vl")
    prompt = policy.renderer.initial(image_prompt(three_images[0])).ids
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    good = policy.engine.generate(prompt, params, request_id="good", images=three_images[:1])
    too_many = policy.engine.generate(prompt, params, request_id="too-many", images=three_images[:2])
    none = policy.engine.generate(prompt, params, request_id="none")
    out, *errors = await asyncio.gather(good, too_many, none, return_exceptions=True)
    assert len(out.token_ids) == 3  # a bad request next to it fails alone
    assert isinstance(errors[0], EngineError) and "the prompt has 1 images but 2 were sent" in str(errors[0])
    assert isinstance(errors[1], EngineError) and "the prompt has 1 images but 0 were sent" in str(errors[1])
    pads = prompt.count(policy.renderer.image_pad_id)
    assert pads == 6 and IMAGE_PAD in policy.renderer.decode(prompt)



async def test_vlm_request_whose_image_does_not_load_fails_alone(policies, three_images, tmp_path):
    """The image is read in the engine step (it cannot be checked cheaply before): its failure must fail
    that request only, not the others in the step."""
    policy = policies("qwen3_vl")
    prompt = policy.renderer.initial(image_prompt(three_images[0])).ids
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    calls = [policy.engine.generate(prompt, params, request_id="ok-1", images=three_images[:1]),
             policy.engine.generate(prompt, params, request_id="missing", images=[str(tmp_path / "gone.png")]),
             policy.engine.generate(prompt, params, request_id="ok-2", images=three_images[:1])]
    first, error, second = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(error, EngineError) and "'missing' failed in prefill" in str(error)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 3

# ---- the geo3k recipe (examples/geo3k_vlm) ---------------------------------------------------------
RECIPE = Path(__file__).parent.parent / "examples" / "geo3k_vlm"


def recipe_module():
    from turnrl.loading import load_module

    return load_module(str(RECIPE / "prepare_data.py"), what="recipe script")


def test_recipe_configs_validate():
    from turnrl.config import TrainConfig, load_config

    cpu = load_config(TrainConfig, RECIPE / "config_cpu.yaml")
    gpu = load_config(TrainConfig, RECIPE / "config_gpu.yaml")
    assert (cpu.model, cpu.rollout.env, cpu.rollout.max_turns, cpu.reward.function) == (
        "tiny-qwen3-vl", "geo3k", 3, "env_last")
    # slime's settings: 64 prompts x 8 samples, 3 turns, 4096-token budget, T=1, lr 1e-6, clip 0.2/0.28, no KL
    assert (gpu.prompts_per_step, gpu.rollout.n, gpu.rollout.max_turns, gpu.rollout.token_budget) == (64, 8, 3, 4096)
    assert (gpu.rollout.sampling.temperature, gpu.optim.lr, gpu.algo.clip_low, gpu.algo.clip_high, gpu.algo.kl_coef) == (
        1.0, 1e-6, 0.2, 0.28, 0.0)


def test_prepare_data_converts_a_real_geo3k_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    diagram("white", (32, 32)).save(buf, format="PNG")
    table = pyarrow.Table.from_pylist([  # hiyouga/geometry3k: images are {"bytes", "path"} structs
        {"images": [{"bytes": buf.getvalue(), "path": "d.png"}], "problem": "<image>Find x.", "answer": "13"}])
    pq.write_table(table, tmp_path / "train.parquet")
    prepare = recipe_module()
    path = prepare.write_split(prepare.load_geo3k(tmp_path / "train.parquet"), tmp_path / "out", "train", max_turns=3)
    row = json.loads(path.read_text())
    assert row["images"] == ["images/train-00000-0.png"] and row["answer"] == "13"
    assert (tmp_path / "out" / "images" / "train-00000-0.png").read_bytes() == buf.getvalue()
    assert row["prompt"].startswith("<image>Find x.\n\n") and "calc_score" in row["prompt"]
    assert "at most 2 candidate" in row["prompt"] and "\\boxed{your answer}" in row["prompt"]
    messages = prompt_messages(load_rows(path)[0])  # the loader turns the placeholder into an image part
    assert messages[0]["content"][0] == {"type": "image", "image": str(tmp_path / "out" / "images" / "train-00000-0.png")}


@pytest.mark.slow
def test_geo3k_recipe_trains_on_cpu_and_the_viewer_shows_its_images(tmp_path, monkeypatch):
    """A few GRPO steps of the CPU recipe (shrunk), then `turnrl view --html` shows every trajectory's diagram."""
    from rich.console import Console
    from typer.testing import CliRunner

    from turnrl.cli import app, run_training
    from turnrl.config import TrainConfig, load_config

    monkeypatch.chdir(tmp_path)  # as the README runs it: data and images relative to the working directory
    recipe_module().write_synthetic(Path("data/geo3k_vlm"), n_train=4, n_eval=2, seed=0, max_turns=3)
    cfg = load_config(TrainConfig, RECIPE / "config_cpu.yaml", [
        "steps=2", "prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.token_budget=64",
        "eval_data=null", "run_dir=runs/test"])
    history = run_training(cfg, console=Console(file=io.StringIO()))

    steps = [h for h in history if "train/samples" in h]
    assert len(steps) == 2 and all(h["train/samples"] == 4 for h in steps)  # the KL term trains all four
    assert all(h["train/tokens"] > 4 * 64 for h in steps) and steps[-1]["train/policy_version"] == 2
    trajectories = Path("runs/test/trajectories/last_step.jsonl")
    rows = [json.loads(line) for line in trajectories.read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] != "failed" for r in rows)
    assert all(len(r["images"]) == 1 and r["images"][0].startswith("data/geo3k_vlm/images/train-") for r in rows)

    result = CliRunner().invoke(app, ["view", str(trajectories), "--html", "view.html"])
    assert result.exit_code == 0, result.output
    page = Path("view.html").read_text()
    assert page.count("<img ") == 4 and "missing image" not in page
    for r in rows:
        data = base64.b64encode(Path(r["images"][0]).read_bytes()).decode()
        assert f"<img src='data:image/png;base64,{data}'" in page


def test_build_processor_uses_a_hub_models_own_processor_and_template(tmp_path, monkeypatch):
    """A hub id (no local folder) gets its own preprocessor config and chat template, not the tiny defaults."""
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for f in Path(resolve_model("tiny-qwen3-vl")).iterdir():
        if f.suffix in (".json", ".jinja", ".txt"):
            (snapshot / f.name).write_bytes(f.read_bytes())
    config = json.loads((snapshot / "preprocessor_config.json").read_text())
    (snapshot / "preprocessor_config.json").write_text(json.dumps({**config, "size": {"longest_edge": 128 * 128,
                                                                                        "shortest_edge": 32 * 32}}))
    (snapshot / "chat_template.jinja").write_text("{#- the hub model's own -#}" + (snapshot / "chat_template.jinja").read_text())
    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: fetched.append(repo) or str(snapshot))
    processor = build_processor("org/some-vl-model")
    assert fetched == ["org/some-vl-model"]
    assert processor.image_processor.size.longest_edge == 128 * 128  # the tiny default is 224 * 224
    assert "the hub model's own" in processor.chat_template
