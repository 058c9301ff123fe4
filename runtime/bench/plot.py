"""Output tokens/s against parallel sequences as a chart (`spruce bench offline --plot`)."""

from __future__ import annotations

PLOT_COUNTS = (1, 4, 16, 64)  # parallel sequences


def plot_scaling(curves: dict[str, dict[int, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(PLOT_COUNTS, [str(n) for n in PLOT_COUNTS])
    ax.set_yscale("log")
    ax.set_xlabel("parallel sequences (128 prompt + 128 generated tokens each)")
    ax.set_ylabel("output tokens/s (end to end)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
