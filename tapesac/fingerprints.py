"""Fingerprints of values: what verification forwards compare, bit for bit, between what autograd
saved and what replay rebuilds (replay invariant R6), and what a kernel launch may have written
(recorder invariant 10).

A fingerprint runs ATen ops of TapeSAC's own with the dispatch modes off, so no storage counter
sees them. Its memory is still part of the step: the temporaries are reported to the active
counters as a transient (:func:`~tapesac.meter.count_transient`) and the result as a storage
they count (:func:`~tapesac.meter.count_own`), so that a traced step and a measured step show
what a verifying step really allocates, as the CUDA allocator shows it.
"""

from __future__ import annotations

import torch

from .meter import count_own, count_transient

Tensor = torch.Tensor

_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: consecutive multipliers differ widely
_CHUNK_BYTES = 4 << 20
"""Bytes hashed at a time: one fingerprint's temporaries stay under twice this (three times for a
chunk that must be copied twice: non-contiguous, then not word-aligned)."""


def fingerprint(t: Tensor) -> Tensor | None:
    """A 64-bit summary of ``t``'s bytes, as a 0-d int64 tensor on ``t``'s device (no host sync).

    The bytes, in ``t``'s logical (row-major) order and read as 64-bit words ``w_i`` (the last
    few bytes as words of their own), are summed as ``sum(w_i * c_i) mod 2**64`` with odd
    multipliers ``c_i`` that differ per position: two tensors whose words differ in exactly one
    position always differ here; other differences collide with probability about 2**-64.
    Shape and dtype are not part of it (callers compare those). Works in chunks of
    :data:`_CHUNK_BYTES`, so a large tensor costs no copy of itself. Call it with TapeSAC's
    dispatch modes off (it runs ATen ops). A DTensor is summarised by its local shard; None for
    other tensor subclasses (no bytes of their own to read)."""
    if type(t) not in (Tensor, torch.nn.Parameter):
        t = getattr(t, "_local_tensor", None)
        if t is None or type(t) is not Tensor:
            return None
    if t.layout != torch.strided or t.is_quantized:  # no plain bytes to read
        return None
    t = t.detach()
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    count_own(total)
    if t.numel() == 0:
        return total
    if t.dim() == 0:
        t = t.reshape(1)
    rows = t.reshape(t.shape[0], -1) if t.is_contiguous() else t
    row_bytes = max(1, t[0].numel() * t.element_size())
    step = max(1, _CHUNK_BYTES // row_bytes)
    offset = 0
    for start in range(0, t.shape[0], step):
        part = rows[start:start + step]
        chunk = part.contiguous()
        copied = 0 if chunk is part else chunk.numel() * chunk.element_size()
        chunk = chunk.reshape(-1).view(torch.uint8)
        if chunk.storage_offset() % 8:  # a row that starts inside a word: word-aligned copy
            chunk = chunk.clone()
            copied += chunk.numel()
        n = chunk.numel()
        whole = n - n % 8
        # Alive at once: the copies, the multipliers (the product is made in place in them),
        # and a tail's eight-byte words with their multipliers.
        count_transient(copied + whole + 16 * (n - whole) + 16)
        if whole:
            words = chunk[:whole].view(torch.int64)
            total += _multipliers(offset, words.numel(), t.device).mul_(words).sum()
        if n > whole:
            tail = chunk[whole:].to(torch.int64)
            total += _multipliers(offset + whole // 8, tail.numel(), t.device).mul_(tail).sum()
        offset += n // 8 + 1
    return total


def _multipliers(start: int, n: int, device: torch.device) -> Tensor:
    coef = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return coef.mul_(_MUL).bitwise_or_(1)
