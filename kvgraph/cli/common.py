"""Arguments and helpers shared by the subcommands: model resolution, engine flags, argument types."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cache")
    g.add_argument("--cache", choices=("paged", "continuous"), default="paged", help="KV cache strategy")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")


def load_model_arg(args: argparse.Namespace) -> tuple[torch.nn.Module | str, object | None]:
    """The model ``--model`` names: a preset (module and byte tokenizer) or a checkpoint directory."""
    from kvgraph.presets import is_preset, load_preset, preset_names

    name = args.model
    if is_preset(name):
        return load_preset(name, seed=args.seed)
    path = Path(name)
    if path.is_dir():
        return str(path), None
    if "/" in name or name.startswith("."):
        raise InvalidParamsError(f"checkpoint directory {name!r} does not exist")
    raise InvalidParamsError(
        f"unknown model {name!r}: not a preset ({', '.join(preset_names())}) nor a checkpoint directory"
    )


def build_llm(args: argparse.Namespace):
    """``kvgraph.LLM`` for the model and engine flags in ``args``."""
    from kvgraph.engine import LLM

    model, tokenizer = load_model_arg(args)
    return LLM(
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
        trust_remote_code=args.trust_remote_code,
    )
