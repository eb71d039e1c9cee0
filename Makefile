# kvgraph build entry points. `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Pin torch before anything else so that pip never resolves a bare `torch` into the CUDA build.
TORCH  := torch==2.13.0

.PHONY: install test demo lint bench clean fuzz soak gpu

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

# On a CUDA machine, with a Python whose torch has CUDA and Triton (not the CPU-only venv): the
# Triton kernels compiled (each kernel's first config; at most 4 workers, as the long-context cases
# take GiBs each), the other GPU-marked tests, then decode timings over an fp32, int8 and float8
# cache. Logs and JSON go to $(GPU_OUT).
GPU_PYTHON ?= python3
GPU_OUT    ?= gpu-results
gpu:
	mkdir -p $(GPU_OUT)
	-KVGRAPH_TRITON_AUTOTUNE=0 PYTHONPATH=. $(GPU_PYTHON) -m pytest -q -n 4 -p no:cacheprovider --tb=short \
		tests/ops/triton tests/ops/test_attention.py::test_cuda_op_matches_golden > $(GPU_OUT)/triton-tests.log 2>&1
	-PYTHONPATH=. $(GPU_PYTHON) -m pytest -q -m gpu -p no:cacheprovider --tb=short --continue-on-collection-errors \
		--ignore=tests/ops/triton \
		tests > $(GPU_OUT)/gpu-tests.log 2>&1
	for d in auto int8 fp8_e4m3; do KVGRAPH_TRITON_AUTOTUNE=0 PYTHONPATH=. $(GPU_PYTHON) benchmarks/attention.py \
		--dtype float32 --batches 64 --contexts 512,4096 --prefill-batch 1 --prefill-lengths 512 \
		--kv-cache-dtype $$d > $(GPU_OUT)/attention-fp32-$$d.json || exit 1; done
	tail -n 1 $(GPU_OUT)/triton-tests.log $(GPU_OUT)/gpu-tests.log

demo: $(STAMP)
	$(BIN)/kvgraph generate --model llama-tiny --prompt "Hello from kvgraph" \
		--prompt "Paged attention with continuous batching" --max-new-tokens 32 --compare-hf

lint: $(STAMP)
	$(BIN)/ruff check kvgraph tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
