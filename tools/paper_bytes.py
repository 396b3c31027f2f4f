"""Claim 3 of docs/paper.md: bytes are not cost. One process, no torchtitan.

A stack of blocks, each with a custom kernel that the dispatcher sees as one opaque op (a
``torch.library`` custom op, as a Triton or CUDA kernel registered for ``torch.compile`` is),
trained with AdamW:

* ``equal``: the kernel (``K`` chained matmuls with tanh) and a plain ``Linear`` each make a
  ``[tokens, dim]`` tensor that backward reads. Equal bytes; the kernel costs ``K`` times more.
* ``tiny``: the kernel makes ``[tokens, 4]`` from ``K`` matmuls; beside it, a cheap
  ``repeat`` + SiLU makes ``[tokens, 4 * dim]``. Small output, large cost; large output, small cost.

Each policy runs the same model from the same weights on the same batches:

* eager: no AC, full AC (``torch.utils.checkpoint`` per block), TapeSAC planned at each compile
  point's measured peak;
* ``torch.compile`` without AC and with its activation memory budget (torchtitan's
  ``memory_budget`` mode): a knapsack over the ops it may recompute, which prices each op by
  FLOPs (``activation_memory_budget_runtime_estimator = "flops"``, the default); a custom op has no
  FLOP formula, so it is priced at one FLOP whatever it costs;
* TapeSAC+compile (``wrap(compile=True)``: TapeSAC plans from measured times, torch.compile runs the
  plan) at each compile budget's measured peak, so the two compiled columns compare selections at
  the same memory with the same kernels.

Measured per policy: step peak (parameters, gradients, optimizer state and batch, plus the CPU
allocator's highest running total during a step, from the profiler's allocator events: it sees
compiled code), median step time over interleaved rounds, and how many times the kernel ran per
step (a counter in the kernel: ``blocks`` if its output was kept, twice that if recomputed).

    .venv03/bin/python tools/paper_bytes.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the allocator meter's profiler, quietly

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tapesac  # noqa: E402
from tapesac.errors import PlanError  # noqa: E402
from tapesac.meter import AllocatorPeak  # noqa: E402

CALLS = {"kernel": 0}
"""Forward runs of the custom kernel (recomputations included), counted inside the kernel."""


TILE = 128
"""Rows per tile. The kernel works tile by tile, so its temporaries stay a tile's worth, as a GPU
kernel's stay in registers and shared memory: what the allocator sees is its outputs, so TapeSAC's
CPU storage counter and the allocator's events measure the same peaks."""


def _chain(h: Tensor, w: Tensor) -> Tensor:
    for i in range(w.shape[0]):
        h = torch.tanh(h @ w[i])
    return h


@torch.library.custom_op("tapesac_paper::chain", mutates_args=())
def chain(h: Tensor, w: Tensor, p: Tensor) -> Tensor:
    """``tanh`` chained over ``w``'s ``K`` matrices, then a projection by ``p``: ``K + 1``
    matmuls behind one op, its output ``[tokens, p.shape[1]]``."""
    CALLS["kernel"] += 1
    out = h.new_empty(h.shape[0], p.shape[1])
    for r in range(0, h.shape[0], TILE):
        torch.mm(_chain(h[r:r + TILE], w), p, out=out[r:r + TILE])
    return out


@chain.register_fake
def _(h: Tensor, w: Tensor, p: Tensor) -> Tensor:
    return h.new_empty(h.shape[0], p.shape[1])


