"""Figures of ``kvgraph bench``: per-system summaries, output agreement, a text table and a PNG chart."""

from __future__ import annotations

from pathlib import Path

from kvgraph.cli.baselines import SystemResult

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation) of ``values``; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(result: SystemResult, reference: SystemResult | None = None) -> dict:
    """Throughput, its ratio to ``reference``, TTFT and inter-token latency percentiles (ms), KV memory."""
    out = {
        "system": result.name,
        "requests": len(result.outputs),
        "new_tokens": result.new_tokens,
        "elapsed_s": result.elapsed_s,
        "tokens_per_s": result.tokens_per_s,
        "speedup_vs_kvgraph": (
            reference.tokens_per_s / result.tokens_per_s
            if reference is not None and result.tokens_per_s > 0 else None
        ),
    }
    for label, values in (("ttft", result.ttft_s), ("itl", result.itl_s)):
        for q in PERCENTILES:
            p = percentile(values, q)
            out[f"{label}_p{q}_ms"] = None if p is None else p * 1e3
    out["kv_allocated_bytes"] = result.kv_allocated_bytes
    out["kv_peak_bytes"] = result.kv_peak_bytes
    out["kv_waste"] = result.kv_waste
    return out


def agreement(reference: SystemResult, other: SystemResult) -> dict:
    """How many requests generated the same tokens in both systems, and where the first mismatch is."""
    same = 0
    first = None
    for i, (a, b) in enumerate(zip(reference.outputs, other.outputs, strict=True)):
        if a == b:
            same += 1
        elif first is None:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            first = {"request": i, "token": at}
    return {"system": other.name, "identical": same, "requests": len(reference.outputs), "first_mismatch": first}


def format_table(rows: list[dict]) -> str:
    """The summaries as an aligned text table."""
    cols = [
        ("system", "system", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
        ("kvgraph x", "speedup_vs_kvgraph", "{:.2f}"),
        ("ttft p50 ms", "ttft_p50_ms", "{:.1f}"), ("ttft p99 ms", "ttft_p99_ms", "{:.1f}"),
        ("itl p50 ms", "itl_p50_ms", "{:.2f}"), ("itl p90 ms", "itl_p90_ms", "{:.2f}"),
        ("itl p99 ms", "itl_p99_ms", "{:.2f}"),
        ("kv peak MiB", "kv_peak_bytes", "{:.2f}"), ("kv alloc MiB", "kv_allocated_bytes", "{:.2f}"),
        ("kv waste", "kv_waste", "{:.1%}"),
    ]

    def cell(row: dict, key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "n/a"
        return fmt.format(v / 2**20 if key.endswith("_bytes") else v)

    table = [[h for h, _, _ in cols]] + [[cell(r, k, f) for _, k, f in cols] for r in rows]
    widths = [max(len(line[c]) for line in table) for c in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in table)


def plot(rows: list[dict], title: str, path: Path) -> Path:
    """A 2x2 PNG: throughput, TTFT, inter-token latency percentiles and KV memory per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    axes[0][0].bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    axes[0][0].set_title("throughput (new tokens/s)")
    for ax, label in ((axes[0][1], "ttft"), (axes[1][0], "itl")):
        width = 0.8 / len(PERCENTILES)
        for k, q in enumerate(PERCENTILES):
            xs = [i + (k - 1) * width for i in range(len(rows))]
            ax.bar(xs, [r[f"{label}_p{q}_ms"] or 0.0 for r in rows], width, label=f"p{q}")
        ax.set_xticks(range(len(rows)), names)
        ax.set_title(f"{'time to first token' if label == 'ttft' else 'inter-token latency'} (ms)")
        ax.legend()
    axes[1][1].bar(names, [(r["kv_peak_bytes"] or r["kv_allocated_bytes"] or 0) / 2**20 for r in rows],
                   color="tab:green")
    axes[1][1].set_title("KV memory, peak held (else allocated), MiB")
    for ax in axes.flat:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
