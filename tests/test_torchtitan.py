"""torchtitan + FSDP2 on CPU with gloo: real torchrun jobs, compared to the bit with the baseline."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .net import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/llama3_debug_cpu.toml"
BASELINE = "train_configs/llama3_debug_cpu_baseline.toml"
STEPS = 5

pytestmark = pytest.mark.slow


def run_titan(tmp: Path, name: str, config: str, *overrides: str, nproc: int = 2,
              dump: Path | None = None, steps: int = STEPS) -> tuple[subprocess.CompletedProcess, list[dict]]:
    probe = tmp / name
    dump = dump or tmp / f"{name}_dump"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "torchtitan.train", "--job.config_file", config, "--job.dump_folder", str(dump),
           "--training.steps", str(steps), "--experimental.custom_import", "tests.titan_probe", *overrides]
    env = {**os.environ, "TAPESAC_PROBE": str(probe), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    records = []
    for r in range(nproc):
        path = Path(f"{probe}.rank{r}.json")
        records.append(json.loads(path.read_text()) if path.exists() else None)
    return out, records


def _ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    out, records = run_titan(tmp, "base", BASELINE)
    _ok(out)
    return [r["losses"] for r in records]


@pytest.fixture(scope="module")
def planned_limit_gib(tmp_path_factory):
    """A limit between the smallest and the largest useful peak, read from a first run's frontier."""
    tmp = tmp_path_factory.mktemp("span")
    out, _ = run_titan(tmp, "span", CONFIG, "--tapesac.limit_gib", "8", steps=3)
    _ok(out)
    frontier = json.loads((tmp / "span_dump" / "tapesac" / "frontier.json").read_text())["frontier"]
    lo, hi = frontier[0]["memory"], frontier[-1]["memory"]
    assert hi > lo
    return (lo + 0.4 * (hi - lo)) / 2**30


def test_two_rank_fsdp_run_matches_baseline_bitwise_and_restarts_from_its_policy(tmp_path, baseline,
                                                                                 planned_limit_gib):
    dump = tmp_path / "dump"
    limit = f"{planned_limit_gib:.6f}"
    out, records = run_titan(tmp_path, "tapesac", CONFIG, "--tapesac.limit_gib", limit, dump=dump)
    _ok(out)
    assert [r["losses"] for r in records] == baseline  # the loss curve, to the bit, on every rank
    r0, r1 = records
    assert r0["planned"] and r1["planned"]
    assert r0["policy"] == r1["policy"] and any(keep for _i, keep, _s in r0["policy"])
    measured = r0["history"][0]["measured_peak_bytes"]
    assert measured <= float(limit) * 2**30
    assert abs(r0["history"][0]["predicted_peak_bytes"] - measured) <= 0.05 * measured
    policy = json.loads((dump / "tapesac" / "policy.json").read_text())
    assert policy["meta"]["world_size"] == 2
    assert policy["meta"]["limit_requested_bytes"] == int(float(limit) * 2**30) >= policy["limit_bytes"]
    assert "TapeSAC plan: limit" in out.stdout + out.stderr

    # A restart with the same job loads the policy: no profiling, the same losses.
    out2, again = run_titan(tmp_path, "restart", CONFIG, "--tapesac.limit_gib", limit, dump=dump)
    _ok(out2)
    log = out2.stdout + out2.stderr
    assert "loaded policy" in log and "TapeSAC plan:" not in log
    assert [r["losses"] for r in again] == baseline
    assert again[0]["policy"] == r0["policy"] and not again[0]["planned"]


