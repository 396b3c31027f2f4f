"""TapeSAC's measured frontier against every policy a torchtitan user would pick instead.

For each model (torchtitan llama3, qwen3 dense and qwen3 MoE, scaled so a CPU step takes about
a second, and llama3 with frozen weights) every policy is built the way torchtitan builds a job:
a JobConfig parsed from the model's CPU TOML plus command-line overrides, the model spec's
``parallelize_fn`` (which applies torchtitan's activation checkpointing and torch.compile), and,
for TapeSAC, the ``tapesac`` converter. All policies of a model live in one process and take
turns, one full training step each (forward, cross-entropy, backward, AdamW), so drift of the
machine hits all alike; ratios are medians of per-round ratios.

Policies: no AC; torchtitan full AC (early_stop False as torchtitan sets it, and True);
torchtitan selective op SAC and per-layer SAC (every 2nd layer); torch.compile with the
activation memory budget, without AC and with full AC; TapeSAC replay-only; TapeSAC planned at
limits spanning full-AC to no-AC memory (at full AC's peak, op SAC's, the midpoint, three
quarters, no AC's); and TapeSAC+compile (compiled mode: eager plan, compiled blocks, measured
compiled steps) at the same limits, when compile budgets are given.

Memory is the step peak of one profiled step per policy after warm-up, from the CPU allocator's
events (parameters, gradients, optimizer state, activations, batch); for eager code it equals the
storage counting TapeSAC plans with, and it also sees what compiled code allocates.

    python tools/bench.py [--quick] [--json results.json] [--models llama3,qwen3] [--plot-dir docs]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types

CLOCK = time.perf_counter
"""What step times are read from: wall time, or this process's CPU time (``--clock cpu``: on a
shared machine it leaves out the time other jobs took the core)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.argv, _argv = [sys.argv[0]], sys.argv  # torchtitan's config manager reads sys.argv at import

import torch  # noqa: E402

import torchtitan_ext  # noqa: E402,F401
from bench_replay import tune_malloc  # noqa: E402

sys.argv = _argv


@dataclasses.dataclass
class ModelSpec:
    config: str
    flavor: str
    changes: dict
    seq: int
    batch: int
    frozen: bool = False


def model_specs(quick: bool, gpu: bool = False) -> dict[str, ModelSpec]:
    from torchtitan.models.moe import MoEArgs

    # Activations must outweigh parameters and optimizer state, as in real LLM training at long
    # sequence lengths; otherwise every policy's peak is the optimizer step's and nothing differs.
    if gpu:  # realistic widths for one GPU, few layers so the whole check stays short
        dense = dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8)
        seq, batch = 4096, 2
    elif quick:
        dense = dict(dim=128, n_layers=4, n_heads=2, n_kv_heads=1)
        seq, batch = 256, 4
    else:
        dense = dict(dim=256, n_layers=6, n_heads=4, n_kv_heads=2)
        seq, batch = 512, 4
    qwen = dict(dense, head_dim=dense["dim"] // dense["n_heads"], hidden_dim=3 * dense["dim"])
    moe = dict(dim=256 if not quick else 128, n_layers=4 if not quick else 2, n_heads=4, n_kv_heads=2,
               head_dim=64, hidden_dim=768, moe_inter_dim=512 if not quick else 256, moe_args=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2,
                                                   score_func="softmax", route_norm=True,
                                                   score_before_experts=False))
    return {
        "llama3": ModelSpec("train_configs/llama3_debug_cpu.toml", "debugmodel", dense, seq, batch),
        "qwen3": ModelSpec("train_configs/qwen3_debug_cpu.toml", "debugmodel_untied", qwen, seq, batch),
        "qwen3_moe": ModelSpec("train_configs/qwen3_moe_debug_cpu.toml", "debugmodel_moe", moe, seq, batch),
        "llama3_frozen": ModelSpec("train_configs/llama3_debug_cpu.toml", "debugmodel", dense, seq, batch,
                                   frozen=True),
    }


BASELINES: list[tuple[str, list[str]]] = [
    ("no AC", ["--activation_checkpoint.mode", "none"]),
    ("full AC", ["--activation_checkpoint.mode", "full"]),
    ("full AC early_stop", ["--activation_checkpoint.mode", "full", "--activation_checkpoint.early_stop"]),
    ("op SAC", ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    ("layer SAC", ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]),
]


