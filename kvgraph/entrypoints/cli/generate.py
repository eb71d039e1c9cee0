"""``kvgraph generate``: run prompts through ``kvgraph.LLM`` and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvgraph.entrypoints.cli.common import (
    add_engine_args,
    add_model_args,
    build_llm,
    int_list,
    non_negative_float,
    plural,
    positive_int,
)
from kvgraph.entrypoints.cli.heap import freeze_warm_heap
from kvgraph.errors import ConfigError

DEFAULT_PROMPT = "Hello from kvgraph!"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from prompts",
        description="Generate completions with continuous batching over a paged KV cache. "
        "A progress bar runs on stderr; the completions go to stdout.",
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help=f"a text prompt (repeatable; default {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-ids", type=int_list, action="append", help="a prompt as token ids: 1,2,3 (repeatable)")
    src.add_argument("--prompts-file", type=Path,
                     help="one prompt per non-empty line: text, or a JSON list of token ids")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per prompt (default 32)")
    s.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=positive_int, help="sample among the k most likely tokens")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    s.add_argument("--sampling-seed", type=int, help="seed each request's sampler (reproducible sampling)")
    s.add_argument("--stop-token-ids", type=int_list, default=[], help="extra stop tokens: 5,7")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    add_engine_args(p)
    p.add_argument("--compare-hf", action="store_true",
                   help="also run the prompts through the model's own Hugging Face generate (greedy) and show "
                   "both systems' token ids, times and KV memory side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object (completions and stats)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (compile stages, generation bar)")
    p.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    if args.prompt_ids:
        return list(args.prompt_ids)
    if args.prompts_file is None:
        return list(args.prompt or [DEFAULT_PROMPT])
    if not args.prompts_file.is_file():
        raise ConfigError(f"prompts file {str(args.prompts_file)!r} does not exist")
    prompts: list[str | list[int]] = []
    for line in args.prompts_file.read_text().splitlines():
        if line.strip():
            prompts.append(_parse_line(line))
    if not prompts:
        raise ConfigError(f"prompts file {str(args.prompts_file)!r} has no prompt")
    return prompts


def _parse_line(line: str) -> str | list[int]:
    if line.lstrip().startswith("["):
        try:
            ids = json.loads(line)
        except json.JSONDecodeError:
            return line
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return ids
    return line


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvgraph.engine import SamplingParams
    from kvgraph.engine.stats import kv_usage_text

    prompts = read_prompts(args)
    if args.compare_hf and args.temperature != 0.0:
        raise ConfigError(
            f"--compare-hf compares greedy token ids: it needs --temperature 0, got {args.temperature:g}"
        )
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.sampling_seed, stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
    )
    llm = build_llm(args, progress=not args.no_progress)
    if llm is None:
        return 0
    if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise ConfigError(
            f"model {args.model!r} has no tokenizer, so text prompts cannot be encoded: give them as token ids "
            "with --prompt-ids 1,2,3"
        )
    llm.check_prompts(prompts, sampling)  # before compiling: bad input fails at once
    warmup = llm.warmup()
    freeze_warm_heap()
    start = time.perf_counter()
    bar = tqdm(total=len(prompts) * args.max_new_tokens, unit="tok", desc="generate", file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)
    with bar:
        completions = llm.generate(prompts, sampling, on_step=lambda events: bar.update(len(events)))
    elapsed = time.perf_counter() - start
    comparison = None
    if args.compare_hf:
        from kvgraph.engine.prompts import encode_prompt
        from kvgraph.entrypoints.cli.compare import compare_with_hf, comparison_lines

        ids = [encode_prompt(p, llm.tokenizer, llm.vocab_size, llm.max_seq_len) for p in prompts]
        comparison = compare_with_hf(llm, ids, completions, elapsed, args.max_batch_size)
    stats = llm.stats()
    new_tokens = sum(len(c.token_ids) for c in completions)
    summary = (
        f"{plural(len(completions), 'prompt')}, {plural(new_tokens, 'new token')} in {elapsed:.2f}s: "
        f"{new_tokens / elapsed:.1f} tok/s (prefill {stats['prefill_tokens_per_s']:.1f} tok/s, "
        f"decode {stats['decode_tokens_per_s']:.1f} tok/s), {stats['steps']} steps, "
        f"{kv_usage_text(stats)}, prefix hit rate {stats['prefix_hit_rate']:.0%} "
        f"(compile and warm-up: {warmup:.1f}s, not counted: {llm.startup_note()}; "
        f"{stats['recompiles']} recompiles after it)"
    )
    if args.json:
        out = {
            "model": args.model,
            "completions": [
                {
                    "prompt_tokens": c.prompt_tokens, "token_ids": c.token_ids, "text": c.text,
                    "finish_reason": c.finish_reason, "cached_tokens": c.cached_tokens,
                }
                for c in completions
            ],
            "elapsed_s": elapsed,
            "warmup_s": warmup,
            "tokens_per_s": new_tokens / elapsed,
            "stats": stats,
            "compare_hf": comparison,
        }
        print(json.dumps(out, indent=2))
    else:
        note = random_weights_note(args.model)
        if note is not None:
            print(note, file=sys.stderr, flush=True)
        for i, c in enumerate(completions):
            body = repr(c.text) if c.text is not None else " ".join(map(str, c.token_ids))
            print(f"[{i}] ({c.finish_reason}, {len(c.token_ids)} tokens) {body}")
        if comparison is not None:
            print("Side by side with Hugging Face generate on the same model:")
            print("\n".join(comparison_lines(ids, completions, comparison)))
    print(summary, file=sys.stderr)
    llm.close()
    return 0


def random_weights_note(model: str) -> str | None:
    """What a preset is, and why its text reads as noise (``None`` for a checkpoint directory)."""
    from kvgraph.presets import PRESETS

    preset = PRESETS.get(model)
    if preset is None:
        return None
    return (f"{model}: {preset.description}; seeded random weights (nothing downloaded), so the text is noise. "
            "What holds is the token ids: --compare-hf checks them against Hugging Face generate.")
