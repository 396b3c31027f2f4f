"""The CPU shim's token permutation for expert parallelism gives the indices torchtitan's own
(Triton, or host-loop reference) implementation gives, for any routing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
kernels = pytest.importorskip("torchtitan.models.moe.kernels")

from torchtitan_ext.cpu_shim import permute_indices  # noqa: E402


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


def test_the_shim_routes_cpu_tensors_to_it():
    import torchtitan_ext  # noqa: F401  (installs the shim on a machine without CUDA)
    from torchtitan.models.moe import utils

    if torch.cuda.is_available():
        pytest.skip("the shim is installed only without CUDA")
    counts = torch.tensor([3, 0, 5, 2])
    out = utils.generate_permute_indices(counts, 2, 2, 32, 8)
    assert torch.equal(out[0], permute_indices(counts, 2, 2, 32, 8)[0])
