# kvgraph build entry points. `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Pin torch before anything else so that pip never resolves a bare `torch` into the CUDA build.
TORCH  := torch==2.13.0

.PHONY: install test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check kvgraph passes kernels tests benchmarks
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/kvgraph generate --model llama-tiny --prompt "Hello from kvgraph" \
		--prompt "Paged attention with continuous batching" --max-new-tokens 32 --compare-hf

lint: $(STAMP)
	$(BIN)/ruff check kvgraph passes kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
