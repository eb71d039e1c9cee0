"""Resolve what ``LLM`` was given: a module, a preset name or a local Hugging Face checkpoint, and its tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from kvgraph.cache.managers import load_kv_manager
from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.cache.quant import KVCacheQuantizationConfig
from kvgraph.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("*.safetensors", "*.bin")


def load_model(
    model: torch.nn.Module | str | Path,
    tokenizer: object | None = None,
    *,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> tuple[torch.nn.Module, object | None]:
    """The module and tokenizer ``LLM`` runs.

    ``model`` is one of
    - an ``nn.Module``: returned as is, with ``tokenizer``;
    - the name of a built-in preset (``kvgraph.presets``: ``"llama-tiny"``, ...): its model with
      random weights seeded by ``seed``, and its byte-level tokenizer unless ``tokenizer`` is given;
    - the path of a local Hugging Face checkpoint directory, loaded with ``local_files_only=True``
      together with its tokenizer when the directory has one and ``tokenizer`` is ``None``.

    Loading never runs the checkpoint's code: a config that needs its own modelling files
    (``auto_map``) is refused unless ``trust_remote_code``; weights come from safetensors
    when present, else from ``.bin`` pickles read with ``weights_only=True`` (which refuses
    any pickle that would call a function). A directory that cannot be loaded (corrupt or
    truncated files, fields of the wrong type) raises ``ConfigError`` naming it.
    """
    from kvgraph.presets import is_preset, load_preset, preset_names

    if isinstance(model, torch.nn.Module):
        return model, tokenizer
    if not isinstance(model, (str, Path)):
        raise ConfigError(
            f"model must be an nn.Module, a preset name or a checkpoint directory, got {type(model).__name__}"
        )
    if isinstance(model, str) and is_preset(model):
        module, preset_tokenizer = load_preset(model, seed=seed)
        return module, tokenizer if tokenizer is not None else preset_tokenizer
    path = Path(model)
    if not path.is_dir():
        name = str(model)
        if "/" in name or name.startswith("."):
            raise ConfigError(f"checkpoint directory {name!r} does not exist")
        raise ConfigError(
            f"unknown model {name!r}: not a preset ({', '.join(preset_names())}) nor a checkpoint directory"
        )
    check_checkpoint(path, trust_remote_code)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    safe = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        module = AutoModelForCausalLM.from_pretrained(path, weights_only=True, **safe)
        if tokenizer is None and any((path / name).is_file() for name in TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(path, **safe)
    except Exception as exc:  # transformers, safetensors, json and pickle each raise their own kinds
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"checkpoint directory {str(path)!r} could not be loaded: {type(exc).__name__}: {first_line}"
        ) from exc
    return module, tokenizer


def check_checkpoint(path: Path, trust_remote_code: bool) -> None:
    """``ConfigError`` unless ``path`` is a checkpoint directory kvgraph may load: a
    ``config.json`` that is a JSON object, weights (``*.safetensors`` or ``*.bin``), and no
    ``auto_map`` (code shipped with the checkpoint) unless ``trust_remote_code``."""
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"checkpoint directory {str(path)!r} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(config_file)!r} holds a {type(config).__name__}, not a JSON object")
    if "auto_map" in config and not trust_remote_code:
        raise ConfigError(
            f"checkpoint directory {str(path)!r} ships its own model code (config.json auto_map); kvgraph "
            "does not run it unless trust_remote_code=True (--trust-remote-code)"
        )
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(
            f"checkpoint directory {str(path)!r} has no weights ({' or '.join(WEIGHT_FILES)}): truncated?"
        )


def check_tokenizer(tokenizer: object) -> None:
    """``ConfigError`` unless ``tokenizer`` is ``None`` or has ``encode`` and ``decode``."""
    if tokenizer is not None and not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise ConfigError(
            f"tokenizer must have encode() and decode() (a Hugging Face tokenizer), got {type(tokenizer).__name__}"
        )


def model_kv_params(model: torch.nn.Module, kv_cache_dtype: torch.dtype | None = None, **cache: object) -> KVCacheParams:
    """``KVCacheParams`` of ``model``: from its Hugging Face config when it has one
    (:func:`kv_params_from_config`), else from the attention sites of its graph (:func:`traced_kv_params`).
    ``cache`` is their keyword arguments: ``cache_strategy``, ``page_size``, ``enable_prefix_caching``, ``device``.
    ``kv_cache_dtype`` (``torch.int8``, ``torch.float8_e4m3fn``) stores the cache quantized with MAX's
    default ``KVCacheQuantizationConfig()``; ``None``: in the model's dtype."""
    params = kv_params_from_config(model, **cache)
    params = params if params is not None else traced_kv_params(model, **cache)
    if kv_cache_dtype is None:
        return params
    return replace(params, dtype=kv_cache_dtype, kvcache_quant_config=KVCacheQuantizationConfig())


