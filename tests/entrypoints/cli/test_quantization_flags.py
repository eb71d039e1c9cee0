"""``--quantization`` and ``--quantize-lm-head`` on every command that runs a model."""

import json

import pytest
import torch

from kvgraph.engine.config import EngineConfig
from kvgraph.entrypoints.cli import build_parser, main
from kvgraph.entrypoints.cli.common import engine_config

QUANT = ["--dtype", "bfloat16", "--quantization", "int8-weight-only"]


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_the_flags_set_the_config_fields(command):
    args = build_parser().parse_args([command, *QUANT, "--quantize-lm-head"])
    assert engine_config(args, progress=True) == EngineConfig(
        dtype=torch.bfloat16, quantization="int8-weight-only", quantize_lm_head=True,
        background_compile=command == "serve",  # serve's own default
    )


@pytest.mark.parametrize("command", ["generate", "bench", "serve", "dump"])
def test_an_unknown_scheme_is_refused_by_the_parser(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--quantization", "int4-weight-only"])
    assert exit_.value.code == 2
    assert "invalid choice: 'int4-weight-only' (choose from 'int8-weight-only')" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "dump"])
def test_a_float32_model_is_one_line_naming_the_dtype(command, capsys):
    assert main([command, "--model", "llama-tiny", "--quantization", "int8-weight-only"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvgraph {command}: error: quantization='int8-weight-only' runs with dtype torch.bfloat16")
    assert err.endswith("--dtype bfloat16)") and "\n" not in err


def test_generate_runs_the_quantized_model(kvgraph_cli, fast_flags):
    done = kvgraph_cli("generate", "--model", "llama-tiny", *QUANT, *fast_flags, "--prompt", "Hello",
                       "--max-new-tokens", "4", "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    completion = json.loads(done.stdout)["completions"][0]
    assert completion["finish_reason"] in ("length", "stop") and 1 <= len(completion["token_ids"]) <= 4


def test_dump_lowers_the_quantized_model_onto_the_same_op(kvgraph_cli):
    done = kvgraph_cli("dump", "--model", "llama-tiny", *QUANT, "--stage", "lowered", "--format", "fx")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("kvgraph.ragged_attention") == 2
    assert "kv_blocks               kv        bfloat16" in done.stdout


def test_bench_runs_the_quantized_model_and_explains_its_mismatches(kvgraph_cli, fast_flags):
    done = kvgraph_cli("bench", "--model", "llama-tiny", *QUANT, *fast_flags, "--requests", "2", "--workload",
                       "mixed", "--max-new-tokens", "8", "--no-floor", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "2 graphs compiled in warm-up, 0 recompiles after it" in done.stderr


@pytest.mark.parametrize("command", ["generate", "dump"])
def test_tensor_parallelism_is_refused_before_the_model_loads(command, capsys, monkeypatch):
    for module in ("common", "dump"):
        monkeypatch.setattr(f"kvgraph.entrypoints.cli.{module}.load_model_arg", lambda args: pytest.fail("loaded"))
    assert main([command, "--model", "llama-tiny", *QUANT, "--tensor-parallel-size", "2"]) == 1
    assert "quantization runs on 1 rank only" in capsys.readouterr().err
