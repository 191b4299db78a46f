"""docs/config.md is generated from the typed config (scripts/gen_config_docs.py): it cannot drift from it."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

import turnrl.config as config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"


def test_docs_config_md_is_what_the_schema_generates():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\nregenerate it: python scripts/gen_config_docs.py"


def test_every_key_of_every_section_has_a_row_with_its_type_default_and_doc():
    text = (ROOT / "docs" / "config.md").read_text()
    text = text.split(": the keys above, and")[0]  # TrainConfig's tables (another command's may redefine a key)
    gen = runpy.run_path(str(SCRIPT))
    for prefix, model in gen["sections"](config.TrainConfig):
        for name, field in model.model_fields.items():
            [row] = [line for line in text.splitlines() if line.startswith(f"| `{prefix}{name}` |")]
            cells = row.split(" | ")
            assert cells[3].rstrip(" |") != "—", f"{prefix}{name} has no doc line in turnrl/config.py"
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                assert cells[2].startswith(("`", "**required**")), row  # a default, or marked required
    assert "| `algo.clip_high` | float (>= 0) | `0.2` | Ratio clipped above at 1 + clip_high" in text
    assert '| `trainer.mode` | "sync" \\| "async" | `"sync"` |' in text


def test_a_key_added_to_the_schema_fails_the_check(monkeypatch):
    from pydantic import Field

    class ExtraConfig(config.TrainConfig):
        """A command's config that extends TrainConfig."""

        turnrl_new_key: int = Field(3, ge=1)
        """A key the page does not list yet."""

    monkeypatch.setattr(config, "ExtraConfig", ExtraConfig, raising=False)
    gen = runpy.run_path(str(SCRIPT))
    rendered = gen["render"]()
    assert "| `turnrl_new_key` | int (>= 1) | `3` | A key the page does not list yet. |" in rendered
    assert rendered != (ROOT / "docs" / "config.md").read_text()  # what --check compares: it would fail


def test_the_openai_agent_readme_says_stop_strings_work():
    """They do, of any length (tests/test_serve_apis.py sends multi-token ones through the proxy); the README
    said they were refused."""
    text = " ".join((ROOT / "examples" / "openai_agent" / "README.md").read_text().split())
    assert "`stop` strings are refused" not in text and "`stop` strings of any length" in text


def test_the_readme_tree_names_every_module_and_folder():
    """README's architecture tree is how a newcomer finds a file: every folder and public module is in it."""
    text = (ROOT / "README.md").read_text()
    tree = text.split("## Architecture", 1)[1].split("```")[1]
    package = ROOT / "turnrl"
    names = {p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")} - {"templates"}
    names |= {p.name for p in package.rglob("*.py") if not p.name.startswith("_")}
    missing = sorted(name for name in names if name.removesuffix(".py") not in tree)
    assert not missing, f"README.md's architecture tree leaves out {missing}"
