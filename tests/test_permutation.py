"""Expert parallelism's token permutation in torch ops gives the indices torchtitan's own
(Triton, or host-loop reference) implementation gives, for any routing, and TapeSAC replays it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
kernels = pytest.importorskip("torchtitan.models.moe.kernels")

from torchtitan_ext.permutation import permute_indices  # noqa: E402


@pytest.mark.parametrize("experts_per_rank, ranks, alignment", [(1, 2, 8), (4, 2, 8), (2, 4, 16), (3, 1, 32)])
@pytest.mark.parametrize("seed", range(4))
def test_permute_indices_match_torchtitans_reference(experts_per_rank, ranks, alignment, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (experts_per_rank * ranks,), generator=g)
    if seed == 0:
        counts[::2] = 0  # experts that receive nothing are padded to the alignment
    tokens = int(counts.sum())
    max_len = (tokens + experts_per_rank * alignment + alignment - 1) // alignment * alignment
    expected = kernels.generate_permute_indices(counts, experts_per_rank, ranks, max_len, alignment, use_cpu=True)
    got = permute_indices(counts, experts_per_rank, ranks, max_len, alignment)
    for e, o in zip(expected, got):
        assert e.dtype == o.dtype and torch.equal(e, o)


def test_torchtitans_permutation_is_routed_to_it():
    from torchtitan.models.moe import utils

    from torchtitan_ext import permutation

    permutation.install()  # the CPU shim did already, on a machine without CUDA
    counts = torch.tensor([3, 0, 5, 2])
    out = utils.generate_permute_indices(counts, 2, 2, 32, 8)
    assert torch.equal(out[0], permute_indices(counts, 2, 2, 32, 8)[0])


class _Permute(torch.nn.Module):
    """Regroups tokens by expert as EP does (indices under no_grad, then a gather and a
    scatter that save them for backward), with a weight in between."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, counts):
        with torch.no_grad():
            idx, _sizes, _offsets = permute_indices(counts, 2, 2, 48, 8)
        padded = torch.vstack((x, x.new_zeros(x.shape[-1])))
        grouped = torch.tanh(padded[idx, :] @ self.w)
        out = grouped.new_empty(padded.shape)
        out[idx, :] = grouped
        return out[:-1]


def test_tapesac_replays_the_permutation_exactly():
    import tapesac

    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for wrap in (False, True):
        block = _Permute()
        handle = tapesac.wrap([block]) if wrap else None
        xi = x.clone().requires_grad_()
        block(xi, counts).square().sum().backward()
        grads.append((xi.grad, block.w.grad))
        if handle is not None:
            assert handle.stats()[0]["ops_replayed"] > 0
            handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torchtitans_triton_permutation_kernel_replays_exactly_as_a_tape_step():
    """The real kernel (Triton's interpreter, in a fresh process): recorded as a launch step,
    relaunched by replay, several optimizer steps bit-identical to plain autograd."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "tests/permutation_kernel_probe.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode, r in result.items():
        assert r["identical"], f"{mode}: gradients differ from plain autograd"
        assert max(r["kernel_launches"]) == 1, r  # one launch per recorded block forward
    assert min(result["replay_only"]["ops_replayed"]) > 0
