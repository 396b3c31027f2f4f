"""The paper's claims, run side by side on torchtitan 0.3's jobs; writes ``docs/paper.md``.

    .venv03/bin/python tools/paper.py [--quick] [--claims 1,1b,2,4] [--rounds 3] [--out docs]

Every run is a real ``torchrun`` process (one CPU rank, one thread, FSDP2 skipped by torchtitan
on one rank) of a ``torchtitan03_ext`` debug job, through ``tools/paper_probe.py``: per step its
exact loss and wall seconds, and one metered step's peak of live tensor storages (the meter
TapeSAC's planner uses on CPU). The policies are the ones a torchtitan 0.3 user picks:
``activation-checkpoint:none``, ``:full``, ``:selective`` (torchtitan's hand-written op list)
and ``:tapesac`` (replay-only, and planned under a limit).

On CPU there is no device memory, so the *device* of a job is its step peak without activation
checkpointing (``:none``), measured in the same run; "90% of the device" is 0.9 of that.

Claims (the paper's numbers beside ours in the page):

1. Replay alone against full AC at no more memory, and planned under 90% of the device against
   full AC: step time and peak, every policy once per round, rounds interleaved, ratios to full AC
   paired within a round.
1b. The same, compiled (llama3, qwen3 MoE, and Qwen3.5 dense with its kernels as custom ops, the
   way it compiles at all): torch.compile's memory budget (``:memory-budget`` at 0.8, 0.5, 0.2)
   against TapeSAC+compile at each budget's measured peak, every peak read by the CPU allocator's
   events (they see compiled code); on Qwen3.5, how often each policy runs the gated delta rule.
2. The MoE batch sweep: Qwen3.5 MoE at a fixed limit (its device at the smallest batch) and a
   growing local batch; where each policy first exceeds the limit, and TapeSAC re-planned at each.
3. Bytes are not cost: ``tools/paper_bytes.py`` (in its own process, no torchtitan), a custom
   kernel that torch.compile prices at one FLOP, against compile's activation memory budget, at
   each budget's measured peak.
4. End to end: TapeSAC planned, full AC and selective AC, each a whole run (warm-up, profiling
   and planning included in the wall time), losses against ``:none``'s bit for bit.
5. The 397B's layer pattern (a planning experiment): ``tools/paper_shape.py`` (in its own
   process) probes Qwen3.5-397B-A17B's two block kinds at its widths on CPU and plans its 60
   blocks from their measured costs, scaled to a GPU rank's tokens, against full AC, the
   ``selective`` op lists and a uniform budget; the planner's wall time at that shape.
6. Ablations (a planning experiment): the allocation MILP against greedy and a uniform budget.

``--merge`` reruns some claims and keeps the others (claim 1b: the jobs not run again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20

JOBS = {
    "Qwen3.5 dense": "qwen35_debug_cpu",
    "Qwen3.5 MoE": "qwen35_moe_debug_cpu",
    "qwen3 MoE": "qwen3_moe_debug_cpu",
    "llama3": "llama3_debug_cpu",
}
POLICIES = {
    "none": ["activation-checkpoint:none"],
    "full AC": ["activation-checkpoint:full"],
    "selective AC": ["activation-checkpoint:selective"],
    "TapeSAC replay-only": ["activation-checkpoint:tapesac", "--activation-checkpoint.mode", "replay_only"],
}
PLANNED = "TapeSAC planned (90% of device)"


def run(config: str, policy: list[str], steps: int, meter_step: int, tmp: Path, name: str,
        extra: tuple[str, ...] = (), meter: str = "storages") -> dict:
    """One ``torchrun`` process; its probe record plus the process's wall seconds. ``meter``:
    the probe's (``storages``, TapeSAC's CPU counter; ``allocator``, which sees compiled code)."""
    probe = tmp / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "tools.paper_probe", "--module", "torchtitan03_ext", "--config", config,
           "--dump_folder", str(tmp / f"{name}_dump"), "--training.steps", str(steps), *extra, *policy]
    env = {**os.environ, "PAPER_PROBE": str(probe), "PAPER_METER_STEP": str(meter_step), "OMP_NUM_THREADS": "1",
           "PAPER_METER": meter}
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    path = Path(f"{probe}.rank0.json")
    if out.returncode != 0 or not path.exists():
        log = out.stdout + out.stderr
        error = next((ln.split("error: ", 1)[-1] for ln in log.splitlines() if ln.startswith("[tapesac] error:")), None)
        return {"failed": True, "wall_s": wall, "log_tail": log[-3000:], "error": error,
                "refused": error is not None and "is infeasible" in error}
    record = json.loads(path.read_text())
    record["wall_s"] = wall
    record["failed"] = False
    return record


def step_time(record: dict, first: int) -> float:
    times = [t for t in record["step_s"][first:] if t is not None]
    return statistics.median(times)


# Claim 1 ---------------------------------------------------------------------------------------

def claim1(jobs: list[str], rounds: int, steps: int, tmp: Path, log) -> dict:
    """Per job: the device (``:none``'s peak), then ``rounds`` rounds of every policy."""
    meter_step, timed_from = 3, 4  # 0 warm-up, 1 profiled, 2 verified, 3 metered, 4.. timed
    results: dict = {}
    for job in jobs:
        config = JOBS[job]
        device = run(config, POLICIES["none"], meter_step + 1, meter_step, tmp, f"{config}_device")
        if device["failed"]:
            raise RuntimeError(f"{job}: the no-AC run failed:\n{device['log_tail']}")
        limit_gib = 0.9 * device["peak_bytes"] / GIB
        policies = dict(POLICIES)
        policies[PLANNED] = ["activation-checkpoint:tapesac", "--activation-checkpoint.limit_gib", f"{limit_gib:.6f}"]
        names = list(policies)
        per_round: list[dict] = []
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # each policy leads a round in turn
            got = {}
            for name in order:
                rec = run(config, policies[name], steps, meter_step, tmp, f"{config}_{r}_{len(got)}")
                got[name] = rec
                log(f"claim 1: {job}, round {r + 1}/{rounds}, {name}: "
                    + ("failed" if rec["failed"] else
                       f"{step_time(rec, timed_from) * 1e3:.0f} ms/step, peak {rec['peak_bytes'] / MIB:.1f} MiB"))
            per_round.append(got)
        results[job] = {"device_bytes": device["peak_bytes"], "limit_bytes": 0.9 * device["peak_bytes"],
                        "rounds": per_round, "timed_from": timed_from}
    return results


def summarise1(results: dict) -> dict:
    out = {}
    for job, res in results.items():
        rows = {}
        base = res["rounds"][0].get("none")
        for name in res["rounds"][0]:
            recs = [rd[name] for rd in res["rounds"]]
            if any(r["failed"] for r in recs):
                rows[name] = {"failed": True}
                continue
            t = [step_time(r, res["timed_from"]) for r in recs]
            ratios = [step_time(rd[name], res["timed_from"]) / step_time(rd["full AC"], res["timed_from"])
                      for rd in res["rounds"] if not rd["full AC"]["failed"]]
            rows[name] = {
                "step_ms": statistics.median(t) * 1e3, "step_ms_spread": (min(t) * 1e3, max(t) * 1e3),
                "peak_mib": max(r["peak_bytes"] for r in recs) / MIB,
                "vs_full": statistics.median(ratios) - 1 if ratios else None,
                "vs_full_spread": (min(ratios) - 1, max(ratios) - 1) if ratios else None,
                "exact": base is not None and not base["failed"] and all(r["losses"] == base["losses"] for r in recs),
            }
        out[job] = rows
    return out


# Claim 1b --------------------------------------------------------------------------------------

COMPILE_JOBS = {"llama3": "llama3_debug_cpu", "qwen3 MoE": "qwen3_moe_debug_cpu",
                "Qwen3.5 dense": "qwen35_debug_cpu_custom_ops"}
"""Claim 1b's jobs and their configs. Qwen3.5 compiles only with fla's kernels as custom ops
(fla-core 0.6.0's gated delta rule is compile-disabled, torchtitan compiles blocks whole):
``torchtitan03_ext.fla_cpu.use_custom_ops``."""
BUDGETS = (0.8, 0.5, 0.2)
QUICK_BUDGETS = (0.8, 0.2)
"""``--quick``'s budgets: on llama3 the first gives a TapeSAC+compile run, the second a refusal."""
METER_STEP_1B = 6
"""Claim 1b's first metered step (the probe meters it and the next, recording the second)."""


def compile_baselines(budgets: tuple[float, ...]) -> dict[str, list[str]]:
    return {"compile, no AC": ["activation-checkpoint:none"],
            "compile, full AC": ["activation-checkpoint:full"],
            **{f"memory budget {b}": ["activation-checkpoint:memory-budget", "--activation-checkpoint.memory-budget",
                                      str(b)] for b in budgets}}


def claim1b(jobs: list[str], rounds: int, steps: int, tmp: Path, log,
            budgets: tuple[float, ...] = BUDGETS) -> dict:
    """Compiled runs: torch.compile's memory budget against TapeSAC+compile (compiled mode) at each
    budget's measured peak, every policy once per round, the allocator meter for all."""
    baselines = compile_baselines(budgets)
    meter_step, timed_from = METER_STEP_1B, 8  # warm-up, profile, verify and compiled re-plans, 2 metered
    steps = max(steps, timed_from + 4)
    results: dict = {}
    for job in jobs:
        config = COMPILE_JOBS[job]
        per_round: list[dict] = []
        limits: dict[str, float] = {}
        for r in range(rounds):
            got: dict = {}
            names = list(baselines)
            for name in names[r % len(names):] + names[:r % len(names)]:
                got[name] = run(config, ["--compile.enable", *baselines[name]], steps, meter_step, tmp,
                                f"{config}_c{r}_{len(got)}", meter="allocator")
            if not limits:  # TapeSAC's limits: each budget's peak in the first round
                limits = {f"TapeSAC+compile @ memory budget {b} peak": got[f"memory budget {b}"]["peak_bytes"]
                          for b in budgets if not got[f"memory budget {b}"]["failed"]}
            tnames = list(limits)
            for name in tnames[r % len(tnames):] + tnames[:r % len(tnames)]:
                policy = ["--compile.enable", "activation-checkpoint:tapesac", "--activation-checkpoint.limit_gib",
                          repr(math.ceil(limits[name]) / GIB)]
                got[name] = rec = run(config, policy, steps, meter_step, tmp, f"{config}_c{r}_{len(got)}",
                                      meter="allocator")
                if rec.get("refused"):  # its error line says why; the log adds nothing
                    rec.pop("log_tail")
            for name, rec in got.items():
                log(f"claim 1b: {job}, round {r + 1}/{rounds}, {name}: " + (
                    ("refused: " + rec["error"]) if rec.get("refused") else "failed" if rec["failed"] else
                    f"{step_time(rec, timed_from) * 1e3:.0f} ms/step, peak {rec['peak_bytes'] / MIB:.1f} MiB"))
            per_round.append(got)
        results[job] = {"rounds": per_round, "timed_from": timed_from, "limits": limits, "budgets": list(budgets)}
    return results


def summarise1b(results: dict) -> dict:
    """Per job and policy: median step, largest peak, losses against compile without AC's; per
    budget, TapeSAC+compile at its peak against it (time paired within a round)."""
    out: dict = {}
    for job, res in results.items():
        t0 = res["timed_from"]
        rows: dict = {}
        base = res["rounds"][0].get("compile, no AC")
        for name in res["rounds"][0]:
            recs = [rd[name] for rd in res["rounds"]]
            if any(r["failed"] for r in recs):
                rows[name] = {"failed": True, "refused": any(r.get("refused") for r in recs),
                              "error": next((r.get("error") for r in recs if r.get("error")), None)}
                continue
            t = [step_time(r, t0) for r in recs]
            # A compiled plan still being re-measured by TapeSAC's own allocator meter on the probe's
            # metered steps takes the profiler from the probe's meter: TapeSAC's measurement stands.
            own = [h["measured_peak_bytes"] for r in recs for h in (r.get("tapesac") or {}).get("history", [])
                   if h.get("step") in (METER_STEP_1B, METER_STEP_1B + 1)]
            runs = [steps.get("chunk_gated_delta_rule", 0) for r in recs for steps in r.get("kernel_runs", [])[t0:]]
            rows[name] = {"step_ms": statistics.median(t) * 1e3, "step_ms_spread": (min(t) * 1e3, max(t) * 1e3),
                          "peak_mib": (max(own) if own else max(r["peak_bytes"] for r in recs)) / MIB,
                          "peak_by_tapesac": bool(own),
                          "delta_rule_runs": statistics.median(runs) if runs else 0,
                          "same_losses": base is not None and not base["failed"]
                          and all(r["losses"] == base["losses"] for r in recs)}
        pairs = []
        for b in res.get("budgets", BUDGETS):
            mb, ts = f"memory budget {b}", f"TapeSAC+compile @ memory budget {b} peak"
            if ts not in rows or rows[mb].get("failed") or rows[ts].get("failed"):
                pairs.append({"budget": b, "tapesac": None})
                continue
            ratios = [step_time(rd[ts], t0) / step_time(rd[mb], t0) for rd in res["rounds"]]
            pairs.append({"budget": b, "tapesac": ts, "limit_mib": res["limits"][ts] / MIB,
                          "vs_budget": statistics.median(ratios) - 1,
                          "spread": (min(ratios) - 1, max(ratios) - 1)})
        out[job] = {"rows": rows, "pairs": pairs}
    return out


# Claim 2 ---------------------------------------------------------------------------------------

def claim2(batches: list[int], steps: int, tmp: Path, log) -> dict:
    """Qwen3.5 MoE: the limit is the device at the smallest batch; every policy at every batch."""
    config = JOBS["Qwen3.5 MoE"]
    meter_step = 3
    device = run(config, POLICIES["none"], meter_step + 1, meter_step, tmp, "sweep_device",
                 ("--training.local_batch_size", str(batches[0])))
    if device["failed"]:
        raise RuntimeError(f"claim 2: the no-AC run failed:\n{device['log_tail']}")
    limit = device["peak_bytes"]
    policies = {"full AC": POLICIES["full AC"], "selective AC": POLICIES["selective AC"],
                "TapeSAC planned": ["activation-checkpoint:tapesac", "--activation-checkpoint.limit_gib",
                                    f"{limit / GIB:.6f}", "--activation-checkpoint.budget", "1.0"]}
    rows: list[dict] = []
    for b in batches:
        for name, policy in policies.items():
            rec = run(config, policy, steps, meter_step, tmp, f"sweep_{b}_{len(rows)}",
                      ("--training.local_batch_size", str(b)))
            row = {"batch": b, "policy": name, "failed": rec["failed"]}
            if not rec["failed"]:
                row.update(step_ms=step_time(rec, meter_step + 1) * 1e3, peak_mib=rec["peak_bytes"] / MIB,
                           over=rec["peak_bytes"] > limit, planned=rec.get("tapesac", {}).get("planned"))
            else:
                tail = rec["log_tail"]
                refused = next((ln for ln in tail.splitlines() if "is infeasible" in ln), None)
                row["why"] = refused.split("error: ", 1)[-1] if refused else tail[-600:]
                row["refused"] = refused is not None
            rows.append(row)
            log(f"claim 2: batch {b}, {name}: " + ("failed" if rec["failed"] else
                f"{row['step_ms']:.0f} ms/step, peak {row['peak_mib']:.1f} MiB{' OVER' if row['over'] else ''}"))
    return {"limit_mib": limit / MIB, "rows": rows}


# Claim 4 ---------------------------------------------------------------------------------------

def claim4(job: str, steps: int, tmp: Path, log) -> dict:
    config = JOBS[job]
    none = run(config, POLICIES["none"], steps, steps - 1, tmp, "e2e_none")
    if none["failed"]:
        raise RuntimeError(f"claim 4: the no-AC run failed:\n{none['log_tail']}")
    limit_gib = 0.9 * none["peak_bytes"] / GIB
    policies = {"none": None, "full AC": POLICIES["full AC"], "selective AC": POLICIES["selective AC"],
                PLANNED: ["activation-checkpoint:tapesac", "--activation-checkpoint.limit_gib", f"{limit_gib:.6f}"]}
    runs = {"none": none}
    for name, policy in policies.items():
        if policy is None:
            continue
        runs[name] = run(config, policy, steps, steps - 1, tmp, f"e2e_{len(runs)}")
        log(f"claim 4: {name}: " + ("failed" if runs[name]["failed"] else f"{runs[name]['wall_s']:.0f} s"))
    out = {"job": job, "steps": steps, "limit_mib": limit_gib * 1024, "runs": {}}
    for name, rec in runs.items():
        if rec["failed"]:
            out["runs"][name] = {"failed": True}
            continue
        out["runs"][name] = {
            "wall_s": rec["wall_s"], "train_s": sum(t for t in rec["step_s"] if t is not None),
            "peak_mib": rec["peak_bytes"] / MIB, "losses": [float.fromhex(x) for x in rec["losses"]],
            "exact": rec["losses"] == none["losses"], "failed": False,
        }
    return out


# Claim 6 ---------------------------------------------------------------------------------------

def claim6(quick: bool, log) -> dict:
    """Planning only (no training): the allocation at three limits by the default planner (greedy
    start, MILP polish within ``solver_time_limit_s``), greedy alone, a uniform per-block budget,
    and the MILP given a long time limit (the optimum where it proves optimality)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_planner import synthetic_block, synthetic_memory
    from paper_shape import ablation_row, uniform_choice

    from tapesac.autoplan import PlanConfig
    from tapesac.planner.allocate import formula_deltas, largest_useful_peak, predicted_peak, smallest_peak
    from tapesac.planner.milp import frontier

    blocks, values = (16, 200) if quick else (64, 400)
    long_s = 5.0 if quick else 60.0
    kinds = [synthetic_block(1, values), synthetic_block(2, values)]
    fronts = [frontier(g, max_points=PlanConfig.points_per_block) for g in kinds]
    frontiers = {b: fronts[b % 2] for b in range(blocks)}
    memory = synthetic_memory(blocks, fronts[0][0].transient)
    deltas = formula_deltas(memory, frontiers)
    lo, hi = smallest_peak(memory, frontiers, deltas), largest_useful_peak(memory, frontiers, deltas)
    rows = []
    for frac in (0.25, 0.5, 0.75):
        limit = lo + frac * (hi - lo)
        row = {"limit_fraction": frac, **ablation_row(memory, frontiers, deltas, limit, long_s)}
        u = uniform_choice(memory, frontiers, deltas, limit, PlanConfig.points_per_block)
        row["uniform"] = (None if u is None else
                          {"recompute_s": sum(frontiers[b][i].time for b, i in u.items()),
                           "peak_bytes": predicted_peak(memory, u, frontiers, deltas), "status": "uniform budget"})
        rows.append(row)
        log(f"claim 6: limit at {frac:.0%} of the frontier: " + ", ".join(
            f"{k} {row[k]['recompute_s'] * 1e3:.1f} ms ({row[k]['status']})"
            for k in ("default", "greedy", "long MILP", "uniform") if row[k]))
    return {"blocks": blocks, "values": values, "kinds": 2, "long_s": long_s,
            "frontier_points": [len(f) for f in fronts], "rows": rows}


# Claim 5 ---------------------------------------------------------------------------------------

def claim5(quick: bool, log) -> dict:
    """``tools/paper_shape.py`` in its own process: probe the block kinds, plan the 397B's pattern."""
    with tempfile.TemporaryDirectory(prefix="paper_shape_") as d:
        path = Path(d) / "shape.json"
        cmd = [sys.executable, "tools/paper_shape.py", "--json", str(path), *(["--quick"] if quick else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError("claim 5: tools/paper_shape.py failed:\n" + (out.stdout + out.stderr)[-3000:])
        for line in out.stdout.splitlines():
            if "claim 5" in line:
                log(line.split("] ", 1)[-1])
        return json.loads(path.read_text())


def plot_shape(c5: dict, path: Path) -> None:
    """The 397B pattern's step frontier with every policy's point and the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    f = c5["frontier"]
    ax.plot([p["peak_bytes"] / GIB for p in f], [p["recompute_s"] for p in f], "-o", ms=3, label="TapeSAC frontier")
    for name, p in c5["policies"].items():
        if p is not None:
            ax.plot(p["peak_bytes"] / GIB, p["recompute_s"], "s", label=name)
    ax.axvline(c5["limit_bytes"] / GIB, color="red", ls="--", label="90% of an H200")
    ax.set_xlabel("predicted step peak per rank (GiB)")
    ax.set_ylabel("recompute per step (s, CPU-measured costs, scaled)")
    ax.set_title("Qwen3.5-397B-A17B layer pattern (a planning experiment)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The page --------------------------------------------------------------------------------------

# Claim 3 ---------------------------------------------------------------------------------------

def claim3(quick: bool, log) -> dict:
    """``tools/paper_bytes.py`` in its own process (one thread, as every run here)."""
    with tempfile.TemporaryDirectory(prefix="paper_bytes_") as d:
        path = Path(d) / "bytes.json"
        cmd = [sys.executable, "tools/paper_bytes.py", "--json", str(path), *(["--quick"] if quick else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError("claim 3: tools/paper_bytes.py failed:\n" + (out.stdout + out.stderr)[-3000:])
        data = json.loads(path.read_text())
    for k in data["kinds"]:
        k["summary"] = summarise3(k)
        for r in k["summary"]:
            log(f"claim 3: {k['kind']}: {r['compile']} {r['compile_ms']:.0f} ms, kernel x{r['compile_calls']}; "
                + (f"TapeSAC+compile {r['tapesac_ms']:.0f} ms, kernel x{r['tapesac_calls']}" if r["tapesac"]
                   else "no TapeSAC+compile point at or under its peak"))
    return data


def summarise3(kind: dict) -> list[dict]:
    """Per compile budget: the fastest TapeSAC+compile run whose measured peak is at or under the
    budget's measured peak (same kernels, same meter), and the time difference."""
    rows = kind["rows"]
    out = []
    for c in (r for r in rows if r["budget"] is not None):
        fits = [r for r in rows if r["policy"].startswith("TapeSAC+compile") and r["peak_bytes"] <= c["peak_bytes"]]
        best = min(fits, key=lambda r: r["step_s"]) if fits else None
        out.append({"compile": c["policy"], "compile_peak_mib": c["peak_bytes"] / MIB, "compile_ms": c["step_s"] * 1e3,
                    "compile_calls": c["kernel_calls_per_step"],
                    "tapesac": best["policy"] if best else None,
                    "tapesac_peak_mib": best["peak_bytes"] / MIB if best else None,
                    "tapesac_ms": best["step_s"] * 1e3 if best else None,
                    "tapesac_calls": best["kernel_calls_per_step"] if best else None,
                    "diff": best["step_s"] / c["step_s"] - 1 if best else None})
    return out


def plot_bytes(c3: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = c3["kinds"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False)
    blocks = c3["config"]["blocks"]
    for ax, k in zip(axes[0], kinds):
        groups = {"eager": lambda n: n.startswith("eager"), "compile (memory budget)": lambda n: n.startswith("compile"),
                  "TapeSAC (eager)": lambda n: n.startswith("TapeSAC @"),
                  "TapeSAC+compile": lambda n: n.startswith("TapeSAC+compile")}
        for (label, pick), marker in zip(groups.items(), "sovD"):
            rows = sorted((r for r in k["rows"] if pick(r["policy"])), key=lambda r: r["peak_bytes"])
            ax.plot([r["peak_bytes"] / MIB for r in rows], [r["step_s"] * 1e3 for r in rows], marker,
                    ls="-" if label != "eager" else "", label=label)
            for r in rows:
                if r["kernel_calls_per_step"] and r["kernel_calls_per_step"] > blocks:
                    ax.annotate(f"kernel ×{r['kernel_calls_per_step']}", (r["peak_bytes"] / MIB, r["step_s"] * 1e3), fontsize=7,
                                xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel="measured step peak (MiB)", ylabel="median step (ms)", title=f"block '{k['kind']}'")
        ax.legend(fontsize=8)
    fig.suptitle(f"Bytes are not cost: a custom kernel beside plain ops, one CPU thread\n"
                 f"kernel ×N: the kernel's runs per step where backward recomputes it ({blocks} = kept in every block)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pct(x: float | None) -> str:
    if x is None:
        return "—"
    s = f"{x * 100:+.1f}%"
    return "+0.0%" if s == "-0.0%" else s


def run_line(data: dict, claim: int) -> str:
    """Where a claim's numbers come from, when claims were run separately (``--merge``)."""
    r = data.get(f"claim{claim}_run")
    if not r:
        return ""
    took = f", {r['wall_s'] / 60:.1f} min" if r.get("wall_s") is not None else ""
    note = f" ({r['note']})" if r.get("note") else ""
    return f"Run by `{r['command']}` on commit `{r['commit']}`, {r['date']}{took}{note}.\n"


def plot_sweep(sweep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["policy"] for r in sweep["rows"]):
        rows = [r for r in sweep["rows"] if r["policy"] == name and not r["failed"]]
        ax1.plot([r["batch"] for r in rows], [r["peak_mib"] for r in rows], "o-", label=name)
        ax2.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-", label=name)
    ax1.axhline(sweep["limit_mib"], color="k", ls="--", label="limit")
    ax1.set(xlabel="local batch (sequences of 256 tokens)", ylabel="step peak (MiB)")
    ax2.set(xlabel="local batch (sequences of 256 tokens)", ylabel="step time (ms)")
    ax1.legend(fontsize=8)
    fig.suptitle("Qwen3.5 MoE debug job, one CPU rank: peak and step time against batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(e2e: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in e2e["runs"].items():
        if not r["failed"]:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{name} ({r['wall_s']:.0f} s)", lw=1)
    ax.set(xlabel="step", ylabel="loss", title=f"{e2e['job']}: {e2e['steps']} steps, each policy a whole run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = {
    "Qwen3.5 dense": ("−3.0% (27B dense)", "−6.3%"),
    "Qwen3.5 MoE": ("−1.7% (35B-A3B MoE)", "−13.9%"),
}


def _refusal(row: dict) -> str:
    """A refused run in a table cell: the smallest peak TapeSAC said it can reach (predicted
    before training, or replay-only measured in it)."""
    error = row.get("error") or ""
    m = re.search(r"the predicted step peak is ([0-9.]+ [KMG]iB)", error)
    if m:
        return f"refused: its smallest peak is {m.group(1)}"
    m = re.search(r"step ([0-9]+) kept nothing .* measured ([0-9.]+ [KMG]iB)", error)
    return f"stopped at step {m.group(1)}: replay-only measured {m.group(2)}" if m else "refused"


def budgets_run(data: dict) -> list[float]:
    """Every budget some job of claim 1b ran, in ``BUDGETS``' order."""
    ran = {b for res in data["claim1b"].values() for b in res.get("budgets", BUDGETS)}
    return [b for b in BUDGETS if b in ran]


def budget_section(data: dict) -> list[str]:
    summary = data["claim1b_summary"]
    rounds = len(next(iter(data["claim1b"].values()))["rounds"])
    runs = [data["claim1b"][job].get("run") for job in summary]
    one_run = all(r == runs[0] for r in runs)  # else each job names its own run
    lines = ["### 1b. Against torch.compile's memory budget (compiled runs)", "",
             run_line(data, "1b") if one_run else "",
             "llama3, qwen3 MoE and Qwen3.5 dense, every run with "
             "`--compile.enable`: `activation-checkpoint:none`, `:full`, `:memory-budget` at budgets "
             f"{', '.join(str(b) for b in budgets_run(data))} (compile's partitioner saves by a knapsack over FLOPs and "
             "bytes), and `:tapesac` in compiled mode (TapeSAC's plan run through torch.compile) at each budget's "
             "measured peak, given as its limit. Every peak is read by the CPU allocator's events over the step "
             "(`tapesac.meter.AllocatorPeak`), which see compiled code: parameters, gradients, optimizer state "
             f"plus the highest running total. {rounds} round(s), each policy once per round in rotated order; "
             "step time is the median over the timed steps, then over rounds; TapeSAC against the budget is "
             "paired within a round. *Same losses*: equal to compile without AC's bit for bit. Qwen3.5 compiles "
             "only with fla's kernels as `torch.library` custom ops: fla-core 0.6.0 marks its gated delta rule "
             "`torch.compiler.disable`, and torchtitan 0.3 compiles each block with `fullgraph=True`, so dynamo "
             "refuses the DeltaNet blocks while tracing, on any device (`tests03/test_qwen35_custom_ops.py`). "
             "Its job here, `qwen35_debug_cpu_custom_ops`, runs the CPU stand-ins as such ops (the same numbers "
             "as the opaque stand-ins of claim 1); *delta-rule runs* counts the gated delta rule's forward runs "
             "per step, recomputations included. *(TapeSAC's meter)*: TapeSAC was still measuring its compiled "
             "steps on the probe's metered steps, which leaves the probe's meter without the profiler; the "
             "peak is the largest TapeSAC measured on them.", ""]
    for job, s in summary.items():
        counted = any(r.get("delta_rule_runs") for r in s["rows"].values())
        lines += [f"**{job}** (`{COMPILE_JOBS[job]}`)", ""]
        if not one_run:
            lines += [run_line({"claim1b_run": data["claim1b"][job]["run"]}, "1b").rstrip(), ""]
        lines += ["| policy | step (ms) | peak (MiB) | same losses |" + (" delta-rule runs |" if counted else ""),
                  "|---|---|---|---|" + ("---|" if counted else "")]
        for name, r in s["rows"].items():
            if r.get("failed"):
                lines.append(f"| {name} | {_refusal(r) if r.get('refused') else 'failed'} | | |" + (" |" if counted else ""))
                continue
            same = "yes" if r["same_losses"] else "no"
            by = " (TapeSAC's meter)" if r.get("peak_by_tapesac") else ""
            lines.append(f"| {name} | {r['step_ms']:.0f} | {r['peak_mib']:.1f}{by} | {same} |"
                         + (f" {r['delta_rule_runs']:g} |" if counted else ""))
        lines += ["", "| budget | its peak (MiB) | TapeSAC+compile at that limit: peak (MiB) | time vs the budget |",
                  "|---|---|---|---|"]
        for pr in s["pairs"]:
            mb = s["rows"].get(f"memory budget {pr['budget']}", {})
            if pr["tapesac"] is None:
                ts = s["rows"].get(f"TapeSAC+compile @ memory budget {pr['budget']} peak", {})
                why = _refusal(ts) if ts.get("refused") else "—"
                lines.append(f"| {pr['budget']} | {mb.get('peak_mib', float('nan')):.1f} | {why} | — |")
                continue
            t = s["rows"][pr["tapesac"]]
            spread = f" ({pct(pr['spread'][0])} to {pct(pr['spread'][1])})" if rounds > 1 else ""
            lines.append(f"| {pr['budget']} | {mb['peak_mib']:.1f} | {t['peak_mib']:.1f} | "
                         f"{pct(pr['vs_budget'])}{spread} |")
        lines.append("")
    lines += [data.get("claim1b_verdict", ""), ""]
    return lines


def shape_section(data: dict) -> list[str]:
    c = data["claim5"]
    m, pl = c["memory_model"], c["planner"]
    kinds = c["kinds"]
    lines = ["## 5. The 397B's layer pattern (a planning experiment, not a training run)", "",
             run_line(data, 5),
             f"`tools/paper_shape.py`. **Measured**: one CPU rank trains `{c['probe']['config']}` "
             f"(`torchtitan03_ext`), Qwen3.5-397B-A17B's two block kinds at its widths with "
             f"{c['probe']['layers'][0]['local_experts']} local experts and {c['probe_tokens']} tokens; TapeSAC "
             "profiles it as planned mode does (per-op times, storage bytes, the step's memory windows). "
             f"**Scaled** to {c['tokens']} tokens per rank (×{c['scale']:.2f}): storages with a token dimension and "
             "the times of ops that touch one grow linearly, attention's score product quadratically; "
             "activation bytes halve (bf16 on the GPU, fp32 in the probe). Times stay CPU times. "
             f"**Planned**: the 397B's {c['blocks']} blocks (gated DeltaNet, full attention every fourth) on one "
             f"rank of {c['gpus']} H200s, FSDP2 with EP {c['ep']} and no TP: sharded states "
             f"{m['states_bytes'] / GIB:.1f} GiB, two layers' gathered bf16 weights "
             f"{m['gathered_bytes'] / GIB:.1f} GiB, "
             f"one layer's fp32 gradients in backward {m['gradient_bytes'] / GIB:.1f} GiB, block input "
             f"{m['block_input_bytes'] / GIB:.3f} GiB. Limit: 90% of an H200 ({c['limit_bytes'] / GIB:.1f} GiB).", "",
             "| block kind | ops | values | read by backward | forward ops, scaled (s) | produced bytes without a "
             "token dimension (weight casts, free on the GPU) |",
             "|---|---|---|---|---|---|"]
    for name, k in kinds.items():
        lines.append(f"| {name} | {k['ops']} | {k['values']} | {k['read']} | {k['op_s_scaled']:.2f} | "
                     f"{k['produced_bytes_not_token'] / max(k['produced_bytes_probe'], 1):.1%} |")
    by_kind = list(kinds.values())  # "D" blocks are the first kind, "A" the second
    forward = sum(by_kind[1 if ch == "A" else 0]["op_s_scaled"] for ch in c["pattern"])
    step0 = 3 * forward  # forward, and a backward estimated at twice the forward
    points = ", ".join(str(n) for n in c["block_frontier_points"].values())
    lines += ["", f"**Planner wall time at this shape** (this machine, one thread): block frontiers "
              f"{pl['block_frontiers_s']:.2f} s ({points} points), "
              f"one plan as planned mode makes it {pl['one_plan_s']:.2f} s ({pl['status']}), the step frontier "
              f"({len(c['frontier'])} points) {pl['step_frontier_s']:.2f} s. Step frontier: "
              f"{pl['smallest_peak_bytes'] / GIB:.1f} GiB (everything recomputed) to "
              f"{pl['largest_useful_peak_bytes'] / GIB:.1f} GiB. At the limit TapeSAC predicts "
              f"{pl['predicted_peak_bytes'] / GIB:.1f} GiB and {pl['recompute_s']:.2f} s of recompute per step.", "",
              f"Recompute is per step, in the probe's CPU seconds scaled; a step without recompute is estimated at "
              f"three times the blocks' forward ops, {step0:.0f} s (backward at twice the forward), and *step* "
              "columns add the recompute to it.", "",
              "| policy | predicted peak (GiB) | fits 90% | recompute (s) | TapeSAC at that peak (s) | difference "
              "| step, estimated | TapeSAC's smallest peak at no more recompute (GiB) | difference |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in c["policies"].items():
        if r is None:
            lines.append(f"| {name} | no budget fits | | | | | | | |")
            continue
        t = r["tapesac_at_same_peak"]
        if "recompute_s" in t:
            diff = t["recompute_s"] - r["recompute_s"]
            rel = pct(t["recompute_s"] / r["recompute_s"] - 1) if r["recompute_s"] > 0 else "—"
            step = pct((step0 + t["recompute_s"]) / (step0 + r["recompute_s"]) - 1)
            cell = f"{t['recompute_s']:.2f} | {diff:+.2f} s ({rel}) | {step}"
        else:
            cell = "below TapeSAC's floor | — | —"
        same = r.get("tapesac_at_same_recompute")
        mem = (f"{same['peak_bytes'] / GIB:.1f} | {pct(same['peak_bytes'] / r['peak_bytes'] - 1)}" if same
               else "none | —")
        lines.append(f"| {name} | {r['peak_bytes'] / GIB:.1f} | {'yes' if r['fits_limit'] else '**no**'} | "
                     f"{r['recompute_s']:.2f} | {cell} | {mem} |")
    lines += ["", "Full AC and the two `selective` op lists are costed as torch's checkpoint runs them: the "
              "outputs of saved ops are kept and every other op reruns in backward. *uniform*: every block the "
              "same kept-bytes budget among TapeSAC's points, the largest that fits the limit.", "",
              "![397B pattern](paper_397b_pattern.png)", "",
              f"Claim 6 at this shape: the allocation at three limits across the step frontier; *long MILP* is "
              f"given {c['long_s']:.0f} s. Status *greedy* in a MILP column: the MILP found nothing better than "
              "the greedy start (in the long MILP's column, within its time, so the greedy plan is optimal "
              "where it finished early).", "",
              "| limit (fraction of the frontier) | default | greedy | long MILP |", "|---|---|---|---|"]
    for r in c["ablation"]:
        best = r["long MILP"]["recompute_s"]

        def cell(x):
            gap = x["recompute_s"] / best - 1 if best > 0 else 0.0
            return f"{x['recompute_s']:.3f} s ({pct(gap)}; {x['status']}, {x['solve_s']:.2f} s)"
        lines.append(f"| {r['limit_fraction']:.2f} | {cell(r['default'])} | {cell(r['greedy'])} | "
                     f"{cell(r['long MILP'])} |")
    lines += ["", data.get("claim5_verdict", ""), ""]
    return lines


def page(data: dict, args: argparse.Namespace, out: Path) -> str:
    if data.get("merged"):  # claims run separately: each section names its own run
        total = sum(data[k]["wall_s"] or 0.0 for k in data if k.endswith("_run"))
        written = "Claims were run separately (`--merge`); each section names its command, commit and date"
    else:
        total = data["wall_s"]
        written = data.get("written_by") or (f"Written by `{data['command']}` on commit `{data['commit']}`, "
                                             f"{data['date']}")
    lines = ["# The paper's claims, measured on torchtitan 0.3's debug jobs", "",
             f"{written}; machine: {data['machine']}. Total wall time {total / 60:.1f} min"
             f"{' (--quick: a smoke run, not results)' if args.quick else ''}.", "",
             "Every run is one `torchrun` process (one CPU rank, one thread) of a `torchtitan03_ext` debug job "
             "(offline text, AdamW; `tools/paper_probe.py` records each step's loss and time and one metered "
             "step's peak of live tensor storages). On CPU there is no device memory: the *device* of a job is "
             "its step peak without activation checkpointing (`activation-checkpoint:none`), measured in the "
             "same run, and \"90% of the device\" is 0.9 of that. These jobs are 4-block models a CPU trains "
             "in about a second a step; the paper's are 27B to 397B on GPUs. Where our number differs, the "
             "verdict says why.", ""]
    if "claim1" in data:
        lines += ["## 1. Replay vs full AC, and planned under 90% of the device", "",
                  run_line(data, 1),
                  f"{args.rounds} round(s), every policy once per round in rotated order; step time is the median "
                  "over the timed steps (after warm-up, profiling and the verified step), then over rounds; the "
                  "ratio to full AC is paired within a round (median, and the range over rounds). *Exact*: "
                  "losses equal `:none`'s bit for bit on every step.", ""]
        for job, rows in data["claim1_summary"].items():
            res = data["claim1"][job]
            lines += [f"**{job}** (`{JOBS[job]}`): device {res['device_bytes'] / MIB:.1f} MiB, 90% = "
                      f"{res['limit_bytes'] / MIB:.1f} MiB", "",
                      "| policy | step (ms) | vs full AC | peak (MiB) | exact |", "|---|---|---|---|---|"]
            for name, r in rows.items():
                if r.get("failed"):
                    lines.append(f"| {name} | failed | | | |")
                    continue
                spread = r["vs_full_spread"]
                rng = f" ({pct(spread[0])} to {pct(spread[1])})" if spread and len(res["rounds"]) > 1 else ""
                lines.append(f"| {name} | {r['step_ms']:.0f} | {pct(r['vs_full'])}{rng} | {r['peak_mib']:.1f} | "
                             f"{'yes' if r['exact'] else 'no'} |")
            paper = PAPER.get(job)
            if paper:
                lines += ["", f"Paper: replay alone {paper[0]}, planned at 90% {paper[1]} against full AC."]
            lines.append("")
        lines += [data.get("claim1_verdict", ""), ""]
    if "claim1b" in data:
        lines += budget_section(data)
    if "claim2" in data:
        sw = data["claim2"]
        lines += ["## 2. The MoE batch sweep", "",
                  run_line(data, 2),
                  f"Qwen3.5 MoE (`{JOBS['Qwen3.5 MoE']}`), limit {sw['limit_mib']:.1f} MiB: the device at the "
                  "smallest batch. TapeSAC is given the limit (`limit_gib`) and re-plans at each batch; the others "
                  "are not limited, and a peak over the limit is where a GPU of that size runs out of memory.", "",
                  "| batch | policy | step (ms) | peak (MiB) | over the limit |", "|---|---|---|---|---|"]
        for r in sw["rows"]:
            if r["failed"]:
                what = "refused: no plan fits the limit" if r.get("refused") else "failed"
                lines.append(f"| {r['batch']} | {r['policy']} | {what} | | |")
            else:
                lines.append(f"| {r['batch']} | {r['policy']} | {r['step_ms']:.0f} | {r['peak_mib']:.1f} | "
                             f"{'**yes**' if r['over'] else 'no'} |")
        lines += ["", "![sweep](paper_moe_batch_sweep.png)", "", data.get("claim2_verdict", ""), ""]
    if "claim3" in data:
        c = data["claim3"]
        cfg = c["config"]
        lines += ["## 3. Bytes are not cost: compile's FLOP-priced budget against measured costs", "",
                  run_line(data, 3),
                  f"`tools/paper_bytes.py` (no torchtitan; torch {c['torch']}, one thread): {cfg['blocks']} blocks, "
                  f"dim {cfg['dim']}, batch {cfg['batch']} × {cfg['seq']} tokens, AdamW. Each block has a custom "
                  f"kernel (a `torch.library` custom op: {cfg['k']} chained matmuls with tanh and a projection, "
                  "computed tile by tile as a GPU kernel would, so its temporaries stay small) that torch.compile "
                  "sees as one op with no FLOP formula. *equal*: the kernel's output and a `Linear`'s have the same "
                  f"size, `[tokens, {cfg['dim']}]`; the kernel costs about {cfg['k'] + 1}× the `Linear`. "
                  "This is the gated-DeltaNet layer's situation: the delta rule's output is the size of a "
                  "projection's and costs many times more. *tiny*: the kernel's output is `[tokens, 4]`, beside "
                  f"a cheap `repeat` + SiLU of `[tokens, {4 * cfg['dim']}]`.", "",
                  "torch.compile's `activation_memory_budget` (torchtitan's `memory_budget` mode) picks what to "
                  "save with a knapsack that prices each op it may recompute by its FLOPs; an op without a FLOP "
                  "formula is priced at one FLOP. TapeSAC prices each op by its measured time. TapeSAC+compile "
                  "(`wrap(compile=True)`) runs TapeSAC's plan through torch.compile, so it and the budget use the "
                  "same kernels and are measured by the same meter: the step peak is parameters, gradients, "
                  "optimizer state and batch plus the CPU allocator's highest running total in a step (the "
                  "profiler's allocator events, which see compiled code, and also the kernel's tile temporaries, which "
                  "TapeSAC's CPU storage counter does not: on CPU it sees no kernel's workspace, on CUDA it plans "
                  "from the allocator's statistics). *kernel runs* counts the custom "
                  f"kernel's forwards per step: {cfg['blocks']} when its output is kept, "
                  f"{2 * cfg['blocks']} when backward recomputes it. Step times are medians over "
                  f"{cfg['rounds']} interleaved rounds of {cfg['steps']} steps.", ""]
        for k in c["kinds"]:
            lines += [f"### Block *{k['kind']}*: at each compile budget's peak", "",
                      "| compile point | its peak (MiB) | its step (ms) | kernel runs | fastest TapeSAC+compile "
                      "at or under that peak | peak (MiB) | step (ms) | kernel runs | time vs compile |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in k["summary"]:
                t = (f"{r['tapesac']} | {r['tapesac_peak_mib']:.1f} | {r['tapesac_ms']:.0f} | {r['tapesac_calls']} | "
                     f"{pct(r['diff'])}") if r["tapesac"] else "none fits | — | — | — | —"
                lines.append(f"| {r['compile']} | {r['compile_peak_mib']:.1f} | {r['compile_ms']:.0f} | "
                             f"{r['compile_calls']} | {t} |")
            lines += ["", f"All runs of block *{k['kind']}*:", "",
                      "| policy | measured peak (MiB) | limit (MiB) | median step (ms) | kernel runs per step |",
                      "|---|---|---|---|---|"]
            for r in sorted(k["rows"], key=lambda r: (r["policy"].split(" @")[0], r["peak_bytes"])):
                lim = f"{r['limit_bytes'] / MIB:.1f}" if r["limit_bytes"] else ""
                if r["limit_bytes"] and r["peak_bytes"] > r["limit_bytes"]:
                    lim += f" (**over by {(r['peak_bytes'] - r['limit_bytes']) / 2**10:.0f} KiB**)"
                lines.append(f"| {r['policy']} | {r['peak_bytes'] / MIB:.1f} | {lim} | {r['step_s'] * 1e3:.0f} | "
                             f"{r['kernel_calls_per_step']} |")
            for r in k["refused"]:
                lines.append(f"| {r['policy']} | refused before training | {r['limit_bytes'] / MIB:.1f} | — | — |")
            lines.append("")
        lines += ["![bytes vs cost](paper_bytes_vs_cost.png)", "", data.get("claim3_verdict", ""), ""]
    if "claim4" in data:
        e = data["claim4"]
        lines += ["## 4. End to end", "",
                  run_line(data, 4),
                  f"{e['job']} (`{JOBS[e['job']]}`), {e['steps']} steps per run on the project's offline text; "
                  f"TapeSAC planned at 90% of the device ({e['limit_mib']:.1f} MiB). Wall time is the whole "
                  "process: start-up, warm-up, profiling and planning included.", "",
                  "| policy | wall (s) | training steps (s) | vs full AC (wall) | peak (MiB) | losses = none's |",
                  "|---|---|---|---|---|---|"]
        full = e["runs"].get("full AC", {})
        for name, r in e["runs"].items():
            if r["failed"]:
                lines.append(f"| {name} | failed | | | | |")
                continue
            vs = pct(r["wall_s"] / full["wall_s"] - 1) if full and not full["failed"] else "—"
            lines.append(f"| {name} | {r['wall_s']:.0f} | {r['train_s']:.0f} | {vs} | {r['peak_mib']:.1f} | "
                         f"{'yes' if r['exact'] else 'no'} |")
        lines += ["", "![losses](paper_end_to_end_losses.png)", "", data.get("claim4_verdict", ""), ""]
    if "claim5" in data:
        lines += shape_section(data)
    if "claim6" in data:
        c = data["claim6"]
        lines += ["## 6. Ablations: the allocation MILP against greedy and a uniform budget", "",
                  run_line(data, 6),
                  f"A planning experiment, not a training run: `tools/bench_planner.py`'s synthetic step, "
                  f"{c['blocks']} blocks of {c['kinds']} kinds with {c['values']} values each "
                  f"({c['frontier_points']} frontier points per kind), at three limits across its step "
                  "frontier. *default*: what planned mode runs (greedy start, MILP polish within "
                  f"`solver_time_limit_s`); *long MILP*: the same MILP given {c['long_s']:.0f} s (where its "
                  "status says optimal, the optimum of this model); *uniform*: every block the same kept-bytes "
                  "budget, the largest that fits. Predicted recompute per step; gap to the long MILP.", "",
                  "| limit (fraction of the frontier) | default | greedy | uniform | long MILP |",
                  "|---|---|---|---|---|"]
        for r in c["rows"]:
            best = r["long MILP"]["recompute_s"]

            def cell(x):
                if not x:
                    return "no fit"
                gap = x["recompute_s"] / best - 1 if best > 0 else 0.0
                extra = f", {x['solve_s']:.2f} s" if "solve_s" in x else ""
                return f"{x['recompute_s'] * 1e3:.2f} ms ({pct(gap)}; {x['status']}{extra})"
            lines.append(f"| {r['limit_fraction']:.2f} | {cell(r['default'])} | {cell(r['greedy'])} | "
                         f"{cell(r['uniform'])} | {cell(r['long MILP'])} |")
        lines += ["", data.get("claim6_verdict", ""), ""]
    lines += ["## Not yet run by this harness", "",
              "- **3. and 1b. with fla's Triton kernels** (on a GPU): here the Qwen3.5 job's kernels are CPU "
              "stand-ins wrapped as custom ops (claim 1b), whose times and working memory are the CPU "
              "reference's, not the kernels'. Qwen3.5 MoE compiled is tested in-process, not run in claim 1b.",
              "- **5. with the probe under tensor parallelism** (torchtitan's 397B job runs TP 8; the probe "
              "models a rank without it).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one job, one round, one batch, compile's budgets 0.8 and 0.2 only, 50 end-to-end steps on "
                         "llama3 (a smoke run, < 10 min)")
    ap.add_argument("--claims", default="1,1b,2,3,4,5,6",
                    help="1b: claim 1's jobs compiled (Qwen3.5 dense with its kernels as custom ops), against "
                         "compile's memory budget")
    ap.add_argument("--merge", action="store_true",
                    help="keep OUT/paper.json's other claims; replace only the ones run now (each claim's section "
                         "then names its own command, commit and date)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--jobs", default=None, help="claim 1's jobs, comma-separated: " + ", ".join(JOBS))
    ap.add_argument("--e2e-job", default=None, help="claim 4's job (default Qwen3.5 dense; --quick: llama3)")
    ap.add_argument("--e2e-steps", type=int, default=None)
    ap.add_argument("--batches", default=None, help="claim 2's local batches, comma-separated")
    ap.add_argument("--out", default="docs", help="where paper.md, paper.json and the plots go")
    ap.add_argument("--page-only", action="store_true",
                    help="rewrite paper.md from OUT/paper.json and OUT/paper_verdicts.json; run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    if args.page_only:
        data = json.loads((out / "paper.json").read_text())
        verdicts = out / "paper_verdicts.json"
        if verdicts.exists():
            data.update(json.loads(verdicts.read_text()))
        if "claim1b" in data:  # summaries are functions of the runs: a page always reads the current one
            data["claim1b_summary"] = summarise1b(data["claim1b"])
        args.quick = "--quick" in data["command"]
        args.rounds = len(next(iter(data["claim1"].values()))["rounds"]) if "claim1" in data else 0
        (out / "paper.md").write_text(page(data, args, out))
        return
    claims = {c.strip() for c in args.claims.split(",") if c.strip()}
    known = {"1", "1b", "2", "3", "4", "5", "6"}
    if not claims or any(c and not c[0].isdigit() for c in claims) or ";" in args.claims:
        ap.error(f"--claims: {args.claims!r} is not a comma-separated list of claim numbers")
    if claims - known:
        ap.error(f"--claims: this harness runs claims 1, 1b and 2 to 6; got {args.claims!r}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    jobs = args.jobs.split(",") if args.jobs else (["llama3"] if args.quick else list(JOBS))
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([2] if args.quick else [2, 4, 6, 8])
    e2e_steps = args.e2e_steps or (50 if args.quick else 500)
    e2e_job = args.e2e_job or ("llama3" if args.quick else "Qwen3.5 dense")
    steps = 7 if args.quick else 10
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    data: dict = {"command": "python tools/paper.py " + shlex.join(sys.argv[1:]), "commit": commit,
                  "date": date.today().isoformat(),
                  "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                             f"Python {platform.python_version()}"}
    if args.merge and (out / "paper.json").exists():
        old = json.loads((out / "paper.json").read_text())
        for key in ("command", "commit", "date"):  # the earlier run's provenance moves to its claims
            for c in range(1, 7):
                if f"claim{c}" in old and f"claim{c}_run" not in old:
                    old[f"claim{c}_run"] = {"command": old["command"], "commit": old["commit"], "date": old["date"],
                                            "wall_s": old.get("wall_s", 0.0)}
        data = {**old, **data, "merged": True}
    with tempfile.TemporaryDirectory(prefix="paper_") as d:
        tmp = Path(d)

        def timed(claim: int, fn):
            t0 = time.perf_counter()
            result = fn()
            data[f"claim{claim}_run"] = {"command": data["command"], "commit": commit, "date": data["date"],
                                         "wall_s": time.perf_counter() - t0}
            return result

        if "3" in claims:
            data["claim3"] = timed(3, lambda: claim3(args.quick, log))
            plot_bytes(data["claim3"], out / "paper_bytes_vs_cost.png")
        if "1" in claims:
            data["claim1"] = timed(1, lambda: claim1(jobs, args.rounds, steps, tmp, log))
            data["claim1_summary"] = summarise1(data["claim1"])
        if "1b" in claims:
            compile_jobs = [j for j in jobs if j in COMPILE_JOBS]
            earlier = data.get("claim1b", {}) if args.merge else {}
            earlier_run = data.get("claim1b_run")
            fresh = timed("1b", lambda: claim1b(compile_jobs, args.rounds, steps + 4, tmp, log,
                                                QUICK_BUDGETS if args.quick else BUDGETS))
            for job in fresh:
                fresh[job]["run"] = data["claim1b_run"]
            for job in earlier:  # jobs not run again keep their numbers and say where they come from
                earlier[job].setdefault("run", earlier_run)
            data["claim1b"] = {**{j: r for j, r in earlier.items() if j not in fresh}, **fresh}
            data["claim1b_summary"] = summarise1b(data["claim1b"])
        if "2" in claims:
            data["claim2"] = timed(2, lambda: claim2(batches, steps if not args.quick else 5, tmp, log))
            plot_sweep(data["claim2"], out / "paper_moe_batch_sweep.png")
        if "5" in claims:
            data["claim5"] = timed(5, lambda: claim5(args.quick, log))
            plot_shape(data["claim5"], out / "paper_397b_pattern.png")
        if "6" in claims:
            data["claim6"] = timed(6, lambda: claim6(args.quick, log))
        if "4" in claims:
            data["claim4"] = timed(4, lambda: claim4(e2e_job, e2e_steps, tmp, log))
            plot_losses(data["claim4"], out / "paper_end_to_end_losses.png")
    data["wall_s"] = time.perf_counter() - start
    verdicts = out / "paper_verdicts.json"  # written by people after reading the numbers
    if verdicts.exists():
        data.update(json.loads(verdicts.read_text()))
    (out / "paper.json").write_text(json.dumps(data, indent=1))
    (out / "paper.md").write_text(page(data, args, out))
    log(f"wrote {out / 'paper.md'}")


if __name__ == "__main__":
    main()
