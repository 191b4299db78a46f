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
