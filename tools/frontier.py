"""The memory/time Pareto frontier of a block graph, or of a whole job from its saved frontier.

    python tools/frontier.py --graph GRAPH.json [--json] [--plot out.png] [--max-points N]
    python tools/frontier.py --saved FRONTIER.json [--json] [--plot out.png]

``--graph`` takes either the abstract form ``{"ops": {name: {"time", "bytes", "deps"}},
"read": [names]}`` (each op makes one value in its own storage; memory is the sum of kept
values' bytes) or a block graph measured from a real model (``tapesac.planner.graph.BlockGraph``
JSON, with storages, aliasing and always-available values). ``--saved`` takes the step-level
frontier a TapeSAC run writes (``frontier.json``), with its baselines if present, and only
prints or plots it.

With ``--json`` stdout is ``{"block_replay_time", "replay_only_time", "frontier": [{"kept",
"recompute_time", "memory"}, ...]}``: one entry per Pareto-optimal (memory, time) pair, memory
ascending.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tapesac.errors import TapeSACError  # noqa: E402
from tapesac.planner.graph import BlockGraph  # noqa: E402
from tapesac.planner.milp import frontier  # noqa: E402
from tapesac.plot import plot_frontier  # noqa: E402


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def block_frontier(data: dict, max_points: int | None) -> dict:
    g = BlockGraph.from_json(data) if "op_time_s" in data else BlockGraph.from_abstract(data)
    points = frontier(g, max_points=max_points)
    return {
        "block_replay_time": _num(g.block_replay_time()),
        "replay_only_time": _num(g.replay_only_time()),
        "frontier": [
            {"kept": [g.value_name(v) for v in p.kept], "recompute_time": _num(p.time), "memory": _num(p.memory)}
            for p in points
        ],
    }


def print_table(result: dict) -> None:
    if "block_replay_time" in result:
        print(f"full block replay time: {result['block_replay_time']}")
        print(f"replay-only time:       {result['replay_only_time']}")
    else:
        print(result.get("title", "frontier"))
    print(f"{'memory':>14}  {'recompute time':>16}  kept")
    for p in result["frontier"]:
        kept = ", ".join(map(str, p["kept"])) or "-"
        if len(kept) > 60:
            kept = f"{len(p['kept'])} values"
        print(f"{p['memory']:>14}  {p['recompute_time']:>16}  {kept}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--graph", help="block graph JSON (abstract or measured)")
    src.add_argument("--saved", help="a frontier.json written by a TapeSAC run")
    ap.add_argument("--json", action="store_true", help="print the frontier as JSON")
    ap.add_argument("--plot", help="draw the frontier into this PNG file")
    ap.add_argument("--max-points", type=int, default=None,
                    help="at most this many points (default: every Pareto point)")
    a = ap.parse_args(argv)
    try:
        with open(a.graph or a.saved) as f:
            data = json.load(f)
        result = data if a.saved else block_frontier(data, a.max_points)
    except (OSError, json.JSONDecodeError, TapeSACError) as e:
        print(f"frontier: {e}", file=sys.stderr)
        return 2
    if a.json:
        json.dump(result, sys.stdout)
        print()
    else:
        print_table(result)
    if a.plot:
        plot_frontier(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