@torch.library.custom_op("tapesac_paper::chain_backward", mutates_args=())
def chain_backward(h: Tensor, w: Tensor, p: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward, as a flash kernel's: it recomputes its own intermediates, a tile
    at a time."""
    dh, dw, dp = torch.empty_like(h), torch.zeros_like(w), torch.zeros_like(p)
    for r in range(0, h.shape[0], TILE):
        ts = [h[r:r + TILE]]
        for i in range(w.shape[0]):
            ts.append(torch.tanh(ts[-1] @ w[i]))
        g = grad[r:r + TILE]
        dp.addmm_(ts[-1].T, g)
        g = g @ p.T
        for i in reversed(range(w.shape[0])):
            g = g * (1 - ts[i + 1] * ts[i + 1])
            dw[i].addmm_(ts[i].T, g)
            g = g @ w[i].T
        dh[r:r + TILE] = g
    return dh, dw, dp


@chain_backward.register_fake
def _(h: Tensor, w: Tensor, p: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(h), torch.empty_like(w), torch.empty_like(p)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return chain_backward(*ctx.saved_tensors, grad)


chain.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    def __init__(self, kind: str, dim: int, k: int) -> None:
        super().__init__()
        if kind not in ("equal", "tiny"):
            raise ValueError(f"unknown block kind {kind!r}: equal or tiny")
        self.kind = kind
        self.norm = nn.RMSNorm(dim)
        self.w = nn.Parameter(torch.randn(k, dim, dim) / math.sqrt(dim))
        width = dim if kind == "equal" else 4
        self.p = nn.Parameter(torch.randn(dim, width) / math.sqrt(dim))
        self.lin = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        c = chain(h.reshape(b * t, d), self.w, self.p)
        if self.kind == "equal":  # equal bytes: the kernel's output and a Linear's
            m = self.lin(h)
            return x + self.out(F.gelu(c.view(b, t, d)) * F.gelu(m))
        # tiny: [tokens, 4] from the kernel, [tokens, 4 * dim] from a cheap repeat
        big = F.silu(self.lin(h).repeat(1, 1, 4)).view(b, t, 4, d)
        return x + self.out((big * c.view(b, t, 4, 1)).sum(2))


class Model(nn.Module):
    def __init__(self, kind: str, blocks: int, dim: int, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(kind, dim, k) for _ in range(blocks)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _own_code(block: nn.Module, tag: str) -> None:
    """A ``forward`` with a code object of its own: Dynamo caches graphs per code object and does
    not guard on the activation memory budget, so each compiled policy compiles its own."""
    cls = type(block)
    f = cls.forward
    name = "forward_" + "".join(c if c.isalnum() else "_" for c in tag)
    code = f.__code__.replace(co_name=name, co_qualname=name)
    block.__class__ = type(f"{cls.__name__}_{name}", (cls,), {
        "forward": types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)})


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class Runner:
    """One policy: its own model (same initial weights), AdamW, and how its blocks run."""

    def __init__(self, name: str, base: Model, *, budget: float | None = None, limit: int | None = None,
                 compiled: bool = False, full_ac: bool = False) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        self.budget = 1.0 if budget is None else budget
        self.limit = limit
        self.handle = None
        if full_ac:
            self.model.layers = nn.ModuleList([Checkpointed(b) for b in self.model.layers])
        if budget is not None:  # torch.compile with its memory budget: each block compiled
            for i, block in enumerate(self.model.layers):
                _own_code(block, name)
                self.model.layers[i] = torch.compile(block)
        if limit is not None:
            # Default settings: compiled mode plans by the eager memory model, which compiled code
            # peaks below (``compiled_raise_into_slack`` would trade that room for time).
            self.handle = tapesac.wrap(self.model.layers, memory_limit_bytes=limit, compile=compiled)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.calls: int | None = None

    def step(self, x: Tensor) -> float:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            t0 = time.perf_counter()
            x = x.clone()  # the batch arrives in the step, as from a data loader: every meter counts it
            loss = self.model(x)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

    def peak(self, x: Tensor) -> int:
        """Step peak: what lives across steps plus the allocator's highest running total."""
        alive = [*self.model.parameters(),
                 *(v for st in self.opt.state.values() for v in st.values() if isinstance(v, Tensor))]
        base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())
        before = CALLS["kernel"]
        for _ in range(2):  # the first profiled step also counts one-off allocations
            with AllocatorPeak() as meter:
                self.step(x)
        self.calls = (CALLS["kernel"] - before) // 2
        return base + meter.peak_bytes

    def plan_summary(self) -> dict | None:
        if self.handle is None or self.handle.plan is None:
            return None
        a = self.handle.plan.allocation
        return {"predicted_peak_bytes": a.predicted_peak_bytes, "recompute_s": a.recompute_s,
                "status": a.status, "kept_bytes_per_block": [p.memory for _, p in sorted(a.points.items())]}


