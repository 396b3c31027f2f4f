"""Planned mode in each loop shape a trainer uses: limit, predicted and measured step peaks.

    python tools/bench_loops.py [--steps 6] [--json out.json]

For each loop (tests/loops.py: gradient accumulation with forwards first or interleaved, a block
applied twice, a retained graph, dropout, and a sequence length that changes), the limit is put
halfway between the smallest and the largest useful predicted peak of a first plan; the loop then
trains ``--steps`` steps under that limit. Each step is measured twice: by TapeSAC's storage
counter (entered around the whole step) and, independently, by the PyTorch profiler's allocator
events. Gradients are compared bit for bit with the same run without TapeSAC.

Reported per loop: the limit, the plan's predicted peak, TapeSAC's own measured peak of the first
planned step (its verify), and the largest peak of any step after the first plan by both meters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import tapesac  # noqa: E402
from tapesac.autoplan import PlanConfig  # noqa: E402
from tests.loops import LOOPS, Model, forwards_first, train  # noqa: E402

SEQ = 48


def span(loop, model_fn, seq: int) -> tuple[float, float]:
    """(smallest, largest useful) predicted step peak of a loop, from a first plan."""
    probe = model_fn()
    h = tapesac.wrap(probe.layers, plan_config=PlanConfig(memory_limit_bytes=10**12))
    train(probe, loop, [seq] * 3)
    h.remove()
    return h.plan.smallest_peak_bytes, h.plan.largest_useful_peak_bytes


def run(name: str, loop, model_fn, seqs: list[int], limit: float | None = None) -> dict:
    if limit is None:
        lo, hi = span(loop, model_fn, seqs[0])
        limit = lo + 0.5 * (hi - lo)
    expected = train(model_fn(), loop, seqs)
    model = model_fn()
    handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=int(limit)))
    try:
        actual = train(model, loop, seqs, handle, allocator=True)
    finally:
        handle.remove()
    exact = all(
        all(torch.equal(a, b) for a, b in zip(le, la)) and ge.keys() == ga.keys()
        and all(torch.equal(ge[k], ga[k]) for k in ge)
        for (le, ge, *_), (la, ga, *_) in zip(expected, actual))
    history = handle.planner.history
    first = min(r["step"] for r in history) - 1 if history else len(seqs)
    after = actual[first:]
    return {
        "loop": name, "steps": len(seqs), "limit_bytes": int(limit),
        "predicted_peak_bytes": [r["predicted_peak_bytes"] for r in history],
        "tapesac_verify_bytes": [r["measured_peak_bytes"] for r in history],
        "max_counter_bytes": max(p for *_x, p, _a in after) if after else None,
        "max_allocator_bytes": max(a for *_x, a in after) if after else None,
        "plans": len(handle.planner.plans), "exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (loop, model_fn) in LOOPS.items():
        rows.append(run(name, loop, model_fn, [SEQ] * a.steps))
        print(f"{name}: done", file=sys.stderr, flush=True)
    # A sequence length that changes: plan at 24 (everything fits), then 192 (replay-only's peak).
    long_lo, _ = span(forwards_first(1), Model, 192)
    seqs = [24] * 3 + [192] * 3 + [24] * 2 + [192] * 2
    rows.append(run("sequence 24 -> 192 -> 24 -> 192", forwards_first(1), Model, seqs, limit=long_lo * 1.05))
    mib = 2**20
    print(f"\n{'loop':34} {'limit':>8} {'predicted':>10} {'verify':>8} {'counter':>8} {'profiler':>9}  plans exact")
    for r in rows:
        pred = max(r["predicted_peak_bytes"]) / mib if r["predicted_peak_bytes"] else float("nan")
        ver = max(r["tapesac_verify_bytes"]) / mib if r["tapesac_verify_bytes"] else float("nan")
        print(f"{r['loop']:34} {r['limit_bytes'] / mib:8.3f} {pred:10.3f} {ver:8.3f} "
              f"{r['max_counter_bytes'] / mib:8.3f} {r['max_allocator_bytes'] / mib:9.3f}  {r['plans']:>5} {r['exact']}")
    print("(MiB; verify: TapeSAC's measurement of the first step under each plan; counter and profiler: "
          "the largest step peak after the first plan, by TapeSAC's counter and by the profiler's "
          "allocator events)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": str(date.today()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
