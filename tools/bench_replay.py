"""Targeted replay against full activation checkpointing, side by side in one process on CPU.

For each model (a stack of torchtitan llama3 blocks; the same with frozen weights; the same with
a no-grad router-statistics branch) this times one forward+backward step under: no
checkpointing, full AC through torchtitan's wrapper (``early_stop`` False, torchtitan's
default, and True), and TapeSAC targeted replay. Policies alternate within every round, so
drift of the machine hits all of them alike. Also reported, from one extra step per policy:

* step-peak memory, measured by ``tapesac.meter.StorageCounter`` (a storage-counting dispatch
  mode: bytes of live tensor storages, parameters and input included, allocator caching not);
* ops recomputed per block: ops dispatched in backward minus those of backward without AC;
* recomputed GFLOP per step: FLOPs counted in backward minus those of backward without AC
  (``torch.utils.flop_counter``; exact, unlike times);
* TapeSAC's recording overhead: forward time wrapped vs. unwrapped, median of the ratios of
  alternating pairs (outputs freed after the clock stops).

Timing noise on a small shared CPU machine is mostly page faults: glibc returns large freed
blocks to the kernel and every step faults them in again. ``tune_malloc`` keeps freed memory in
the heap (raised mmap and trim thresholds) for every policy alike.

Sizes (``model_sizes``): 4 blocks, dim 512, 8 heads (4 KV heads), seq 512, batch 2, float32, 15
rounds; ``--quick``: 2 blocks, dim 256, seq 256, batch 2, 3 rounds. The first line printed says
which.

    python tools/bench_replay.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import statistics
import time

CLOCK = time.perf_counter
"""What step times are read from: wall time, or this process's CPU time (``--clock cpu``: on a
shared machine it leaves out the time other jobs took the core)."""
from typing import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

import tapesac
from tapesac.meter import StorageCounter


class BlockStack(nn.Module):
    """Blocks applied in sequence to a given hidden state, with the rope table they need."""

    def __init__(self, layers: list[nn.Module], freqs_cis: torch.Tensor) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, self.freqs_cis, attention_masks=None)
        return h


class RouterStats(nn.Module):
    """A llama3 block preceded by router statistics computed under no_grad (MoE-style logging)."""

    def __init__(self, block: nn.Module, dim: int, experts: int = 64) -> None:
        super().__init__()
        self.block = block
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("load", torch.zeros(experts))
        self.register_buffer("entropy", torch.zeros(()))

    def forward(self, x, freqs_cis, attention_masks=None):
        with torch.no_grad():
            probs = self.gate(x).float().softmax(-1)
            self.load.add_(torch.bincount(probs.argmax(-1).flatten(), minlength=probs.shape[-1]).float())
            self.entropy.copy_(-(probs * probs.clamp_min(1e-9).log()).sum(-1).mean())
        return self.block(x, freqs_cis, attention_masks)


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap (mallopt), so steps do not page-fault it back in."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1  # glibc's largest mmap threshold
    ok &= libc.mallopt(m_trim_threshold, 1 << 34) == 1
    ok &= libc.mallopt(m_top_pad, 256 << 20) == 1
    return bool(ok)


def model_sizes(quick: bool) -> dict[str, int]:
    """The llama3 stack's sizes: 64-wide heads, two query heads per KV head, float32."""
    dim, layers, seq, batch = (256, 2, 256, 2) if quick else (512, 4, 512, 2)
    return {"dim": dim, "layers": layers, "heads": dim // 64, "kv_heads": dim // 128, "seq": seq, "batch": batch}


def build_models(quick: bool) -> dict[str, tuple[BlockStack, torch.Tensor]]:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    size = model_sizes(quick)
    dim, layers, seq, batch = size["dim"], size["layers"], size["seq"], size["batch"]
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=dim, n_layers=layers, n_heads=size["heads"], n_kv_heads=size["kv_heads"],
                                vocab_size=256, max_seq_len=seq)
    base = Transformer(args)
    with torch.no_grad():
        base.init_weights(buffer_device=torch.device("cpu"))
    blocks = list(base.layers.values())
    h0 = torch.randn(batch, seq, dim)

    llama = BlockStack(copy.deepcopy(blocks), base.freqs_cis)
    frozen = BlockStack(copy.deepcopy(blocks), base.freqs_cis)
    for name, p in frozen.named_parameters():
        p.requires_grad_("norm" in name)  # fine-tuning: only the norms train
    router = BlockStack([RouterStats(b, dim) for b in copy.deepcopy(blocks)], base.freqs_cis)
    return {"llama3": (llama, h0), "llama3_frozen": (frozen, h0), "llama3_router": (router, h0)}


def apply_policy(model: BlockStack, policy: str):
    """A fresh copy of ``model`` under ``policy``; returns (model, tapesac handle or None)."""
    model = copy.deepcopy(model)
    if policy.startswith("full_ac"):
        early = policy.endswith("early_stop")
        for i, layer in enumerate(list(model.layers)):
            model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=True, early_stop=early)
        return model, None
    if policy == "tapesac":
        return model, tapesac.wrap(list(model.layers))
    return model, None


