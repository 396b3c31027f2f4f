"""Every shipped job parses, with the [tapesac] section and without torchtitan's own AC."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses(path):
    import torchtitan_ext  # noqa: F401
    from torchtitan.config import ConfigManager

    from torchtitan_ext.converter import validate

    cfg = ConfigManager().parse_args(["--job.config_file", str(path), "--tapesac.budget", "0.85"])
    assert cfg.tapesac.budget == 0.85  # CLI overrides reach the section
    assert cfg.activation_checkpoint.mode == "none"
    if "tapesac" in cfg.model.converters:
        validate(cfg)
    else:
        assert path.name.endswith("_baseline.toml")


def test_there_are_cpu_debug_and_gpu_jobs():
    names = {p.name for p in CONFIGS}
    assert {"llama3_debug_cpu.toml", "qwen3_debug_cpu.toml", "qwen3_moe_debug_cpu.toml"} <= names
    assert {"llama3_8b.toml", "qwen3_8b.toml", "qwen3_30b_a3b.toml"} <= names
    parallel = {"llama3_tp2_debug_cpu.toml", "llama3_fsdp2_tp2_debug_cpu.toml", "llama3_pp2_debug_cpu.toml",
                "qwen3_moe_ep2_debug_cpu.toml", "qwen3_moe_ep2_debug_cpu_baseline.toml", "llama3_70b.toml"}
    assert parallel <= names


def test_toml_section_and_eager_plan_config_share_defaults():
    import dataclasses

    from tapesac.autoplan import PlanConfig
    from torchtitan_ext.config import TapeSAC

    eager = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    toml = {f.name: f.default for f in dataclasses.fields(TapeSAC)}
    shared = {"safety_margin": "safety_margin", "warmup_steps": "warmup_steps", "profile_steps": "profile_steps",
              "repeats": "profile_repeats", "timing_reduction": "timing_reduction",
              "solver_time_limit_s": "solver_time_limit_s", "verify": "verify"}
    assert {e: eager[e] for e in shared} == {e: toml[t] for e, t in shared.items()}


@pytest.mark.parametrize("field, value, message", [
    ("budget", 1.5, "tapesac.budget must be in (0, 1]"),
    ("budget", float("nan"), "tapesac.budget must be in (0, 1]"),
    ("limit_gib", -1.0, "tapesac.limit_gib must be >= 0"),
    ("limit_gib", float("inf"), "tapesac.limit_gib must be >= 0 and finite"),
    ("safety_margin", 1.0, "tapesac.safety_margin must be in [0, 1)"),
    ("profile_repeats", 0, "tapesac.profile_repeats must be an integer >= 1"),
    ("warmup_steps", 1.5, "tapesac.warmup_steps must be an integer >= 0"),
    ("timing_reduction", "sum", "tapesac.timing_reduction must be one of max, mean, median"),
    ("mode", "fast", "tapesac.mode must be 'plan' or 'replay_only'"),
])
def test_bad_values_are_refused_when_the_section_is_made(field, value, message):
    import tapesac
    from torchtitan_ext.config import TapeSAC

    with pytest.raises(tapesac.ConfigError) as e:
        TapeSAC(**{field: value})
    assert str(e.value).startswith(message)


def test_eager_plan_config_uses_the_same_checks():
    import tapesac
    from tapesac.autoplan import PlanConfig

    with pytest.raises(tapesac.ConfigError, match=r"^safety_margin must be in \[0, 1\)"):
        PlanConfig(memory_limit_bytes=10, safety_margin=2.0)
    with pytest.raises(tapesac.ConfigError, match="memory_limit_bytes must be a positive number"):
        PlanConfig(memory_limit_bytes=0)


@pytest.mark.parametrize("overrides, dims, message", [
    (["--parallelism.context_parallel_degree", "2"], {"cp_enabled": True},
     "set parallelism.context_parallel_degree = 1"),
    (["--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"], {"pp_enabled": True},
     "set parallelism.pipeline_parallel_schedule to one of those"),
    (["--parallelism.pipeline_parallel_schedule_csv", "schedule.csv"], {"pp_enabled": True},
     "pipeline_parallel_schedule_csv = 'schedule.csv' is not one of them"),
    ([], {"pp_enabled": True, "custom_split": True}, "splits its pipeline stages with its own"),
])
def test_parallelisms_tapesac_cannot_run_are_refused_with_the_setting_to_change(monkeypatch, overrides, dims, message):
    from types import SimpleNamespace

    import tapesac
    import torchtitan_ext  # noqa: F401
    from torchtitan.config import ConfigManager

    from torchtitan_ext import converter

    if dims.pop("custom_split", False):
        monkeypatch.setattr(converter, "_pipelining_fn", lambda name: (lambda *a: None))
    cfg = ConfigManager().parse_args(["--job.config_file", str(ROOT / "train_configs/llama3_debug_cpu.toml"),
                                      *overrides])
    parallel_dims = SimpleNamespace(**{"cp_enabled": False, "pp_enabled": False, **dims})
    with pytest.raises(tapesac.ConfigError) as e:
        converter.validate(cfg, parallel_dims)
    assert message in str(e.value)


def test_pipeline_parallel_with_torchtitans_split_is_accepted():
    from types import SimpleNamespace

    import torchtitan_ext  # noqa: F401
    from torchtitan.config import ConfigManager

    from torchtitan_ext import converter

    for schedule in converter.PP_SCHEDULES:
        cfg = ConfigManager().parse_args(["--job.config_file", str(ROOT / "train_configs/llama3_debug_cpu.toml"),
                                          "--parallelism.pipeline_parallel_schedule", schedule])
        converter.validate(cfg, SimpleNamespace(cp_enabled=False, pp_enabled=True))


def test_the_torchtitan_0_3_front_door_refuses_this_torchtitan_in_one_line():
    import subprocess
    import sys

    import torchtitan

    out = subprocess.run([sys.executable, "-c", "import torchtitan03_ext"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"[tapesac] error: TapeSAC: torchtitan {torchtitan.__version__} is installed, "
                                  "but torchtitan03_ext supports torchtitan 0.3.x: use torchtitan_ext instead "
                                  "(see the README)")