COMPILE_MODEL = ["--compile.enable", "--compile.components", "model"]


def compile_policies(budgets: list[float]) -> list[tuple[str, list[str]]]:
    """torch.compile without AC (the reference of TapeSAC+compile's numerics), with full AC, then
    with the activation memory budget; none without budgets."""
    if not budgets:
        return []
    return [("compile no AC", ["--activation_checkpoint.mode", "none", *COMPILE_MODEL]),
            ("compile full AC", ["--activation_checkpoint.mode", "full", *COMPILE_MODEL])] + [
        (f"compile budget {b}", ["--activation_checkpoint.mode", "memory_budget",
                                 "--activation_checkpoint.memory_budget", str(b), *COMPILE_MODEL]) for b in budgets]


TAPESAC_COMPILE_LIMITS = ("full AC", "op SAC", "midpoint", "3/4", "no AC")
"""Limits at which TapeSAC+compile (compiled mode) is measured, beside the compile budgets: the
same as eager TapeSAC's."""


@dataclasses.dataclass
class Setup:
    """Where and how the models run."""

    device: str = "cpu"
    fsdp: bool = False
    """Shard every block and the root with FSDP2 (one rank: torchtitan itself skips FSDP2 then)."""
    bf16: bool = False
    """FSDP2 mixed precision: bf16 parameters and compute, fp32 gradient reduction."""


SETUP = Setup()


def _init_single_rank_group() -> None:
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if SETUP.device == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}")


