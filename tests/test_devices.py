"""The engine and planner on every available device (CPU always; CUDA when present).

On CUDA this is where the device-specific parts are checked: the CUDA generator's state for
dropout, bf16 autocast casts on the tape, and the step peak measured by the caching allocator's
own statistics against the planner's prediction.
"""

from __future__ import annotations

import pytest
import torch

import tapesac
from tapesac.autoplan import PlanConfig

from .blocks import CASES, DEEP, assert_identical, grads, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
KINDS = ["llama3", "qwen3_moe", "encoder_dropout", "inplace"]


def _kinds(device: str) -> list[str]:
    return KINDS if device == "cuda" else KINDS[:1]  # CPU covers the rest elsewhere


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True])
def test_gradients_are_bit_identical_on_device(device, autocast):
    for kind in _kinds(device):
        def run(case):
            if not autocast:
                return grads(case)
            with torch.autocast(device, dtype=torch.bfloat16):
                return grads(case)

        expected, _ = run(to_device(CASES[kind](), device))
        case = to_device(CASES[kind](), device)
        handle = tapesac.wrap(case.blocks)
        actual, _ = run(case)
        assert_identical(expected, actual)
        assert all(s["ops_replayed"] > 0 for s in handle.stats().values()), kind


@pytest.mark.parametrize("device", DEVICES)
def test_planned_peak_fits_and_is_predicted_on_device(device):
    def train(limit, steps=5):
        case = to_device(DEEP["llama3"](), device)
        handle = tapesac.wrap(case.blocks, plan_config=PlanConfig(memory_limit_bytes=int(limit),
                                                                  device=torch.device(device)))
        result = []
        for s in range(steps):
            result.append(grads(case, seed=s)[0])
            handle.step()  # no optimizer here: the step ends by hand
        handle.remove()
        return handle, result

    first, _ = train(1e12, steps=4)
    lo, hi = first.plan.smallest_peak_bytes, first.plan.largest_useful_peak_bytes
    limit = (lo + hi) / 2
    handle, actual = train(limit)
    expected = [grads(to_device(DEEP["llama3"](), device), seed=s)[0] for s in range(5)]
    for e, a in zip(expected, actual):
        assert_identical(e, a)
    record = handle.planner.history[0]
    assert record["measured_peak_bytes"] <= limit
    assert abs(record["predicted_peak_bytes"] - record["measured_peak_bytes"]) <= 0.05 * record["measured_peak_bytes"]
