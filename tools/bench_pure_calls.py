"""What running pure module calls without the dispatch mode saves (``tapesac.segments``).

The llama3 stack of ``tools/bench_replay.py`` (full size, or ``--quick``), forward only, in turn
in one process: unwrapped; under a dispatch mode that does nothing; TapeSAC replay-only following
its verified tapes with pure calls run unobserved; the same with ``BlockState.pure_calls = False``
(every op under the mode). Medians of per-round ratios to unwrapped; this process's CPU time.

    python tools/bench_pure_calls.py [--quick] [--rounds 16] [--model llama3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import tapesac
from bench_replay import _NullMode, build_models, tune_malloc  # tools/ is on the path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--model", default="llama3", choices=["llama3", "llama3_frozen", "llama3_router"])
    args = ap.parse_args()
    tune_malloc()
    torch.set_num_threads(1)
    model, h0 = build_models(args.quick)[args.model]
    runs = {"unwrapped": (model, None), "null mode": (model, _NullMode)}
    for name, pure in (("pure calls on", True), ("pure calls off", False)):
        m = copy.deepcopy(model)
        for state in tapesac.wrap(list(m.layers)).blocks:
            state.pure_calls = pure
        runs[name] = (m, None)
    for _ in range(3):  # recorded twice, then followed
        for m, _mode in runs.values():
            m(h0.detach().requires_grad_()).sum().backward()

    def forward(m: torch.nn.Module, mode) -> float:
        x = h0.detach().requires_grad_()
        t0 = time.process_time()
        if mode is None:
            out = m(x)
        else:
            with mode():
                out = m(x)
        elapsed = time.process_time() - t0
        del out
        return elapsed

    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(args.rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k].append(forward(*runs[k]))
    base = times["unwrapped"]
    print(f"{args.model} ({'quick' if args.quick else 'full'} size), {args.rounds} rounds, "
          f"unwrapped forward {1e3 * statistics.median(base):.1f} ms (CPU time); forward overhead:")
    for k in names[1:]:
        ratio = statistics.median(a / b for a, b in zip(times[k], base))
        print(f"  {k}: {100 * (ratio - 1):+.2f}%")


if __name__ == "__main__":
    main()
