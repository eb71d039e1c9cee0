"""kvgraph against OpenVINO GenAI's continuous-batching pipeline on this CPU, runs alternating.

The peer engine lives in its own virtualenv and is never a kvgraph dependency. Create it once
(torch first, from the local CPU wheel, so that nothing pulls a CUDA build; optimum-intel pulls a
torchvision that does not load beside that torch, and it is not needed):

    python3 -m venv /work/peers/openvino
    /work/peers/openvino/bin/pip install torch==2.13.0
    /work/peers/openvino/bin/pip install torch==2.13.0 openvino-genai 'optimum-intel[openvino]' transformers
    /work/peers/openvino/bin/pip uninstall -y torchvision

Then, in kvgraph's own environment:

    python benchmarks/peers.py --model llama-56m --repeats 3 [--workloads mixed,decode-heavy]

For each workload (``kvgraph.workloads.make_workload``, seed 0, built as in ``cpu_serving.py``) it
writes the preset's checkpoint (``kvgraph.presets.save_preset``), exports it once to OpenVINO IR in
fp32 (``optimum-cli export openvino --weight-format fp32``, cached under ``--cache-dir/MODEL``,
redone only when the checkpoint's weights change; the export's seconds are reported apart), then
for ``--repeats`` rounds runs, alternating which goes first:

- kvgraph on that checkpoint (built and warmed up once, before the rounds: compile is warm-up),
  every run from an empty prefix cache (``run_kvgraph``), prefix caching off;
- ``benchmarks/peers/run_openvino_genai.py`` in the peer virtualenv (``--peer-python``), a fresh
  process per round: ``ContinuousBatchingPipeline``, paged attention, ``dynamic_split_fuse``,
  prefix caching off, fp32 weights, activations and KV cache (``--dtype bfloat16``: bf16 on both
  sides, the exported fp32 weights cast when each engine loads them; ``--dtype int8``: what a CPU
  user runs quantized, int8 weights with bf16 activations and an 8-bit KV cache: an export with
  ``--weight-format int8`` (every linear layer and the embedding as u8) and OpenVINO's u8 cache
  against kvgraph's torchao ``int8-weight-only`` with the vocabulary projection quantized too and
  an int8 cache); its build and warm-up are timed apart.

Each engine runs every workload once untimed before its timed run (kvgraph once per workload,
OpenVINO once in each of its processes): both build their GEMM kernels for shapes they see the
first time then, which the timed runs should not include. Those runs' seconds are reported.

Both: greedy, exactly the workload's new tokens per request (EOS ignored), every request submitted
at once, ``--threads`` threads, at most ``--max-batch-size`` sequences and 2048 tokens a step.
Prints JSON: per workload each engine's median and per-run seconds, generated tokens/s, kvgraph's
throughput over OpenVINO's, how many requests' greedy outputs agree token for token (random-weight
models can part after near-ties: reported, not asserted), each engine's start-up, and the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.llm import LLM
from kvgraph.ops.linear import cpuinfo
from kvgraph.presets import save_preset
from kvgraph.workloads import Workload, make_workload

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peers" / "run_openvino_genai.py"
DEFAULT_PEER_PYTHON = Path("/work/peers/openvino/bin/python")
DEFAULT_CACHE = Path.home() / ".cache" / "kvgraph" / "peers"
MAX_BATCHED_TOKENS = 2048
# (workload, new tokens), as benchmarks/cpu_serving.py measures them
WORKLOADS = {"mixed": None, "decode-heavy": 128, "shared-prefix": None}
# --dtype -> kvgraph's LLM settings
ENGINE_SETTINGS = {
    "float32": {"dtype": torch.float32},
    "bfloat16": {"dtype": torch.bfloat16},
    # OpenVINO's int8 export compresses the vocabulary projection too (and the embedding)
    "int8": {"dtype": torch.bfloat16, "quantization": "int8-weight-only", "quantize_lm_head": True,
             "kv_cache_dtype": "int8"},
}
VENV_HELP = (
    "python3 -m venv /work/peers/openvino && /work/peers/openvino/bin/pip install torch==2.13.0 && "
    "/work/peers/openvino/bin/pip install torch==2.13.0 openvino-genai 'optimum-intel[openvino]' transformers && "
    "/work/peers/openvino/bin/pip uninstall -y torchvision"
)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def check_peer_python(peer_python: Path) -> None:
    """Exit with one line saying how to create the peer virtualenv when it is missing or broken."""
    if not peer_python.is_file():
        raise SystemExit(f"peer virtualenv missing: no {peer_python}; create it with: {VENV_HELP}")
    probe = subprocess.run([str(peer_python), "-c", "import openvino_genai"], capture_output=True,
                           text=True, env=peer_env())
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"peer virtualenv {peer_python} cannot import openvino_genai ({last}); "
                         f"create it with: {VENV_HELP}")


def peer_env() -> dict:
    """The environment of a peer process: kvgraph's path left out, nothing fetched from a hub."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def build_workload(name: str, requests: int, vocab_size: int, max_new_tokens: int | None) -> Workload:
    """The workload as ``cpu_serving.py`` builds it: ``requests`` for ``mixed``, half for the others."""
    n = requests if name == "mixed" else max(1, requests // 2)
    new = max_new_tokens if max_new_tokens is not None else WORKLOADS[name]
    return make_workload(name, num_requests=n, vocab_size=vocab_size, max_new_tokens=new)


def peer_request(workload: Workload, *, max_batch_size: int, threads: int, dtype: str = "float32") -> dict:
    """What the peer script reads: the workload's prompts and output length, the engine limits."""
    return {
        "prompts": workload.prompts, "max_new_tokens": workload.max_new_tokens,
        "max_num_seqs": max_batch_size, "max_num_batched_tokens": MAX_BATCHED_TOKENS, "threads": threads,
        "warm_runs": 1, "dtype": dtype,
    }


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_checkpoints(model: str, cache_dir: Path, peer_python: Path,
                        weight_format: str = "fp32") -> tuple[Path, Path, float | None]:
    """The preset's Hugging Face checkpoint and its OpenVINO export with ``weight_format`` weights
    (``fp32`` or ``int8``), and the export's seconds (``None`` when an export of the same weights
    was already there)."""
    hf_dir, ov_dir = cache_dir / model / "hf", cache_dir / model / f"openvino-{weight_format}"
    save_preset(model, hf_dir)
    digest = file_digest(hf_dir / "model.safetensors")
    stamp = ov_dir / "kvgraph-checkpoint.sha256"
    if stamp.is_file() and stamp.read_text().strip() == digest and (ov_dir / "openvino_model.xml").is_file():
        return hf_dir, ov_dir, None
    cli = peer_python.parent / "optimum-cli"
    log(f"exporting {hf_dir} to {ov_dir} ({weight_format} weights)")
    start = time.perf_counter()
    subprocess.run(
        [str(cli), "export", "openvino", "--model", str(hf_dir), "--task", "text-generation-with-past",
         "--weight-format", weight_format, str(ov_dir)],
        check=True, env=peer_env(), stdout=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - start
    stamp.write_text(digest + "\n")
    return hf_dir, ov_dir, elapsed


def run_peer(peer_python: Path, ov_dir: Path, request: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        done = subprocess.run(
            [str(peer_python), str(PEER_SCRIPT), "--model-dir", str(ov_dir), "--request", str(path)],
            check=True, env=peer_env(), stdout=subprocess.PIPE, text=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Requests whose outputs are equal token for token, and the tokens the two agree on before
    they first part (summed over requests)."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    common = 0
    for a, b in zip(ours, theirs, strict=True):
        common += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    total = sum(len(a) for a in ours)
    return {"identical_requests": same, "requests": len(ours), "fraction_identical": round(same / len(ours), 4),
            "tokens_before_first_difference": common, "tokens": total}


def machine() -> dict:
    return {
        "cpu": cpuinfo("model name"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
    }


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m", help="a kvgraph preset (default llama-56m)")
    parser.add_argument("--workloads", "--workload", default="mixed,decode-heavy",
                        help=f"comma-separated subset of {', '.join(WORKLOADS)} (default mixed,decode-heavy)")
    parser.add_argument("--requests", type=int, default=64, help="mixed (the others use half; default 64)")
    parser.add_argument("--max-new-tokens", type=int, help="override every workload's output length")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=tuple(ENGINE_SETTINGS), default="float32",
                        help="weights, activations and KV cache of both engines (default float32); int8: "
                        "int8 weights with bf16 activations and an 8-bit KV cache on both (kvgraph: torchao "
                        "int8-weight-only and an int8 cache; OpenVINO: an int8 export and its u8 cache)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-python", type=Path, default=DEFAULT_PEER_PYTHON)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="checkpoints and exports, by model")
    args = parser.parse_args()
    names = [w for w in args.workloads.replace(" ", "").split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; expected a subset of {', '.join(WORKLOADS)}")
    check_peer_python(args.peer_python)

    load_before = os.getloadavg()
    hf_dir, ov_dir, export_s = prepare_checkpoints(args.model, args.cache_dir, args.peer_python,
                                                   "int8" if args.dtype == "int8" else "fp32")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(str(hf_dir), max_batch_size=args.max_batch_size, max_seq_len=1024,
              max_batch_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=False, **ENGINE_SETTINGS[args.dtype])
    built_s = time.perf_counter() - start
    warmup_s = llm.warmup()
    graphs_after_warmup = llm.stats()["compiled_graphs"]
    report = {
        "model": args.model, "checkpoint": str(hf_dir), "openvino_model": str(ov_dir),
        "export_s": None if export_s is None else round(export_s, 2),
        "threads": args.threads, "repeats": args.repeats, "machine": machine(),
        "kvgraph": {"build_s": round(built_s, 3), "warmup_s": round(warmup_s, 3),
                    "startup_s": round(built_s + warmup_s, 3), "prefix_caching": False,
                    "dtype": str(llm.params.dtype), "settings": {k: str(v) for k, v in ENGINE_SETTINGS[args.dtype].items()}},
        "workloads": {},
    }
    peer_info = None
    for name in names:
        workload = build_workload(name, args.requests, llm.vocab_size, args.max_new_tokens)
        request = peer_request(workload, max_batch_size=args.max_batch_size, threads=args.threads,
                               dtype=args.dtype)
        tokens = len(workload.prompts) * workload.max_new_tokens
        kvgraph_first_s = run_kvgraph(llm, workload)[0].elapsed_s  # untimed, as the peer's warm run
        runs = {"kvgraph_s": [], "openvino_s": [], "openvino_build_s": [], "openvino_warmup_s": []}
        untimed = {"kvgraph": [round(kvgraph_first_s, 4)], "openvino": []}
        outputs = {"kvgraph": [], "openvino": []}
        order = []
        for repeat in range(args.repeats):
            first = ("kvgraph", "openvino") if repeat % 2 == 0 else ("openvino", "kvgraph")
            order.append(list(first))
            for engine in first:
                if engine == "kvgraph":
                    ours, _ = run_kvgraph(llm, workload)
                    runs["kvgraph_s"].append(ours.elapsed_s)
                    outputs["kvgraph"].append(ours.outputs)
                else:
                    peer = run_peer(args.peer_python, ov_dir, request)
                    runs["openvino_s"].append(peer["wall_s"])
                    runs["openvino_build_s"].append(peer["build_s"])
                    runs["openvino_warmup_s"].append(peer["warmup_s"])
                    untimed["openvino"] += peer["untimed_runs_s"]
                    outputs["openvino"].append(peer.pop("outputs"))
                    if sum(peer["generated_tokens"]) != tokens:
                        raise SystemExit(f"OpenVINO generated {sum(peer['generated_tokens'])} tokens, not {tokens}")
                    peer_info = {k: peer[k] for k in ("engine", "versions", "device", "scheduler",
                                                      "properties_requested", "properties_resolved")}
            log(f"{name} #{repeat}: kvgraph {runs['kvgraph_s'][-1]:.3f} s, openvino {runs['openvino_s'][-1]:.3f} s")
        kv_s, ov_s = median(runs["kvgraph_s"]), median(runs["openvino_s"])
        report["workloads"][name] = {
            "requests": len(workload.prompts), "prompt_tokens": workload.prompt_tokens,
            "new_tokens_per_request": workload.max_new_tokens, "generated_tokens": tokens,
            "kvgraph_s": kv_s, "openvino_s": ov_s,
            "kvgraph_s_runs": [round(t, 4) for t in runs["kvgraph_s"]],
            "openvino_s_runs": [round(t, 4) for t in runs["openvino_s"]],
            "kvgraph_tokens_per_s": round(tokens / kv_s, 1), "openvino_tokens_per_s": round(tokens / ov_s, 1),
            "kvgraph_vs_openvino_throughput": round(ov_s / kv_s, 3),
            "kvgraph_vs_openvino_throughput_runs": [
                round(o / k, 3) for o, k in zip(runs["openvino_s"], runs["kvgraph_s"], strict=True)
            ],
            "order_runs": order,
            "untimed_first_runs_s": untimed,
            "outputs_agree": agreement(outputs["kvgraph"][0], outputs["openvino"][0]),
            "outputs_same_across_repeats": {
                engine: all(o == seen[0] for o in seen) for engine, seen in outputs.items()
            },
            "openvino_startup_s": {
                "build_s_runs": [round(t, 3) for t in runs["openvino_build_s"]],
                "warmup_s_runs": [round(t, 3) for t in runs["openvino_warmup_s"]],
                "startup_s": median([b + w for b, w in zip(runs["openvino_build_s"],
                                                          runs["openvino_warmup_s"], strict=True)]),
            },
        }
    report["openvino"] = peer_info
    report["kvgraph"]["compiled_graphs_after_warmup"] = graphs_after_warmup
    report["kvgraph"]["recompiles_after_warmup"] = llm.stats()["compiled_graphs"] - graphs_after_warmup
    report["load_average_1m"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
