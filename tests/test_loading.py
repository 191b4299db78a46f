"""turnrl.loading: one loader for user code named by module or file (envs, agents, tools, plugins, rewards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes import ScriptedEngine

from turnrl.loading import LoadError, load_module, load_object, module_name_for

REPO = Path(__file__).resolve().parents[1]  # the subprocess imports this checkout's turnrl


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader appends folders; undo that per test


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


COUNTED = """
    from pathlib import Path

    from turnrl.tools import function_tool

    Path(__file__).with_suffix(".runs").open("a").write("ran\\n")

    @function_tool
    def ping(x: int) -> int:
        \"\"\"Echo x.\"\"\"
        return x
"""


def test_a_file_given_as_plugin_and_as_tool_file_runs_once(tmp_path, monkeypatch, qwen3_tokenizer):
    """Before loading.py, the plugin importer and the tool-file importer named modules differently, so a file
    listed in both (here: by a relative and by an absolute path) ran twice."""
    from turnrl.build import build_rollout_manager
    from turnrl.config import RolloutConfig
    from turnrl.render import ChatRenderer

    tools = write(tmp_path / "both" / "shared_tools.py", COUNTED)
    monkeypatch.chdir(tmp_path)
    cfg = RolloutConfig(agent="tool_agent", plugins=["both/shared_tools.py"], tools=[str(tools)])
    build_rollout_manager(cfg, ScriptedEngine(qwen3_tokenizer, lambda *a: "ok"), ChatRenderer(qwen3_tokenizer))
    build_rollout_manager(cfg, ScriptedEngine(qwen3_tokenizer, lambda *a: "ok"), ChatRenderer(qwen3_tokenizer))
    assert tools.with_suffix(".runs").read_text() == "ran\n"


def test_module_names_are_stable_across_processes(tmp_path):
    path = write(tmp_path / "stable_env.py", "X = 1\n")
    here = load_module(str(path), what="environment").__name__
    assert here == module_name_for(path) and here.startswith("turnrl_user_stable_env_")
    script = f"from turnrl.loading import load_module; print(load_module({str(path)!r}).__name__)"
    for seed in ("1", "2"):  # hash() would differ between these two
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, cwd=REPO)
        assert out.stdout.strip() == here


def test_relative_and_absolute_paths_are_one_module(tmp_path, monkeypatch):
    path = write(tmp_path / "once.py", COUNTED)
    monkeypatch.chdir(tmp_path)
    assert load_module("once.py") is load_module(str(path)) is load_module(str(tmp_path / "." / "once.py"))
    assert load_object("once.py:ping") is load_object(f"{path}:ping")
    assert path.with_suffix(".runs").read_text() == "ran\n"


def test_sibling_imports_and_a_sibling_loaded_later_is_not_rerun(tmp_path):
    write(tmp_path / "envs" / "base_env_s10.py", """
        from pathlib import Path
        Path(__file__).with_suffix(".runs").open("a").write("ran\\n")
        class BaseEnv:
            pass
    """)
    write(tmp_path / "envs" / "my_env.py", """
        from base_env_s10 import BaseEnv
        class MyEnv(BaseEnv):
            pass
        def build_env(sample, config):
            return MyEnv()
    """)
    factory = load_object(f"{tmp_path}/envs/my_env.py:build_env", what="environment")
    base = load_module(str(tmp_path / "envs" / "base_env_s10.py"), what="plugin")
    assert isinstance(factory({}, {}), base.BaseEnv)  # one BaseEnv class, not two
    assert (tmp_path / "envs" / "base_env_s10.runs").read_text() == "ran\n"


def test_slime_layout_imports_its_package_from_the_current_directory(tmp_path, monkeypatch):
    """slime's examples/x/env.py does `from examples.x.base_env import ...` and runs from the repo root."""
    write(tmp_path / "slimerepo_s10" / "geo" / "base_env.py", "class Base:\n    pass\n")
    write(tmp_path / "slimerepo_s10" / "geo" / "env.py", """
        from slimerepo_s10.geo.base_env import Base
        def build_env(sample, config):
            return Base()
    """)
    monkeypatch.chdir(tmp_path)
    from turnrl.envs.base import load_env_factory

    assert type(load_env_factory("slimerepo_s10/geo/env.py")({}, {})).__name__ == "Base"


def test_dotted_modules_and_their_errors():
    from turnrl.envs import arithmetic

    assert load_object("turnrl.envs.arithmetic:build_env", what="environment") is arithmetic.build_env
    with pytest.raises(ModuleNotFoundError, match=r"agent 'no_such_mod_s10': cannot import module 'no_such_mod_s10'"):
        load_module("no_such_mod_s10", what="agent")
    with pytest.raises(AttributeError, match=r"reward 'turnrl.envs.arithmetic:nope': .*arithmetic.py has no "
                                             r"attribute 'nope'; it defines .*build_env"):
        load_object("turnrl.envs.arithmetic:nope", what="reward")
    with pytest.raises(ValueError, match=r"scheduler 'x.py': expected path/file.py:name or package.module:name"):
        load_object("x.py", what="scheduler")


