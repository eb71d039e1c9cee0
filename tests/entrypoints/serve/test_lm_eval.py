"""lm-evaluation-harness's ``local-completions`` model against ``kvgraph serve``: two tasks kept in
``lm_eval_tasks/`` (nothing downloaded), each score checked against the preset model run here.

- ``kvgraph_tiny_qa`` (``generate_until``): greedy text, three tokens at most, cut at ``"<"``;
  the texts and ``exact_match`` equal a plain greedy loop over the model's logits.
- ``kvgraph_tiny_choice`` (``multiple_choice``): each choice's log-likelihood comes from
  ``/v1/completions`` with ``echo`` (the prompt's log-probabilities) and must equal the sum of the
  continuation tokens' log-softmax here (to 1e-4), and ``acc`` / ``acc_norm`` the argmax of those sums.

The server serves a checkpoint written by ``save_preset``, the directory lm-eval also takes its
tokenizer from; the reference is ``load_preset`` in this process (the same seeded weights, checked).
Each task runs one request a call (``batch_size=1``) and four (a list of four prompts a call).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraph.presets import EOS_ID, load_preset, save_preset
from tests.entrypoints.serve.lm_eval_tasks.data import read_jsonl
from tests.entrypoints.serve.serving import MAX_SEQ_LEN, MODEL

lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is in the 'test' extra")

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
SERVED_NAME = "kvgraph-tiny"
LOGPROB_TOL = 1e-4
QA_UNTIL, QA_MAX_TOKENS = ["<"], 3  # as in kvgraph_tiny_qa.yaml


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_preset(MODEL, tmp_path_factory.mktemp("lm_eval") / MODEL)


@pytest.fixture(scope="module")
def lm_server(start_server, checkpoint):
    return start_server("--model", str(checkpoint), "--served-model-name", SERVED_NAME,
                        "--compile", "eager", "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "8")


@pytest.fixture(scope="module")
def preset():
    model, tokenizer = load_preset(MODEL)
    return model, tokenizer


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """No hub: the tokenizer is a local directory, the documents local jsonl."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")


def evaluate(task: str, lm_server, checkpoint, task_manager, batch_size: int) -> dict:
    """``task`` through lm-eval, ``batch_size`` requests a ``/v1/completions`` call (a list of prompts)."""
    model_args = ",".join([
        f"base_url={lm_server.url}/v1/completions", f"model={SERVED_NAME}",
        "tokenizer_backend=huggingface", f"tokenizer={checkpoint}", "tokenized_requests=True",
        "num_concurrent=1", "max_retries=1", f"max_length={MAX_SEQ_LEN}",
    ])
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                      task_manager=task_manager, log_samples=True, bootstrap_iters=0,
                                      batch_size=batch_size)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return {"metrics": results["results"][task], "samples": samples}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.no_grad()
def greedy_text(model, tokenizer, prompt: str) -> str:
    """Argmax of the logits, one token at a time, up to EOS or ``QA_MAX_TOKENS``; the text cut
    where the first stop string (``until`` and EOS's text, as lm-eval sends them) begins."""
    ids = encode(tokenizer, prompt)
    out: list[int] = []
    while len(out) < QA_MAX_TOKENS:
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        if token == EOS_ID:
            break
        out.append(token)
    text = tokenizer.decode(out)
    cuts = [text.find(s) for s in [*QA_UNTIL, tokenizer.eos_token] if s in text]
    return text[:min(cuts)] if cuts else text


@torch.no_grad()
def loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation tokens' summed log-probabilities after the context, and whether each is the
    argmax (lm-eval's ``is_greedy``)."""
    ctx, cont = encode(tokenizer, context), encode(tokenizer, continuation)
    assert encode(tokenizer, context + continuation) == ctx + cont  # bytes: no merge across the split
    logprobs = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), dim=-1)
    rows = logprobs[len(ctx) - 1:-1]
    picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_saved_checkpoint_is_the_preset(checkpoint, preset):
    """The server's checkpoint and lm-eval's tokenizer are this process's seeded preset."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = preset
    saved = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).state_dict()
    ours = model.state_dict()
    assert saved.keys() == ours.keys()
    assert all(torch.equal(saved[k], ours[k]) for k in ours)
    again, _ = load_preset(MODEL)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.items())  # seeded: every load alike
    saved_tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    for text in ["Q: 2+2?\nA:", "Two plus two is four", "caf\u00e9 \u2603 <s>"]:
        assert encode(saved_tokenizer, text) == encode(tokenizer, text)
    assert (saved_tokenizer.eos_token, saved_tokenizer.eos_token_id) == (tokenizer.eos_token, EOS_ID)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_generate_until_task(lm_server, checkpoint, task_manager, preset, batch_size):
    model, tokenizer = preset
    docs = read_jsonl("tiny_qa.jsonl")
    expected = [greedy_text(model, tokenizer, f"Q: {doc['question']}\nA:") for doc in docs]
    expected_em = float(np.mean([text == doc["answer"] for text, doc in zip(expected, docs, strict=True)]))
    assert 0 < expected_em < 1, f"the task should have hits and misses; greedy texts: {expected}"

    out = evaluate("kvgraph_tiny_qa", lm_server, checkpoint, task_manager, batch_size)
    served = [s["filtered_resps"][0] for s in out["samples"]]
    assert [s["doc"] for s in out["samples"]] == docs
    assert served == expected
    assert out["metrics"]["exact_match,none"] == pytest.approx(expected_em, abs=1e-12)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_multiple_choice_task(lm_server, checkpoint, task_manager, preset, batch_size):
    model, tokenizer = preset
    docs = read_jsonl("tiny_choice.jsonl")
    expected = [[loglikelihood(model, tokenizer, doc["question"], " " + choice) for choice in doc["choices"]]
                for doc in docs]
    lls = [np.array([ll for ll, _ in doc_lls]) for doc_lls in expected]
    lengths = [np.array([float(len(c)) for c in doc["choices"]]) for doc in docs]
    acc = float(np.mean([np.argmax(ll) == doc["answer"] for ll, doc in zip(lls, docs, strict=True)]))
    acc_norm = float(np.mean([np.argmax(ll / n) == doc["answer"]
                              for ll, n, doc in zip(lls, lengths, docs, strict=True)]))
    assert 0 < acc < 1, f"the task should have hits and misses; log-likelihoods: {lls}"

    out = evaluate("kvgraph_tiny_choice", lm_server, checkpoint, task_manager, batch_size)
    assert [s["doc"] for s in out["samples"]] == docs
    for sample, doc_expected in zip(out["samples"], expected, strict=True):
        served = [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]]
        assert len(served) == len(doc_expected)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(served, doc_expected, strict=True):
            assert ll == pytest.approx(ref_ll, abs=LOGPROB_TOL)
            assert greedy == ref_greedy
    assert out["metrics"]["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert out["metrics"]["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
