"""Frontier plots (matplotlib is optional: only imported here)."""

from __future__ import annotations


def plot_frontier(result: dict, path) -> None:
    """Draw a frontier (and labelled baseline points, if any) into a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = result["frontier"]
    xs = [p["memory"] for p in pts]
    ys = [p["recompute_time"] for p in pts]
    # With at least a point's memory, its time is reachable: a staircase, not a line.
    ax.step(xs, ys, where="post", color="tab:blue")
    ax.plot(xs, ys, "o", color="tab:blue", label="TapeSAC frontier")
    for b in result.get("baselines", []):
        ax.plot([b["memory"]], [b["recompute_time"]], "s", label=b["policy"])
        ax.annotate(b["policy"], (b["memory"], b["recompute_time"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel(result.get("memory_label", "memory (bytes kept)"))
    ax.set_ylabel(result.get("time_label", "recompute time"))
    ax.set_title(result.get("title", "TapeSAC frontier"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