def test_file_errors_name_the_file_and_leave_nothing_behind(tmp_path):
    missing = tmp_path / "missing.py"
    with pytest.raises(FileNotFoundError, match=rf"plugin file {missing} does not exist"):
        load_module(str(missing), what="plugin")
    lib = write(tmp_path / "lib.py", "X = 1\nY = 2\ndef helper():\n    pass\nclass Tool:\n    pass\n")
    with pytest.raises(AttributeError, match=r"tool '.*lib.py:Nope': .*lib.py has no attribute 'Nope'; "
                                             r"it defines Tool, helper$"):
        load_object(f"{lib}:Nope", what="tool")
    with pytest.raises(AttributeError, match=r"lib.py has a int named 'X', not a function or class; it defines"):
        load_object(f"{lib}:X", what="tool")

    bad = write(tmp_path / "bad_syntax.py", "x = 1\ndef f(:\n")
    broken = write(tmp_path / "broken_import.py", "import json\nfrom no_such_pkg_s10 import thing\n")
    raising = write(tmp_path / "raising.py", "raise RuntimeError('boom at import')\n")
    path_before, modules_before = list(sys.path), set(sys.modules)
    with pytest.raises(LoadError, match=rf"agent file {bad}: syntax error at {bad}:2: "):
        load_module(str(bad), what="agent")
    with pytest.raises(LoadError, match=rf"plugin file {broken}: an import inside it failed: "
                                        r"No module named 'no_such_pkg_s10' \(the file's folder"):
        load_module(str(broken), what="plugin")
    with pytest.raises(RuntimeError, match="boom at import") as info:
        load_module(str(raising), what="environment")
    assert info.value.__notes__ == [f"raised while loading environment file {raising}"]
    assert sys.path == path_before
    assert not {m for m in set(sys.modules) - modules_before if m.startswith("turnrl_user_")}
    raising.write_text("OK = True\n")  # fixed: a second try loads it (nothing stale was cached)
    assert load_module(str(raising)).OK


def test_unknown_env_name_lists_the_built_ins_and_suggests(tmp_path, monkeypatch):
    from turnrl.envs.base import load_env_factory

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r"unknown environment 'geo3kk': not a built-in "
                                                  r"\(arithmetic, geo3k, single_turn\).*did you mean 'geo3k'\?"):
        load_env_factory("geo3kk")
    write(tmp_path / "my_env_s10.py", "def build_env(sample, config):\n    return None\n")
    with pytest.raises(ModuleNotFoundError, match=r"did you mean 'my_env_s10.py'\?"):
        load_env_factory("my_env_s10")
    with pytest.raises(AttributeError, match=r"environment 'turnrl.render:build_env': .*render.py has no "
                                             r"build_env\(sample, config\) function; it defines ChatRenderer"):
        load_env_factory("turnrl.render")


def test_agent_scheduler_and_reward_specs_go_through_the_loader(tmp_path):
    from turnrl.agents import load_agent
    from turnrl.agents.scheduler import get_scheduler
    from turnrl.rewards import load_reward_fn

    user = write(tmp_path / "user_code.py", """
        from turnrl.agents.scheduler import MultiTurnScheduler

        async def my_agent(ctx, sample):
            return None

        class MySched(MultiTurnScheduler):
            pass

        def my_reward(response):
            return float(len(response))
    """)
    assert load_agent(f"fast={user}:my_agent")[0] == "fast"
    assert load_agent(f"{user}:my_agent")[0] == "my_agent"
    assert get_scheduler(f"{user}:MySched").__name__ == "MySched"
    with pytest.raises(AttributeError, match="is not a class"):
        get_scheduler(f"{user}:my_agent")
    assert load_reward_fn(f"{user}:my_reward").__name__ == f"{user}:my_reward"
    with pytest.raises(AttributeError, match=r"agent '.*user_code.py:nope': .* it defines MySched, my_agent, "
                                             r"my_reward"):
        load_agent(f"{user}:nope")


def test_a_partial_builtin_model_folder_is_replaced_by_a_complete_one(tmp_path, monkeypatch):
    from turnrl import models

    monkeypatch.setenv("TURNRL_CACHE_DIR", str(tmp_path))
    partial = tmp_path / "models" / "tiny-qwen3"
    partial.mkdir(parents=True)
    (partial / "tokenizer.json").write_text("{}")  # a folder with a tokenizer and no model (the CI cache had one)
    path = Path(models.resolve_model("tiny-qwen3"))
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # nothing left aside


RANKS_RESOLVE = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from turnrl.models import resolve_model
import time
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    time.sleep(3)  # rank 1 reaches the empty cache first
path = Path(resolve_model("tiny-qwen3"))
print(json.dumps({"rank": dist.get_rank(), "complete": (path / "config.json").exists()
                  and (path / "model.safetensors").exists()}))
dist.barrier()
dist.destroy_process_group()
"""


def test_two_ranks_on_a_cold_cache_both_get_the_complete_builtin_model(tmp_path):
    # transformers' save_pretrained writes nothing on ranks other than 0: a rank 1 that built the model itself
    # used to publish a folder without config.json or weights, which the other rank then failed to load
    script = tmp_path / "resolve.py"
    script.write_text(RANKS_RESOLVE)
    env = {**os.environ, "TURNRL_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    results = sorted(json.loads(line)["complete"] for line in out.stdout.splitlines() if line.startswith("{"))
    assert results == [True, True]


def test_a_package_of_the_current_directory_loads_when_another_thread_put_it_on_sys_path_first(tmp_path, monkeypatch):
    """Env factories load on threads: one thread's import fails, another appends the current directory to
    sys.path and imports, then the first must retry instead of raising (failed once in CI: env_error at start)."""
    import importlib

    write(tmp_path / "racepkg_s35" / "mod.py", "VALUE = 35\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path.resolve()))])
    real = importlib.import_module
    calls = []

    def racing(name, package=None):
        calls.append(name)
        if len(calls) == 1:  # this thread's first try failed; meanwhile the other thread added the directory
            sys.path.append(str(tmp_path.resolve()))
            raise ModuleNotFoundError(f"No module named {name.partition('.')[0]!r}", name=name.partition(".")[0])
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", racing)
    assert load_module("racepkg_s35.mod", what="interaction").VALUE == 35
    assert calls == ["racepkg_s35.mod", "racepkg_s35.mod"]
