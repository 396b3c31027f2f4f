"""Imported into the torchtitan runs of ``tools/bench_parallel.py`` (``--experimental.custom_import
tools.titan_bench_probe``): per training step on this rank, the wall and CPU seconds of
``train_step``; on the last step instead, its peak of live tensor storages, by the meter TapeSAC's
planner uses on CPU (tracking the model and its optimizers' states, as the planner does). At
exit it writes ``$TAPESAC_BENCH.rank<r>.json``."""

import atexit
import json
import os
import sys
import time

import torchtitan.train

from tapesac.autoplan import _tensors_of
from tapesac.meter import CpuMeter

_STEPS = int(os.environ["TAPESAC_BENCH_STEPS"])
_times: list[tuple[float, float]] = []
_record: dict = {}


def _patch(trainer_cls) -> None:
    original = trainer_cls.train_step

    def train_step(self, *args, **kwargs):
        if len(_times) == _STEPS - 1:  # the metered step: not timed (the meter costs per op)
            optimizers = [o for container in [self.optimizers] for o in getattr(container, "optimizers", [])]
            meter = CpuMeter(list(_tensors_of(list(self.model_parts))) + list(_tensors_of(optimizers)))
            meter.start()
            try:
                return original(self, *args, **kwargs)
            finally:
                _record["peak_bytes"] = meter.peak()
                meter.stop()
                _times.append((float("nan"), float("nan")))
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            _times.append((time.perf_counter() - wall, time.process_time() - cpu))

    trainer_cls.train_step = train_step


# ``python -m torchtitan.train`` runs the trainer as __main__, a second copy of the module.
for module in {sys.modules["torchtitan.train"], sys.modules.get("__main__")}:
    if module is not None and hasattr(module, "Trainer"):
        _patch(module.Trainer)


def _dump() -> None:
    _record["step_wall_s"] = [t[0] for t in _times]
    _record["step_cpu_s"] = [t[1] for t in _times]
    rank = os.environ.get("RANK", "0")
    with open(f"{os.environ['TAPESAC_BENCH']}.rank{rank}.json", "w") as f:
        json.dump(_record, f)


atexit.register(_dump)
