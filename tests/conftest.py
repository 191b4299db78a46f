import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TURNRL_CACHE_DIR", str(Path.home() / ".cache" / "turnrl"))
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from turnrl.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


@pytest.fixture(scope="session")
def smol_tokenizer():
    from turnrl.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from turnrl.models import load_model

    return load_model("tiny-qwen3")


@pytest.fixture()
def host_refusing_namespaces(monkeypatch, tmp_path):
    """The sandbox's child program under a seccomp filter refusing unshare(2), as a container's default policy
    does: the kernel itself says no to every namespace and mount the sandbox asks for."""
    from turnrl.tools import sandbox

    child = sandbox._CHILD_PROGRAM
    wrapper = tmp_path / "child_without_namespaces.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        f"sys.path.insert(0, {os.path.dirname(child)!r})\n"
        "import _sandbox_kernel\n"
        "del sys.path[0]\n"
        "_sandbox_kernel.seccomp_deny(['unshare'])\n"
        f"sys.argv[0] = {child!r}\n"
        f"runpy.run_path({child!r}, run_name='__main__')\n"
    )
    monkeypatch.setattr(sandbox, "_CHILD_PROGRAM", str(wrapper))


@pytest.fixture(scope="module")
def zoo():
    """The template zoo's directory (tests/template_zoo.py); skips when its sdist cannot be fetched."""
    from template_zoo import ZooUnavailable, fetch_zoo

    try:
        return fetch_zoo()
    except ZooUnavailable as e:
        pytest.skip(f"the llama-cpp-python sdist (chat templates, vocab GGUFs) could not be fetched: {e}")