def test_micro_batches_with_a_tight_limit_and_a_corrupt_policy_file(tmp_path):
    """Two micro-batches per optimizer step (gradient accumulation) under a limit that fits only
    when a step is planned as a whole; a policy file of random bytes is warned about and replaced."""
    accumulate = ("--training.global_batch_size", "8")  # local batch 2 x 2 ranks x 2 micro-batches
    out, base = run_titan(tmp_path, "ga_base", BASELINE, *accumulate)
    _ok(out)
    dump = tmp_path / "dump"
    (dump / "tapesac").mkdir(parents=True)
    (dump / "tapesac" / "policy.json").write_bytes(bytes(range(256)) * 4)
    out, records = run_titan(tmp_path, "ga", CONFIG, *accumulate, "--tapesac.limit_gib", "0.085",
                             "--metrics.enable_tensorboard", dump=dump)
    _ok(out)
    log = out.stdout + out.stderr
    assert "ignoring policy file" in log and "TapeSAC plan: limit" in log
    assert "TapeSAC [planned]: limit 87.0 MiB, predicted peak" in log  # under torchtitan's step line
    assert_tensorboard_has_tapesac_metrics(dump)
    assert [r["losses"] for r in records] == [r["losses"] for r in base]
    assert records[0]["policy"] == records[1]["policy"] and any(keep for _i, keep, _s in records[0]["policy"])
    assert records[0]["history"] and all(h["measured_peak_bytes"] <= 0.085 * 2**30 for h in records[0]["history"])
    json.loads((dump / "tapesac" / "policy.json").read_text())  # replaced by the new plan


def test_fsdp_with_tensor_parallel_on_four_ranks_plans_once_for_all(tmp_path):
    """FSDP2 x TP2: the tape signatures carry no process-group names, so all four ranks (two TP
    groups) plan together and apply one policy at a tight limit; replay-only and planned losses
    equal the baseline's to the bit. (tools/bench_parallel.py measured 34.7 MiB replay-only and
    59.2 MiB keeping nearly everything on this job: 0.045 GiB = 46.1 MiB sits between.)"""
    tp = ("--parallelism.tensor_parallel_degree", "2")
    limit_gib = 0.045
    out, base = run_titan(tmp_path, "tp_base", BASELINE, *tp, nproc=4, steps=4)
    _ok(out)
    out, replay_only = run_titan(tmp_path, "tp_ro", CONFIG, *tp, "--tapesac.mode", "replay_only", nproc=4, steps=4)
    _ok(out)
    assert [r["losses"] for r in replay_only] == [r["losses"] for r in base]
    out, records = run_titan(tmp_path, "tp", CONFIG, *tp, "--tapesac.limit_gib", str(limit_gib), nproc=4, steps=4)
    _ok(out)
    assert [r["losses"] for r in records] == [r["losses"] for r in base]
    assert all(r["planned"] for r in records)
    assert all(r["policy"] == records[0]["policy"] for r in records)
    assert any(keep for _i, keep, _s in records[0]["policy"]), "the plan keeps nothing: the limit is not tight"
    for r in records:
        assert r["history"] and all(h["measured_peak_bytes"] <= limit_gib * 2**30 for h in r["history"])