def kv_params_from_config(
    model: torch.nn.Module,
    *,
    cache_strategy: KVCacheStrategy | str,
    page_size: int | None,
    enable_prefix_caching: bool,
    device: torch.device,
) -> KVCacheParams | None:
    """``KVCacheParams`` read from a Hugging Face ``model.config`` (``None`` for other modules).

    Layers from ``num_hidden_layers``, KV heads from ``num_key_value_heads`` (else
    ``num_attention_heads``), head size from ``head_dim`` (else ``hidden_size / heads``),
    dtype from the module's first floating parameter.
    """
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    strategy = KVCacheStrategy.parse(cache_strategy).resolved
    return KVCacheParams(
        dtype=model_dtype(model),
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        num_layers=layers,
        page_size=page_size if strategy is KVCacheStrategy.PAGED else None,
        cache_strategy=strategy,
        enable_prefix_caching=enable_prefix_caching and strategy is KVCacheStrategy.PAGED,
        device=device,
    )


def traced_kv_params(
    model: torch.nn.Module,
    *,
    cache_strategy: KVCacheStrategy | str,
    page_size: int | None,
    enable_prefix_caching: bool,
    device: torch.device,
) -> KVCacheParams:
    """``KVCacheParams`` of any module, read off its attention sites.

    Captures the module's graph once on a 4-token example (``input_ids``, ``position_ids``
    ``[1, 4]``) and runs the attention finder on it: layers are the sites, KV heads, head
    size and dtype theirs. Raises ``LoweringError`` when the graph has no attention to lower.
    """
    from kvgraph.passes import find_attention

    found = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list):
        found.append(find_attention.run(gm, example_inputs))
        return gm.forward

    def trace(input_ids: torch.Tensor, position_ids: torch.Tensor):
        return model(input_ids=input_ids, position_ids=position_ids)

    ids = torch.arange(1, 5, device=device)[None]
    with torch.no_grad():
        torch.compile(trace, backend=capture, fullgraph=True, dynamic=False)(ids, ids - 1)
    analysis = found[0]
    strategy = KVCacheStrategy.parse(cache_strategy).resolved
    return KVCacheParams(
        dtype=analysis.dtype,
        n_kv_heads=analysis.n_kv_heads,
        head_dim=analysis.head_dim,
        num_layers=analysis.num_layers,
        page_size=page_size if strategy is KVCacheStrategy.PAGED else None,
        cache_strategy=strategy,
        enable_prefix_caching=enable_prefix_caching and strategy is KVCacheStrategy.PAGED,
        device=device,
    )


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the module's first floating parameter (``float32`` when it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def eos_token_ids(model: torch.nn.Module, tokenizer: object | None) -> tuple[int, ...]:
    """The EOS ids from the model's generation config, else its config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        ids = tuple(i for i in ids if isinstance(i, int) and i >= 0)
        if ids:
            return ids
    return ()


def vocab_size(model: torch.nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def make_manager(
    params: KVCacheParams, max_batch_size: int, max_seq_len: int, kv_cache_memory: int | None
) -> KVCacheManager:
    """The manager for ``params``: a paged pool of ``kv_cache_memory`` bytes (default: room for
    ``max_batch_size`` sequences of ``max_seq_len`` tokens), or continuous slots, which need
    ``max_batch_size * max_seq_len`` tokens up front (more than ``kv_cache_memory`` raises)."""
    if kv_cache_memory is None:
        return load_kv_manager(params, max_batch_size, max_seq_len)
    if params.is_paged:
        return load_kv_manager(params, max_batch_size, max_seq_len, available_cache_memory=kv_cache_memory)
    need = max_batch_size * max_seq_len * params.bytes_per_token
    if kv_cache_memory < need:
        raise ConfigError(
            f"kv_cache_memory={kv_cache_memory} bytes is less than the {need} bytes the continuous cache "
            f"needs ({max_batch_size} slots of {max_seq_len} tokens)"
        )
    return load_kv_manager(params, max_batch_size, max_seq_len)
