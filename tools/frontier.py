"""The memory/time Pareto frontier of a block graph, or of a whole job from its saved frontier.

    python tools/frontier.py --graph GRAPH.json [--json] [--plot out.png] [--max-points N]
    python tools/frontier.py --saved FRONTIER.json [--json] [--plot out.png]
    python tools/frontier.py --graph tests/data/worked_example.json    # a 5-op example

``--graph`` takes either the abstract form ``{"ops": {name: {"time", "bytes", "deps"}},
"read": [names]}`` (each op makes one value in its own storage; memory is the sum of kept
values' bytes; units are the file's own) or a block graph measured from a real model
(``tapesac.planner.graph.BlockGraph`` JSON, with storages, aliasing and always-available values;
bytes and seconds, shown in KiB/MiB/GiB and ms). ``--saved`` takes the step-level frontier a
TapeSAC run writes (``frontier.json``, see ``Plan.frontier_json``), with its baselines if present,
and prints it in MiB/GiB and ms with the limit as a rule across the table, the chosen plan's row
marked ``*`` and, where the file has them, the chosen plan's kept values per block kind.

With ``--json`` stdout is ``{"block_replay_time", "replay_only_time", "frontier": [{"kept",
"recompute_time", "memory"}, ...]}``: one entry per Pareto-optimal (memory, time) pair, memory
ascending; measured graphs add ``"memory_unit": "bytes", "time_unit": "s"``. ``--saved --json``
prints the file as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tapesac.errors import TapeSACError  # noqa: E402
from tapesac.planner.graph import BlockGraph  # noqa: E402
from tapesac.planner.milp import frontier  # noqa: E402
from tapesac.plot import STEP_ENDS, plot_frontier  # noqa: E402
from tapesac.report import block_ranges, fmt_number, frontier_axes, group_names  # noqa: E402


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


# What the ends of a block's frontier are (a run's step frontier names its own in "ends").
BLOCK_ENDS = ("replay-only: keeps nothing", "keeps everything useful: no replay")


def block_frontier(data: dict, max_points: int | None) -> dict:
    measured = "op_time_s" in data
    g = BlockGraph.from_json(data) if measured else BlockGraph.from_abstract(data)
    points = frontier(g, max_points=max_points)
    result = {
        "block_replay_time": _num(g.block_replay_time()),
        "replay_only_time": _num(g.replay_only_time()),
        "frontier": [
            {"kept": [g.value_name(v) for v in p.kept], "recompute_time": _num(p.time), "memory": _num(p.memory)}
            for p in points
        ],
    }
    if measured:  # abstract graphs are in the file's own units
        result.update({"memory_unit": "bytes", "time_unit": "s"})
    return result


def _is_chosen(p: dict, chosen: dict | None) -> bool:
    return chosen is not None and math.isclose(p["memory"], chosen["memory"], rel_tol=1e-9) and \
        math.isclose(p["recompute_time"], chosen["recompute_time"], rel_tol=1e-9, abs_tol=1e-12)


def _rows(result: dict, ends: tuple[str, str] | None) -> list[dict]:
    """The frontier's points with their notes: the ends named, the chosen plan flagged (and
    inserted where it is not one of the swept points)."""
    rows = [dict(p) for p in result["frontier"]]
    if ends and rows:
        rows[0]["note"] = ends[0]
        if len(rows) > 1:
            rows[-1]["note"] = ends[1]
    chosen = result.get("chosen")
    if chosen is not None:
        at = next((p for p in rows if _is_chosen(p, chosen)), None)
        if at is None:  # solved for its own limit, off the greedy sweep: a row of its own
            how = f", status {chosen['status']}" if chosen.get("status") else ""
            at = {"memory": chosen["memory"], "recompute_time": chosen["recompute_time"],
                  "note": f"chosen plan (solved for this limit alone{how}; other rows: one greedy sweep over limits)"}
            rows.append(at)
            rows.sort(key=lambda p: (p["memory"], -p["recompute_time"]))
        at["chosen"] = True
    return rows


def table_lines(result: dict, source: str | None = None) -> list[str]:
    """The frontier as a table, in MiB/GiB and ms where the data has units.

    Rows go smallest memory first; the ends say what they are, a run's limit is a rule across the
    table at its place, and the chosen plan's row is marked ``*``, followed by what it keeps per
    block kind.
    """
    axes = frontier_axes(result)
    mem_u = f" {axes.memory_unit}" if axes.memory_unit else ""
    time_u = f" {axes.time_unit}" if axes.time_unit else ""
    mem = lambda x: f"{fmt_number(axes.memory(x))}{mem_u}"  # noqa: E731
    dur = lambda x: f"{fmt_number(axes.time(x))}{time_u}"  # noqa: E731
    block = "block_replay_time" in result
    limit, chosen = result.get("limit_bytes"), result.get("chosen")
    lines = []
    if block:
        lines.append(f"block frontier of {source}" + ("" if axes.memory_unit else " (units as in the file)"))
        lines.append(f"full block replay time: {dur(result['block_replay_time'])}  (every op: what full AC reruns)")
        lines.append(f"replay-only time:       {dur(result['replay_only_time'])}  (only what backward reads)")
    else:
        lines.append(result.get("title", "frontier"))
    if limit is not None:
        lines.append(f"limit: {mem(limit)}")
    if chosen is not None:
        lines.append(f"chosen plan (*): {axes.memory_label} {mem(chosen['memory'])}, "
                     f"{axes.time_label} {dur(chosen['recompute_time'])}")

    ends = result.get("ends") or (BLOCK_ENDS if block else STEP_ENDS if limit is not None else None)
    rows = _rows(result, ends)
    # Step frontiers written before kept sets were saved hold "kept": [] everywhere: say nothing.
    show_kept = any(p.get("kept") for p in rows)
    mem_h, time_h = axes.memory_title(), axes.time_title()
    mem_w, time_w = max(len(mem_h), 12), max(len(time_h), 14)
    lines.append(f"  {mem_h:>{mem_w}}  {time_h:>{time_w}}  {'kept' if show_kept else ''}".rstrip())
    rule = f"  {'-' * (mem_w + time_w + 2)}  limit {mem(limit)}" if limit is not None else None
    for p in rows:
        if rule and p["memory"] > limit:
            lines.append(rule)
            rule = None
        notes = [group_names(p.get("kept") or []) or "nothing"] if show_kept else []
        if p.get("note"):
            notes.append(f"({p['note']})" if show_kept else p["note"])
        lines.append(f"{'*' if p.get('chosen') else ' '} {fmt_number(axes.memory(p['memory'])):>{mem_w}}  "
                     f"{fmt_number(axes.time(p['recompute_time'])):>{time_w}}  {' '.join(notes)}".rstrip())
    if rule:
        lines.append(rule)

    if chosen is not None and chosen.get("keeps"):
        lines.append("chosen plan (*), per block kind:")
        for k in chosen["keeps"]:
            n = len(k["blocks"])
            what = k.get("summary") or f"keeps {len(k['kept'])} values (the file does not name them)"
            lines.append(f"  kind {k['kind'][:8]}, block{'s' if n > 1 else ''} {block_ranges(k['blocks'])} "
                         f"({n} block{'s' if n > 1 else ''}): {mem(k['kept_bytes'])} kept and "
                         f"{dur(k['recompute_time'])} recompute per block; {what}")
    return lines


def print_table(result: dict, source: str | None = None) -> None:
    print("\n".join(table_lines(result, source)))


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
        print_table(result, a.graph or a.saved)
    if a.plot:
        if a.graph:
            result = {"title": f"block frontier of {os.path.basename(a.graph)}", "ends": BLOCK_ENDS, **result}
        plot_frontier(result, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
