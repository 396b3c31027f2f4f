"""A block with an FSDP2 unit of its own inside (as torchtitan shards MoE experts under expert
parallel), on two gloo ranks, against the same model without TapeSAC.

FSDP2 frees the inner unit's parameters after its forward and gathers them again only in its
backward. Nodes of the block that run before that (here the ``y * y`` after the unit) read the
unit's output, so replay must not reach into the unit from there: the unit's outputs are held
(recorder invariant 9). Without that, replay reads freed parameter storage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .net import in_ranks

pytestmark = pytest.mark.slow

STEPS = 3
DIM = 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.inner = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        y = self.inner(self.norm(x))
        return x + y * y  # mul saves y, and runs its backward before the inner unit's


def _train(mesh, wrapped: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    for block in model:
        fully_shard(block.inner, mesh=mesh, reshard_after_forward=True)
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    handle = None
    if wrapped:
        import tapesac

        handle = tapesac.wrap(list(model))
    out: dict = {"losses": [], "grads": []}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
        loss = model(x).square().mean()
        loss.backward()
        out["losses"].append(float(loss).hex())
        out["grads"].append([p.grad.to_local().numpy().tobytes().hex()[:64] + str(float(p.grad.to_local().sum()).hex())
                             for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    if handle is not None:
        out["replayed"] = [s["ops_replayed"] for s in handle.stats().values()]
    return out


def _body(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {"plain": _train(mesh, wrapped=False), "tapesac": _train(mesh, wrapped=True)}


def test_replay_never_reaches_into_a_nested_fsdp_unit_from_outside():
    for rank, r in in_ranks(_body).items():
        assert r["tapesac"]["losses"] == r["plain"]["losses"], rank
        assert r["tapesac"]["grads"] == r["plain"]["grads"], rank
        assert all(n > 0 for n in r["tapesac"]["replayed"])