def assert_tensorboard_has_tapesac_metrics(dump: Path) -> None:
    """``python -m torchtitan.train`` runs the trainer as ``__main__``: the metrics must get there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in (dump / "tb").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags.update(acc.Tags()["scalars"])
    expected = {"tapesac/limit_gib", "tapesac/predicted_peak_gib", "tapesac/measured_peak_gib",
                "tapesac/kept_gib", "tapesac/recompute_ms", "tapesac/replayed_ops"}
    assert expected <= tags, sorted(tags)


def test_replay_only_mode_matches_baseline(tmp_path, baseline):
    out, records = run_titan(tmp_path, "ro", CONFIG, "--tapesac.mode", "replay_only")
    _ok(out)
    assert [r["losses"] for r in records] == baseline
    stats = records[0]["stats"]
    assert all(s["ops_replayed"] > 0 and s["kept_bytes"] == 0 for s in stats.values())


def test_two_nodes_on_loopback_match_baseline(tmp_path, baseline, planned_limit_gib):
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
               "--rdzv_id=tapesac-test", "-m", "torchtitan.train", "--job.config_file", CONFIG,
               "--job.dump_folder", str(tmp_path / "dump"), "--training.steps", str(STEPS),
               "--tapesac.limit_gib", f"{planned_limit_gib:.6f}",
               "--experimental.custom_import", "tests.titan_probe"]
        env = {**os.environ, "TAPESAC_PROBE": str(tmp_path / "nodes"), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    records = [json.loads((tmp_path / f"nodes.rank{r}.json").read_text()) for r in range(2)]
    assert [r["losses"] for r in records] == baseline
    assert records[0]["policy"] == records[1]["policy"] and records[0]["planned"]


COMPILED_STEPS = 10
COMPILED_LOSS_TOL = 1e-5
"""Compiled mode against torchtitan's compile without AC (same backend): measured on the 2-rank
debug job, the per-step losses (2.7 to 4.1) differed by at most 4.8e-7 (1.5e-7 relative, one or
two float32 ulp) on either rank over 10 steps; 1e-5 leaves room for other CPUs' kernels and still
fails a wrong gradient (one AdamW step moves the loss by ~0.1 here) by orders of magnitude."""


def test_two_rank_fsdp_compiled_run_fits_its_limit_and_matches_compile_without_ac(tmp_path):
    out, records = run_titan(tmp_path, "base", BASELINE, "--compile.enable", steps=COMPILED_STEPS)
    _ok(out)
    expected = [[float.fromhex(x) for x in r["losses"]] for r in records]
    out, records = run_titan(tmp_path, "compiled", CONFIG, "--compile.enable", steps=COMPILED_STEPS)
    _ok(out)
    log = out.stdout + out.stderr
    assert "full AC from now on" not in log  # every plan compiled, every trace ran its block's tape
    for rank, (record, losses) in enumerate(zip(records, expected)):
        actual = [float.fromhex(x) for x in record["losses"]]
        assert len(actual) == COMPILED_STEPS
        diffs = [abs(a - e) for a, e in zip(actual, losses)]
        assert max(diffs) <= COMPILED_LOSS_TOL, (rank, diffs)
        assert record["planned"] and all(s["compiled"] for s in record["stats"].values())
        # The job's limit (budget 0.9 of its 0.1 GiB "device") lies inside the frontier; the last
        # measured step under the plan (after any re-plan) fits it, or it was a plan raised into
        # measured slack, which goes back to the last plan measured within the limit.
        history = record["history"]
        last = history[-1]
        assert abs(last["limit_bytes"] - 0.9 * 0.1 * 2**30) < 2
        within = [h for h in history if h["measured_peak_bytes"] <= h["limit_bytes"]]
        assert within and (last is within[-1] or last["planned_limit_bytes"] > within[-1]["planned_limit_bytes"])
    assert records[0]["policy"] == records[1]["policy"] and any(keep for _i, keep, _s in records[0]["policy"])


@pytest.mark.parametrize("nproc, overrides, message", [
    # Settings that need no second rank run on one: each launch costs two ranks' imports, and the
    # two-rank cases below show that rank 0 alone reports and no other rank prints.
    (1, ["--tapesac.budget", "1.5"], "tapesac.budget must be in (0, 1]"),
    (1, ["--tapesac.budget", "0"], "tapesac.budget must be in (0, 1]"),
    (1, ["--tapesac.limit_gib", "-1"], "tapesac.limit_gib must be >= 0 and finite"),
    (1, ["--tapesac.profile_steps", "0"], "tapesac.profile_steps must be an integer >= 1"),
    (2, ["--activation_checkpoint.mode", "full"], "TapeSAC replaces activation checkpointing"),
    (1, ["--activation_checkpoint.mode", "selective"], "activation_checkpoint.mode = \"none\""),
    (1, ["--compile.enable", "--tapesac.mode", "replay_only"], "TapeSAC compiles a block only under a plan"),
    (2, ["--compile.enable", "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
     "runs under FSDP2 and data parallelism only"),
    (1, ["--compile.enable", "--tapesac.debug"], "debug mode checks eager replay"),
    (2, ["--parallelism.context_parallel_degree", "2"], "set parallelism.context_parallel_degree = 1"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "set parallelism.pipeline_parallel_schedule to one of those"),
])
def test_bad_settings_fail_before_training(tmp_path, nproc, overrides, message):
    out, records = run_titan(tmp_path, "bad", CONFIG, *overrides, nproc=nproc, steps=2)
    assert out.returncode != 0
    assert_one_clear_error(out, message)
    assert all(r is None or r["losses"] == [] for r in records)  # no step ran on any rank


def assert_one_clear_error(out: subprocess.CompletedProcess, message: str) -> None:
    """One line from rank 0 says what is wrong; no rank prints a traceback; status 2."""
    log = out.stdout + out.stderr
    lines = [line for line in log.splitlines() if line.startswith("[tapesac] error:")]
    assert len(lines) == 1 and message in lines[0], log[-4000:]
    assert "exitcode  : 2" in log
    assert 'File "' + str(ROOT / "tapesac") not in log and "torchtitan_ext/" not in log.split("[tapesac] error:")[1]


def test_unknown_setting_is_an_error(tmp_path):
    out, _ = run_titan(tmp_path, "bogus", CONFIG, "--tapesac.bogus", "1", nproc=1, steps=2)
    assert out.returncode != 0 and "bogus" in out.stdout + out.stderr


def test_unknown_field_in_toml_is_an_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text((ROOT / CONFIG).read_text() + "bogus_field = 3\n")
    out, _ = run_titan(tmp_path, "badtoml", str(config), nproc=1, steps=2)
    assert out.returncode != 0 and "bogus_field" in out.stdout + out.stderr


def test_infeasible_limit_names_the_smallest_peak(tmp_path):
    out, records = run_titan(tmp_path, "tiny", CONFIG, "--tapesac.limit_gib", "0.001", steps=4)
    assert out.returncode != 0
    assert_one_clear_error(out, "is infeasible")
    assert "the smallest achievable" in out.stdout + out.stderr
    assert len(records[0]["losses"]) <= 2  # warm-up and profiling steps only


def test_policy_from_another_world_size_is_replanned_with_a_warning(tmp_path):
    dump = tmp_path / "dump"
    limit = "0.25"  # feasible on one rank too (unsharded parameters and optimizer state)
    _ok(run_titan(tmp_path, "two", CONFIG, "--tapesac.limit_gib", limit, dump=dump, steps=3)[0])
    out, records = run_titan(tmp_path, "one", CONFIG, "--tapesac.limit_gib", limit, dump=dump, nproc=1, steps=4)
    _ok(out)
    log = out.stdout + out.stderr
    assert "ignoring policy file" in log and "world_size=2" in log
    assert records[0]["planned"]
    assert json.loads((dump / "tapesac" / "policy.json").read_text())["meta"]["world_size"] == 1


def test_slurm_script_builds_the_torchrun_command(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        # A long node list: the script must read all of it (a reader that stops early would get
        # the writer killed by SIGPIPE, and pipefail would fail the job).
        "scontrol": 'echo gpu-node-07; for i in $(seq 8 30000); do echo gpu-node-$i; done',
        "srun": 'echo "srun $*"',
    }.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
           "PYTHON": "python3"}
    out = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch"), "train_configs/llama3_8b.toml",
                          "--tapesac.budget", "0.85"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    srun = [line for line in out.stdout.splitlines() if line.startswith("srun ")][0]
    assert srun == ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 python3 -m torch.distributed.run "
                    "--nnodes 2 --nproc_per_node 8 --rdzv_id 4242 --rdzv_backend c10d "
                    "--rdzv_endpoint gpu-node-07:29500 -m torchtitan.train --job.config_file "
                    "train_configs/llama3_8b.toml --tapesac.budget 0.85")
    # torchtitan 0.3.x: torchtitan.train's own arguments, passed as they are.
    out03 = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch"), "--module", "torchtitan03_ext",
                            "--config", "llama3_8b", "activation-checkpoint:tapesac",
                            "--activation-checkpoint.budget", "0.85"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert out03.returncode == 0, out03.stderr
    srun03 = [line for line in out03.stdout.splitlines() if line.startswith("srun ")][0]
    assert srun03.endswith("--rdzv_endpoint gpu-node-07:29500 -m torchtitan.train --module torchtitan03_ext "
                           "--config llama3_8b activation-checkpoint:tapesac --activation-checkpoint.budget 0.85")
    empty = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch")], env=env,
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "usage:" in empty.stderr
    env2 = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    out2 = subprocess.run(["bash", str(ROOT / "tools/slurm/train.sbatch"), "x.toml"], env=env2,
                          capture_output=True, text=True, timeout=60)
    assert out2.returncode != 0 and "run under SLURM" in out2.stderr
