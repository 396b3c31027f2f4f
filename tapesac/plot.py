"""Frontier plots (matplotlib is optional: only imported here)."""

from __future__ import annotations

from typing import Any

from .report import fmt_number, frontier_axes

# Labels of a step frontier's ends, for files written before ``frontier.json`` named them.
STEP_ENDS = ("replay-only (full-AC memory)", "keep everything useful (no-AC-like memory)")


def frontier_figure(result: dict[str, Any]):
    """A matplotlib ``Figure`` of a frontier dict (see ``Plan.frontier_json``).

    Draws the frontier as a staircase (with at least a point's memory, its time is reachable),
    labelled baseline points if any, the limit (``limit_bytes``) as a vertical line labelled with
    its value, the chosen plan (``chosen``) as a star labelled with its peak and recompute time,
    further staircases (``frontiers``: a list of ``{"label", "points"}``, points as in ``frontier``),
    and the two ends with ``ends`` (a run's ``frontier.json`` without ``ends`` gets ``STEP_ENDS``).
    Memory shows in KiB/MiB/GiB as its range needs, time in ms (``report.frontier_axes``).
    The figure is not attached to pyplot: nothing global is touched, so it is safe on any thread.
    """
    from matplotlib.figure import Figure

    axes = frontier_axes(result)
    mem_u = f" {axes.memory_unit}" if axes.memory_unit else ""
    time_u = f" {axes.time_unit}" if axes.time_unit else ""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    pts = result["frontier"]
    xs = [axes.memory(p["memory"]) for p in pts]
    ys = [axes.time(p["recompute_time"]) for p in pts]
    ax.step(xs, ys, where="post", color="tab:blue")
    ax.plot(xs, ys, "o", color="tab:blue", label=result.get("frontier_label", "TapeSAC frontier"))

    ends = result.get("ends") or (STEP_ENDS if "limit_bytes" in result else None)
    if ends and pts:
        ax.annotate(ends[0], (xs[0], ys[0]), xytext=(6, 6), textcoords="offset points",
                    fontsize=8, va="bottom", ha="left")
        if len(pts) > 1:
            ax.annotate(ends[1], (xs[-1], ys[-1]), xytext=(-4, 10), textcoords="offset points",
                        fontsize=8, va="bottom", ha="right")

    for colour, extra in zip(("black", "tab:purple", "tab:brown"), result.get("frontiers", [])):
        exs = [axes.memory(p["memory"]) for p in extra["points"]]
        eys = [axes.time(p["recompute_time"]) for p in extra["points"]]
        ax.step(exs, eys, where="post", color=colour)
        ax.plot(exs, eys, "D", color=colour, label=extra["label"])

    for b in result.get("baselines", []):
        x, y = axes.memory(b["memory"]), axes.time(b["recompute_time"])
        ax.plot([x], [y], "s", label=b["policy"])
        ax.annotate(b["policy"], (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")

    limit = result.get("limit_bytes")
    if limit is not None:
        x = axes.memory(limit)
        ax.axvline(x, color="tab:red", linestyle="--", linewidth=1.2, label="memory limit")
        ax.annotate(f"limit {fmt_number(x)}{mem_u}", (x, 1), xycoords=("data", "axes fraction"),
                    xytext=(-3, -4), textcoords="offset points", rotation=90, ha="right", va="top",
                    fontsize=8, color="tab:red")

    chosen = result.get("chosen")
    if chosen is not None:
        x, y = axes.memory(chosen["memory"]), axes.time(chosen["recompute_time"])
        ax.plot([x], [y], "*", markersize=15, color="tab:orange", markeredgecolor="black", zorder=5,
                label="chosen plan")
        ax.annotate(f"chosen plan: peak {fmt_number(x)}{mem_u},\nrecompute {fmt_number(y)}{time_u}",
                    (x, y), xytext=(-30, -40), textcoords="offset points", fontsize=8, ha="right", va="top",
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8},
                    bbox={"boxstyle": "round", "fc": "white", "ec": "tab:orange"})

    ax.ticklabel_format(useOffset=False, style="plain")
    ax.margins(x=0.06, y=0.12)
    ax.set_xlabel(axes.memory_title())
    ax.set_ylabel(axes.time_title())
    ax.set_title(result.get("title", "TapeSAC frontier"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_frontier(result: dict[str, Any], path) -> None:
    """Draw ``frontier_figure(result)`` into a PNG file."""
    frontier_figure(result).savefig(path, dpi=120)