def measure(kind: str, args, log) -> dict:
    base = Model(kind, args.blocks, args.dim, args.k)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.seq, args.dim, generator=gen) for _ in range(2)]
    budgets = [float(b) for b in args.budgets.split(",")]

    def warm(r: Runner) -> Runner:
        for i in range(args.warmup):
            r.step(xs[i % 2])
        return r

    eager = [warm(Runner("eager no AC", base)), warm(Runner("eager full AC", base, full_ac=True))]
    compiled = [warm(Runner("compile no AC", base, budget=1.0))]
    compiled += [warm(Runner(f"compile budget {b}", base, budget=b)) for b in budgets]
    peaks = {r.name: r.peak(xs[0]) for r in eager + compiled}
    log(f"{kind}: " + ", ".join(f"{n} {p / 2**20:.1f} MiB" for n, p in peaks.items()))
    limits = {f"{r.name} peak": peaks[r.name] for r in compiled}
    limits["eager full AC peak"] = peaks["eager full AC"]
    limits["eager midpoint"] = (peaks["eager full AC"] + peaks["eager no AC"]) // 2
    planned, refused = [], []
    for where, limit in sorted(limits.items(), key=lambda kv: kv[1]):
        for compiled_mode in (False, True):
            name = f"TapeSAC{'+compile' if compiled_mode else ''} @ {where}"
            r = Runner(name, base, limit=limit, compiled=compiled_mode)
            try:
                planned.append(warm(r))
            except PlanError as e:  # below what the plan can reach: TapeSAC refuses, before training
                r.handle.remove()
                refused.append({"policy": name, "limit_bytes": limit, "refused": str(e).split(":")[0]})
                log(f"{kind}: {name}: refused ({limit / 2**20:.1f} MiB)")
    for r in planned:
        peaks[r.name] = r.peak(xs[0])
    runners = eager + compiled + planned
    for _ in range(args.rounds):  # interleaved: every policy once per round
        for r in runners:
            r.times.extend(r.step(xs[i % 2]) for i in range(args.steps))
    rows = []
    for r in runners:
        rows.append({"policy": r.name, "peak_bytes": peaks[r.name], "step_s": statistics.median(r.times),
                     "kernel_calls_per_step": r.calls, "budget": r.budget if r.name.startswith("compile budget") else None,
                     "limit_bytes": r.limit,
                     "plan": r.plan_summary()})
        log(f"{kind}: {r.name}: {peaks[r.name] / 2**20:.1f} MiB, {rows[-1]['step_s'] * 1e3:.1f} ms, "
            f"kernel x{r.calls}")
    for r in planned:
        r.handle.remove()
    return {"kind": kind, "rows": rows, "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, one round: a smoke run")
    ap.add_argument("--kinds", default="equal,tiny")
    ap.add_argument("--budgets", default="0.8,0.5,0.2")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--k", type=int, default=8, help="matmuls chained inside the kernel")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per policy per round")
    ap.add_argument("--warmup", type=int, default=6, help="steps before measuring (TapeSAC profiles and plans)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    unknown = set(args.kinds.split(",")) - {"equal", "tiny"}
    if unknown:
        ap.error(f"--kinds: unknown block kind(s) {', '.join(sorted(unknown))}; choose from equal, tiny")
    if args.quick:
        args.blocks, args.dim, args.seq, args.rounds, args.budgets = 2, 64, 64, 1, "0.5"
    torch.manual_seed(0)
    results = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "kinds": [],
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    for kind in args.kinds.split(","):
        results["kinds"].append(measure(kind, args, lambda m: print(m, file=sys.stderr, flush=True)))
    text = json.dumps(results, indent=1)
    if args.json is not None:
        args.json.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
