"""TapeSAC's compiled mode in a torchtitan job, whatever the front door.

Both torchtitan versions compile the model with ``compile.enable`` and ``"model"`` in
``compile.components`` (a ``CompileConfig`` with the same fields in 0.2.x and 0.3.x), by
compiling each transformer block in the model's ``parallelize_fn``. A compiled block cannot be
recorded, so with TapeSAC the front door keeps torchtitan from compiling the blocks (it drops
``"model"`` from the components torchtitan sees) and TapeSAC compiles them itself, after
recording and planning them eagerly (``tapesac.compiled``), with :func:`compile_options`.
The loss is still compiled by torchtitan when listed.
"""

from __future__ import annotations

from typing import Any

from tapesac.errors import ConfigError

from .settings import TapeSACSettings

COMPILE_ONLY_THE_LOSS = "compile only the loss (compile.components = [\"loss\"])"


def compiles_blocks(compile_config: Any) -> bool:
    """The job asks torchtitan to compile the model (each transformer block)."""
    return bool(compile_config.enable and "model" in compile_config.components)


def compile_options(compile_config: Any) -> dict[str, Any]:
    """``torch.compile``'s arguments for TapeSAC's blocks: the job's backend."""
    return {"backend": compile_config.backend}


def without_blocks(components: list[str]) -> list[str]:
    """``compile.components`` as torchtitan should see them when TapeSAC compiles the blocks."""
    return [c for c in components if c != "model"]


def check(cfg: TapeSACSettings, parallelism: Any) -> None:
    """Refuse what compiled mode does not run (ConfigError naming the setting and the fix).

    Called when the job compiles the blocks. Compiled mode is tested under FSDP2 and data
    parallelism only; it compiles a block under a plan (replay-only runs eagerly), and debug
    mode checks eager replay, which compiled blocks do not do.
    """
    p = cfg.prefix
    if cfg.mode != "plan":
        raise ConfigError(
            f"compile.enable with {p}.mode = '{cfg.mode}': TapeSAC compiles a block only under a plan, "
            f"and replay-only runs eagerly. Set {p}.mode = \"plan\", or {COMPILE_ONLY_THE_LOSS}")
    if cfg.debug:
        raise ConfigError(
            f"compile.enable with {p}.debug = true: debug mode checks eager replay, and compiled blocks "
            f"do not replay. Set {p}.debug = false, or {COMPILE_ONLY_THE_LOSS}")
    others = [f"parallelism.{name} = {getattr(parallelism, name)}" for name in
              ("tensor_parallel_degree", "expert_parallel_degree", "pipeline_parallel_degree")
              if getattr(parallelism, name, 1) > 1]
    if others:
        raise ConfigError(
            "TapeSAC's compiled mode (compile.enable with \"model\" in compile.components) runs under "
            f"FSDP2 and data parallelism only, and this job sets {', '.join(others)}: set "
            f"compile.enable = false (eager TapeSAC supports them), or {COMPILE_ONLY_THE_LOSS}")
