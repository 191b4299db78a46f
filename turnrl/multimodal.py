"""Vision-language policies: processors, images, the VLM renderer, and the two image stores kept in step.

slime's design, with the checks none of the reference systems has. A VLM trajectory keeps its images twice:
- inference side: the images in token-stream order, sent with every generate call (an engine turns them
  into pixels itself, as vLLM/SGLang do from image data);
- training side: the processor tensors of each rendered chunk (prompt, then each observation), buffered
  per turn and concatenated once per key when the trajectory ends (never a `torch.cat` per turn: that is
  O(turns²) bytes copied; bench/multimodal.py measures both).
When a trajectory ends, three parity checks run (`check_parity`): every image's run of placeholder tokens
has exactly the length its features need; the training tensors hold the images in stream order; the
inference-side list equals the training-side list. A violation fails the trajectory (parity_error); it
is never trained on.

Two families of layouts, told apart by the model config:
- Qwen2-VL, Qwen2.5-VL and Qwen3-VL: each image is `<|vision_start|>` + a run of `<|image_pad|>` whose length
  its grid gives + `<|vision_end|>`, and positions are multimodal rotary (M-RoPE, three axes);
- LLaVA (`LlavaForConditionalGeneration`: any vision tower transformers has, CLIP or SigLIP, before any causal
  LM, e.g. SmolLM2 in the built-in `smollm2-llava`): each image is a fixed run of image tokens (the vision
  tower's patches) and positions are the LM's ordinary 1-D ones.
Processors are built from transformers' classes: torchvision does not import beside the CPU torch here, so
with the PIL image processors and without a video processor.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from importlib import resources
from pathlib import Path
from typing import Any, cast

import torch
from PIL import Image

from turnrl.render import ChatRenderer, RenderCheck, Rendered, SanityMode
from turnrl.types import Message

IMAGE_PLACEHOLDER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}


# ---- images ---------------------------------------------------------------------------------------
def load_image(ref: Any) -> Image.Image:
    """A PIL image from a PIL image, a file path, a `data:` URI or raw base64 (no network fetches)."""
    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return Image.open(io.BytesIO(ref["bytes"])).convert("RGB")
        ref = ref.get("path") or ref.get("url") or ref.get("image")
    if not isinstance(ref, str):
        raise ValueError(f"image must be a PIL image, a path, a data URI or base64, got {type(ref).__name__}")
    if ref.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))).convert("RGB")
    if ref.startswith(("http://", "https://")):
        raise ValueError(f"image {ref[:60]!r}: remote images are not fetched; download them first")
    path = Path(ref)
    if path.exists():
        return Image.open(path).convert("RGB")
    try:
        return Image.open(io.BytesIO(base64.b64decode(ref, validate=True))).convert("RGB")
    except Exception:
        raise FileNotFoundError(f"image {ref[:80]!r} is neither an existing file nor base64 data") from None


def image_ref(ref: Any) -> str:
    """How an image is recorded in the trajectory JSONL: its file path, or `sha256:<hex>` of its pixels."""
    if isinstance(ref, str) and not ref.startswith("data:") and Path(ref).exists():
        return ref
    image = load_image(ref)
    return "sha256:" + hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest()


def content_images(messages: list[Message]) -> list[Any]:
    """Image parts of the messages, in rendering order."""
    images = []
    for m in messages:
        if isinstance(m.get("content"), list):
            images += [p.get("image", p.get("image_url")) for p in m["content"] if p.get("type") in ("image", "image_url")]
    return images


def split_placeholders(text: str, images: list[Any], where: str) -> list[dict[str, Any]]:
    """geo3k-style `<image>` placeholders in a prompt string → content parts, images in order."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{where}: the text has {len(pieces) - 1} '{IMAGE_PLACEHOLDER}' placeholders but "
                         f"{len(images)} images")
    parts: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if k < len(images):
            parts.append({"type": "image", "image": images[k]})
    return parts


# ---- layouts --------------------------------------------------------------------------------------
def uses_mrope(config: Any) -> bool:
    """Qwen2/2.5/3-VL (multimodal rotary positions from image grids); False for LLaVA-style 1-D positions."""
    return hasattr(config, "vision_start_token_id")


