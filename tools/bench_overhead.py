"""TapeSAC's own cost per ATen op, on blocks so small that the ops themselves cost next to nothing.

A stack of 4 torchtitan llama3 blocks (dim 64, 2 heads, seq 16, batch 1, float32, one thread):
every op is tiny, so what a step costs beyond plain autograd is Python machinery. Measured side
by side in one process, alternating, medians over rounds:

* forward, per op dispatched: plain; under a dispatch mode that does nothing (the floor of any
  dispatcher-level recorder); TapeSAC recording every forward; TapeSAC recording every forward
  as a verification forward (``verifying``: every saved tensor fingerprinted, every rebuilt one
  checked in backward, what the first forward of each program and profiled and measured steps
  pay); TapeSAC as it runs by default (forwards follow their verified tape where they can);
* backward, per op replayed: TapeSAC's backward minus plain backward, over the ops it replayed.

Times are this process's CPU time (``time.process_time``, one thread): on a shared machine wall
time also counts whatever else took the core.

    python tools/bench_overhead.py [--rounds 60] [--json out.json]

``--record-only`` is for commits before following existed (it skips the modes they lack).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tapesac
from bench_replay import BlockStack, OpCounter  # tools/ is on the path when run as a script


class _Null(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def build() -> tuple[BlockStack, torch.Tensor]:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=64, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=256, max_seq_len=16)
    base = Transformer(args)
    with torch.no_grad():
        base.init_weights(buffer_device=torch.device("cpu"))
    return BlockStack(list(base.layers.values()), base.freqs_cis), torch.randn(1, 16, 64)


def _no_follow(handle) -> None:
    """Record every forward: no block keeps a tape to follow."""
    for state in handle.blocks:
        state.follow = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--json")
    ap.add_argument("--record-only", action="store_true", help="no following (commits before it)")
    ap.add_argument("--no-verifying", dest="verifying", action="store_false",
                    help="no verification forwards (commits before them)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, h0 = build()
    count = OpCounter()
    with count:
        model(h0.detach().requires_grad_())
    n_ops = count.n
    runs = {"plain": model}
    handles = {}
    kinds = ["recording"] if args.record_only else ["recording", "default"]
    if args.verifying:
        kinds.insert(1, "verifying")
    for kind in kinds:
        m = copy.deepcopy(model)
        handles[kind] = tapesac.wrap(list(m.layers), **({"verify_every": 1} if kind == "verifying" else {}))
        if kind in ("recording", "verifying") and not args.record_only:
            _no_follow(handles[kind])
        runs[kind] = m

    def forward(m, mode=None) -> float:
        x = h0.detach().requires_grad_()
        t0 = time.process_time()
        if mode is None:
            out = m(x)
        else:
            with mode:
                out = m(x)
        elapsed = time.process_time() - t0
        del out
        return elapsed

    def backward(m) -> float:
        loss = m(h0.detach().requires_grad_()).sum()
        t0 = time.process_time()
        loss.backward()
        elapsed = time.process_time() - t0
        m.zero_grad(set_to_none=True)
        return elapsed

    for _ in range(5):
        for m in runs.values():
            backward(m)
    fwd = {k: [] for k in ["plain", "null", *kinds]}
    bwd = {k: [] for k in ["plain", *kinds]}
    for _ in range(args.rounds):
        fwd["plain"].append(forward(model))
        fwd["null"].append(forward(model, _Null()))
        for k in kinds:
            fwd[k].append(forward(runs[k]))
        for k in ["plain", *kinds]:
            bwd[k].append(backward(runs[k]))
    replayed = {k: sum(s["ops_replayed"] for s in handles[k].stats().values()) for k in kinds}
    med_f = {k: statistics.median(v) for k, v in fwd.items()}
    med_b = {k: statistics.median(v) for k, v in bwd.items()}
    result = {
        "ops_per_forward": n_ops,
        "forward_us_per_op": {k: 1e6 * v / n_ops for k, v in med_f.items()},
        "forward_overhead_us_per_op": {k: 1e6 * (v - med_f["plain"]) / n_ops for k, v in med_f.items() if k != "plain"},
        "ops_replayed": replayed,
        "backward_overhead_us_per_replayed_op": {k: 1e6 * (med_b[k] - med_b["plain"]) / max(replayed[k], 1)
                                                 for k in kinds},
        "followed": {k: [bool(s.get("followed")) for s in handles[k].stats().values()] for k in kinds},
    }
    print(f"{n_ops} ops per forward, {args.rounds} rounds (medians)")
    print("forward, per op: " + ", ".join(f"{k} {v:.1f} us" for k, v in result["forward_us_per_op"].items()))
    print("forward overhead over plain, per op: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in result["forward_overhead_us_per_op"].items()))
    print("backward overhead per replayed op: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in result["backward_overhead_us_per_replayed_op"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
