"""Run random block programs under TapeSAC and plain autograd and compare them bit for bit.

    python tools/fuzz.py [--count N] [--start S] [--seed S] [--loop NAME] [--json out.json]

Seeds ``start .. start+count-1`` each run their default loop shape (``seed % number of loops``)
unless ``--loop`` names one; ``--seed S`` runs a single program (the repro every failure prints).
Prints outcomes per loop shape, refusals and mismatches grouped by kind, the seeds of every
mismatch, and how often each generator feature appeared. Exits 1 if any program mismatched.
See tests/fuzz.py for the generator, the loops and what each outcome means.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests import fuzz  # noqa: E402


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200, help="programs to run (default 200)")
    ap.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--seed", type=int, help="run this one seed (overrides --count/--start)")
    ap.add_argument("--loop", choices=sorted(fuzz.LOOPS), help="run every seed under this loop shape")
    ap.add_argument("--skip", default="", help="leave these steps out (block.step,...): a shrunk repro")
    ap.add_argument("--shrink", action="store_true",
                    help="shrink each failing program shown to the fewest steps that still fail alike")
    ap.add_argument("--json", help="write every outcome to this file")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every non-MATCH outcome as it comes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.count)
    outcomes: list[fuzz.Outcome] = []
    features: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    for n, seed in enumerate(seeds):
        out = fuzz.check(seed, args.loop, frozenset(filter(None, args.skip.split(","))))
        if args.shrink and args.seed is not None and out.status != fuzz.MATCH:
            out = fuzz.shrink(out)
        outcomes.append(out)
        features.update(fuzz.features_of(seed))
        if args.verbose or args.seed is not None:
            if out.status != fuzz.MATCH or args.seed is not None:
                print(out.message(), flush=True)
                print(f"  program: {fuzz.describe(seed, out.skip)}", flush=True)
        if len(seeds) >= 200 and (n + 1) % 200 == 0:
            print(f"... {n + 1}/{len(seeds)} programs, {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    elapsed_s = time.perf_counter() - t0

    per_loop: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        per_loop[o.loop][o.status] += 1
    rows = [["loop", *fuzz.OUTCOMES, "total"]]
    for loop in fuzz.LOOPS:
        if loop in per_loop:
            c = per_loop[loop]
            rows.append([loop, *(str(c[s]) for s in fuzz.OUTCOMES), str(sum(c.values()))])
    total = collections.Counter(o.status for o in outcomes)
    rows.append(["all", *(str(total[s]) for s in fuzz.OUTCOMES), str(len(outcomes))])
    print(f"\n{len(outcomes)} programs in {elapsed_s:.1f} s ({1000 * elapsed_s / max(len(outcomes), 1):.0f} ms each)\n")
    print(_table(rows))

    for status in (fuzz.REFUSED, fuzz.BOTH_RAISED, fuzz.MISMATCH):
        groups: dict[str, list[fuzz.Outcome]] = collections.defaultdict(list)
        for o in outcomes:
            if o.status == status:
                groups[o.kind].append(o)
        if not groups:
            continue
        print(f"\n{status} by kind:")
        for kind, os_ in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            loops = collections.Counter(o.loop for o in os_)
            print(f"  {len(os_):5d}  {kind}")
            print(f"         loops: {', '.join(f'{k} {v}' for k, v in loops.most_common())}")
            if status == fuzz.MISMATCH:
                print(f"         seeds: {' '.join(str(o.seed) for o in os_[:40])}{' ...' if len(os_) > 40 else ''}")
                by_loop: dict[str, list[fuzz.Outcome]] = collections.defaultdict(list)
                for o in os_:
                    by_loop[o.loop].append(o)
                for loop, group in by_loop.items():
                    o = min(group, key=lambda o: (fuzz.program_size(o.seed), o.seed))
                    if args.shrink:
                        o = fuzz.shrink(o)
                    print(f"         smallest {loop}: {o.repro}  ({fuzz.program_size(o.seed, o.skip)} steps; "
                          f"{o.notes})")
                    if args.shrink:
                        print(f"           program: {fuzz.describe(o.seed, o.skip)}")

    print(f"\nfeatures (programs containing each, of {len(outcomes)}):")
    for name in fuzz.all_features():
        print(f"  {features[name]:6d}  {100 * features[name] / max(len(outcomes), 1):5.1f}%  {name}")

    if args.json:
        Path(args.json).write_text(json.dumps({
            "elapsed_s": elapsed_s,
            "outcomes": [{"seed": o.seed, "loop": o.loop, "status": o.status, "kind": o.kind,
                          "detail": o.detail, "notes": o.notes, "repro": o.repro} for o in outcomes],
            "features": dict(features),
        }, indent=1))
    return 1 if total[fuzz.MISMATCH] else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
