"""``benchmarks/peers.py`` without the peer virtualenv: what it hands the OpenVINO script is the
kvgraph workload itself, the peer script stays clear of kvgraph, and a missing virtualenv is
answered with one line that says how to create it."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraph.presets import VOCAB_SIZE
from kvgraph.workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benchmarks" / "peers.py"
PEER = ROOT / "benchmarks" / "peers" / "run_openvino_genai.py"
VLLM_PEER = ROOT / "benchmarks" / "peers" / "run_vllm_cpu.py"
RUNS = ROOT / "benchmarks" / "peers" / "runs.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("benchmarks_peers", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "requests", "new", "expected_n", "expected_new"), [
    ("mixed", 8, None, 8, 64),
    ("decode-heavy", 8, None, 4, 128),  # as cpu_serving.py: half the requests, 128 new tokens
    ("mixed", 8, 5, 8, 5),
])
def test_peer_request_is_the_kvgraph_workload(peers, name, requests, new, expected_n, expected_new):
    workload = peers.build_workload(name, requests, VOCAB_SIZE, new)
    assert workload == make_workload(name, num_requests=expected_n, vocab_size=VOCAB_SIZE, seed=0,
                                     max_new_tokens=expected_new)
    request = json.loads(json.dumps(peers.peer_request(workload, max_batch_size=64, threads=2)))
    assert request["prompts"] == workload.prompts
    assert request["max_new_tokens"] == workload.max_new_tokens == expected_new
    assert (request["max_num_seqs"], request["max_num_batched_tokens"], request["threads"]) == (64, 2048, 2)
    assert request["dtype"] == "float32"


@pytest.mark.parametrize("script", [PEER, VLLM_PEER], ids=["openvino", "vllm"])
def test_peer_script_reads_exactly_what_the_driver_writes(peers, script):
    read = set(re.findall(r'request\["(\w+)"\]', script.read_text()))
    workload = make_workload("mixed", num_requests=2, vocab_size=VOCAB_SIZE)
    assert read == set(peers.peer_request(workload, max_batch_size=4, threads=1))


@pytest.mark.parametrize(("script", "engine"), [(PEER, "openvino_genai"), (VLLM_PEER, "vllm"), (RUNS, None)],
                         ids=["openvino", "vllm", "runs"])
def test_peer_scripts_do_not_import_kvgraph(script, engine):
    tree = ast.parse(script.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "kvgraph" for name in imported)
    assert engine is None or engine in imported


def test_the_kv_cache_asked_for_holds_every_request_at_its_full_length(tmp_path):
    spec = importlib.util.spec_from_file_location("peer_runs", RUNS)
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "hidden_size": 512, "num_key_value_heads": 4, "num_hidden_layers": 8}))
    per_token = 2 * 8 * 4 * 64 * 4  # K and V, layers, KV heads, head size, fp32
    prompts = [[0] * 100] * 1000
    gb = runs.kv_cache_gb(tmp_path, prompts, 28, 4, page_tokens=128)
    assert gb * 2**30 >= 1000 * (100 + 28 + 128) * per_token  # a page per request to spare
    assert runs.kv_cache_gb(tmp_path, [[0]], 1, 4, page_tokens=16) == 1


def test_peer_env_leaves_kvgraph_out_and_stays_offline(peers, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    env = peers.peer_env()
    assert "PYTHONPATH" not in env
    assert env["HF_HUB_OFFLINE"] == "1"


def test_agreement_counts_requests_and_tokens_before_the_first_difference(peers):
    result = peers.agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]])
    assert result == {"identical_requests": 1, "requests": 3, "fraction_identical": 0.3333,
                      "tokens_before_first_difference": 4, "tokens": 9}


def test_missing_venv_is_one_line_with_the_commands(peers, tmp_path):
    with pytest.raises(SystemExit) as err:
        peers.check_peer_python(tmp_path / "none" / "bin" / "python")
    message = str(err.value)
    assert "\n" not in message
    assert str(tmp_path / "none" / "bin" / "python") in message
    assert "python3 -m venv /work/peers/openvino" in message
    assert "pip install torch==2.13.0" in message and "openvino-genai" in message


def test_venv_without_openvino_genai_is_named(peers):
    if importlib.util.find_spec("openvino_genai") is not None:
        pytest.skip("this interpreter has openvino_genai")
    with pytest.raises(SystemExit, match="cannot import openvino_genai.*python3 -m venv"):
        peers.check_peer_python(Path(sys.executable))


def test_script_exits_before_any_work_without_the_venv(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--model", "llama-tiny", "--peer-python", str(tmp_path / "python"),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.strip().startswith("peer virtualenv missing:")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()


def test_every_driver_dtype_is_a_precision_of_the_peer_script(peers):
    tree = ast.parse(PEER.read_text())
    (precisions,) = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "PRECISIONS" for t in node.targets)]
    assert set(peers.ENGINE_SETTINGS) == set(precisions)
    assert precisions["int8"][1] == "u8"  # OpenVINO's own 8-bit KV cache against kvgraph's int8 one
    assert peers.ENGINE_SETTINGS["int8"]["kv_cache_dtype"] == "int8"
    # OpenVINO's int8 export compresses the vocabulary projection too: kvgraph quantizes its lm_head
    assert peers.ENGINE_SETTINGS["int8"]["quantize_lm_head"] is True
