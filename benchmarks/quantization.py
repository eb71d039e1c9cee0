"""Weight-only int8 on the CPU: float32, bfloat16 and int8 weights (bfloat16 activations) in one process.

    python benchmarks/quantization.py --model llama-56m [--repeats 5] [--requests 32] [--decode-tokens 128]

Variants (``--variants``): ``fp32`` (the preset as built), ``bf16`` (the activation dtype of the
int8 model, unquantized: what quantization alone changes), ``int8`` (``quantization=
"int8-weight-only"``) and ``int8+lm_head`` (``quantize_lm_head=True`` too); on request, ``int8-unfrozen``
(``freeze_weights=False``: weights as graph inputs, so the graphs are precompiled) and
``int8+lm_head-frozen`` (``freeze_weights=True``). Every variant is its own ``kvgraph.LLM`` of the
same seeded weights, compiled with Inductor, its weights frozen or not as the engine decides by
default (``kvgraph.engine.config.resolve_freeze_weights``: fp32 and ``int8+lm_head`` unfrozen, the
others frozen) unless named otherwise, and warmed up
before anything is timed (``LLM.warmup``: its graphs compiled, one for ``T >= 1`` where the model
is precompiled, else ``T > 1`` and ``T == 1``; its seconds are reported as ``warmup_s``, not timed).

1. ``decode``: batch-1 decode of one 32-token prompt for ``--decode-tokens`` tokens; the variants take
   turns in every repeat (fp32, bf16, int8, ..., then again), and each run's decode tokens/s comes
   from the engine's stats (decode steps only). Medians and the ratio to fp32.
2. ``workloads``: ``decode-heavy`` and ``mixed`` (``kvgraph.workloads``) end to end, variants taking
   turns the same way; every run starts from an empty prefix cache (``LLM.reset_prefix_cache`` in
   ``kvgraph/entrypoints/cli/bench.py::run_kvgraph``, which raises if a run would begin warm).
3. ``weight_bytes``: the parameters as stored (int8 data and scales for a quantized weight).
4. ``quality`` against fp32 (``kvgraph/entrypoints/cli/quality.py``): the largest logit error and
   the mean log-likelihood over a fixed 128-token stream, the share of equal next-token picks there,
   and the greedy agreement (leading tokens equal to fp32's) of each decode run.

Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvgraph.engine.quantization import weight_bytes
from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.cli.quality import agreement, quality
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload

VARIANTS = {
    "fp32": {},
    "bf16": {"dtype": torch.bfloat16},
    "int8": {"dtype": torch.bfloat16, "quantization": "int8-weight-only"},
    "int8+lm_head": {"dtype": torch.bfloat16, "quantization": "int8-weight-only", "quantize_lm_head": True},
    # Against the default: unfrozen weights are graph inputs, so the graphs are precompiled (no Dynamo
    # frame per step); frozen ones are constants folded into the graph.
    "int8-unfrozen": {"dtype": torch.bfloat16, "quantization": "int8-weight-only", "freeze_weights": False},
    "int8+lm_head-frozen": {"dtype": torch.bfloat16, "quantization": "int8-weight-only", "quantize_lm_head": True,
                            "freeze_weights": True},
}
WORKLOADS = ("decode-heavy", "mixed")
PROMPT_TOKENS = 32
STREAM_TOKENS = 128


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_run(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Batch-1 decode tokens/s of one greedy run of ``prompt`` (cold prefix cache), and its tokens."""
    from kvgraph.engine import SamplingParams

    llm.reset_prefix_cache()
    llm.reset_stats()
    (done,) = llm.generate([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return llm.stats()["decode_tokens_per_s"], done.token_ids


def median_row(runs: list[float], base: list[float] | None, digits: int = 2) -> dict:
    """Median of ``runs``, the runs themselves, and the ratio of the median to ``base``'s."""
    med = statistics.median(runs)
    row = {"median": round(med, digits), "runs": [round(r, digits) for r in runs]}
    if base is not None:
        row["vs_fp32"] = round(med / statistics.median(base), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m", help="a preset (random weights, nothing downloaded)")
    parser.add_argument("--variants", default="fp32,bf16,int8,int8+lm_head", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32, help="requests of each workload")
    parser.add_argument("--workload-tokens", type=int, help="new tokens per request (default: the workload's)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or "fp32" not in names:
        parser.error(f"--variants must include fp32 and come from {', '.join(VARIANTS)}, got {args.variants!r}")

    reference, _ = load_preset(args.model)
    vocab = reference.config.vocab_size
    workloads = {
        w: make_workload(w, num_requests=args.requests, vocab_size=vocab, max_new_tokens=args.workload_tokens)
        for w in WORKLOADS
    }
    max_seq_len = max(PROMPT_TOKENS + args.decode_tokens, *(w.max_seq_len for w in workloads.values()))
    engines: dict[str, LLM] = {}
    report = {
        "model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "repeats": args.repeats, "max_batch_size": args.max_batch_size, "variants": {},
    }
    for name in names:
        start = time.perf_counter()
        engines[name] = LLM(args.model, max_batch_size=args.max_batch_size, max_seq_len=max_seq_len,
                            progress=False, **VARIANTS[name])
        warmup = engines[name].warmup()
        log(f"{name}: built in {time.perf_counter() - start:.1f} s, warm-up (graphs compiled) {warmup:.1f} s")
        report["variants"][name] = {
            "warmup_s": round(warmup, 1), "weight_bytes": weight_bytes(engines[name].model),
            "quality": quality(engines[name].model, reference, tokens(STREAM_TOKENS, vocab, seed=1)),
        }

    prompt = tokens(PROMPT_TOKENS, vocab, seed=0)
    decode = {name: [] for name in names}
    outputs: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name in names:
            rate, outputs[name] = decode_run(engines[name], prompt, args.decode_tokens)
            decode[name].append(rate)
            log(f"decode #{repeat} {name}: {rate:.1f} tok/s")
    for name in names:
        row = report["variants"][name]
        row["decode_tokens_per_s"] = median_row(decode[name], decode["fp32"] if name != "fp32" else None)
        row["quality"]["greedy_agreement"] = agreement(outputs[name], outputs["fp32"])
        row["quality"]["greedy_tokens"] = args.decode_tokens

    for workload_name, workload in workloads.items():
        rates = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names:
                result, _ = run_kvgraph(engines[name], workload)
                rates[name].append(result.tokens_per_s)
                log(f"{workload_name} #{repeat} {name}: {result.tokens_per_s:.1f} tok/s ({result.elapsed_s:.2f} s)")
        for name in names:
            report["variants"][name][workload_name] = {
                "requests": len(workload.prompts), "new_tokens": workload.max_new_tokens,
                "tokens_per_s": median_row(rates[name], rates["fp32"] if name != "fp32" else None),
            }
    for name in names:
        report["variants"][name]["recompiles_after_warmup"] = engines[name].stats()["recompiles"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
