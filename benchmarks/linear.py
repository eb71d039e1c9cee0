"""Linear layers on the CPU: ``F.linear`` vs ``kvgraph::linear`` (the weight packed once: kvgraph's
panel GEMM with its C++ library, else MKL's packed GEMM or oneDNN) and MKL's and oneDNN's packed
products themselves.

    python benchmarks/linear.py [--vocab 32000] [--hidden 512] [--repeats 20] [--model llama-56m]

Rows are what a step projects: one per sequence (decode batches of 1..64) or, for
comparison, a prefill-sized 512. Median milliseconds of each, their ratio, and the largest
difference between the two outputs, as JSON. With ``--model``, also every linear layer of that
preset in module order, as a decode step runs them (each weight read from memory once a step, not
from a warm cache; each way repeated back to back, as steps follow each other): milliseconds a
step and GFLOP/s at 1, 8, 16, 32, 64, 128, 512, 1024 and 2048 rows, each way, the ways taking
turns (past ``max_packed_rows`` rows, 512 on an Intel CPU, ``kvgraph::linear`` is ``F.linear``).

With ``--loop-nests`` (and ``--model``), instead: the panel GEMM's two loop nests on those layers
at 16..2048 rows, taking turns (``KVGRAPH_PANEL_BLOCKED_ROWS``, read at each call, set to 1 for
``blocked`` and past every row count for ``chunked``), the better of five runs each and their ratio:
what ``kBlockedRows`` in ``csrc/panel_gemm_cpu.cpp`` is chosen from. Needs the panels (an AVX2 or
AVX-512 build of kvgraph's C++ library).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvgraph.ops import cpp
from kvgraph.ops import linear as packed


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


ROWS = (1, 8, 16, 32, 64, 128, 512, 1024, 2048)  # of the per-layer timing (--model)


def model_layers(name: str, repeats: int) -> list[dict]:
    """Every linear layer of preset ``name`` in module order, ``repeats`` steps at each row count,
    with ``F.linear``, with ``kvgraph::linear``, (where PyTorch has MKL) with MKL's packed GEMM
    and (where it has oneDNN) with oneDNN's packed linear, each packed for ``PACK_ROWS`` rows; the
    better of three alternating runs each."""
    from kvgraph.entrypoints.cli.floor import linear_layers
    from kvgraph.presets import load_preset

    model, _ = load_preset(name)
    weights = [layer.weight.detach() for layer in linear_layers(model)]
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, packed.PACK_ROWS) for w in weights] if packed.has_mkl() else []
        onednn = ([torch.ops.mkldnn._reorder_linear_weight(w, packed.PACK_ROWS) for w in weights]
                  if torch.backends.mkldnn.is_available() else [])
        for rows in ROWS:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g) for w in weights}
            ways = {
                "f_linear": [lambda w=w, x=xs[w.shape[1]]: F.linear(x, w) for w in weights],
                "packed": [lambda w=w, x=xs[w.shape[1]]: packed.linear(x, w) for w in weights],
            }
            if mkl:
                ways["mkl_packed"] = [lambda w=w, p=p, x=xs[w.shape[1]], n=rows: torch.ops.mkl._mkl_linear(x, p, w, None, n)
                                      for w, p in zip(weights, mkl, strict=True)]
            if onednn:
                ways["onednn_packed"] = [
                    lambda p=p, x=xs[w.shape[1]]: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                    for w, p in zip(weights, onednn, strict=True)]
            step = {key: [] for key in ways}
            for _ in range(3):
                for key, calls in ways.items():
                    step[key].append(median_ms(lambda calls=calls: [c() for c in calls], repeats))
            flop = 2 * rows * sum(w.numel() for w in weights)
            ms = {k: min(v) for k, v in step.items()}
            out.append({"rows": rows, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                        **{f"{k}_gflops": round(flop / v / 1e6, 1) for k, v in ms.items()},
                        **({"packed_vs_mkl_packed": round(ms["mkl_packed"] / ms["packed"], 2)} if mkl else {}),
                        **({"packed_vs_onednn_packed": round(ms["onednn_packed"] / ms["packed"], 2)} if onednn else {})})
    return out


NEST_ROWS = (16, 24, 32, 40, 48, 64, 96, 128, 512, 2048)  # of --loop-nests
NESTS = {"blocked": "1", "chunked": str(1 << 40)}  # KVGRAPH_PANEL_BLOCKED_ROWS of each


def loop_nests(name: str, repeats: int) -> list[dict]:
    """Every linear layer of preset ``name`` through the panels' blocked and K-chunked loop nests
    in turn at each of ``NEST_ROWS``: milliseconds a step (the better of five alternating runs of
    ``repeats`` steps' median), GFLOP/s and blocked ÷ chunked time."""
    from kvgraph.entrypoints.cli.floor import linear_layers
    from kvgraph.presets import load_preset

    if cpp.packed_linear_gemm() != "panels":
        raise SystemExit("--loop-nests needs kvgraph's panel GEMM (an AVX2 or AVX-512 build of its C++ library)")
    model, _ = load_preset(name)
    weights = [layer.weight.detach() for layer in linear_layers(model)]
    g = torch.Generator().manual_seed(0)
    before = os.environ.get("KVGRAPH_PANEL_BLOCKED_ROWS")
    out = []
    try:
        with torch.inference_mode():
            for rows in NEST_ROWS:
                xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=g) for w in weights}
                step = {nest: [] for nest in NESTS}
                for _ in range(5):
                    for nest, value in NESTS.items():
                        os.environ["KVGRAPH_PANEL_BLOCKED_ROWS"] = value
                        step[nest].append(median_ms(lambda xs=xs: [packed.linear(xs[w.shape[1]], w) for w in weights], repeats))
                ms = {k: min(v) for k, v in step.items()}
                flop = 2 * rows * sum(w.numel() for w in weights)
                out.append({"rows": rows, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                            **{f"{k}_gflops": round(flop / v / 1e6, 1) for k, v in ms.items()},
                            "blocked_vs_chunked_time": round(ms["blocked"] / ms["chunked"], 3)})
    finally:
        if before is None:
            os.environ.pop("KVGRAPH_PANEL_BLOCKED_ROWS", None)
        else:
            os.environ["KVGRAPH_PANEL_BLOCKED_ROWS"] = before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", help="also time every linear layer of this preset, as a decode step runs them")
    parser.add_argument("--loop-nests", action="store_true",
                        help="with --model: the panel GEMM's blocked and K-chunked loop nests instead")
    args = parser.parse_args()
    if args.loop_nests:
        if not args.model:
            parser.error("--loop-nests needs --model")
        print(json.dumps({"model": args.model, "threads": torch.get_num_threads(),
                          "loop_nests": loop_nests(args.model, args.repeats)}, indent=2))
        return
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g)
    results = []
    with torch.inference_mode():
        kind = None
        if packed.uses_packed(weight[:1], weight):
            gemm = cpp.packed_linear_gemm()
            kind = f"kvgraph_cpu:{gemm}" if gemm is not None else packed.packed_weight(weight)[0]
        for rows in (1, 8, 32, 64, 512):
            x = torch.randn(rows, args.hidden, generator=g)
            plain = median_ms(lambda x=x: F.linear(x, weight), args.repeats)
            ours = median_ms(lambda x=x: packed.linear(x, weight), args.repeats)
            diff = (packed.linear(x, weight) - F.linear(x, weight)).abs().max().item()
            results.append({
                "rows": rows, "f_linear_ms": round(plain, 3), "kvgraph_linear_ms": round(ours, 3),
                "speedup": round(plain / ours, 2), "max_abs_diff": diff,
            })
    print(json.dumps({
        "vocab": args.vocab, "hidden": args.hidden, "threads": torch.get_num_threads(),
        "packed_with": kind, "pack_rows": packed.PACK_ROWS, "max_packed_rows": packed.max_packed_rows(), "cpu_vendor": packed.cpu_vendor(), "results": results,
        **({"model": args.model, "model_layers": model_layers(args.model, args.repeats)} if args.model else {}),
    }, indent=2))


if __name__ == "__main__":
    main()
