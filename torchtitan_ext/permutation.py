"""Expert parallelism's token permutation in torch ops, for torchtitan 0.2.x.

After the all-to-all dispatch, an expert-parallel rank holds the tokens it received grouped by
source rank; torchtitan regroups them by local expert (each group padded to an alignment) with
indices from ``generate_permute_indices``, a Triton kernel. That kernel cannot run without a GPU.
On a GPU it writes its output outside the dispatcher; TapeSAC records the launch as a tape step
(:mod:`tapesac.kernels`), and it replays exactly under Triton's interpreter
(``tests/test_permutation.py``), but it has not yet been run under TapeSAC on a GPU.
:func:`permute_indices` computes the same indices with ATen ops of fixed shapes (no host
synchronisation), recorded and replayable like any other value. :func:`install` routes
torchtitan's calls to it: on a machine without CUDA (the CPU shim), and in any job that runs
TapeSAC with expert parallelism (the converter), until a GPU check has run the real kernel.
"""

from __future__ import annotations

import torch


def permute_indices(tokens_per_expert_group: torch.Tensor, experts_per_rank: int, num_ranks: int,
                    max_len: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(permuted_indices, m_sizes, m_offsets)`` as torchtitan's ``generate_permute_indices``.

    ``tokens_per_expert_group[r * experts_per_rank + e]`` tokens arrived from rank ``r`` for local
    expert ``e``, in that order. Expert ``e``'s group starts at ``m_offsets[e] - m_sizes[e]`` and
    holds its tokens from rank 0, then rank 1, ...; ``m_sizes[e]`` is its token count (at least
    ``alignment``) rounded up to a multiple of ``alignment``. ``permuted_indices[i]`` is the
    received token placed at position ``i``, or -1 for padding (the caller appends a zero row).
    """
    counts = tokens_per_expert_group.to(torch.int64)
    per_rank = counts.view(num_ranks, experts_per_rank)
    totals = per_rank.sum(0).clamp_min(alignment)
    m_sizes = ((totals + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0)
    group_starts = m_offsets - m_sizes
    # Each (rank, expert) chunk of received tokens: where it starts among the received tokens,
    # and where it goes (its expert's group start, after that expert's chunks from lower
    # ranks). In destination order (expert-major) the destinations never decrease.
    source = (torch.cumsum(counts, 0) - counts).view(num_ranks, experts_per_rank).t().reshape(-1)
    dest = (group_starts.unsqueeze(0) + torch.cumsum(per_rank, 0) - per_rank).t().reshape(-1)
    length = per_rank.t().reshape(-1)
    # For every output position, the last chunk that starts at or before it (a chunk that is
    # empty shares its start with the next one, so the last is the one that can hold tokens).
    position = torch.arange(max_len, device=counts.device)
    chunk = (torch.searchsorted(dest, position, right=True) - 1).clamp_min(0)
    offset = position - dest[chunk]
    inside = offset < length[chunk]
    permuted = torch.where(inside, source[chunk] + offset, torch.full_like(offset, -1)).to(torch.int32)
    return permuted, m_sizes, m_offsets.to(torch.int32)


def install() -> None:
    """Make torchtitan's MoE token permutation use :func:`permute_indices` (idempotent)."""
    try:
        from torchtitan.models.moe import utils
    except ImportError:  # a torchtitan without MoE (or without Triton): nothing to route
        return
    original = utils.generate_permute_indices
    if getattr(original, "__tapesac__", False):
        return

    def generate_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, max_len,
                                 alignment, use_cpu=False):
        return permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, max_len, alignment)

    generate_permute_indices.__tapesac__ = True  # type: ignore[attr-defined]
    generate_permute_indices.__doc__ = permute_indices.__doc__
    utils.generate_permute_indices = generate_permute_indices
