"""Patches of torch and torchtitan last only as long as the call that needs them
(``torchtitan_common.patches``)."""

from __future__ import annotations

import types

import torch

from tapesac.meter import StorageCounter
from torchtitan_common.patches import until_first_call


def _module(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)

    def build(x):
        calls.append((name, x))
        return x

    module.build = build
    return module


def _plus_one(original):
    def build(x):
        return original(x) + 1

    return build


def test_a_patch_until_first_call_puts_every_copy_back_before_it_runs():
    calls: list = []
    a, b = _module("a", calls), _module("b", calls)
    originals = a.build, b.build
    until_first_call([a, b], "build", _plus_one)
    assert a.build is not originals[0] and b.build is not originals[1]
    assert b.build(1) == 2
    assert (a.build, b.build) == originals
    assert a.build(1) == 1 and calls == [("b", 1), ("a", 1)]


def test_a_newer_patch_replaces_one_still_waiting_for_its_call():
    calls: list = []
    a = _module("a", calls)
    original = a.build
    until_first_call([a], "build", _plus_one)
    until_first_call([a], "build", lambda f: (lambda x: f(x) + 10))
    assert a.build(1) == 11  # the newest wrapper, around the original only
    assert a.build is original


def test_the_storage_counter_patches_resize_only_while_it_counts():
    before = torch.UntypedStorage.__dict__.get("resize_")
    with StorageCounter():
        assert torch.UntypedStorage.__dict__.get("resize_") is not before
    assert torch.UntypedStorage.__dict__.get("resize_") is before