def _fully_shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _init_single_rank_group()
    mesh = init_device_mesh(SETUP.device, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if SETUP.bf16 else None, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _sync() -> None:
    if SETUP.device == "cuda":
        torch.cuda.synchronize()


def _own_forward_code(model: torch.nn.Module, tag: str) -> None:
    """Give ``model``'s blocks a class whose ``forward`` has a code object of its own. Dynamo
    caches compiled graphs per code object and guards neither on torch.compile's activation
    memory budget nor on which instance runs, so without this every compiled runner of a model
    after the first reused the first one's graphs (every compile budget ran compile no AC's
    graph: measured, 2.97 MB saved per block at budgets 1.0, 0.3 and 0.1 alike, against 0.72 MB
    at 0.3 and 0.33 MB at 0.1 when each compiled its own)."""
    for block in model.layers.values():
        cls = type(block)
        f = cls.forward
        name = f"forward_{''.join(c if c.isalnum() else '_' for c in tag)}"
        code = f.__code__.replace(co_name=name, co_qualname=name)
        forward = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
        block.__class__ = type(f"{cls.__name__}_{name}", (cls,), {"forward": forward})


class Runner:
    """One policy on one model: its own model copy (same initial weights), optimizer, converter."""

    def __init__(self, name: str, spec: ModelSpec, config_path: str, overrides: list[str], tapesac: bool) -> None:
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import ParallelDims
        from torchtitan.protocols.train_spec import get_train_spec

        from torchtitan_ext.converter import TapeSACConverter

        self.name = name
        cfg = ConfigManager().parse_args(["--job.config_file", config_path, "--model.flavor", "bench",
                                          "--training.seq_len", str(spec.seq),
                                          "--training.local_batch_size", str(spec.batch), *overrides])
        self.cfg = cfg
        train_spec = get_train_spec(cfg.model.name)
        args = train_spec.model_args["bench"]
        args.update_from_config(cfg)
        pd = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        with torch.device("meta"):
            model = train_spec.model_cls(args)
        if not tapesac and cfg.compile.enable:
            _own_forward_code(model, name)
        self.converter = None
        if tapesac:
            self.converter = TapeSACConverter(cfg, pd)
            self.converter.convert(model)
        # torchtitan's memory_budget mode sets torch.compile's activation budget process-wide,
        # and compilation happens later, in the first steps: each runner compiles under its own.
        functorch_config = torch._functorch.config
        default_budget = functorch_config.activation_memory_budget
        functorch_config.activation_memory_budget = 1.0
        try:
            model = train_spec.parallelize_fn(model, pd, cfg)
            self.memory_budget = functorch_config.activation_memory_budget
        finally:
            functorch_config.activation_memory_budget = default_budget
        if SETUP.fsdp:
            _fully_shard(model)
        model.to_empty(device=SETUP.device)
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device(SETUP.device))
        if spec.frozen:  # fine-tuning: the blocks' linear weights are frozen, norms train
            for n, p in model.layers.named_parameters():
                p.requires_grad_("norm" in n)
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
        self.loss_fn = build_cross_entropy_loss(cfg)
        self.vocab = args.vocab_size
        self.times: list[float] = []

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        tokens, labels = batch
        with torch._functorch.config.patch(activation_memory_budget=self.memory_budget):
            _sync()
            t0 = CLOCK()
            pred = self.model(tokens)
            loss = self.loss_fn(pred, labels) / labels.numel()
            del pred
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            _sync()
            return CLOCK() - t0

    def peak(self, batch) -> int:
        """Step peak from the CPU allocator's own events (torch.profiler memory profiling): the
        bytes alive at the start (parameters, optimizer state, batch) plus the highest running
        total of allocations and frees during one step. Unlike a dispatch mode it also sees
        compiled code; for eager code it equals ``tapesac.meter.StorageCounter`` exactly."""
        from tapesac.meter import AllocatorPeak

        if SETUP.device == "cuda":  # the caching allocator's own statistics
            self.step(batch)
            torch.cuda.reset_peak_memory_stats()
            self.step(batch)
            return torch.cuda.max_memory_allocated()
        alive = [*self.model.parameters(), *self.model.buffers(), *batch,
                 *(v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
        base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())
        for _ in range(2):  # the first profiled step of a process also counts one-off allocations
            with AllocatorPeak() as allocator:
                self.step(batch)
        return base + allocator.peak_bytes

    @property
    def planner(self):
        return self.converter.handle.planner if self.converter and self.converter.handle else None


def _config_without_tapesac(spec: ModelSpec, tmp: Path) -> str:
    text = (ROOT / spec.config).read_text().replace('converters = ["tapesac"]', "converters = []")
    path = tmp / Path(spec.config).name.replace(".toml", "_noconv.toml")
    path.write_text(text)
    return str(path)


def _register_bench_flavor(spec: ModelSpec) -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    name = "qwen3" if "qwen3" in spec.config else "llama3"
    flavors = get_train_spec(name).model_args
    flavors["bench"] = dataclasses.replace(flavors[spec.flavor], **spec.changes)


def bench_model(label: str, spec: ModelSpec, rounds: int, compile_budgets: list[float], log) -> list[dict]:
    _register_bench_flavor(spec)
    tmp = Path(tempfile.mkdtemp(prefix="tapesac-bench-"))
    plain_config = _config_without_tapesac(spec, tmp)
    gen = torch.Generator().manual_seed(1)
    vocab = 2048
    batches = [(torch.randint(0, vocab, (spec.batch, spec.seq), generator=gen).to(SETUP.device),
                torch.randint(0, vocab, (spec.batch, spec.seq), generator=gen).to(SETUP.device)) for _ in range(4)]
    runners: list[Runner] = []
    for name, overrides in BASELINES + compile_policies(compile_budgets):
        log(f"  building {name}")
        runners.append(Runner(name, spec, plain_config, overrides, tapesac=False))
    common = ["--activation_checkpoint.mode", "none", "--tapesac.policy_file", "none",
              "--tapesac.frontier_file", "none", "--tapesac.cpu_capacity_gib", "1024"]
    runners.append(Runner("TapeSAC replay-only", spec, spec.config, [*common, "--tapesac.mode", "replay_only"],
                          tapesac=True))
    for r in runners:  # warm-up (and compilation)
        t0 = time.perf_counter()
        for i in range(2):
            r.step(batches[i % len(batches)])
        log(f"  warmed up {r.name} in {time.perf_counter() - t0:.1f} s")
    peaks = {r.name: r.peak(batches[0]) for r in runners}
    no_ac, full_ac, op_sac = peaks["no AC"], peaks["full AC"], peaks["op SAC"]
    limits = {
        "full AC": full_ac, "op SAC": op_sac, "midpoint": (full_ac + no_ac) / 2,
        "3/4": full_ac + 0.75 * (no_ac - full_ac), "no AC": no_ac,
    }
    from tapesac.errors import PlanError
    from torchtitan_ext.errors import TapeSACExit, raising

    planned = [(f"TapeSAC @ {where} peak", limit, []) for where, limit in limits.items()]
    if compile_budgets:  # compiled mode beside torch.compile's budgets
        compiled = [*COMPILE_MODEL, "--tapesac.compiled_raise_into_slack"]
        planned += [(f"TapeSAC+compile @ {where} peak", limits[where], compiled) for where in TAPESAC_COMPILE_LIMITS]
        # and at each compile point's own peak, the limit its comparison is made at
        planned += [(f"TapeSAC+compile @ {name} peak", peaks[name], compiled)
                    for name, _o in compile_policies(compile_budgets) if name != "compile no AC"]
    for name, limit, extra in planned:
        log(f"  planning {name}: limit {limit / 2**20:.1f} MiB")
        r = Runner(name, spec, spec.config, [*common, "--tapesac.limit_gib", repr(math.ceil(limit) / 2**30), *extra],
                   tapesac=True)
        r.limit_bytes = r.converter.limit_bytes
        try:
            # warm-up, profile, verify (re-plan if needed), planned; compiled mode measures its
            # compiled steps and may re-plan into their slack, each plan verified in turn
            i = 0
            with raising():  # an infeasible limit ends this policy, not the benchmark
                while i < 4 or (extra and i < 12 and r.planner is not None
                                and any(not e.verified for e in r.planner.plans.values())):
                    r.step(batches[i % len(batches)])
                    i += 1
        except (PlanError, TapeSACExit) as e:  # below what TapeSAC can reach (replay-only stands for it)
            log(f"  {name}: {getattr(e, 'error', e)}")
            continue
        runners.append(r)
        peaks[name] = r.peak(batches[0])

    for k in range(rounds):
        order = runners[k % len(runners):] + runners[: k % len(runners)]
        for r in order:
            r.times.append(r.step(batches[k % len(batches)]))
    by_name = {r.name: r for r in runners}

    def ratio(a: Runner, b: Runner) -> float:
        return statistics.median(x / y for x, y in zip(a.times, b.times))

    records = []
    for r in runners:
        rec = {
            "model": label, "policy": r.name,
            "limit_bytes": getattr(r, "limit_bytes", None),
            "step_s": statistics.median(r.times), "peak_bytes": peaks[r.name],
            "predicted_peak_bytes": None, "step_s_all": r.times,
            "vs_no_ac": ratio(r, by_name["no AC"]), "vs_full_ac": ratio(r, by_name["full AC"]),
            "vs_op_sac": ratio(r, by_name["op SAC"]),
        }
        planner = r.planner
        if planner is not None and planner.plan is not None:
            a = planner.plan.allocation
            rec["predicted_peak_bytes"] = a.predicted_peak_bytes
            rec["predicted_recompute_s"] = a.recompute_s
            rec["replans"] = len(planner.history) - 1
            rec["history"] = planner.history
        records.append(rec)
    del runners, by_name
    gc.collect()
    return records


def paired_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's step time over b's in the same round (drift cancels); records
    saved without per-round times fall back to the ratio of medians."""
    if "step_s_all" not in a or "step_s_all" not in b:
        return a["step_s"] / b["step_s"]
    return statistics.median(x / y for x, y in zip(a["step_s_all"], b["step_s_all"]))


RATIOS = ("Signs: negative = faster or less memory. Step time 'vs X' = median over rounds of (this "
          "policy's step time / X's step time in the same round) - 1; memory = measured peak / X's - 1.")


def pct(ratio_minus_one: float) -> str:
    """``-0.034`` -> ``"-3.4%"``; what rounds to zero is ``"+0.0%"`` (never ``"-0.0%"``)."""
    v = round(100 * ratio_minus_one, 1)
    return f"{v + 0.0:+.1f}%"  # + 0.0 turns -0.0 into 0.0


def _mib(r: dict) -> str:
    return f"{r['peak_bytes'] / 2**20:.1f} MiB"


def check_targets(records: list[dict]) -> list[str]:
    """The issue's targets, each as a line that says met or missed and by how much (``RATIOS``'s
    signs: negative is faster or less memory).

    Every comparison, domination included, is a median of per-round ratios: policies ran in turn
    in every round, so a ratio within a round is free of the machine's drift between rounds.
    """
    out = []
    by = {r["policy"]: r for r in records}
    tape = [r for r in records if r["policy"].startswith("TapeSAC")]
    for b in records:
        if b["policy"].startswith("TapeSAC"):
            continue
        fits = [(paired_ratio(t, b), t) for t in tape if t["peak_bytes"] <= b["peak_bytes"]]
        dom = [t for r, t in fits if r < 1 or (r <= 1 and t["peak_bytes"] < b["peak_bytes"])]
        if dom:
            r, t = min(((paired_ratio(t, b), t) for t in dom), key=lambda f: f[0])
            out.append(f"met: TapeSAC dominates {b['policy']}: {t['policy']}, {pct(r - 1)} step time, "
                       f"{pct(t['peak_bytes'] / b['peak_bytes'] - 1)} memory ({_mib(t)} vs {_mib(b)})")
        elif fits:
            r, t = min(fits, key=lambda f: f[0])
            out.append(f"MISSED: TapeSAC does not dominate {b['policy']}: its fastest at no more memory, "
                       f"{t['policy']}, {pct(r - 1)} step time, {pct(t['peak_bytes'] / b['peak_bytes'] - 1)} "
                       f"memory ({_mib(t)} vs {_mib(b)})")
        else:
            out.append(f"MISSED: TapeSAC does not dominate {b['policy']}: no TapeSAC point at its memory "
                       f"({_mib(b)}) or less")
    ro, full = by["TapeSAC replay-only"], by["full AC"]
    r = ro["vs_full_ac"] - 1
    ok = r <= -0.03 and ro["peak_bytes"] <= full["peak_bytes"]
    out.append(f"{'met' if ok else 'MISSED'}: TapeSAC replay-only vs full AC: {pct(r)} step time (target -3.0% "
               f"or less), {pct(ro['peak_bytes'] / full['peak_bytes'] - 1)} memory ({_mib(ro)} vs {_mib(full)}, "
               "target no more)")
    at_op = by.get("TapeSAC @ op SAC peak")
    if at_op is None:
        out.append("MISSED: no TapeSAC plan fits op SAC's memory (its peak is below TapeSAC's smallest)")
    else:
        r = at_op["vs_op_sac"] - 1
        out.append(f"{'met' if r <= -0.05 else 'MISSED'}: TapeSAC planned at op SAC's memory vs op SAC: "
                   f"{pct(r)} step time (target -5.0% or less)")
    mid = by.get("TapeSAC @ midpoint peak")
    if mid is not None:
        r = mid["vs_no_ac"] - 1
        out.append(f"{'met' if r <= 0.03 else 'MISSED'}: TapeSAC planned at the midpoint vs no AC: {pct(r)} step "
                   "time (target +3.0% or less)")
    out += compile_targets(records)
    over = [t for t in tape if t["limit_bytes"] and t["peak_bytes"] > t["limit_bytes"]]
    out.append(f"{'met' if not over else 'MISSED'}: measured peak never above the limit"
               + ("" if not over else f" ({', '.join(t['policy'] for t in over)})"))
    return out


def compile_targets(records: list[dict]) -> list[str]:
    """Issue #13's targets: the TapeSAC+compile points dominate every compile budget point (no
    more memory and faster, per-round ratios), and at compile full AC's memory one is faster."""
    out = []
    tc = [r for r in records if r["policy"].startswith("TapeSAC+compile")]
    if not tc:
        return out
    for b in records:
        if not (b["policy"].startswith("compile budget") or b["policy"] == "compile full AC"):
            continue
        fits = [(paired_ratio(t, b), t) for t in tc if t["peak_bytes"] <= b["peak_bytes"]]
        if not fits:
            out.append(f"MISSED: no TapeSAC+compile point at {b['policy']}'s memory ({_mib(b)}) or less")
            continue
        r, t = min(fits, key=lambda f: f[0])
        ok = r < 1 or (r <= 1 and t["peak_bytes"] < b["peak_bytes"])
        out.append(f"{'met' if ok else 'MISSED'}: TapeSAC+compile {'beats' if ok else 'does not beat'} "
                   f"{b['policy']}: {t['policy']}, {pct(r - 1)} step time, "
                   f"{pct(t['peak_bytes'] / b['peak_bytes'] - 1)} memory ({_mib(t)} vs {_mib(b)})")
    return out


