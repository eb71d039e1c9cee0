"""``kvgraph generate --compare-hf``: the same prompts through Hugging Face ``generate``, side by side.

Greedy decoding makes the comparison exact: kvgraph's token ids must equal those of the model's
own ``generate`` (eager, its own KV cache, padded batches). The lines printed show both systems'
ids per prompt, whether they agree, each system's time for the same tokens, and the KV memory
each held at its peak.
"""

from __future__ import annotations

from kvgraph.engine.requests import Completion
from kvgraph.engine.stats import kv_usage_text
from kvgraph.entrypoints.cli.baselines import hf_generate

SHOWN_IDS = 10  # ids shown per system and prompt; the comparison covers them all


def compare_with_hf(
    llm, prompts: list[list[int]], completions: list[Completion], kvgraph_s: float, batch_size: int,
) -> dict:
    """Run ``prompts`` (token ids) through ``llm.model.generate`` greedily, as many new tokens as
    the longest completion, and set the result against kvgraph's ``completions`` (greedy, same
    prompts, ``kvgraph_s`` seconds). A completion that stopped at EOS is compared with as many of
    HF's tokens. Returns the figures :func:`comparison_lines` prints (also the JSON entry)."""
    new_tokens = max(len(c.token_ids) for c in completions)
    pad_id = getattr(llm.model.config, "pad_token_id", None) or 0
    hf = hf_generate(llm.model, prompts, new_tokens, batch_size, llm.params, pad_id)
    theirs = [out[: len(c.token_ids)] for out, c in zip(hf.outputs, completions, strict=True)]
    stats = llm.stats()
    return {
        "identical": sum(c.token_ids == t for c, t in zip(completions, theirs, strict=True)),
        "requests": len(prompts),
        "hf_token_ids": theirs,
        "new_tokens": sum(len(c.token_ids) for c in completions),
        "kvgraph_s": kvgraph_s,
        "hf_generate_s": hf.elapsed_s,
        "kvgraph_kv_peak_bytes": stats["kv_peak_bytes"],
        "hf_kv_peak_bytes": hf.kv_peak_bytes,
        "kvgraph_kv": kv_usage_text(stats),
    }


def comparison_lines(prompts: list[list[int]], completions: list[Completion], figures: dict) -> list[str]:
    """A few lines: both systems' ids per prompt and whether they agree, then the times and KV memory."""
    lines = []
    for i, (prompt, ours, theirs) in enumerate(zip(prompts, completions, figures["hf_token_ids"], strict=True)):
        verdict = "identical" if ours.token_ids == theirs else "DIFFERENT"
        lines.append(f"[{i}] {len(prompt)} prompt tokens -> {len(ours.token_ids)} new tokens, {verdict}")
        lines.append(f"    kvgraph       {_ids(ours.token_ids)}")
        lines.append(f"    HF generate   {_ids(theirs)}")
    speedup = figures["hf_generate_s"] / figures["kvgraph_s"] if figures["kvgraph_s"] > 0 else float("inf")
    lines.append(
        f"{figures['identical']}/{figures['requests']} prompts give identical token ids. Time for the same "
        f"{figures['new_tokens']} tokens: kvgraph {figures['kvgraph_s'] * 1e3:.0f} ms (after warm-up), "
        f"HF generate {figures['hf_generate_s'] * 1e3:.0f} ms: kvgraph {speedup:.1f}x as fast."
    )
    lines.append(
        f"KV memory at the busiest step: kvgraph {_kib(figures['kvgraph_kv_peak_bytes'])}, "
        f"{figures['kvgraph_kv']}; HF generate {_kib(figures['hf_kv_peak_bytes'])}, its padded batch."
    )
    return lines


def _ids(ids: list[int]) -> str:
    shown = " ".join(map(str, ids[:SHOWN_IDS]))
    return shown + (f" ... ({len(ids)} ids)" if len(ids) > SHOWN_IDS else "")


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB"
