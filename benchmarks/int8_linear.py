"""One int8 weight-only linear layer at every row count: ATen's int8 kernel, dequantize-then-GEMM,
and ``kvgraph::int8_weight_linear`` (which picks one of these or its fused kernel by row count)
with its C++ twin ``kvgraph_cpu::int8_weight_linear`` (what quantized layers call where kvgraph's
C++ library is built), beside a plain GEMM on the weight in the activations' dtype.

    python benchmarks/int8_linear.py [--out 1408] [--in 512] [--dtype bfloat16] [--repeats 30]
    python benchmarks/int8_linear.py --model llama-56m [--repeats 30]

With ``--model``, one row (a batch-1 decode step) through every linear layer of the preset in
module order, the vocabulary projection included, each quantized to int8 with a scale per row:
ATen's ``_weight_int8pack_mm`` against kvgraph's ``int8_matvec`` (AVX-512 VNNI), the two taking
turns every round, with the weight bytes each read per second. The layers' 40 MB do not stay in
the cores' caches between rounds, as they do not between decode steps.

Median milliseconds per call and the op's largest relative difference from ATen's int8 kernel, as
JSON. Every variant reads the same int8 weight and per-row scales; the timed calls are warm (the
first three of each are not timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from linear import median_ms  # benchmarks/linear.py: warm calls, then the median of the timed ones

from kvgraph.ops import int8_linear

ROWS = (1, 8, 16, 24, 32, 64, 128, 512, 2048)


def model_matvec(name: str, repeats: int) -> dict:
    """One bfloat16 row through every linear layer of preset ``name``: ATen's int8 kernel and
    ``int8_matvec``, alternating, median milliseconds per pass and GB/s of int8 weights read."""
    from kvgraph.presets import load_preset

    model, _ = load_preset(name)
    g = torch.Generator().manual_seed(0)
    layers = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            n, k = module.weight.shape
            layers.append((torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                           torch.rand(n, generator=g) / 127))
    rows = {k: torch.randn(1, k, generator=g).bfloat16() for k in {w.shape[1] for w, _ in layers}}
    half = [s.bfloat16() for _, s in layers]
    kernel = int8_linear.matvec_kernel()
    ways = {"aten_int8": lambda: [torch.ops.aten._weight_int8pack_mm(rows[w.shape[1]], w, h)
                                  for (w, _), h in zip(layers, half, strict=True)]}
    if kernel is not None:
        ways["kvgraph_matvec"] = lambda: [kernel(rows[w.shape[1]], w, s, None) for w, s in layers]
    times: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(repeats + 3):
        for way, fn in ways.items():
            start = time.perf_counter()
            fn()
            if i >= 3:
                times[way].append((time.perf_counter() - start) * 1e3)
    weight_bytes = sum(w.numel() for w, _ in layers)
    report = {"model": name, "layers": len(layers), "weight_mb": round(weight_bytes / 1e6, 1),
              "threads": torch.get_num_threads()}
    for way, t in times.items():
        ms = statistics.median(t)
        report[way] = {"ms": round(ms, 3), "gb_per_s": round(weight_bytes / ms / 1e6, 1)}
    if kernel is not None:
        report["aten_over_matvec"] = round(report["aten_int8"]["ms"] / report["kvgraph_matvec"]["ms"], 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=1408)
    parser.add_argument("--in", dest="in_features", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", help="one row through every linear layer of this preset instead")
    args = parser.parse_args()
    if args.model:
        print(json.dumps(model_matvec(args.model, args.repeats), indent=2))
        return
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (args.out, args.in_features), dtype=torch.int8, generator=g)
    scales = torch.rand(args.out, generator=g) / 127
    plain = (weight.float() * scales[:, None]).to(dtype)
    routes = int8_linear.cpu_routes()

    def ms(fn) -> float:
        return round(median_ms(fn, args.repeats), 4)

    rows = []
    for n in ROWS:
        x = torch.randn(n, args.in_features, generator=g).to(dtype)
        s = scales.to(dtype)
        aten = torch.ops.aten._weight_int8pack_mm(x, weight, s).float()
        ours = int8_linear.int8_weight_linear(x, weight, scales).float()
        rows.append({
            "rows": n,
            "aten_int8_ms": ms(lambda x=x, s=s: torch.ops.aten._weight_int8pack_mm(x, weight, s)),
            "dequantize_gemm_ms": ms(lambda x=x: torch.mm(x, weight.to(torch.float32).mul_(scales[:, None]).to(dtype).t())),
            "kvgraph_op_ms": ms(lambda x=x: int8_linear.int8_weight_linear(x, weight, scales)),
            "kvgraph_cpp_op_ms": None if routes is None else ms(
                lambda x=x: int8_linear.int8_weight_linear(x, weight, scales, None, routes)),
            "plain_gemm_ms": ms(lambda x=x: torch.mm(x, plain.t())),
            "op_kernel": int8_linear.kernel_for(n, dtype, args.in_features),
            "op_vs_aten_max_rel_diff": float((ours - aten).abs().max() / aten.abs().max()),
        })
    print(json.dumps({"out": args.out, "in": args.in_features, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
