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
