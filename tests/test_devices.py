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


# Triton kernels on CUDA: real launches (on CPU, tests/test_unseen_writes.py runs the same paths
# under Triton's interpreter) ----------------------------------------------------------------------

from .unseen import elementwise_kernels, triton  # noqa: E402

if triton is not None:
    _affine_kernel, _scale_kernel = elementwise_kernels()  # compiled for the GPU (no interpreter)


class _TritonBlock(torch.nn.Module):
    """A kernel filling ``empty_like`` and one scaling an activation in place, both unseen by
    the dispatcher on a GPU."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.g = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = self.lin(x).contiguous()
        n = h.numel()
        out = torch.empty_like(h)
        _affine_kernel[(triton.cdiv(n, 128),)](h.detach(), out, n, 0.5, BLOCK=128)
        y = (out * self.g).contiguous()
        _scale_kernel[(triton.cdiv(n, 128),)](y, n, 0.5, BLOCK=128)
        return x + y * h


@pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("mode", ["replay_only", "planned"])
def test_triton_kernels_on_cuda_replay_exactly(mode):
    from tapesac.kernels import written_by_analysis

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[_TritonBlock() for _ in range(3)]).cuda()

    def train(net, handle=None, steps=5):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        out = []
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(s))
            loss = net(x).square().mean()
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
            opt.step()
        return out

    expected = train(make())
    net = make()
    limit = None if mode == "replay_only" else int(torch.cuda.memory_allocated() + (8 << 20))
    handle = tapesac.wrap(list(net), memory_limit_bytes=limit)
    actual = train(net, handle)
    for (le, ge), (la, ga) in zip(expected, actual):
        assert torch.equal(le, la) and all(torch.equal(a, b) for a, b in zip(ge, ga))
    assert all(s["kernel_launches"] in (0, 2) for s in handle.stats().values())
    x = torch.randn(8, device="cuda")
    written = written_by_analysis(_scale_kernel, (x, 8, 0.5), {"BLOCK": 128})
    assert written == frozenset({"x_ptr"}), written  # PyTorch's TTIR analysis ran on this GPU
    handle.remove()
