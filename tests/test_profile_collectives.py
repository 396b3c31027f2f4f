"""Profiling under tensor parallelism on two gloo ranks: every collective runs exactly as often
in the profiled step as in any other step, on every rank, and the plan's predicted peak is the
measured one (a repeated collective would hold its repeats' buffers in the measured trace)."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .net import in_ranks

STEPS = 4  # warm-up, profiled, verified, planned


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * torch.sigmoid(self.up(x)))


class _Model(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(blocks))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


class _CountCollectives(TorchDispatchMode):
    """Counts the collectives the dispatcher runs below TapeSAC's recorder (modes nest)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from tapesac.ops import COLLECTIVE_NAMESPACES

        if func.namespace in COLLECTIVE_NAMESPACES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _tensor_parallel(model: _Model, mesh) -> _Model:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in model.layers:
        parallelize_module(b, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _train(model, x, limit_bytes: int | None):
    import tapesac
    from tapesac.autoplan import PlanConfig

    handle = None
    if limit_bytes is not None:
        handle = tapesac.wrap(model.layers, plan_config=PlanConfig(memory_limit_bytes=limit_bytes))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, counts = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with _CountCollectives() as count:
            loss = model(x).square().mean()
            loss.backward()
        opt.step()
        losses.append(float(loss).hex())
        counts.append(sorted(count.calls))
    return handle, losses, counts


def _body(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    result: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))

    def model():
        torch.manual_seed(0)
        return _tensor_parallel(_Model(), mesh)

    _, result["plain_losses"], result["plain_counts"] = _train(model(), x, None)
    handle, result["losses"], result["counts"] = _train(model(), x, 10**12)
    result["planned"] = handle.planner.plan is not None
    # Then a limit inside the frontier: the plan keeps some values (DTensors among them) and
    # replays the rest.
    plan = handle.planner.plan
    limit = int((plan.smallest_peak_bytes + plan.largest_useful_peak_bytes) / 2)
    tight, result["tight_losses"], result["tight_counts"] = _train(model(), x, limit)
    result["limit"] = limit
    result["tight_history"] = tight.planner.history
    result["tight_kept"] = any(s.keep for s in tight.blocks)
    return result


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    return in_ranks(_body)


def test_profiling_runs_each_collective_once_on_every_rank(ranks):
    r0, r1 = ranks[0], ranks[1]
    assert r0["planned"] and r1["planned"]
    assert r0["plain_counts"][0], "the tensor-parallel model runs no collective"
    # Every step, the profiled one (step 2) included, runs the plain model's collectives.
    assert r0["counts"] == r0["plain_counts"] == r1["counts"]
    assert r0["losses"] == r0["plain_losses"] and r1["losses"] == r1["plain_losses"]


def test_a_tensor_parallel_plan_inside_the_frontier_is_exact_and_predicted(ranks):
    for r in ranks.values():
        assert r["tight_losses"] == r["plain_losses"]
        assert r["tight_counts"] == r["plain_counts"]
        assert r["tight_kept"]
        verify = r["tight_history"][0]
        assert verify["measured_peak_bytes"] <= r["limit"]
        # Never under-predicted. Over by up to 12% today: kept DTensor values are counted apart
        # from the local shards backward already holds (issue #10, part 1, not this test's).
        assert verify["measured_peak_bytes"] <= verify["predicted_peak_bytes"] <= 1.15 * verify["measured_peak_bytes"]
