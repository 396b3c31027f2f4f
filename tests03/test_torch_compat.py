"""What ``torchtitan03_ext.torch_compat`` adds to torch 2.13 for torchtitan 0.3, each checked on
torch's own pipeline classes in one process (a one-rank gloo group)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith("0.3."):
    pytest.skip(f"torchtitan {torchtitan.__version__}: these tests need 0.3.x", allow_module_level=True)

import torchtitan03_ext  # noqa: E402,F401  (installs the compat layer)
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: E402


class Counting(nn.Module):
    """A block that counts what it routes in a buffer, as an MoE block counts tokens per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("routed", torch.zeros(4))
        self.register_buffer("table", torch.arange(4.0))  # read, never written

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.routed.add_(x.detach().abs().sum(0))
        return self.linear(x) + self.table


@pytest.fixture()
def one_rank_group():
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(module: Counting, n_microbatches: int, *args, **kwargs) -> list[torch.Tensor]:
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=lambda out, target: out.sum())
    losses: list[torch.Tensor] = []
    schedule.step(*args, **kwargs, losses=losses)
    return losses


def test_a_step_takes_the_micro_batches_it_is_given_and_counts_each_once(one_rank_group):
    """torchtitan 0.3 calls ``step(arg_mbs=, target_mbs=)``; torch 2.13's ``step`` took a whole
    batch only. The stage's shape inference runs the first micro-batch once more, and the
    buffer it writes is restored: each micro-batch is counted once."""
    torch.manual_seed(0)
    microbatches = [torch.randn(2, 4) for _ in range(3)]
    module = Counting()
    losses = _step(module, 3, arg_mbs=[(x,) for x in microbatches],
                   target_mbs=[torch.zeros(2, 4)] * 3)
    assert len(losses) == 3
    expected = sum(x.abs().sum(0) for x in microbatches)
    assert torch.equal(module.routed, expected)
    assert module.table._version == 0  # a buffer the inference did not change is not written

    whole = Counting()  # the whole-batch form still works as torch's own
    _step(whole, 3, torch.cat(microbatches), target=torch.zeros(6, 4))
    assert torch.equal(whole.routed, expected)


def test_giving_both_a_batch_and_its_micro_batches_is_an_error(one_rank_group):
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="not both"):
        _step(Counting(), 1, x, arg_mbs=[(x,)])
