"""The float32 GEMMs of a decode step alone: OpenVINO's CPU plugin against kvgraph's linear and
oneDNN's packed linear, on the same weights (the shapes of ``llama-56m``'s 8 layers, no attention).

    python benchmarks/peers/gemm_chain.py [--rows 8,32,64] [--rounds 3]

Run with kvgraph's Python: each round times kvgraph here, then OpenVINO in the peer virtualenv
(``benchmarks/peers.py``'s, run as a subprocess with ``--engine openvino``), so their runs alternate.
Each layer is q, k, v, o, gate, up, down, chained through adds (so nothing is dead code), in one
OpenVINO model compiled for the CPU at f32 precision with 2 threads and one stream, and as the
same calls in PyTorch. Prints per row count the median milliseconds of a chain, its GFLOP/s, each
side's outputs' checksum (they must agree), and OpenVINO's time ÷ each PyTorch way's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

LAYERS = 8
SHAPES = [(512, 512), (256, 512), (256, 512), (512, 512), (1408, 512), (1408, 512), (512, 1408)]  # (out, in)
FLOP_PER_ROW = 2 * LAYERS * sum(n * k for n, k in SHAPES)
PEER_PYTHON = Path("/work/peers/openvino/bin/python")  # as benchmarks/peers.py


def weights() -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[(rng.standard_normal((n, k)) * 0.01).astype(np.float32) for n, k in SHAPES] for _ in range(LAYERS)]


def time_it(run, repeats: int = 40) -> float:
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def openvino_chain(rows: int) -> tuple[float, float]:
    """(median seconds, checksum) of the chain in OpenVINO."""
    import openvino as ov
    import openvino.opset13 as ops

    x = np.random.default_rng(1).standard_normal((rows, 512)).astype(np.float32)
    p = ops.parameter([rows, 512], np.float32)
    h = p
    for q, k, v, o, gate, up, down in weights():
        def mm(a, w):
            return ops.matmul(a, ops.constant(w), False, True)
        a = ops.add(mm(h, q), h)
        a = ops.add(mm(a, o), ops.add(ops.reduce_sum(mm(h, k), [1], True), ops.reduce_sum(mm(h, v), [1], True)))
        h = ops.add(mm(ops.add(mm(a, gate), mm(a, up)), down), a)
    compiled = ov.Core().compile_model(ov.Model([h], [p]), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": "2",
        "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    seconds = time_it(lambda: request.infer({0: x}))
    return seconds, float(np.abs(request.infer({0: x})[compiled.outputs[0]]).sum())


def torch_chains(rows: int) -> dict[str, tuple[float, float]]:
    """(median seconds, checksum) of the chain with kvgraph::linear and with oneDNN's packed linear."""
    import torch

    from kvgraph.ops import linear as packed

    torch.set_num_threads(2)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((rows, 512)).astype(np.float32))
    ws = [[torch.from_numpy(w) for w in layer] for layer in weights()]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, packed.PACK_ROWS) for w in layer] for layer in ws]

    def chain(layers, lin):
        h = x
        for q, k, v, o, gate, up, down in layers:
            a = lin(h, q) + h
            a = lin(a, o) + lin(h, k).sum(1, keepdim=True) + lin(h, v).sum(1, keepdim=True)
            h = lin(lin(a, gate) + lin(a, up), down) + a
        return h

    ways = {
        "kvgraph_linear": lambda: chain(ws, packed.linear),
        "onednn_packed": lambda: chain(onednn, lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")),
    }
    with torch.inference_mode():
        return {name: (time_it(run), float(run().abs().sum())) for name, run in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("driver", "openvino"), default="driver")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.engine == "openvino":
        print(json.dumps({r: openvino_chain(r) for r in rows}))
        return
    runs: dict[int, dict[str, list]] = {r: {} for r in rows}
    for _ in range(args.rounds):
        for r, got in ((r, torch_chains(r)) for r in rows):
            for name, value in got.items():
                runs[r].setdefault(name, []).append(value)
        peer = subprocess.run([str(args.peer_python), __file__, "--engine", "openvino", "--rows", args.rows],
                              check=True, capture_output=True, text=True)
        for r, value in json.loads(peer.stdout.strip().splitlines()[-1]).items():
            runs[int(r)].setdefault("openvino", []).append(tuple(value))
    report = {}
    for r, ways in runs.items():
        med = {name: statistics.median(s for s, _ in values) for name, values in ways.items()}
        report[r] = {
            **{f"{name}_ms": round(s * 1e3, 2) for name, s in med.items()},
            **{f"{name}_gflops": round(FLOP_PER_ROW * r / s / 1e9, 1) for name, s in med.items()},
            **{f"{name}_checksum": ways[name][0][1] for name in ways},
            **{f"openvino_time_vs_{name}": round(med["openvino"] / s, 3) for name, s in med.items() if name != "openvino"},
        }
    print(json.dumps({"rows": report, "rounds": args.rounds}, indent=2))


if __name__ == "__main__":
    main()
