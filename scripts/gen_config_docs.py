"""Write docs/config.md from the typed config (turnrl/config.py): every key, its type, default and doc line.

    python scripts/gen_config_docs.py           # rewrite docs/config.md
    python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md differs from the schema (CI runs this)

The schema is the source of truth: a key added, renamed or re-documented in turnrl/config.py changes this page,
and tests/test_docs.py fails until the page is regenerated.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

<!-- Generated from turnrl/config.py by scripts/gen_config_docs.py; do not edit by hand (CI checks it). -->

`turnrl train CONFIG.yaml [key=value ...]` reads a `TrainConfig`: a YAML file whose keys are below, with dotted
overrides on the command line (`algo.clip_high=0.28`, `rollout.sampling.temperature=0.7`; values are parsed as
YAML). `turnrl eval` reads the same file. `turnrl serve --rollout-config FILE.yaml` reads a `RolloutConfig`: the
keys of the `rollout` section below, at the top level of its file. An unknown key or a value of the wrong type
fails at once, naming the dotted key, what was given and what was expected (a misspelt key gets a suggestion).

A minimal training config:

```yaml
model: smollm2-135m-instruct          # built-in name, local Hugging Face directory, or hub id
train_data: data/arithmetic/train.jsonl
eval_data: data/arithmetic/eval.jsonl
output_dir: runs/arithmetic           # each run writes runs/arithmetic/<timestamp>/
rollout: {env: arithmetic, n: 4, max_turns: 3}
reward: {function: env}
```

Types: `a | b` is either; `"x" | "y"` is one of these strings; `null` is YAML's null (Python's None). A
constraint such as `>= 1` is checked when the file loads.
"""


def type_name(annotation: Any) -> str:
    """A YAML user's reading of a type annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def constraints(field: FieldInfo) -> str:
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{symbols[name]} {getattr(m, name)}" for m in field.metadata for name in symbols if hasattr(m, name)]
    return f" ({', '.join(parts)})" if parts else ""


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def doc_text(field: FieldInfo) -> str:
    return _cell(" ".join((field.description or "").split())) or "—"


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: its pipes escaped."""
    return text.replace("|", "\\|")


def sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted prefix, model) for `model` and every section under it, in field order."""
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub = field.annotation
        subs = [a for a in typing.get_args(sub) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            subs = [sub]
        for s in subs:
            found += sections(s, f"{prefix}{name}.")
    return found


def table(prefix: str, model: type[BaseModel]) -> str:
    title = f"`{prefix[:-1]}`" if prefix else "Top level"
    doc = " ".join((model.__doc__ or "").split()) if model.__doc__ and model.__doc__ != BaseModel.__doc__ else ""
    lines = [f"## {title} (`{model.__name__}`)", ""]
    if doc and not doc.startswith("!!!"):
        lines += [doc, ""]
    lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        kind, default = _cell(type_name(field.annotation)) + constraints(field), _cell(default_text(field))
        lines.append(f"| `{prefix}{name}` | {kind} | {default} | {doc_text(field)} |")
    return "\n".join(lines)


def _field_key(field: FieldInfo) -> tuple:
    """What the page shows of a field (a subclass's FieldInfo of an inherited key is a copy, never ==)."""
    return (field.annotation, repr(field.default), field.default_factory, field.description, repr(field.metadata))


def variants(base: type[BaseModel]) -> str:
    """Configs of other commands that extend `base` (e.g. `turnrl sft`'s): the keys they add or redefine."""
    import turnrl.config as config

    out = []
    for cls in sorted({c for c in vars(config).values() if isinstance(c, type) and issubclass(c, base)
                       and c is not base}, key=lambda c: c.__name__):
        own = [n for n, f in cls.model_fields.items()
               if n not in base.model_fields or _field_key(f) != _field_key(base.model_fields[n])]
        doc = " ".join((cls.__doc__ or "").split())
        lines = [f"## `{cls.__name__}`: the keys above, and", "", doc, "",
                 "| key | type | default | what it does |", "|---|---|---|---|"]
        for name in own:
            field = cls.model_fields[name]
            kind, default = _cell(type_name(field.annotation)) + constraints(field), _cell(default_text(field))
            lines.append(f"| `{name}` | {kind} | {default} | {doc_text(field)} |")
        subs = [(p, m) for name in own for p, m in sections(cls)[1:] if p.split(".")[0] == name]
        out.append("\n".join(lines) + "".join("\n\n" + table(p, m) for p, m in subs))
    return "".join("\n\n" + part for part in out)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from turnrl.config import TrainConfig

    return HEADER + "\n" + "\n\n".join(table(p, m) for p, m in sections(TrainConfig)) + variants(TrainConfig) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is not what the schema gives")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date with turnrl/config.py: run python scripts/gen_config_docs.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} matches turnrl/config.py")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