def markdown(records: list[dict]) -> str:
    lines = ["| policy | median step (s) | step vs no AC | step vs full AC | step vs op SAC | measured peak (MiB) | "
             "limit (MiB) | predicted peak (MiB) | predicted recompute (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        mib = lambda x: f"{x / 2**20:.1f}" if x else ""  # noqa: E731
        rec = f"{1e3 * r['predicted_recompute_s']:.1f}" if r.get("predicted_recompute_s") is not None else ""
        lines.append(f"| {r['policy']} | {r['step_s']:.3f} | {pct(r['vs_no_ac'] - 1)} | "
                     f"{pct(r['vs_full_ac'] - 1)} | {pct(r['vs_op_sac'] - 1)} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {mib(r['limit_bytes'])} | {mib(r['predicted_peak_bytes'])} | "
                     f"{rec} |")
    return "\n".join(lines)


def plot(records: list[dict], path: Path, model: str) -> None:
    from tapesac.plot import plot_frontier

    def pareto(points: list[dict]) -> list[dict]:  # the measured Pareto front
        front, best = [], float("inf")
        for r in sorted(points, key=lambda r: r["peak_bytes"]):
            if r["step_s"] < best:
                front.append(r)
                best = r["step_s"]
        return [{"memory": r["peak_bytes"], "recompute_time": r["step_s"]} for r in front]

    eager = [r for r in records if r["policy"].startswith("TapeSAC") and not r["policy"].startswith("TapeSAC+compile")]
    compiled = [r for r in records if r["policy"].startswith("TapeSAC+compile")]
    plot_frontier({
        "title": f"{model}: measured step time vs step peak (CPU)",
        "memory_label": "measured step peak", "memory_unit": "bytes",
        "time_label": "median step time", "time_unit": "s",
        "frontier_label": "TapeSAC (measured Pareto points)",
        "frontier": pareto(eager),
        "frontiers": [{"label": "TapeSAC+compile (measured Pareto points)", "points": pareto(compiled)}] if compiled else [],
        "baselines": [{"policy": r["policy"], "memory": r["peak_bytes"], "recompute_time": r["step_s"]}
                      for r in records if not r["policy"].startswith("TapeSAC")],
    }, path)


def report(records: list[dict], plot_dir: str | None) -> None:
    """Tables, targets and (with ``plot_dir``) frontier plots, one model at a time."""
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        print(f"== {model}" if len(records) != len(mine) else "", flush=True)
        print(markdown(mine))
        print(RATIOS)
        for line in check_targets(mine):
            print(line)
        if plot_dir:
            Path(plot_dir).mkdir(parents=True, exist_ok=True)
            plot(mine, Path(plot_dir) / f"frontier_{model}.png", model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models, few rounds, one compile budget (<10 min)")
    ap.add_argument("--json", default=None, help="write one record per (model, policy) here")
    ap.add_argument("--models", default=None, help="comma-separated subset: llama3,qwen3,qwen3_moe,llama3_frozen")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--compile-budgets", default=None, help="comma-separated; empty string for none")
    ap.add_argument("--plot-dir", default=None, help="write frontier_<model>.png here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on one rank around every block")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (with --fsdp)")
    ap.add_argument("--debug-peaks", action="store_true", help="also count each peak by storage counting")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="run nothing: print the tables and targets (and plots with --plot-dir) of a saved --json")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time steps by wall clock or by this process's CPU time (a shared machine; CPU only)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.report:
        try:
            records = json.loads(Path(a.report).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--report {a.report}: cannot read a saved run ({e})")
        if not (isinstance(records, list) and records and all(
                isinstance(r, dict) and {"model", "policy", "step_s", "peak_bytes"} <= r.keys() for r in records)):
            ap.error(f"--report {a.report}: not a file written by --json (a list of per-policy records)")
        report(records, a.plot_dir)
        return
    torch.set_num_threads(a.threads)
    SETUP.device, SETUP.fsdp, SETUP.bf16 = a.device, a.fsdp, a.bf16
    if a.bf16 and not a.fsdp:
        ap.error("--bf16 needs --fsdp (bf16 comes from FSDP2's mixed-precision policy)")
    tuned = tune_malloc()
    rounds = a.rounds or (3 if a.quick else 7)
    budgets = ([0.5] if a.quick else [0.3, 0.7]) if a.compile_budgets is None else \
        [float(x) for x in a.compile_budgets.split(",") if x]
    specs = model_specs(a.quick, gpu=a.device == "cuda")
    names = a.models.split(",") if a.models else list(specs)
    print(f"device={a.device} fsdp={a.fsdp} bf16={a.bf16} threads={a.threads} malloc tuned={tuned} "
          f"rounds={rounds} compile budgets={budgets} clock={a.clock}", flush=True)
    all_records = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        records = bench_model(name, specs[name], rounds, budgets, lambda m: print(m, flush=True))
        all_records += records
        report(records, a.plot_dir)
        print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(all_records, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
