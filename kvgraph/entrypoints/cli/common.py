"""Arguments and helpers shared by the subcommands: model resolution, engine flags, argument types."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch

from kvgraph.engine.config import COMPILE_MODES, KV_CACHE_DTYPES, EngineConfig
from kvgraph.engine.quantization import QUANTIZATION_SCHEMES
from kvgraph.errors import ConfigError

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


AUTO_ON_OFF = {"auto": None, "on": True, "off": False}
"""Values of the flags that name a setting or leave it to the engine (``--freeze-weights``,
``--cpp-wrapper``, where a bare ``--cpp-wrapper`` is ``on``) -> ``EngineConfig``'s ``None``/``True``/``False``."""


def _default(field: str) -> object:
    """The default of ``EngineConfig.<field>``: a flag left out means what ``kvgraph.LLM`` does."""
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == field)


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
    """Flags for the ``EngineConfig`` fields (with its defaults), and ``--threads``."""
    add_cache_args(parser)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-batch-size", type=positive_int, default=_default("max_batch_size"),
                   help="sequences per step (default %(default)s)")
    g.add_argument("--max-seq-len", type=positive_int, default=_default("max_seq_len"),
                   help="longest context (default %(default)s)")
    g.add_argument("--max-batch-tokens", type=positive_int, default=_default("max_batch_tokens"),
                   help="new tokens per step (default %(default)s)")
    g.add_argument("--kv-cache-memory", type=positive_int, default=_default("kv_cache_memory"),
                   help="bytes of the paged pool (default: room for max-batch-size sequences of max-seq-len tokens)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--num-steps", type=positive_int, default=_default("num_steps"),
                   help="decode steps per schedule (default %(default)s)")
    g.add_argument("--compile", choices=COMPILE_MODES, default=_default("compile"),
                   help="what runs the lowered graph (default %(default)s)")
    g.add_argument("--freeze-weights", choices=list(AUTO_ON_OFF), default="auto",
                   help="compile the weights in as constants (Inductor's freezing): on, off, or auto: "
                   "off where kvgraph packs every linear layer itself (float32 on the CPU), else on "
                   "(default %(default)s)")
    g.add_argument("--no-freeze-weights", action="store_true", help="the same as --freeze-weights off")
    g.add_argument("--no-packed-linears", action="store_true",
                   help="leave float32 linear layers on the CPU to Inductor (oneDNN) instead of "
                   "kvgraph::linear (MKL's packed GEMM)")
    g.add_argument("--cpp-wrapper", choices=list(AUTO_ON_OFF), nargs="?", const="on", default="auto",
                   help="have Inductor write each graph's wrapper in C++ instead of Python (fewer "
                   "Python calls a step; a C++ compile when a graph is compiled): on, off, or auto: "
                   "on for the CPU, off for CUDA (default %(default)s)")
    g.add_argument("--device", default=_default("device"), help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--threads", type=positive_int,
                   help="CPU threads of the model's kernels (torch.set_num_threads; default: one per "
                   "core). Fewer leave cores to other work on the host, e.g. the HTTP server's event "
                   "loop or a load generator next to `kvgraph serve`")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction,
                   default=_default("adaptive_threads"),
                   help="between steps, run the kernels on the cores other processes leave free (from 1 "
                   "up to --threads) instead of a fixed thread count (default: on; --no-adaptive-threads "
                   "keeps the count fixed)")
    g.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=_default("precompile"),
                   help="keep the compiled graphs whole on disk, Dynamo's capture included, and load them "
                   "in later starts of the same model and settings without tracing (default: on where it "
                   "applies: Inductor, unfrozen weights, one rank; --no-precompile traces every start)")
    g.add_argument("--background-compile", action=argparse.BooleanOptionalAction,
                   default=_default("background_compile"),
                   help="on a first start (no precompiled files yet), run the lowered graph uncompiled "
                   "at once while a worker process compiles it with Inductor, and switch to the compiled "
                   "graphs when it is done (default: on for serve, off elsewhere)")
    add_quantization_args(g)
    g.add_argument("--tensor-parallel-size", type=positive_int, default=_default("tensor_parallel_size"),
                   help="split the model's heads and MLP over this many ranks (default %(default)s): "
                   "spawned on this host, or the ranks torchrun started")


