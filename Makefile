# kvgraph build entry points. `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Pin torch before anything else so that pip never resolves a bare `torch` into the CUDA build.
TORCH  := torch==2.13.0

.PHONY: install test demo lint bench clean fuzz soak

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check kvgraph tests benchmarks
	$(BIN)/python -m pytest -q

# Lowering fuzz over the whole module space (CI runs 300 examples of a pairwise-covering subset).
fuzz: $(STAMP)
	KVGRAPH_FUZZ_PROFILE=lowering-fuzz $(BIN)/python -m pytest -q --timeout=0 tests/passes/test_fuzz_lowering.py

# 1000 requests through the engine with random aborts and preemption (CI runs 100).
soak: $(STAMP)
	KVGRAPH_SOAK_REQUESTS=1000 $(BIN)/python -m pytest -q --timeout=0 tests/engine/test_soak.py

demo: $(STAMP)
	$(BIN)/kvgraph generate --model llama-tiny --prompt "Hello from kvgraph" \
		--prompt "Paged attention with continuous batching" --max-new-tokens 32 --compare-hf

lint: $(STAMP)
	$(BIN)/ruff check kvgraph tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
