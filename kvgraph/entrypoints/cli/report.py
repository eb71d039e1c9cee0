"""Figures of ``kvgraph bench``: per-system summaries, the matmul floor, output agreement, a text table
and a PNG chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgraph.entrypoints.cli.baselines import SystemResult
from kvgraph.entrypoints.cli.floor import FLOOR_SYSTEM
from kvgraph.errors import require_extra

PERCENTILES = (50, 90, 99)  # the ttft_p*_ms and itl_p*_ms fields of SystemSummary
FLOOR_LABEL = "matmul floor\n(linear layers only)"
SPEEDUP_LEGEND = "speed-up vs system: kvgraph's tokens/s / the system's (above 1x: kvgraph is faster)"
KV_SERIES = {"peak held": "kv_peak_bytes", "allocated": "kv_allocated_bytes"}


@dataclass(frozen=True, kw_only=True)
class SystemSummary:
    """One system's row of ``kvgraph bench``; ``dataclasses.asdict`` is its JSON ``results`` entry.

    Latencies are in ms and ``None`` where nothing was measured (the matmul floor generates
    nothing); ``speedup_vs_system`` is kvgraph's tokens/s over this system's.
    """

    system: str
    requests: int
    new_tokens: int
    elapsed_s: float
    tokens_per_s: float
    speedup_vs_system: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    kv_allocated_bytes: int | None
    kv_peak_bytes: int | None
    kv_waste: float | None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation) of ``values``; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(result: SystemResult, reference: SystemResult | None = None) -> SystemSummary:
    """Throughput, kvgraph's speed-up over it, TTFT and inter-token latency percentiles (ms), KV memory.

    ``reference`` is kvgraph's result: ``speedup_vs_system`` is its tokens/s over this system's.
    """
    return _summary(
        result.name, len(result.outputs), result.new_tokens, result.elapsed_s, reference, result.ttft_s,
        result.itl_s, kv_allocated_bytes=result.kv_allocated_bytes, kv_peak_bytes=result.kv_peak_bytes,
        kv_waste=result.kv_waste,
    )


def summarize_floor(elapsed_s: float, reference: SystemResult) -> SystemSummary:
    """The matmul floor's row: ``reference``'s (kvgraph's) requests and new tokens over ``elapsed_s``;
    it generates nothing, so it has no latency or KV figures."""
    return _summary(
        FLOOR_SYSTEM, len(reference.outputs), reference.new_tokens, elapsed_s, reference, [], [],
        kv_allocated_bytes=None, kv_peak_bytes=None, kv_waste=None,
    )


def _summary(
    system: str, requests: int, new_tokens: int, elapsed_s: float, reference: SystemResult | None,
    ttft_s: list[float], itl_s: list[float], **kv: float | None,
) -> SystemSummary:
    tokens_per_s = new_tokens / elapsed_s if elapsed_s > 0 else 0.0

    def ms(values: list[float], q: int) -> float | None:
        p = percentile(values, q)
        return None if p is None else p * 1e3

    return SystemSummary(
        system=system, requests=requests, new_tokens=new_tokens, elapsed_s=elapsed_s, tokens_per_s=tokens_per_s,
        speedup_vs_system=(
            reference.tokens_per_s / tokens_per_s if reference is not None and tokens_per_s > 0 else None
        ),
        ttft_p50_ms=ms(ttft_s, 50), ttft_p90_ms=ms(ttft_s, 90), ttft_p99_ms=ms(ttft_s, 99),
        itl_p50_ms=ms(itl_s, 50), itl_p90_ms=ms(itl_s, 90), itl_p99_ms=ms(itl_s, 99), **kv,
    )


def ttft_note(result: SystemResult) -> str | None:
    """Why a system's TTFT percentiles are all equal, when they are: every request got its first
    token at the same moment, since all prompts ran in one batch (``None`` otherwise)."""
    ttft = result.ttft_s
    if len(ttft) < 2 or max(ttft) != min(ttft):
        return None
    return (f"{result.name}: ttft p50 == p99 since all {len(ttft)} requests ran in one batch and got their "
            "first token at the same moment")


def kv_memory_mib(rows: list[SystemSummary]) -> dict[str, list[float | None]]:
    """Per KV figure (peak held, allocated), each row's value in MiB (``None``: not measured), so
    that a chart sets peak against peak and allocation against allocation."""
    return {
        label: [None if getattr(r, key) is None else getattr(r, key) / 2**20 for r in rows]
        for label, key in KV_SERIES.items()
    }


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


def format_table(rows: list[SystemSummary]) -> str:
    """The summaries as an aligned text table."""
    cols = [
        ("system", "system", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
        ("speed-up vs system", "speedup_vs_system", "{:#.3g}x"),
        ("ttft p50 ms", "ttft_p50_ms", "{:.1f}"), ("ttft p99 ms", "ttft_p99_ms", "{:.1f}"),
        ("itl p50 ms", "itl_p50_ms", "{:.2f}"), ("itl p90 ms", "itl_p90_ms", "{:.2f}"),
        ("itl p99 ms", "itl_p99_ms", "{:.2f}"),
        ("kv peak MiB", "kv_peak_bytes", "{:.2f}"), ("kv alloc MiB", "kv_allocated_bytes", "{:.2f}"),
        ("kv waste", "kv_waste", "{:.1%}"),
    ]

    def cell(row: SystemSummary, key: str, fmt: str) -> str:
        v = getattr(row, key)
        if v is None:
            return "n/a"
        return fmt.format(v / 2**20 if key.endswith("_bytes") else v)

    table = [[h for h, _, _ in cols]] + [[cell(r, k, f) for _, k, f in cols] for r in rows]
    widths = [max(len(line[c]) for line in table) for c in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in table)


def plot(rows: list[SystemSummary], title: str, path: Path) -> Path:
    """A 2x2 PNG: throughput (with the matmul floor's bar, when there is one), TTFT, inter-token latency
    percentiles and KV memory per system."""
    require_extra("viz", "kvgraph bench --plot", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [r for r in rows if r.system != FLOOR_SYSTEM]
    names = [r.system for r in systems]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    throughput = [r.tokens_per_s for r in rows]
    axes[0][0].bar(
        [FLOOR_LABEL if r.system == FLOOR_SYSTEM else r.system for r in rows], throughput,
        color=["tab:gray" if r.system == FLOOR_SYSTEM else "tab:blue" for r in rows],
    )
    wide = min(throughput) > 0 and max(throughput) > 100 * min(throughput)  # a tiny model's floor
    if wide:
        axes[0][0].set_yscale("log")
    axes[0][0].set_title(f"throughput (new tokens/s{', log scale' if wide else ''})")
    for ax, label in ((axes[0][1], "ttft"), (axes[1][0], "itl")):
        width = 0.8 / len(PERCENTILES)
        for k, q in enumerate(PERCENTILES):
            xs = [i + (k - 1) * width for i in range(len(systems))]
            ax.bar(xs, [getattr(r, f"{label}_p{q}_ms") or 0.0 for r in systems], width, label=f"p{q}")
        ax.set_xticks(range(len(systems)), names)
        ax.set_title(f"{'time to first token' if label == 'ttft' else 'inter-token latency'} (ms)")
        ax.legend()
    kv, width = kv_memory_mib(systems), 0.4
    for k, (label, values) in enumerate(kv.items()):
        xs = [i + (k - 0.5) * width for i in range(len(systems))]
        bars = axes[1][1].bar(xs, [v or 0.0 for v in values], width, label=label)
        axes[1][1].bar_label(bars, ["n/a" if v is None else "" for v in values], fontsize=7)
    axes[1][1].set_xticks(range(len(systems)), names)
    axes[1][1].set_title("KV memory (MiB): peak held by sequences, allocated")
    axes[1][1].legend()
    for ax in axes.flat:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
