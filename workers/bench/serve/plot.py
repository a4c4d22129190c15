"""The picture of a ``chorus bench serve`` report: per model, throughput with and without reuse (bars) and the
latency CDFs of both passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_png(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display here; a file is the output
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(2, max(1, len(models)), figsize=(5.2 * max(1, len(models)), 7.5), squeeze=False)
    for col, entry in enumerate(models):
        on, off = entry["reuse"], entry["no_reuse"]
        bars = axes[0][col]
        values = [off["throughput_rps"] or 0.0, on["throughput_rps"] or 0.0]
        drawn = bars.bar(["reuse off", "reuse on"], values, color=["#8c8c8c", "#2b7bba"])
        bars.bar_label(drawn, fmt="%.2f")
        ratio = entry["compare"]["throughput_ratio"]
        bars.set_title(f"{entry['model']}: throughput (req/s), ×{ratio}")
        bars.set_ylabel("requests / s")
        cdf = axes[1][col]
        for key, label, color in (("off", "reuse off", "#8c8c8c"), ("auto", "reuse on", "#2b7bba")):
            xs = sorted(entry["latencies_s"][key])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            cdf.step(xs, ys, where="post", label=label, color=color)
        cdf.set_xlabel("latency, sent → result (s)")
        cdf.set_ylabel("fraction of requests")
        cdf.set_title(f"{entry['model']}: latency CDF")
        cdf.grid(alpha=0.3)
        cdf.legend(loc="lower right")
    trace = models[0]["trace"] if models else {}
    fig.suptitle(
        f"chorus bench serve: {trace.get('kind')} trace, {trace.get('loop')} loop, "
        f"{report['machine']['cores']} cores{' (quick)' if report['quick'] else ''}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
