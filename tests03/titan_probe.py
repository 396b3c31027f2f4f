"""``python -m tests03.titan_probe <torchtitan.train arguments>``: torchtitan 0.3's trainer,
recording each step's exact loss and, at exit, what TapeSAC did on this rank, as JSON at
``$TAPESAC_PROBE.rank<r>.json`` (for the tests, which launch it under torchrun). With
``TAPESAC_PROBE_PEAKS=1`` it also measures every training step's peak (storage counting, from the
step's start to its optimizer step's end, parameters, gradients and optimizer state included)."""

import atexit
import json
import os

import torchtitan.train
import torchtitan.trainer

# Before this module's exit handler: the CPU shim's own handler (which may end the process
# after a clean teardown) must be registered first, so that it runs after the dump.
import torchtitan03_ext  # noqa: F401

_losses: list[str] = []
_peaks: list[int] = []
_policy: list = []  # held from the first step: the trainer (and its policy) is gone at exit


def _patch(trainer_cls) -> None:
    original = trainer_cls.forward_backward_step

    def forward_backward_step(self, **kwargs):
        loss = original(self, **kwargs)
        _losses.append(float(loss.detach().sum().item()).hex())
        if not _policy and getattr(self, "tapesac", None) is not None:
            _policy.append(self.tapesac)
        return loss

    trainer_cls.forward_backward_step = forward_backward_step
    if os.environ.get("TAPESAC_PROBE_PEAKS"):
        _measure_steps(trainer_cls)


def _measure_steps(trainer_cls) -> None:
    from tapesac.autoplan.step import _tensors_of
    from tapesac.meter import CpuMeter

    original = trainer_cls.train_step

    def train_step(self, *args, **kwargs):
        optimizers = getattr(self.optimizers, "optimizers", [self.optimizers])
        meter = CpuMeter(list(_tensors_of(self.model_parts)) + list(_tensors_of(optimizers)))
        meter.start()
        try:
            return original(self, *args, **kwargs)
        finally:
            meter.stop()
            _peaks.append(meter.peak())

    trainer_cls.train_step = train_step


def _dump() -> None:
    record: dict = {"losses": _losses, "step_peaks": _peaks}
    if _policy:
        handle = _policy[0].handle
        planner = handle.planner
        record["policy"] = [[s.index, sorted(map(list, s.keep or ())), s.expected_signature] for s in handle.blocks]
        record["planned"] = planner is not None and planner.plan is not None
        record["history"] = planner.history if planner is not None else []
        record["stats"] = {str(k): v for k, v in handle.stats().items()}
    rank = os.environ.get("RANK", "0")
    with open(f"{os.environ['TAPESAC_PROBE']}.rank{rank}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    _patch(torchtitan.trainer.Trainer)
    atexit.register(_dump)
    torchtitan.train.main()
