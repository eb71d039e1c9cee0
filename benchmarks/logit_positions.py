"""What the ``logit_positions`` graph input costs a normal step.

    python benchmarks/logit_positions.py --model llama-tiny --batch 32

A pruned graph takes the rows whose logits it returns as an input; for a normal step the runtime
binds ``input_row_offsets[1:] - 1`` (each sequence's last token), which the graph used to compute
itself. This times, in one process: that binding (median per call), and one decode step of
``--batch`` sequences through the compiled model (``ModelRunner``, after warm-up: the compiled
graphs are warm-up, not timed), with the default positions and with the same rows bound
explicitly; it prints the binding's share of a step. Both step variants run the same graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvgraph.cache.request import KVRequest
from kvgraph.compiler.step import prepare_step
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset


def median_us(fn, calls: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="tokens already cached per sequence")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per round")
    args = parser.parse_args()

    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=args.batch, progress=False, enable_prefix_caching=False)
    llm.warmup()
    manager, runner = llm.manager, llm.runner
    seqs = manager.claim(args.batch)
    prompts = [[3 + (i + j) % 200 for j in range(args.context)] for i in range(args.batch)]
    with torch.inference_mode():
        for seq, prompt in zip(seqs, prompts, strict=True):  # fill each sequence's cache
            req = [KVRequest(seq, prompt)]
            kv = manager.fetch(req)
            ids, pos, offs = prepare_step([prompt], kv[0].cache_lengths)
            runner(kv, ids, pos, offs)
            manager.step(req)

    def decode(explicit: bool) -> None:
        reqs = [KVRequest(seq, [7]) for seq in seqs]
        kv = manager.fetch(reqs)
        ids, pos, offs = prepare_step([r.tokens for r in reqs], kv[0].cache_lengths)
        runner(kv, ids, pos, offs, offs[1:] - 1 if explicit else None)
        manager.step(reqs)

    offsets = torch.arange(args.batch + 1, dtype=torch.int32)
    binding_us = median_us(lambda: offsets[1:] - 1, 20000)
    rounds = {"default": [], "explicit": []}
    with torch.inference_mode():
        decode(False)
        decode(True)
        recompiles = runner.recompiles
        for _ in range(5):  # alternate the two variants
            for name in rounds:
                rounds[name].append(median_us(lambda n=name: decode(n == "explicit"), args.steps, rounds=1))
    step_us = statistics.median(rounds["default"])
    print(json.dumps({
        "model": args.model, "batch": args.batch, "context": args.context,
        "binding_default_positions_us": round(binding_us, 2),
        "decode_step_us": {name: round(statistics.median(v), 1) for name, v in rounds.items()},
        "binding_share_of_step": round(binding_us / step_us, 6),
        "recompiles_while_timed": runner.recompiles - recompiles,
        "threads": torch.get_num_threads(),
    }, indent=2))
    for seq in seqs:
        manager.release(seq)


if __name__ == "__main__":
    main()
