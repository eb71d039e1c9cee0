"""Arguments and helpers shared by the subcommands: model resolution, engine flags, argument types."""

from __future__ import annotations

import argparse
import sys

import torch

from kvgraph.errors import InvalidParamsError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one int, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return values


def plural(n: int, noun: str) -> str:
    """``"1 prompt"``, ``"2 prompts"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    from kvgraph.presets import DEFAULT_PRESET, preset_names

    parser.add_argument(
        "--model", default=DEFAULT_PRESET,
        help=f"a built-in preset ({', '.join(preset_names())}; default {DEFAULT_PRESET}) "
        "or a local Hugging Face checkpoint directory",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the model (default: as loaded)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a checkpoint directory run its own model code (off: such checkpoints are refused)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags mapping one to one onto ``kvgraph.LLM``'s keyword arguments."""
    add_cache_args(parser)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-batch-size", type=positive_int, default=64, help="sequences per step (default 64)")
    g.add_argument("--max-seq-len", type=positive_int, default=2048, help="longest context (default 2048)")
    g.add_argument(
        "--max-batch-tokens", type=positive_int, default=2048, help="new tokens per step (default 2048)"
    )
    g.add_argument("--kv-cache-memory", type=positive_int, help="bytes of the paged pool (default: room for "
                   "max-batch-size sequences of max-seq-len tokens)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--num-steps", type=positive_int, default=1, help="decode steps per schedule (default 1)")
    g.add_argument("--compile", choices=("inductor", "eager"), default="inductor",
                   help="what runs the lowered graph (default inductor)")
    g.add_argument("--no-freeze-weights", action="store_true",
                   help="keep the weights as graph inputs instead of compiling them in as prepacked "
                   "constants (Inductor's freezing)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--threads", type=positive_int,
                   help="CPU threads of the model's kernels (torch.set_num_threads; default: one per "
                   "core). Fewer leave cores to other work on the host, e.g. the HTTP server's event "
                   "loop or a load generator next to `kvgraph serve`")
    g.add_argument("--fixed-threads", action="store_true",
                   help="keep the thread count fixed; by default it follows, between steps, the cores "
                   "other processes leave free (from 1 up to --threads)")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="split the model's heads and MLP over this many ranks (default 1): spawned on "
                   "this host, or the ranks torchrun started")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cache")
    g.add_argument("--cache", choices=("paged", "continuous"), default="paged", help="KV cache strategy")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")


def load_model_arg(args: argparse.Namespace) -> tuple[torch.nn.Module, object | None]:
    """The model ``--model`` names: a preset (module and byte tokenizer, weights seeded by ``--seed``)
    or a checkpoint directory (module, and its tokenizer when it has one)."""
    from kvgraph.engine.loading import load_model

    return load_model(args.model, seed=args.seed, trust_remote_code=args.trust_remote_code)


def build_llm(args: argparse.Namespace, *, progress: bool = True):
    """``kvgraph.LLM`` for the model and engine flags in ``args``; ``progress``: show the compile
    stages on stderr. ``None`` on a rank other than 0 of a ``torchrun`` group, once rank 0 has
    finished (that rank has nothing left to do)."""
    from kvgraph.engine import LLM

    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the checkpoint's "Loading weights" bar
    if args.threads:
        if args.tensor_parallel_size > 1:
            raise InvalidParamsError(
                f"--threads {args.threads} with --tensor-parallel-size {args.tensor_parallel_size}: each rank "
                f"takes its share of the host's cores; set OMP_NUM_THREADS per rank under torchrun instead"
            )
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_arg(args)
    llm = LLM(
        model,
        tokenizer=tokenizer,
        cache_strategy=args.cache,
        page_size=args.page_size,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_batch_tokens=args.max_batch_tokens,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        num_steps=args.num_steps,
        compile=args.compile,
        freeze_weights=not args.no_freeze_weights,
        device=args.device,
        dtype=DTYPES.get(args.dtype),
        progress=progress,
        tensor_parallel_size=args.tensor_parallel_size,
        trust_remote_code=args.trust_remote_code,
        adaptive_threads=not args.fixed_threads,
    )
    return llm if llm.tp is None or llm.tp.is_driver else None


def unsharded_model(args: argparse.Namespace, llm) -> torch.nn.Module:
    """The engine's model as one process runs it: ``llm.model``, or a fresh copy when tensor
    parallelism split ``llm.model`` (its layers then take part in collectives)."""
    if llm.tp is None:
        return llm.model
    module, _ = load_model_arg(args)
    return module.to(device=llm.device, dtype=DTYPES.get(args.dtype)).eval()
