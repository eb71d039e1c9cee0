"""The command line's contract: --help everywhere, and bad input as one error line, never a traceback."""

import pytest

import kvgraph
from kvgraph.compiler.backend import KVGraphBackend
from kvgraph.entrypoints.cli import main
from kvgraph.presets import load_preset


@pytest.mark.parametrize("command", [[], ["generate"], ["bench"], ["dump"], ["serve"]])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert "usage: kvgraph" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["generate", "--model", "llama-huge"], 1,
         "kvgraph generate: error: unknown model 'llama-huge': not a preset (llama-tiny, "),
        (["generate", "--model", "./no/such/checkpoint"], 1,
         "kvgraph generate: error: checkpoint directory './no/such/checkpoint' does not exist"),
        (["generate", "--max-new-tokens", "0"], 2,
         "error: argument --max-new-tokens: must be a positive int, got 0"),
        (["generate", "--max-batch-size", "-4"], 2, "error: argument --max-batch-size: must be a positive int"),
        (["generate", "--prompt-ids", "1,x"], 2, "error: argument --prompt-ids: expected comma-separated ints"),
        (["generate", "--prompts-file", "/no/such/prompts.txt"], 1,
         "kvgraph generate: error: prompts file '/no/such/prompts.txt' does not exist"),
        (["generate", "--compare-hf", "--temperature", "0.7"], 1,
         "kvgraph generate: error: --compare-hf compares greedy token ids: it needs --temperature 0, got 0.7"),
        (["bench", "--requests", "0"], 2, "error: argument --requests: must be a positive int, got 0"),
        (["bench", "--workload", "chat"], 2, "error: argument --workload: invalid choice: 'chat'"),
        (["bench", "--baselines", "vllm"], 1, "kvgraph bench: error: unknown baseline 'vllm'"),
        (["serve", "--port", "70000"], 2, "error: argument --port: must be in [0, 65535], got 70000"),
        (["serve", "--model", "llama-huge"], 1, "kvgraph serve: error: unknown model 'llama-huge'"),
        (["serve", "--threads", "0"], 2, "error: argument --threads: must be a positive int, got 0"),
        (["generate", "--threads", "1", "--tensor-parallel-size", "2"], 1,
         "kvgraph generate: error: --threads 1 with --tensor-parallel-size 2: each rank takes its share"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, status, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == status
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def compiles(monkeypatch):
    """The graphs Dynamo hands to the kvgraph backend during the test (each one a compile)."""
    seen = []
    original = KVGraphBackend.__call__

    def recording(self, gm, example_inputs):
        seen.append(gm)
        return original(self, gm, example_inputs)

    monkeypatch.setattr(KVGraphBackend, "__call__", recording)
    return seen


def test_errors_after_loading_the_model_are_one_line_too(capsys, compiles):
    code = main(["generate", "--prompt-ids", "5," * 40 + "5", "--max-seq-len", "16", "--compile", "eager",
                 "--max-batch-size", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().endswith("prompt of 41 tokens is longer than max_seq_len=16")
    assert "Traceback" not in err
    assert compiles == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "a prompt of many tokens", "--max-seq-len", "4"],
         "prompt of 23 tokens is longer than max_seq_len=4"),
        (["--prompt-ids", "1,2,400"], "prompt token 400 is not an id in [0, 259)"),
        (["--prompt-ids", "1,2,3", "--max-new-tokens", "100", "--max-seq-len", "64", "--kv-cache-memory", "16384"],
         "needs 4 pages; the pool has 2 pages of 16 tokens"),
    ],
)
def test_generate_refuses_bad_prompts_before_compiling(argv, message, capsys, compiles):
    code = main(["generate", *argv, "--compile", "eager", "--max-batch-size", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert message in err and len(err.strip().splitlines()) == 1
    assert compiles == []


def test_warmup_fits_a_max_seq_len_shorter_than_its_prompts(capsys):
    code = main(["generate", "--prompt-ids", "5", "--max-seq-len", "2", "--max-new-tokens", "1",
                 "--compile", "eager", "--max-batch-size", "2", "--no-progress"])
    assert code == 0, capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvgraph {kvgraph.__version__}"


def test_text_prompt_for_a_checkpoint_without_tokenizer_names_prompt_ids(tmp_path, capsys, compiles):
    model, _ = load_preset("llama-tiny")
    model.save_pretrained(tmp_path)  # weights and config, no tokenizer files
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hello", "--compile", "eager",
                 "--max-batch-size", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "has no tokenizer" in err and "--prompt-ids 1,2,3" in err
    assert compiles == []


def test_one_prompt_is_counted_in_the_singular(capsys):
    code = main(["generate", "--prompt-ids", "5,6", "--max-new-tokens", "1", "--compile", "eager",
                 "--max-batch-size", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "1 prompt, 1 new token in " in err
