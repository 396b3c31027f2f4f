"""What planned mode writes for people and later runs: the policy, the step frontier (JSON and
PNG) and the measured block graphs. Only rank 0 calls these; nothing here is read back by the
driver except the policy (``tapesac.policy.Policy.load``)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from .planner import Plan
from .planner.graph import BlockGraph

log = logging.getLogger("tapesac")


def save_plan(plan: Plan, graphs: dict[int, BlockGraph] | None, *, policy_path: str | None,
              frontier_path: str | None, graph_dir: str | None) -> list[str]:
    """Write the plan's artifacts where configured; return the paths written."""
    written: list[str] = []
    if policy_path:
        plan.policy.save(policy_path)
        written.append(str(policy_path))
    if graph_dir and graphs:
        folder = Path(graph_dir)
        folder.mkdir(parents=True, exist_ok=True)
        kinds: set[str] = set()
        for b, g in sorted(graphs.items()):
            if g.signature not in kinds:
                kinds.add(g.signature)
                path = folder / f"block{b}_{g.signature}.json"
                path.write_text(json.dumps(g.to_json()))
                written.append(str(path))
    if frontier_path:
        path = Path(frontier_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = plan.frontier_json(graphs=graphs)
        path.write_text(json.dumps(data, indent=1))
        written.append(str(path))
        if plot_in_thread(data, path.with_suffix(".png")):
            written.append(str(path.with_suffix(".png")))
    return written


def plot_in_thread(data: dict, path: Path) -> bool:
    """Draw the frontier PNG on a short-lived thread; True if it was drawn.

    Importing matplotlib inside a training step would pin that step's call stack, and with it
    the model's activations, in tracebacks its import machinery keeps; on a thread of its own
    only that thread's frames are involved. A plot must never stop training.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return False
    drawn: list[bool] = []

    def draw() -> None:
        try:
            from .plot import plot_frontier

            plot_frontier(data, path)
            drawn.append(True)
        except Exception as e:  # noqa: BLE001 - a plot never stops training
            log.warning("TapeSAC: could not draw the frontier plot: %s", e)

    t = threading.Thread(target=draw, name="tapesac-plot")
    t.start()
    t.join()
    return bool(drawn)
