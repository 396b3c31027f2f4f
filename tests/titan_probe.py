"""Imported into torchtitan runs under test (``--experimental.custom_import tests.titan_probe``):
records each step's exact loss and, at exit, what TapeSAC did on this rank, as JSON at
``$TAPESAC_PROBE.rank<r>.json``."""

import atexit
import json
import os
import sys

import torchtitan.train

import torchtitan_ext.converter as converter

_losses: list[str] = []
_converter: list = []  # held from the first step: the trainer (and its converter) is gone at exit


def _patch(trainer_cls) -> None:
    original = trainer_cls.forward_backward_step

    def forward_backward_step(self, **kwargs):
        loss = original(self, **kwargs)
        _losses.append(float(loss.detach().sum().item()).hex())
        if not _converter and converter.active() is not None:
            _converter.append(converter.active())
        return loss

    trainer_cls.forward_backward_step = forward_backward_step


# ``python -m torchtitan.train`` runs the trainer as __main__, a second copy of the module.
for module in {sys.modules["torchtitan.train"], sys.modules.get("__main__")}:
    if module is not None and hasattr(module, "Trainer"):
        _patch(module.Trainer)


def _dump() -> None:
    record = {"losses": _losses}
    if _converter:
        handle = _converter[0].handle
        planner = handle.planner
        record["policy"] = [[s.index, sorted(map(list, s.keep or ())), s.expected_signature] for s in handle.blocks]
        record["planned"] = planner is not None and planner.plan is not None
        record["history"] = planner.history if planner is not None else []
        record["stats"] = {str(k): v for k, v in handle.stats().items()}
    rank = os.environ.get("RANK", "0")
    with open(f"{os.environ['TAPESAC_PROBE']}.rank{rank}.json", "w") as f:
        json.dump(record, f)


atexit.register(_dump)