def step(model: BlockStack, h0: torch.Tensor) -> None:
    x = h0.detach().requires_grad_()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure_once(model: BlockStack, h0: torch.Tensor) -> tuple[int, int, float]:
    """(step-peak bytes, ops dispatched in backward, FLOPs in backward) of one step."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = StorageCounter()
    counter.track(model.parameters())
    counter.track(model.buffers())
    x = h0.detach().requires_grad_()
    counter.track([x])
    with counter:
        loss = model(x).float().pow(2).mean()
        loss.backward()
    peak = counter.peak_bytes
    model.zero_grad(set_to_none=True)
    del loss
    # A second step counts ops and FLOPs of backward (kept apart: these modes hold references).
    ops = OpCounter()
    flops = FlopCounterMode(display=False)
    loss = model(h0.detach().requires_grad_()).float().pow(2).mean()
    with ops, flops:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return peak, ops.n, flops.get_total_flops()


def timed(fn: Callable[[], None]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def timed_forward(model: BlockStack, h0: torch.Tensor) -> float:
    x = h0.detach().requires_grad_()
    t0 = CLOCK()
    out = model(x)
    elapsed = CLOCK() - t0
    del out
    return elapsed


def bench_model(name: str, model: BlockStack, h0: torch.Tensor, rounds: int, warmup: int) -> list[dict]:
    policies = ["none", "full_ac", "full_ac_early_stop", "tapesac"]
    runs = {p: apply_policy(model, p) for p in policies}
    for p in policies:
        for _ in range(warmup):
            step(runs[p][0], h0)
    times: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(rounds):
        order = policies[r % len(policies):] + policies[: r % len(policies)]
        for p in order:
            times[p].append(timed(lambda: step(runs[p][0], h0)))

    # Recording overhead: forward only (grad enabled, outputs freed after the clock stops),
    # wrapped vs unwrapped in alternating pairs; forwards are cheap, so three times the rounds.
    fwd = {"none": [], "tapesac": []}
    for r in range(3 * rounds):
        for p in (("none", "tapesac") if r % 2 == 0 else ("tapesac", "none")):
            fwd[p].append(timed_forward(runs[p][0], h0))

    n_blocks = len(model.layers)
    results = []
    base_peak, base_bwd_ops, base_flops = measure_once(runs["none"][0], h0)
    for p in policies:
        peak, bwd_ops, flops = (measure_once(runs[p][0], h0) if p != "none"
                                else (base_peak, base_bwd_ops, base_flops))
        rec = {
            "model": name, "policy": p, "step_s": statistics.median(times[p]),
            "step_s_all": times[p], "peak_bytes": peak,
            # Ratios of steps timed back to back in the same round, then the median: drift cancels.
            "vs_full_ac": statistics.median(a / b for a, b in zip(times[p], times["full_ac"])) - 1,
            "vs_full_ac_early_stop": statistics.median(
                a / b for a, b in zip(times[p], times["full_ac_early_stop"])) - 1,
            "recomputed_ops_per_block": (bwd_ops - base_bwd_ops) / n_blocks,
            "recomputed_gflop": (flops - base_flops) / 1e9,
        }
        handle = runs[p][1]
        if handle is not None:
            stats = handle.stats()
            rec["ops_recorded_per_block"] = statistics.mean(s["ops_recorded"] for s in stats.values())
            rec["ops_replayed_per_block"] = statistics.mean(s["ops_replayed"] for s in stats.values())
            rec["forward_overhead"] = statistics.median(a / b for a, b in zip(fwd["tapesac"], fwd["none"])) - 1
        results.append(rec)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| model | policy | median step (s) | vs full AC (es False) | vs full AC (es True) | "
             "step peak (MiB) | recomputed GFLOP/step | recomputed ops/block | TapeSAC forward overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_model: dict[str, dict[str, dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["policy"]] = r
    for model, rows in by_model.items():
        for p, r in rows.items():
            ovh = f"{100 * r['forward_overhead']:+.1f}%" if "forward_overhead" in r else ""
            ops = f"{r['recomputed_ops_per_block']:.0f}"
            if "ops_replayed_per_block" in r:
                ops += f" (replayed {r['ops_replayed_per_block']:.0f} of {r['ops_recorded_per_block']:.0f} recorded)"
            lines.append(f"| {model} | {p} | {r['step_s']:.3f} | {100 * r['vs_full_ac']:+.1f}% | "
                         f"{100 * r['vs_full_ac_early_stop']:+.1f}% | {r['peak_bytes'] / 2**20:.1f} | "
                         f"{r['recomputed_gflop']:.2f} | {ops} | {ovh} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and few rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per policy")
    ap.add_argument("--json", default=None, help="write one record per (model, policy) here")
    ap.add_argument("--models", default=None, help="comma-separated subset of models")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1 leaves a core for the rest of the machine: less noise)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time steps by wall clock or by this process's CPU time (a shared machine)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    rounds = a.rounds or (3 if a.quick else 15)
    # The sizes go on the first line so a pasted table says what it measured.
    size = ", ".join(f"{k}={v}" for k, v in model_sizes(a.quick).items())
    print(f"llama3 blocks: {size}, float32; rounds={rounds} threads={a.threads} clock={a.clock} "
          f"malloc tuned={tune_malloc()}",
          flush=True)
    models = build_models(a.quick)
    if a.models:
        models = {k: v for k, v in models.items() if k in a.models.split(",")}
    results = []
    for name, (model, h0) in models.items():
        print(f"benchmarking {name} ...", flush=True)
        results += bench_model(name, model, h0, rounds=rounds, warmup=1 if a.quick else 2)
    print(markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
