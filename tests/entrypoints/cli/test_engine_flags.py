"""The engine flags are ``EngineConfig``: every field is set by a flag or named as set otherwise, the
flags default to its defaults, and ``build_llm`` hands ``kvgraph.LLM`` the config the flags make."""

import dataclasses

import pytest
import torch

from kvgraph.engine.config import EngineConfig
from kvgraph.entrypoints.cli import build_parser, common
from kvgraph.entrypoints.cli.common import FLAG_READERS, NOT_FLAGS, engine_config

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]
ENGINE_COMMANDS = ["generate", "bench", "serve"]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_config_field_is_a_flag_or_named_as_not_one(command):
    args = build_parser().parse_args([command])
    by_flag = [name for name in FIELDS if name in FLAG_READERS or hasattr(args, name)]
    assert sorted(by_flag + list(NOT_FLAGS)) == sorted(FIELDS)
    assert set(FLAG_READERS) | set(NOT_FLAGS) <= set(FIELDS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_no_flags_mean_the_config_defaults(command):
    """Each default is ``kvgraph.LLM``'s, but a server compiles in the background on a first start."""
    expected = EngineConfig(background_compile=command == "serve")
    assert engine_config(build_parser().parse_args([command]), progress=True) == expected


def test_background_compile_flags():
    parse = build_parser().parse_args
    assert engine_config(parse(["serve", "--no-background-compile"]), progress=True).background_compile is False
    assert engine_config(parse(["generate", "--background-compile"]), progress=True).background_compile is True


def test_each_flag_sets_its_field():
    args = build_parser().parse_args([
        "generate", "--cache", "continuous", "--page-size", "8", "--max-batch-size", "3", "--max-seq-len", "96",
        "--max-batch-tokens", "40", "--kv-cache-memory", "4096", "--no-prefix-caching", "--num-steps", "2",
        "--compile", "eager", "--no-freeze-weights", "--device", "cpu", "--dtype", "bfloat16",
        "--tensor-parallel-size", "2", "--trust-remote-code", "--no-adaptive-threads", "--no-precompile",
        "--background-compile",
    ])
    assert engine_config(args, progress=False) == EngineConfig(
        cache_strategy="continuous", page_size=8, max_batch_size=3, max_seq_len=96, max_batch_tokens=40,
        kv_cache_memory=4096, enable_prefix_caching=False, num_steps=2, compile="eager", freeze_weights=False,
        device="cpu", dtype=torch.bfloat16, progress=False, tensor_parallel_size=2, trust_remote_code=True,
        adaptive_threads=False, precompile=False, background_compile=True,
    )


@pytest.mark.parametrize("flags, frozen", [
    ([], None), (["--freeze-weights", "on"], True), (["--freeze-weights", "off"], False),
    (["--no-freeze-weights"], False), (["--no-packed-linears"], None),
])
def test_freeze_weights_flags(flags, frozen):
    args = build_parser().parse_args(["generate", *flags])
    config = engine_config(args, progress=False)
    assert config.freeze_weights is frozen
    assert config.packed_linears is ("--no-packed-linears" not in flags)


def test_build_llm_hands_the_engine_the_config_of_the_flags(monkeypatch):
    built = {}

    class Recorder:
        rank = 0

        def __init__(self, model, *, tokenizer, config) -> None:
            built.update(model=model, tokenizer=tokenizer, config=config)

    monkeypatch.setattr("kvgraph.entrypoints.llm.LLM", Recorder)
    monkeypatch.setattr(common, "load_model_arg", lambda args: ("module", "tokenizer"))
    args = build_parser().parse_args(["generate", "--max-batch-size", "3", "--compile", "eager"])
    assert isinstance(common.build_llm(args, progress=False), Recorder)
    assert built == {"model": "module", "tokenizer": "tokenizer", "config": engine_config(args, progress=False)}


@pytest.mark.parametrize("flags, cpp_wrapper", [
    ([], None), (["--cpp-wrapper"], True), (["--cpp-wrapper", "on"], True), (["--cpp-wrapper", "off"], False),
    (["--cpp-wrapper", "auto"], None),
])
def test_cpp_wrapper_flags(flags, cpp_wrapper):
    args = build_parser().parse_args(["generate", *flags])
    assert engine_config(args, progress=False).cpp_wrapper is cpp_wrapper
