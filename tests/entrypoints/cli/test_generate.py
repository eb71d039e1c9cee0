import json

import torch

from kvgraph.presets import load_preset


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generate_json_matches_hf_greedy_and_reports_throughput(kvgraph_cli, fast_flags):
    done = kvgraph_cli(
        "generate", "--model", "llama-tiny", "--prompt", "Hello", "--prompt", "paged attention",
        "--max-new-tokens", "5", "--ignore-eos", "--max-seq-len", "64", "--json", *fast_flags,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    model, tok = load_preset("llama-tiny")
    for prompt, c in zip(["Hello", "paged attention"], out["completions"], strict=True):
        ids = tok.encode(prompt)
        assert c["prompt_tokens"] == len(ids)
        assert c["token_ids"] == _hf_greedy(model, ids, 5)
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
        assert c["finish_reason"] == "length"
    assert out["stats"]["decode_tokens"] == 8 and out["tokens_per_s"] > 0
    summary = done.stderr.strip().splitlines()[-1]
    assert summary.startswith("2 prompts, 10 new tokens in") and "tok/s" in summary
    assert "generate:" in done.stderr  # the progress bar
    assert done.stderr.count("kvgraph: the first step compiles a graph") == 1
    for stage in ("capturing the model with Dynamo", "lowering attention onto the KV cache",
                  "compiling the lowered graph with eager"):
        assert f"kvgraph: compiling graph 1 of 2 (several new tokens, T > 1): {stage}" in done.stderr
    assert "kvgraph: compiled graph 2 of 2 (one new token, T == 1) in " in done.stderr
    assert out["stats"]["warmup_graphs"] == 2 and out["stats"]["recompiles"] == 0


def test_generate_text_output_from_a_prompts_file(kvgraph_cli, fast_flags, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\n[5, 6, 7]\n")
    done = kvgraph_cli("generate", "--prompts-file", str(prompts), "--max-new-tokens", "3", "--ignore-eos",
                       "--no-progress", "--max-seq-len", "32", *fast_flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0] (length, 3 tokens) ") and lines[1].startswith("[1] ")
    assert "kvgraph: compil" not in done.stderr and "generate:" not in done.stderr


def test_compare_hf_shows_identical_ids_side_by_side_and_says_the_weights_are_random(kvgraph_cli, fast_flags):
    done = kvgraph_cli("generate", "--prompt", "Hello from kvgraph", "--prompt", "Paged attention", "--max-new-tokens",
                       "6", "--compare-hf", "--no-progress", "--max-seq-len", "48", *fast_flags)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    note = "llama-tiny: Llama, 2 layers, hidden 64, 4 query / 2 KV heads (GQA); seeded random weights"
    assert note in done.stderr and note not in out  # stdout: the completions and the comparison
    assert "[0] 18 prompt tokens -> 6 new tokens, identical" in out and "[1] 15 prompt tokens -> 6 new tokens, " \
        "identical" in out
    for line in out.splitlines():
        if line.strip().startswith("kvgraph "):
            ours = line.split(maxsplit=1)[1]
        if line.strip().startswith("HF generate "):
            assert line.split(maxsplit=2)[2] == ours and len(ours.split()) == 6
    assert "2/2 prompts give identical token ids. Time for the same 12 tokens: kvgraph " in out
    assert "KV memory at the busiest step: kvgraph " in out and " KV pages (16 tokens each" in out
