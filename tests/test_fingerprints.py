"""Fingerprints: what they tell apart, and that the memory they take is seen by every meter."""

from __future__ import annotations

import pytest
import torch

from tapesac import fingerprints
from tapesac.fingerprints import fingerprint
from tapesac.meter import AllocatorPeak, StorageCounter


def _off(t):
    with torch._C._DisableTorchDispatch():
        return fingerprint(t)


@pytest.mark.parametrize("seed", range(8))
def test_one_changed_word_always_changes_the_fingerprint(seed):
    g = torch.Generator().manual_seed(seed)
    shape = [int(s) for s in torch.randint(1, 9, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)]
    t = torch.randn(shape, generator=g)
    before = _off(t)
    u = t.clone()
    i = int(torch.randint(0, u.numel(), (1,), generator=g))
    u.view(-1)[i] += 1.0
    assert torch.equal(before, _off(t.clone())), f"seed {seed}: same bytes, different fingerprint"
    assert not torch.equal(before, _off(u)), f"seed {seed}: element {i} changed, fingerprint did not"


def test_logical_order_not_storage_order():
    t = torch.randn(6, 5)
    assert torch.equal(_off(t.t()), _off(t.t().contiguous()))
    assert torch.equal(_off(t[:, 1:4]), _off(t[:, 1:4].contiguous()))
    assert not torch.equal(_off(t), _off(t.t().contiguous()))


def test_a_tensor_in_many_chunks_still_shows_one_changed_element(monkeypatch):
    monkeypatch.setattr(fingerprints, "_CHUNK_BYTES", 24)
    t = torch.randn(40, 7, dtype=torch.float16)[:, 1:6]  # 10-byte rows: copied, then realigned
    before = _off(t)
    for i in (0, 17, t.numel() - 1):
        u = t.clone()
        u.view(-1)[i] += 1.0
        assert not torch.equal(before, _off(u)), f"element {i}"
    assert torch.equal(before, _off(t.contiguous()))


def test_a_counter_sees_the_temporaries_and_the_result():
    """With the modes off no op reaches a counter; the fingerprint reports its temporaries (a
    copy of a non-contiguous chunk and its multipliers) and its result itself."""
    t = torch.randn(64, 512)[:, ::2]  # non-contiguous: the chunk is copied (64 KiB)
    with StorageCounter() as counter:
        counter.mark()
        live = counter.live_bytes
        fp = _off(t)
        assert counter.live_bytes == live + fp.untyped_storage().nbytes()
        assert counter.peak_bytes - live >= 2 * t.numel() * t.element_size()
        with AllocatorPeak() as events:
            _off(t)
        assert events.peak_bytes <= counter.peak_bytes - live, "the allocator saw more than was reported"
