"""One timed run of OpenVINO GenAI's ``ContinuousBatchingPipeline`` on prompts given as token ids.

Runs inside the peer virtualenv (``benchmarks/peers.py`` says how to create it) and imports nothing
of kvgraph; ``benchmarks/peers.py`` starts it once per round:

    /work/peers/openvino/bin/python benchmarks/peers/run_openvino_genai.py --model-dir OV_DIR --request REQ.json

``OV_DIR`` is a model exported by ``optimum-cli export openvino --weight-format fp32`` (or
``int8``; with its converted tokenizer). ``REQ.json`` holds ``prompts`` (lists of token ids), ``max_new_tokens``,
``max_num_seqs``, ``max_num_batched_tokens``, ``threads`` and ``dtype``. The pipeline: paged attention,
``dynamic_split_fuse``, prefix caching off, the request's ``dtype`` (fp32 by default, or bf16) for
weights and activations (``INFERENCE_PRECISION_HINT``)
and KV cache (``KV_CACHE_PRECISION``, ``KEY_CACHE_PRECISION``, ``VALUE_CACHE_PRECISION``); ``int8``:
bf16 inference over the int8 weights of the export and a u8 KV cache (the CPU plugin's default), greedy,
exactly ``max_new_tokens`` per request (EOS ignored), every request submitted at once in one
``generate`` call. Before the timed call, a warm-up like ``LLM.warmup`` (3 short requests) and,
with ``warm_runs`` in the request, that many untimed runs of the whole workload (as the driver
gives kvgraph); the pipeline's build and the warm-up are timed apart. Prints one JSON object on stdout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from runs import (  # benchmarks/peers/runs.py, beside this script
    kv_cache_gb,
    read_request,
    timed_run,
)

# request dtype -> (OpenVINO inference type, KV cache type, KV bytes per element); "int8": a model
# exported with int8 weights, bf16 inference and the CPU plugin's default u8 KV cache
PRECISIONS = {"float32": ("f32", "f32", 4), "bfloat16": ("bf16", "bf16", 2), "int8": ("bf16", "u8", 1)}
KV_KEYS = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION")
PRECISION_KEYS = (*KV_KEYS, "INFERENCE_PRECISION_HINT")
REPORTED_KEYS = (*PRECISION_KEYS, "INFERENCE_NUM_THREADS", "NUM_STREAMS", "PERFORMANCE_HINT")


def properties(threads: int, dtype: str) -> dict:
    infer, kv, _ = PRECISIONS[dtype]
    return {**{key: kv for key in KV_KEYS}, "INFERENCE_PRECISION_HINT": infer, "INFERENCE_NUM_THREADS": threads}


def scheduler_config(request: dict, cache_gb: int) -> ov_genai.SchedulerConfig:
    config = ov_genai.SchedulerConfig()
    config.cache_size = cache_gb
    config.max_num_batched_tokens = request["max_num_batched_tokens"]
    config.max_num_seqs = request["max_num_seqs"]
    config.dynamic_split_fuse = True
    config.enable_prefix_caching = False
    return config


def greedy(max_new_tokens: int) -> ov_genai.GenerationConfig:
    config = ov_genai.GenerationConfig()
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = max_new_tokens
    config.ignore_eos = True
    return config


def generate(pipe, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
    configs = [greedy(max_new_tokens)] * len(prompts)
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    elapsed = time.perf_counter() - start
    return [list(r.m_generation_ids[0]) for r in results], elapsed


def resolved_properties(model_dir: Path, props: dict) -> dict:
    """What the CPU plugin makes of ``props`` (the pipeline compiles its model with the same ones;
    it does not expose its compiled model, so this compiles the exported model once more)."""
    compiled = ov.Core().compile_model(model_dir / "openvino_model.xml", "CPU", props)
    out = {}
    for key in REPORTED_KEYS:
        try:
            value = compiled.get_property(key)
        except RuntimeError:
            out[key] = None
            continue
        out[key] = value.to_string() if isinstance(value, ov.Type) else str(value)
    return out


def main() -> None:
    model_dir, request = read_request(__doc__.splitlines()[0])
    prompts, new = request["prompts"], request["max_new_tokens"]
    dtype = request["dtype"]
    cache_gb = kv_cache_gb(model_dir, prompts, new, PRECISIONS[dtype][2], page_tokens=32)
    props = properties(request["threads"], dtype)

    start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(
        model_dir, scheduler_config(request, cache_gb), "CPU", props
    )
    build_s = time.perf_counter() - start
    run = timed_run(generate, pipe, prompts, new, request["warm_runs"])

    print(json.dumps({
        "engine": "openvino-genai ContinuousBatchingPipeline",
        "versions": {"openvino": ov.__version__, "openvino_genai": ov_genai.__version__},
        "device": ov.Core().get_property("CPU", "FULL_DEVICE_NAME"),
        "build_s": round(build_s, 4), **run,
        "scheduler": {
            "cache_size_gb": cache_gb, "max_num_batched_tokens": request["max_num_batched_tokens"],
            "max_num_seqs": request["max_num_seqs"], "dynamic_split_fuse": True,
            "enable_prefix_caching": False,
        },
        "properties_requested": props,
        "properties_resolved": resolved_properties(model_dir, props),
    }))


if __name__ == "__main__":
    main()