def add_quantization_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--quantization`` and ``--quantize-lm-head`` (``EngineConfig.quantization``, ``quantize_lm_head``)."""
    parser.add_argument("--quantization", choices=QUANTIZATION_SCHEMES, default=_default("quantization"),
                        help="store the linear layers' weights quantized (int8 with a scale per row; needs "
                        "--dtype bfloat16 and the 'quant' extra: pip install 'kvgraph[quant]'); default: as loaded")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="with --quantization, quantize the vocabulary projection too")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cache")
    g.add_argument("--cache", choices=("paged", "continuous"), default=_default("cache_strategy"),
                   help="KV cache strategy")
    g.add_argument("--page-size", type=positive_int, default=_default("page_size"),
                   help="tokens per page (default %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="store K/V quantized, 8 bits with a float32 scale per 128 head-dim elements "
                   "(CPU only); auto: the model's dtype (default %(default)s)")


FLAG_READERS: dict[str, Callable[[argparse.Namespace], object]] = {
    "cache_strategy": lambda args: args.cache,
    "enable_prefix_caching": lambda args: not args.no_prefix_caching,
    "freeze_weights": lambda args: False if args.no_freeze_weights else AUTO_ON_OFF[args.freeze_weights],
    "packed_linears": lambda args: not args.no_packed_linears,
    "dtype": lambda args: DTYPES.get(args.dtype),
    "adaptive_threads": lambda args: args.adaptive_threads,
    "kv_cache_dtype": lambda args: KV_CACHE_DTYPES[args.kv_cache_dtype],
    "cpp_wrapper": lambda args: AUTO_ON_OFF[args.cpp_wrapper],
}
"""How the ``EngineConfig`` fields whose flag has another name or meaning are read from the parsed
flags; every other field is the flag of its own name (``--page-size`` is ``page_size``)."""
NOT_FLAGS = ("progress",)
"""``EngineConfig`` fields no engine flag sets: ``progress`` comes from each command (``--no-progress``)."""


def engine_config(args: argparse.Namespace, *, progress: bool) -> EngineConfig:
    """The ``EngineConfig`` of the flags in ``args`` (from :func:`add_model_args` and :func:`add_engine_args`)."""
    values = {
        f.name: FLAG_READERS[f.name](args) if f.name in FLAG_READERS else getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FLAGS
    }
    return EngineConfig(**values, progress=progress)


def load_model_arg(args: argparse.Namespace) -> tuple[torch.nn.Module, object | None]:
    """The model ``--model`` names: a preset (module and byte tokenizer, weights seeded by ``--seed``)
    or a checkpoint directory (module, and its tokenizer when it has one)."""
    from kvgraph.engine.loading import load_model

    return load_model(args.model, seed=args.seed, trust_remote_code=args.trust_remote_code)


def build_llm(args: argparse.Namespace, *, progress: bool = True):
    """``kvgraph.LLM`` for the model and engine flags in ``args``; ``progress``: show the compile
    stages on stderr. ``None`` on a rank other than 0 of a ``torchrun`` group, once rank 0 has
    finished (that rank has nothing left to do)."""
    from kvgraph.entrypoints.llm import LLM

    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the checkpoint's "Loading weights" bar
    if args.threads:
        if args.tensor_parallel_size > 1:
            raise ConfigError(
                f"--threads {args.threads} with --tensor-parallel-size {args.tensor_parallel_size}: each rank "
                f"takes its share of the host's cores; set OMP_NUM_THREADS per rank under torchrun instead"
            )
        torch.set_num_threads(args.threads)
    config = engine_config(args, progress=progress)  # checked before the model loads
    model, tokenizer = load_model_arg(args)
    llm = LLM(model, tokenizer=tokenizer, config=config)
    return llm if llm.rank == 0 else None


def unsharded_model(args: argparse.Namespace, llm) -> torch.nn.Module:
    """The engine's model as one process runs it: ``llm.model``, or a fresh copy when tensor
    parallelism split ``llm.model`` (its layers then take part in collectives)."""
    if llm.config.tensor_parallel_size == 1:
        return llm.model
    module, _ = load_model_arg(args)
    return module.to(device=llm.device, dtype=DTYPES.get(args.dtype)).eval()
