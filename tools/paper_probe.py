"""``python -m tools.paper_probe <torchtitan 0.3 arguments>``: torchtitan 0.3's trainer for
``tools/paper.py``, recording on this rank, per training step, its exact loss and the wall
seconds of ``train_step`` (forward, backward and optimizer step), and the peak of live tensor
storages of one step (``$PAPER_METER_STEP``, 0-based; that step is metered, not timed: the meter
costs per op), and per step how many times Qwen3.5's CPU kernels ran (recomputations included).
The meter is the one TapeSAC's planner uses on CPU, tracking the model and its
optimizers' states as the planner does; with ``$PAPER_METER=allocator``, the CPU allocator's
events instead (``tapesac.meter.AllocatorPeak``: it sees compiled code, which a dispatch mode
stops), over that step and the next, the second one's peak recorded. With TapeSAC, also its
plan: limit, predicted peak and recompute, and the measured history. At exit it writes
``$PAPER_PROBE.rank<r>.json``.

With ``$PAPER_GRAPHS`` set, the first profiled step's block graphs (measured op times, storage
bytes), each value's shape and element size, and the step's measured memory windows are written
there as JSON (``tools/paper_shape.py`` plans a larger model's layer pattern from them)."""

import atexit
import json
import math
import os
import time

import torchtitan.train
import torchtitan.trainer

import torchtitan03_ext  # noqa: F401  (registers the CPU shim and the tapesac choice)
from torchtitan03_ext.fla_cpu import KERNEL_RUNS
from tapesac.autoplan.step import _tensors_of
from tapesac.meter import AllocatorPeak, CpuMeter

_METER_STEP = int(os.environ.get("PAPER_METER_STEP", "-1"))
_METER = os.environ.get("PAPER_METER", "storages")
_record: dict = {"losses": [], "step_s": [], "peak_bytes": None, "kernel_runs": []}
_trainer: list = []


def _tracked(trainer) -> list:
    """What lives across steps: the model's parameters, gradients and buffers, the optimizers' states."""
    optimizers = getattr(trainer.optimizers, "optimizers", [trainer.optimizers])
    return list(_tensors_of(list(trainer.model_parts))) + list(_tensors_of(optimizers))


def _allocator_meter(trainer) -> tuple[AllocatorPeak, int]:
    """An allocator meter watching what lives across steps (held weakly once entered), and the
    bytes of that."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in _tracked(trainer)}
    return AllocatorPeak(watch=storages.values()), sum(st.nbytes() for st in storages.values())


def _patch(trainer_cls) -> None:
    forward_backward = trainer_cls.forward_backward_step
    train_step = trainer_cls.train_step

    def forward_backward_step(self, **kwargs):
        loss = forward_backward(self, **kwargs)
        _record["losses"].append(float(loss.detach().sum().item()).hex())
        if not _trainer:
            _trainer.append(self)
        return loss

    def timed_train_step(self, *args, **kwargs):
        before = KERNEL_RUNS.copy()
        try:
            return metered_or_timed(self, *args, **kwargs)
        finally:
            _record["kernel_runs"].append(dict(KERNEL_RUNS - before))

    def metered_or_timed(self, *args, **kwargs):
        step = len(_record["step_s"])
        # The meters hold what they track only until they start: a reference kept here would keep
        # the last step's gradients alive through this step's backward (the step frees them in
        # zero_grad) and add them to the peak measured.
        if _METER == "allocator" and step in (_METER_STEP, _METER_STEP + 1):
            # Sees compiled code (a dispatch mode stops fullgraph compiles). Two steps in a row:
            # the profiler reports the free of a block only if a profiler ran when it was
            # allocated, and the first metered step frees what the step before it allocated.
            meter, base = _allocator_meter(self)
            try:
                with meter:
                    return train_step(self, *args, **kwargs)
            finally:
                _record["peak_bytes"] = base + meter.peak_bytes
                _record["step_s"].append(math.nan)
        if step == _METER_STEP:
            meter = CpuMeter(_tracked(self))
            meter.start()
            try:
                return train_step(self, *args, **kwargs)
            finally:
                meter.stop()
                _record["peak_bytes"] = meter.peak()
                _record["step_s"].append(math.nan)
        start = time.perf_counter()
        try:
            return train_step(self, *args, **kwargs)
        finally:
            _record["step_s"].append(time.perf_counter() - start)

    trainer_cls.forward_backward_step = forward_backward_step
    trainer_cls.train_step = timed_train_step


def _capture_graphs(path: str) -> None:
    """Write the first profiled step's block graphs, value shapes and memory windows to ``path``."""
    import dataclasses

    from tapesac.autoplan.plans import PlanMaker

    plan_profiled = PlanMaker.plan_profiled

    def capture(self, key, step, memory, orders):
        why = plan_profiled(self, key, step, memory, orders)
        if why is None and not os.path.exists(path):
            tapes = dict(step.tapes)
            entry = self.plans[key]
            blocks = {str(b): {"graph": g.to_json(),
                               "value_shapes": [list(v.shape) for v in tapes[b].values],
                               "value_itemsize": [v.dtype.itemsize for v in tapes[b].values]}
                      for b, g in entry.graphs.items()}
            data = {"blocks": blocks, "memory": [dataclasses.asdict(w) for w in entry.memory.windows]}
            with open(path, "w") as f:
                json.dump(data, f)
        return why

    PlanMaker.plan_profiled = capture


def _add_layer_sizes(path: str) -> None:
    """Each block's parameter bytes, those of its routed experts and how many experts it holds,
    into the graphs' file."""
    if not _trainer or not os.path.exists(path):
        return
    layers = _trainer[0].model_parts[0].layers
    sizes = []
    for layer in (layers.values() if hasattr(layers, "values") else layers):
        named = list(layer.named_parameters())
        experts = [p for n, p in named if "routed_experts." in n]
        sizes.append({"param_bytes": sum(p.numel() * p.element_size() for _n, p in named),
                      "expert_param_bytes": sum(p.numel() * p.element_size() for p in experts),
                      "local_experts": experts[0].shape[0] if experts else 0})
    with open(path) as f:
        data = json.load(f)
    data["layers"] = sizes
    with open(path, "w") as f:
        json.dump(data, f)


def _dump() -> None:
    if os.environ.get("PAPER_GRAPHS"):
        _add_layer_sizes(os.environ["PAPER_GRAPHS"])
    tapesac = getattr(_trainer[0], "tapesac", None) if _trainer else None
    if tapesac is not None:
        planner = tapesac.handle.planner
        plan = planner.plan if planner is not None else None
        _record["tapesac"] = {
            "limit_bytes": getattr(tapesac, "limit_bytes", None),
            "planned": plan is not None,
            "predicted_peak_bytes": plan.policy.predicted_peak_bytes if plan is not None else None,
            "predicted_recompute_s": plan.policy.predicted_recompute_s if plan is not None else None,
            "solve_s": plan.solve_s if plan is not None else None,
            "history": planner.history if planner is not None else [],
        }
    _record["step_s"] = [None if math.isnan(s) else s for s in _record["step_s"]]
    rank = os.environ.get("RANK", "0")
    with open(f"{os.environ['PAPER_PROBE']}.rank{rank}.json", "w") as f:
        json.dump(_record, f)


if __name__ == "__main__":
    _patch(torchtitan.trainer.Trainer)
    if os.environ.get("PAPER_GRAPHS"):
        _capture_graphs(os.environ["PAPER_GRAPHS"])
    atexit.register(_dump)
    torchtitan.train.main()