def llava_image_tokens(config: Any) -> int:
    """Image tokens per image of a LLaVA model: the vision tower's patches (+ its class token for CLIP towers
    when every feature is kept), as LlavaProcessor expands them."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    cls = 1 if vision.model_type == "clip_vision_model" else 0
    return patches + cls - (1 if config.vision_feature_select_strategy == "default" else 0)


def count_images(config: Any, ids: list[int]) -> int:
    """Images in a token chunk: vision-start tokens (Qwen VL), else image tokens / tokens per image (LLaVA)."""
    if uses_mrope(config):
        return ids.count(config.vision_start_token_id)
    return ids.count(config.image_token_id) // llava_image_tokens(config)


# ---- processors and tiny models ---------------------------------------------------------------------
def _allow_missing_video_processor(cls):
    class Processor(cls):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    Processor.__name__ = cls.__name__
    return Processor


def build_processor(model_dir: str | Path):
    """A transformers VL processor for a Qwen2/2.5/3-VL directory, with the PIL image processor and no video
    processor (torchvision-free). The directory's chat template wins; else turnrl's Qwen VL template."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen3VLProcessor,
    )

    model_dir = Path(model_dir)
    if not model_dir.is_dir():  # a hub id: fetch its small files, so its own image processor and template are used
        from huggingface_hub import snapshot_download

        model_dir = Path(snapshot_download(str(model_dir), allow_patterns=["*.json", "*.jinja", "*.txt"]))
    config = AutoConfig.from_pretrained(model_dir)
    classes = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}
    if config.model_type == "llava":
        return _llava_processor(model_dir, config)
    if config.model_type not in classes:
        raise ValueError(f"{model_dir}: no VL processor for model_type {config.model_type!r} (supported: "
                         f"{sorted([*classes, 'llava'])})")
    if (model_dir / "preprocessor_config.json").exists():
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    else:
        image_processor = tiny_image_processor(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = None
    if (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if template is None or "vision_start" not in template:
        template = resources.files("turnrl").joinpath("templates/qwen_vl.jinja").read_text()
    cls = _allow_missing_video_processor(classes[config.model_type])
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template)


def _llava_processor(model_dir: Path, config: Any):
    """LlavaProcessor over the directory's tokenizer, chat template and image processor (its PIL class)."""
    import transformers
    from transformers import AutoTokenizer, LlavaProcessor

    preprocessor = model_dir / "preprocessor_config.json"
    settings = json.loads(preprocessor.read_text()) if preprocessor.exists() else {}
    kind = settings.get("image_processor_type", "CLIPImageProcessor").removesuffix("Fast")
    cls = getattr(transformers, f"{kind}Pil", None) or getattr(transformers, kind, None)
    if cls is None:
        raise ValueError(f"{model_dir}: unknown image processor {kind!r} in preprocessor_config.json")
    template_file = model_dir / "chat_template.jinja"
    if not template_file.exists():
        raise ValueError(f"{model_dir}: a LLaVA directory needs chat_template.jinja (a template that writes the "
                         "image token for image parts)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = config.vision_config
    return LlavaProcessor(image_processor=cls.from_pretrained(model_dir), tokenizer=tokenizer,
                          patch_size=vision.patch_size, chat_template=template_file.read_text(),
                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                          image_token=tokenizer.convert_ids_to_tokens(config.image_token_id),
                          num_additional_image_tokens=1 if vision.model_type == "clip_vision_model" else 0)


def tiny_image_processor(config):
    from transformers import Qwen2VLImageProcessorPil

    vision = config.vision_config
    mean_std = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if config.model_type == "qwen3_vl" else {}
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size,
        min_pixels=32 * 32, max_pixels=224 * 224, **mean_std,
    )


def tiny_vl_config(family: str = "qwen3_vl"):
    """A few-million-parameter random VLM config with the real Qwen3 vocabulary and vision token ids."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids: dict[str, Any] = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                               vision_end_token_id=151653)
    text: dict[str, Any] = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=151645,
                pad_token_id=151643, bos_token_id=151643)
    if family == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                                  "mrope_interleaved": True})
        vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=256, deepstack_visual_indexes=[0], patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def materialise_tiny_vl(out: Path, family: str = "qwen3_vl") -> None:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vl_config(family))
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(out)
    tiny_image_processor(model.config).save_pretrained(out)
    (out / "chat_template.jinja").write_text(resources.files("turnrl").joinpath("templates/qwen_vl.jinja").read_text())


def materialise_tiny_qwen3_vl(out: Path) -> None:
    materialise_tiny_vl(out, "qwen3_vl")


LLAVA_IMAGE_TOKEN = "<image>"


def llava_config(text_config: Any, image_token_id: int, *, image_size: int = 64, patch_size: int = 16,
                 vision_hidden: int = 128, vision_layers: int = 2):
    """A LLaVA config: a small SigLIP vision tower (random init; (image_size / patch_size)² image tokens per
    image), a two-layer projector, and `text_config`'s LM."""
    from transformers import LlavaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=4 * vision_hidden,
                                num_hidden_layers=vision_layers, num_attention_heads=4, image_size=image_size,
                                patch_size=patch_size)
    return LlavaConfig(vision_config=vision, text_config=text_config, image_token_index=image_token_id,
                       vision_feature_select_strategy="full", vision_feature_layer=-1, projector_hidden_act="gelu",
                       image_seq_length=(image_size // patch_size) ** 2,
                       tie_word_embeddings=getattr(text_config, "tie_word_embeddings", False))


def materialise_llava(out: Path, lm_dir: str | Path, *, text_config: Any = None, **vision: Any) -> None:
    """A LLaVA directory over the causal LM in `lm_dir` (its tokenizer plus an `<image>` token, its weights, a
    new random vision tower and projector), or over a random LM of `text_config` with that tokenizer."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
    torch.manual_seed(0)
    lm = (AutoModelForCausalLM.from_config(text_config) if text_config is not None
          else AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32))
    lm.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # a row for <image> (replaced by features)
    config = llava_config(lm.config, cast(int, tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN)), **vision)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    model.generation_config = lm.generation_config if text_config is None else GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    size = config.vision_config.image_size
    SiglipImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3,
                            image_std=[0.5] * 3).save_pretrained(out)
    (out / "chat_template.jinja").write_text(resources.files("turnrl").joinpath("templates/chatml_vl.jinja").read_text())


# ---- rendering --------------------------------------------------------------------------------------
class VisionRenderer(ChatRenderer):
    """ChatRenderer for VLM processors: image parts expand into placeholder tokens and pixel tensors."""

    def __init__(self, processor: Any, chat_template_kwargs: dict[str, Any] | None = None):
        self.processor = processor
        tokenizer = processor.tokenizer
        tokenizer.chat_template = processor.chat_template  # the delta machinery renders through the tokenizer
        super().__init__(tokenizer, chat_template_kwargs)
        from transformers import LlavaProcessor

        self.mrope = not isinstance(processor, LlavaProcessor)
        """Qwen VL: multimodal rotary positions and grid-sized images; LLaVA: 1-D positions, fixed-size images."""
        self.image_pad_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        self.vision_start_id = tokenizer.convert_tokens_to_ids(VISION_START)
        self.merge_size = getattr(processor.image_processor, "merge_size", 1)
        self.tokens_per_image = 0 if self.mrope else _llava_processor_tokens(processor)
        """LLaVA: the fixed run of image tokens every image becomes (0 for Qwen VL: it depends on the image)."""

    def _encode_with_images(self, text: str, images: list[Any]) -> Rendered:
        if not images:
            return Rendered(self.encode(text))
        pil = [load_image(im) for im in images]
        out = self.processor(text=[text], images=pil, return_tensors="pt")
        mm = {k: v for k, v in out.items() if k not in TEXT_KEYS and isinstance(v, torch.Tensor)}
        return Rendered(out["input_ids"][0].tolist(), list(images), mm)

    def _with_prefill(self, rendered: Rendered, text: str) -> Rendered:
        rendered.prefill, rendered.prefill_ids = self._prefill_of(text, rendered.ids)
        return rendered

    def initial(self, messages: list[Message], tools: list[dict] | None = None) -> Rendered:
        text = self.render_initial(messages, tools)
        return self._with_prefill(self._encode_with_images(text, content_images(messages)), text)

    def observation(self, messages: list[Message], tools: list[dict] | None = None, *,
                    history: list[Message] | None = None) -> Rendered:
        text, start = self.observation_text(messages, tools, history)
        self._encode_suffix(text, start)  # the boundary must be a token boundary
        return self._with_prefill(self._encode_with_images(text[start:], content_images(messages)), text)

    def check(self, stream_ids: list[int], messages: list[Message], tools: list[dict] | None = None,
              mode: SanityMode | str = SanityMode.STRICT) -> RenderCheck:
        """The text-level re-render writes one image token per image; the stream holds a run per image."""
        collapsed: list[int] = []
        for k, t in enumerate(stream_ids):
            if t != self.image_pad_id or not k or stream_ids[k - 1] != self.image_pad_id:
                collapsed.append(t)
        if not self.mrope:  # LLaVA: adjacent images are one run of k × tokens_per_image tokens
            collapsed = self._expand_runs(collapsed, stream_ids)
        return super().check(collapsed, messages, tools, mode)

    def _expand_runs(self, collapsed: list[int], stream_ids: list[int]) -> list[int]:
        runs = iter(self.placeholder_runs(stream_ids, per_image=False))
        out: list[int] = []
        for t in collapsed:
            out += [t] * max(next(runs) // self.tokens_per_image, 1) if t == self.image_pad_id else [t]
        return out

    def image_token_counts(self, mm_inputs: dict[str, torch.Tensor]) -> list[int]:
        """Placeholder tokens each image's features need: prod(grid_thw) / merge_size² (Qwen VL), the fixed
        tokens_per_image (LLaVA)."""
        grid = mm_inputs.get("image_grid_thw")
        if grid is not None:
            return [int(g.prod()) // self.merge_size**2 for g in grid]
        pixels = mm_inputs.get("pixel_values")
        return [] if pixels is None or self.mrope else [self.tokens_per_image] * pixels.shape[0]

    def placeholder_runs(self, ids: list[int], per_image: bool = True) -> list[int]:
        """Lengths of the image-token runs of `ids`; for LLaVA (`per_image`) a run of adjacent images is split
        into runs of tokens_per_image (what is left over stays a run of its own: a broken image)."""
        runs = _placeholder_runs(ids, self.image_pad_id)
        if self.mrope or not per_image:
            return runs
        out = []
        for n in runs:
            out += [self.tokens_per_image] * (n // self.tokens_per_image) + ([n % self.tokens_per_image]
                                                                            if n % self.tokens_per_image else [])
        return out


def _llava_processor_tokens(processor: Any) -> int:
    """LlavaProcessor's own count: patches of the resized image, + additional tokens, - CLS under `default`."""
    size = processor.image_processor.size
    height, width = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
    n = (height // processor.patch_size) * (width // processor.patch_size) + processor.num_additional_image_tokens
    return n - (1 if processor.vision_feature_select_strategy == "default" else 0)


# ---- the training-side buffer and parity checks -------------------------------------------------------
class ImageBuffer:
    """Both image stores of one trajectory, appended chunk by chunk, merged once per key at the end."""

    def __init__(self) -> None:
        self.images: list[Any] = []  # inference side, stream order
        self.chunks: list[dict[str, torch.Tensor]] = []  # training side, one dict per chunk with images
        self.chunk_images: list[list[str]] = []  # refs of the images each training chunk holds
        self.chunk_digests: list[list[str]] = []  # digests of each image's pixel rows, as the chunk holds them

    def add(self, rendered: Rendered) -> None:
        if not rendered.images:
            return
        self.images.extend(rendered.images)
        self.chunks.append(rendered.mm_inputs)
        self.chunk_images.append([image_ref(im) for im in rendered.images])
        self.chunk_digests.append(pixel_digests(rendered.mm_inputs))

    def merged(self) -> dict[str, torch.Tensor]:
        """One `torch.cat` per key over all chunks (O(total bytes), whatever the number of turns)."""
        if not self.chunks:
            return {}
        return {key: torch.cat([c[key] for c in self.chunks], dim=0) for key in self.chunks[0]}


def check_parity(stream_ids: list[int], buffer: ImageBuffer, merged: dict[str, torch.Tensor],
                 renderer: VisionRenderer) -> str | None:
    """None when the token stream, the training tensors and the inference images agree, else why not."""
    runs = renderer.placeholder_runs(stream_ids)
    needed = renderer.image_token_counts(merged)
    if len(runs) != len(needed):
        return f"the token stream has {len(runs)} image placeholder runs but the training tensors hold {len(needed)} images"
    for k, (have, need) in enumerate(zip(runs, needed, strict=True)):
        if have != need:
            return f"image {k}: {have} placeholder tokens in the stream but its features need {need}"
    inference = [image_ref(im) for im in buffer.images]
    training = [ref for refs in buffer.chunk_images for ref in refs]
    if len(inference) != len(training):
        return f"{len(inference)} images on the inference side but {len(training)} on the training side"
    for k, (a, b) in enumerate(zip(inference, training, strict=True)):
        if a != b:
            return f"image {k} differs between the inference side ({a}) and the training side ({b})"
    if len(inference) != len(needed):
        return f"{len(inference)} images sent to the engine but {len(needed)} in the training tensors"
    for k, im in enumerate(buffer.images):  # stream order: image k's own size gives image k's grid
        need = expected_image_tokens(renderer, im)
        if need != needed[k]:
            return f"image {k} is out of order: its size needs {need} placeholder tokens, the tensors hold {needed[k]}"
    # same-sized images (every geo3k diagram) pass all the counts above in any order: compare pixels
    recorded = [d for digests in buffer.chunk_digests for d in digests]
    for k, (digest, expected) in enumerate(zip(pixel_digests(merged), recorded, strict=False)):
        if digest != expected:
            return (f"image {k} is out of order: the training tensors at its place hold other pixels than "
                    f"image {k} of the stream ({training[k]})")
    return None


def pixel_digests(mm_inputs: dict[str, torch.Tensor]) -> list[str]:
    """A digest of each image's rows of `pixel_values` (t·h·w rows per image; LLaVA: one [3, H, W] per image),
    read in place (no copy)."""
    pixels, grid = mm_inputs.get("pixel_values"), mm_inputs.get("image_grid_thw")
    if pixels is not None and grid is None and pixels.dim() == 4:
        rows = list(pixels.contiguous())
    elif pixels is None or grid is None or int(grid.prod(-1).sum()) != pixels.shape[0]:
        return []
    else:
        rows = pixels.contiguous().split([int(g.prod()) for g in grid])
    return [hashlib.blake2b(r.reshape(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest() for r in rows]


def expected_image_tokens(renderer: VisionRenderer, image: Any) -> int:
    if not renderer.mrope:  # LLaVA resizes every image to the tower's size
        return renderer.tokens_per_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = renderer.processor.image_processor
    width, height = load_image(image).size
    factor = ip.patch_size * ip.merge_size
    min_pixels = getattr(ip, "min_pixels", None) or ip.size.get("shortest_edge")
    max_pixels = getattr(ip, "max_pixels", None) or ip.size.get("longest_edge")
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // ip.patch_size) * (w // ip.patch_size) // ip.merge_size**2


def _placeholder_runs(ids: list[int], pad_id: int) -> list[int]:
    runs, n = [], 0
    for t in ids:
        if t == pad_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


# ---- multimodal rotary positions ---------------------------------------------------------------------
def vl_positions(model: torch.nn.Module, ids: list[int], image_grid_thw: torch.Tensor | None,
                 offset: int = 0) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, 1, T] of a token chunk starting at rotary position `offset`, and the position of
    the token after it. Positions are translation-invariant per chunk, so a delta (e.g. the next turn after
    a cached prefix) gets the same positions as inside the whole sequence."""
    input_ids = torch.tensor([ids])
    vlm: Any = model  # a transformers VLM: config.image_token_id, model.get_rope_index
    mm_token_type_ids = (input_ids == vlm.config.image_token_id).int()
    positions, _ = vlm.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                              image_grid_thw=image_grid_thw)
    positions = positions + offset
    return positions, int(positions.max()) + 1
