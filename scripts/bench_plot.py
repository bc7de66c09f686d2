"""The bench's PNG: output tok/s and inter-token latency against concurrency (one line per TP
size, or per server). Needs matplotlib (`pip install matplotlib`, or neuron's `bench` extra)."""

from __future__ import annotations


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in sorted({str(r.get("tp", "")) for r in rows}):
        mine = sorted((r for r in rows if str(r.get("tp", "")) == label), key=lambda r: r["concurrency"])
        conc = [r["concurrency"] for r in mine]
        name = f"TP={label}" if label else "server"
        tps.plot(conc, [r["output_tok_s"] for r in mine], marker="o", label=name)
        itl.plot(conc, [r["itl_p50"] * 1e3 for r in mine], marker="o", label=f"{name} p50")
        itl.plot(conc, [r["itl_p99"] * 1e3 for r in mine], marker="x", linestyle="--", label=f"{name} p99")
    for ax, ylabel in ((tps, "output tok/s (all streams)"), (itl, "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
