"""Activation checkpointing choices under torchtitan's parallelisms, side by side in one run.

    python tools/bench_parallel.py [--setups tp2,fsdp2_tp2,ep2] [--steps 10] [--rounds 1]
                                   [--json out.json]

For each setup (CPU ranks, gloo, the debug jobs in ``train_configs/``) it runs the same job as
real ``torchrun`` processes once per choice: no AC, torchtitan's full AC, torchtitan's op SAC,
TapeSAC replay-only, and TapeSAC planned at three limits (the peak full AC measured in this
round, the midpoint between replay-only's and no AC's peaks, and no AC's peak). Every run trains
``--steps`` steps; the first half are warm-up (planned mode profiles and plans there), the next
are timed, and the last step is metered: its peak of live tensor storages, by the meter TapeSAC's
planner uses on CPU, tracking the model and its optimizer states (``tools/titan_bench_probe.py``).

Reported per choice: the peak (largest over ranks), the step time (median over the timed steps
of the slowest rank), wall and CPU seconds, and both as ratios to full AC measured in the same
round. On a shared machine CPU time is the steadier clock; gloo's waits are in wall time only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_BASE = "train_configs/llama3_debug_cpu_baseline.toml"
SETUPS = {
    "tp2": dict(nproc=2, tapesac="train_configs/llama3_tp2_debug_cpu.toml", base=LLAMA_BASE,
                base_args=["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": dict(nproc=4, tapesac="train_configs/llama3_fsdp2_tp2_debug_cpu.toml", base=LLAMA_BASE,
                      base_args=["--parallelism.tensor_parallel_degree", "2"]),
    "ep2": dict(nproc=2, tapesac="train_configs/qwen3_moe_ep2_debug_cpu.toml",
                base="train_configs/qwen3_moe_ep2_debug_cpu_baseline.toml", base_args=[]),
}
BASELINES = {
    "no AC": [],
    "full AC": ["--activation_checkpoint.mode", "full"],
    "op SAC": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
}


def run(setup: dict, config: str, args: list[str], steps: int, tmp: Path, name: str) -> dict:
    probe = tmp / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={setup['nproc']}",
           "-m", "torchtitan.train", "--job.config_file", config, "--job.dump_folder", str(tmp / f"{name}_dump"),
           "--training.steps", str(steps), "--experimental.custom_import", "tools.titan_bench_probe", *args]
    env = {**os.environ, "TAPESAC_BENCH": str(probe), "TAPESAC_BENCH_STEPS": str(steps), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    records = [json.loads(Path(f"{probe}.rank{r}.json").read_text()) for r in range(setup["nproc"])]
    timed = range(steps // 2, steps - 1)
    return {
        "peak_bytes": max(r["peak_bytes"] for r in records),
        "step_wall_s": statistics.median(max(r["step_wall_s"][i] for r in records) for i in timed),
        "step_cpu_s": statistics.median(max(r["step_cpu_s"][i] for r in records) for i in timed),
    }


def _last_error(text: str) -> str:
    """The last line of a failed run's output that names an error."""
    lines = [line.strip() for line in text.splitlines() if "Error" in line and ":" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def bench_setup(key: str, steps: int, tmp: Path) -> dict:
    setup = SETUPS[key]
    tmp.mkdir(parents=True, exist_ok=True)
    points: dict[str, dict] = {}
    for name, extra in BASELINES.items():
        try:
            points[name] = run(setup, setup["base"], setup["base_args"] + extra, steps, tmp,
                               f"{key}_{name.replace(' ', '_')}")
        except RuntimeError as e:  # a baseline torchtitan cannot run here: say so, go on
            points[name] = {"error": _last_error(str(e))}
        print(f"  {key} {name}: {points[name]}", flush=True)
    points["TapeSAC replay-only"] = run(setup, setup["tapesac"], ["--tapesac.mode", "replay_only"], steps, tmp,
                                        f"{key}_ro")
    print(f"  {key} replay-only: {points['TapeSAC replay-only']}", flush=True)
    if any("error" in points[k] for k in ("no AC", "full AC", "TapeSAC replay-only")):
        return points  # no limits to plan at
    none, full, ro = (points[k]["peak_bytes"] for k in ("no AC", "full AC", "TapeSAC replay-only"))
    limits = {"full AC's peak": full, "midpoint": (ro + none) // 2, "no AC's peak": none}
    for label, limit in limits.items():
        args = ["--tapesac.mode", "plan", "--tapesac.limit_gib", repr(limit / 2**30),
                "--tapesac.warmup_steps", "1"]
        try:
            p = run(setup, setup["tapesac"], args, steps, tmp, f"{key}_plan_{label.split()[0].strip(chr(39))}")
        except RuntimeError as e:
            p = {"error": _last_error(str(e))}
        p["limit_bytes"] = limit
        points[f"TapeSAC planned at {label}"] = p
        print(f"  {key} planned at {label}: {p}", flush=True)
    for p in points.values():
        if "step_cpu_s" in p and "step_cpu_s" in points["full AC"]:
            p["cpu_vs_full_ac"] = p["step_cpu_s"] / points["full AC"]["step_cpu_s"]
            p["wall_vs_full_ac"] = p["step_wall_s"] / points["full AC"]["step_wall_s"]
            p["peak_vs_full_ac"] = p["peak_bytes"] / points["full AC"]["peak_bytes"]
    return points


def table(key: str, points: dict) -> str:
    lines = [f"### {key}", "", "| choice | peak MiB | vs full AC | step CPU s | vs full AC | step wall s | vs full AC |",
             "|---|---|---|---|---|---|---|"]
    for name, p in points.items():
        if "error" in p:
            limit = f" (limit {p['limit_bytes'] / 2**20:.1f} MiB)" if "limit_bytes" in p else ""
            lines.append(f"| {name}{limit} | failed: {p['error']} | | | | | |")
            continue
        label = name + (f" (limit {p['limit_bytes'] / 2**20:.1f} MiB)" if "limit_bytes" in p else "")
        lines.append(f"| {label} | {p['peak_bytes'] / 2**20:.1f} | {p['peak_vs_full_ac']:.3f} | {p['step_cpu_s']:.3f} | "
                     f"{p['cpu_vs_full_ac']:.3f} | {p['step_wall_s']:.3f} | {p['wall_vs_full_ac']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="tp2,fsdp2_tp2,ep2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.steps < 6:
        ap.error("--steps must be at least 6 (warm-up and planning, timed steps, a metered step)")
    result = {"date": date.today().isoformat(), "steps": a.steps, "rounds": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            rnd = {}
            for key in a.setups.split(","):
                print(f"round {r}: {key}", flush=True)
                rnd[key] = bench_setup(key, a.steps, Path(tmp) / f"r{r}")
                print(table(key, rnd[key]), flush=True)
            result["rounds"].append(rnd)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
