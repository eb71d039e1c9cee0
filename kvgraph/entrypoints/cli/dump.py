"""``kvgraph dump``: the model's graph as Dynamo captured it and as kvgraph lowered it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgraph.entrypoints.cli import graph_render as R
from kvgraph.entrypoints.cli.common import (
    DTYPES,
    add_cache_args,
    add_model_args,
    add_quantization_args,
    load_model_arg,
    positive_int,
)

STAGES = ("captured", "lowered")
FORMATS = ("table", "fx", "mlir", "dot", "svg")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "dump", help="show the graph before and after lowering",
        description="Capture the model's graph with Dynamo (one prefill step), lower it onto the KV cache, "
        "and print either stage. Every format starts with the table of graph inputs (name, kind, dtype, "
        "shape with symbolic dims, device). table: one row per node; fx: Python code; mlir: torch-dialect "
        "MLIR via torch-mlir; dot: the dataflow graph with attention sites highlighted, for Graphviz; svg: the same drawn with "
        "networkx and matplotlib (no Graphviz needed), one panel per stage in one document.",
    )
    add_model_args(p)
    add_cache_args(p)
    add_quantization_args(p)
    p.add_argument("--stage", choices=(*STAGES, "all"), default="all", help="default: all")
    p.add_argument("--format", choices=FORMATS, default="table", help="default: table")
    p.add_argument("--prompt-len", type=positive_int, default=8, help="tokens of the example step (default 8)")
    p.add_argument("--no-prune-logits", action="store_true", help="keep logits for every token")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="show rank 0's graph of the model split over this many ranks: Hq/N and Hkv/N "
                   "heads, all-reduces after the attention and MLP outputs (default 1)")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    p.set_defaults(run=run)


@dataclass
class Captured:
    """The two stages of one model's graph, and the facts the renderings print."""

    captured: torch.fx.GraphModule
    lowered: torch.fx.GraphModule
    kv_inputs: list[str]
    sites: list
    tensor_parallel_size: int = 1


def capture(args: argparse.Namespace) -> Captured:
    """Run one prefill step of ``--prompt-len`` tokens through ``kvgraph.compile`` (eager inner
    compiler) and take the captured and lowered graphs from the backend."""
    from kvgraph.cache.managers import load_kv_manager
    from kvgraph.cache.request import KVRequest
    from kvgraph.compiler import backend
    from kvgraph.compiler.step import run_step
    from kvgraph.engine.config import check_kv_cache_dtype
    from kvgraph.engine.loading import model_kv_params
    from kvgraph.engine.quantization import check_quantization, quantize

    check_quantization(args.quantization, DTYPES.get(args.dtype), args.tensor_parallel_size)
    model, _ = load_model_arg(args)
    model = model.eval()
    if args.dtype:
        model = model.to(DTYPES[args.dtype])
    if args.quantization:
        model = quantize(model, args.quantization, lm_head=args.quantize_lm_head)
    device = next(model.parameters()).device
    kw = dict(cache_strategy=args.cache, page_size=args.page_size, enable_prefix_caching=False, device=device)
    params = model_kv_params(model, kv_cache_dtype=check_kv_cache_dtype(args.kv_cache_dtype, device), **kw)
    if args.tensor_parallel_size > 1:
        from kvgraph.parallel.single_rank import shard_as_rank_zero

        params = shard_as_rank_zero(model, args.tensor_parallel_size, params)
    manager = load_kv_manager(params, 1, args.prompt_len)
    compiled = backend.compile(model, manager=manager, inner="eager", prune_logits=not args.no_prune_logits)
    (seq,) = manager.claim(1)
    with torch.inference_mode():
        run_step(compiled, manager, [KVRequest(seq, list(range(3, 3 + args.prompt_len)))])
    runner = compiled.backend.runners[0]
    result = next(iter(runner.layouts.values())).result
    return Captured(
        runner.gm, result.gm, list(result.kv_placeholders), list(result.sites), args.tensor_parallel_size
    )


def header(stage: str, gm: torch.fx.GraphModule, c: Captured, model_name: str) -> str:
    """The stage's title line and its input table (KV inputs marked ``kv``)."""
    from kvgraph.passes.graph_view import placeholder_kind

    def kind(node: torch.fx.Node) -> str:
        return "kv" if node.name in c.kv_inputs else placeholder_kind(node)

    sites = sum(R.is_attention(n) for n in gm.graph.nodes)
    title = f"kvgraph dump: {model_name}, stage {stage}, {sites} attention sites"
    if c.tensor_parallel_size > 1:
        from kvgraph.parallel.single_rank import all_reduces

        reduces = [n.name for n in all_reduces(gm)]
        title += (f"\nrank 0 of {c.tensor_parallel_size}: {len(reduces)} all-reduces (Partial -> Replicate): "
                  f"{', '.join(reduces)}")
    return title + "\n\n" + R.input_table(gm, kind)


def render(stages: dict[str, torch.fx.GraphModule], fmt: str, c: Captured, model_name: str) -> str:
    """The stages in one format, each headed by its input table (MLIR: one module, one function per stage)."""
    heads = {s: header(s, gm, c, model_name) for s, gm in stages.items()}
    if fmt == "mlir":
        return R.comment("\n\n".join(heads.values()), "mlir") + "\n" + R.mlir(stages) + "\n"
    if fmt == "svg":
        from kvgraph.entrypoints.cli.graph_svg import svg

        body = svg(stages)
        at = body.find("<svg")
        return body[:at] + R.comment("\n\n".join(heads.values()), "svg") + "\n" + body[at:]
    parts = []
    for stage, gm in stages.items():
        if fmt == "table":
            parts.append(heads[stage] + "\n\n" + R.node_table(gm) + "\n")
        elif fmt == "fx":
            parts.append(R.comment(heads[stage], "fx") + "\n" + R.fx_code(gm))
        else:
            parts.append(R.comment(heads[stage], "dot") + "\n" + R.dot(gm, stage) + "\n")
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    c = capture(args)
    graphs = {"captured": c.captured, "lowered": c.lowered}
    stages = {s: graphs[s] for s in (STAGES if args.stage == "all" else (args.stage,))}
    text = render(stages, args.format, c, args.model)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output} ({', '.join(stages)}, {args.format})", file=sys.stderr)
    return 0
