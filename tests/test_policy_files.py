"""Policy files: any bad input is a PolicyError naming the file and why; writes are atomic.

The caller turns a PolicyError into a warning and a fresh plan, so the contract is that *nothing
else* ever escapes ``Policy.load`` / ``Policy.from_json``. The property loops are seeded; a failure
names the seed that reproduces it.
"""

from __future__ import annotations

import json
import math
import os
import random
import stat
from pathlib import Path

import pytest

from tapesac.errors import PolicyError
from tapesac.policy import POLICY_VERSION, BlockPolicy, Policy


def _valid() -> Policy:
    return Policy({0: BlockPolicy("0123abcd", [(1, 0), (4, 2)], 128, 0.5),
                   3: BlockPolicy("ffff0000", [], 0, 0.0, passthrough=True)},
                  limit_bytes=10, predicted_peak_bytes=9, predicted_recompute_s=0.1,
                  meta={"world_size": 2, "status": "optimal"})


def _loads_or_policy_error(load, seed: int, what: str) -> Policy | None:
    """Run ``load``; a Policy or a PolicyError is fine, anything else fails naming the seed."""
    try:
        return load()
    except PolicyError:
        return None
    except Exception as e:  # noqa: BLE001 - the point is that nothing else escapes
        raise AssertionError(f"seed {seed}: {what} raised {type(e).__name__}: {e}") from e


def _check_loaded(policy: Policy, seed: int) -> None:
    """What a successfully loaded policy guarantees its users, and that it survives a round trip."""
    for index, b in policy.blocks.items():
        assert type(index) is int and index >= 0, f"seed {seed}"
        assert isinstance(b.signature, str), f"seed {seed}"
        assert all(type(p) is tuple and len(p) == 2 and all(type(x) is int and x >= 0 for x in p)
                   for p in b.keep), f"seed {seed}: keep {b.keep}"
        assert type(b.passthrough) is bool and type(b.kept_bytes) is int, f"seed {seed}"
        assert type(b.recompute_s) is float and math.isfinite(b.recompute_s), f"seed {seed}"
    text = json.dumps(policy.to_json(), sort_keys=True)  # text, not ==: meta may hold a NaN
    assert json.dumps(Policy.from_json(json.loads(text)).to_json(), sort_keys=True) == text, f"seed {seed}"


# Random inputs -------------------------------------------------------------------------------------

def _random_json(rng: random.Random, depth: int = 0):
    kinds = ["null", "bool", "int", "float", "str"] + (["list", "dict"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2, POLICY_VERSION, 10**20, rng.randint(-5, 50)])
    if kind == "float":
        return rng.choice([0.0, 0.5, -1.5, 1e300, float("nan"), float("inf"), -float("inf")])
    if kind == "str":
        return rng.choice(["", "1", "03", "-1", "x", "blocks", "version", "keep", "é", "\x00"])
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["version", "blocks", "signature", "keep", "meta", "0", "1", "limit_bytes", "kept_bytes",
            "recompute_s", "passthrough", "predicted_peak_bytes", "predicted_recompute_s", "extra"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _mutate(rng: random.Random, node, depth: int = 0):
    """``node`` with one randomly chosen sub-value replaced, removed, or given a new field."""
    if isinstance(node, dict) and node and rng.random() < 0.8:
        node = dict(node)
        key = rng.choice(sorted(node))
        action = rng.random()
        if action < 0.15:
            del node[key]
        elif action < 0.25:
            node[rng.choice(["extra", "0", "-1", "03", "x"])] = _random_json(rng, depth + 1)
        elif action < 0.6:
            node[key] = _mutate(rng, node[key], depth + 1)
        else:
            node[key] = _random_json(rng, depth + 1)
        return node
    if isinstance(node, list) and node and rng.random() < 0.8:
        node = list(node)
        i = rng.randrange(len(node))
        node[i] = _mutate(rng, node[i], depth + 1) if rng.random() < 0.5 else _random_json(rng, depth + 1)
        return node
    return _random_json(rng, depth)


def test_random_json_structures_are_a_policy_or_a_policy_error():
    for seed in range(1500):
        data = _random_json(random.Random(seed))
        p = _loads_or_policy_error(lambda: Policy.from_json(data), seed, f"from_json({data!r})")
        if p is not None:
            _check_loaded(p, seed)


def test_mutated_policies_are_a_policy_or_a_policy_error():
    base = _valid().to_json()
    loaded = 0
    for seed in range(3000):
        rng = random.Random(seed)
        data = base
        for _ in range(rng.randint(1, 3)):
            data = _mutate(rng, data)
        p = _loads_or_policy_error(lambda: Policy.from_json(data), seed, f"from_json({data!r})")
        if p is not None:
            loaded += 1
            _check_loaded(p, seed)
    assert 0 < loaded < 3000  # the mutations reach both outcomes


def test_random_bytes_are_a_policy_error_naming_the_file(tmp_path):
    path = tmp_path / "policy.json"
    for seed in range(400):
        rng = random.Random(seed)
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        path.write_bytes(raw)
        try:
            Policy.load(path)
        except PolicyError as e:
            assert str(path) in str(e), f"seed {seed}: {e}"
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"seed {seed}: load of {raw!r} raised {type(e).__name__}: {e}") from e


def test_truncated_and_corrupted_files_are_a_policy_or_a_policy_error(tmp_path):
    path = tmp_path / "policy.json"
    good = json.dumps(_valid().to_json(), indent=1).encode()
    for cut in range(len(good)):  # every truncation: an interrupted non-atomic write
        path.write_bytes(good[:cut])
        _loads_or_policy_error(lambda: Policy.load(path), cut, f"load of the first {cut} bytes")
    for seed in range(300):  # flipped bytes: disk or transfer corruption
        rng = random.Random(seed)
        raw = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        p = _loads_or_policy_error(lambda: Policy.load(path), seed, f"load of {bytes(raw)!r}")
        if p is not None:
            _check_loaded(p, seed)


def test_random_valid_policies_round_trip_through_a_file(tmp_path):
    path = tmp_path / "policy.json"
    for seed in range(100):
        rng = random.Random(seed)
        blocks = {rng.randrange(100): BlockPolicy(f"{rng.getrandbits(64):016x}",
                                                  [(rng.randrange(500), rng.randrange(4)) for _ in range(rng.randrange(6))],
                                                  rng.randrange(1 << 40), rng.random(), rng.random() < 0.3)
                  for _ in range(rng.randint(0, 5))}
        p = Policy(blocks, rng.choice([None, rng.randrange(1 << 40)]), rng.choice([None, rng.randrange(1 << 40)]),
                   rng.choice([None, rng.random()]), {"seed": seed})
        p.save(path)
        assert Policy.load(path) == p, f"seed {seed}"


# Explicit cases -------------------------------------------------------------------------------------

BAD_FILES = {
    "empty": (b"", "is empty"),
    "whitespace": (b" \n\t", "is empty"),
    "binary": (b"\xff\xfe\x00\x81garbage", "not text"),
    "truncated": (b'{"version": 1, "blocks": {"0": {"signature": "ab', "not valid JSON"),
    "not json": (b"{not json", "not valid JSON"),
    "nested too deeply": (b"[" * 100_000, "not valid JSON"),
    "number too long": (b"1" * 5000, "not valid JSON"),
    "a list": (b"[1, 2]", "top level is a list"),
    "a number": (b"3", "top level is a number"),
    "null": (b"null", "top level is null"),
    "a string": (b'"policy"', "top level is a string"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_file_is_a_policy_error_naming_the_file_and_why(tmp_path, name):
    raw, why = BAD_FILES[name]
    path = tmp_path / "policy.json"
    path.write_bytes(raw)
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    assert str(path) in str(e.value) and why in str(e.value)


def _with(**changes):
    data = _valid().to_json()
    for dotted, value in changes.items():
        node, *keys = [data] + dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return data


_DELETE = object()

BAD_DATA = {
    "blocks is a list": ({"version": 1, "blocks": []}, "'blocks' is a list"),
    "blocks is null": (_with(blocks=None), "'blocks' is null"),
    "no blocks": (_with(blocks=_DELETE), "no 'blocks' field"),
    "no version": (_with(version=_DELETE), "no 'version' field"),
    "version 2": (_with(version=2), "version 2 is not supported"),
    "version as text": (_with(version="1"), "version '1' is not supported"),
    "version true": (_with(version=True), "version True is not supported"),
    "block key not a number": (_with(blocks={"x": _valid().to_json()["blocks"]["0"]}), "block key 'x'"),
    "negative block key": (_with(blocks={"-1": _valid().to_json()["blocks"]["0"]}), "block key '-1'"),
    "block key spelled twice": (_with(blocks={"3": _valid().to_json()["blocks"]["0"], "03": {}}), "block key '03'"),
    "entry is a list": (_with(blocks__0=[1, 2]), "blocks['0'] is a list"),
    "no signature": (_with(blocks__0__signature=_DELETE), "signature is missing or not a string"),
    "signature a number": (_with(blocks__0__signature=7), "signature is missing or not a string"),
    "no keep": (_with(blocks__0__keep=_DELETE), "keep is missing or not a list"),
    "keep a dict": (_with(blocks__0__keep={"1": 0}), "keep is missing or not a list"),
    "keep single": (_with(blocks__0__keep=[[1]]), "keep[0] = [1] is not an [op index, slot] pair"),
    "keep triple": (_with(blocks__0__keep=[[1, 0], [1, 2, 3]]), "keep[1] = [1, 2, 3]"),
    "keep negative": (_with(blocks__0__keep=[[-1, 0]]), "keep[0] = [-1, 0]"),
    "keep float": (_with(blocks__0__keep=[[1.5, 0]]), "keep[0] = [1.5, 0]"),
    "keep bool": (_with(blocks__0__keep=[[True, 0]]), "keep[0] = [True, 0]"),
    "keep text": (_with(blocks__0__keep=[["1", 0]]), "keep[0] = ['1', 0]"),
    "keep scalar": (_with(blocks__0__keep=[4]), "keep[0] = 4"),
    "passthrough text": (_with(blocks__0__passthrough="yes"), "passthrough = 'yes' is not true or false"),
    "negative kept bytes": (_with(blocks__0__kept_bytes=-1), "kept_bytes = -1"),
    "recompute text": (_with(blocks__0__recompute_s="fast"), "recompute_s = 'fast'"),
    "recompute nan": (_with(blocks__0__recompute_s=float("nan")), "recompute_s = nan"),
    "limit text": (_with(limit_bytes="1GiB"), "limit_bytes = '1GiB'"),
    "meta a list": (_with(meta=[["world_size", 2]]), "'meta' is a list"),
}


@pytest.mark.parametrize("name", BAD_DATA)
def test_malformed_policy_is_a_policy_error_naming_the_field(tmp_path, name):
    data, why = BAD_DATA[name]
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError) as e:
        Policy.load(path)
    assert str(path) in str(e.value) and why in str(e.value), str(e.value)


def test_unknown_fields_are_ignored():
    data = _valid().to_json()
    data["written_by"] = "a newer TapeSAC"
    data["blocks"]["0"]["comment"] = {"anything": [1, 2]}
    assert Policy.from_json(data) == _valid()


def test_long_values_are_cut_in_the_message():
    with pytest.raises(PolicyError) as e:
        Policy.from_json(_with(blocks__0__keep=[list(range(10_000))]))
    assert len(str(e.value)) < 300


def test_a_directory_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read") as e:
        Policy.load(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_a_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read"):
        Policy.load(tmp_path / "nope.json")


def test_an_unreadable_file_is_a_policy_error(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    _valid().save(path)
    if os.geteuid() != 0:  # root reads anything: simulate the refusal instead
        path.chmod(0)
    else:
        def refuse(self):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(PolicyError, match="cannot be read: Permission denied") as e:
        Policy.load(path)
    assert str(path) in str(e.value)


# Writing -----------------------------------------------------------------------------------------

def test_save_replaces_the_file_through_a_unique_synced_temporary_in_the_same_folder(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "policy.json"
    replaced, synced = [], []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), real_replace(a, b)))
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    _valid().save(path)
    Policy({}).save(path)
    assert [dst for _src, dst in replaced] == [path, path]
    (tmp1, _), (tmp2, _) = replaced
    assert tmp1.parent == path.parent and tmp1 != tmp2
    assert len(synced) >= 2  # the data of each write, before the rename
    assert sorted(p.name for p in path.parent.iterdir()) == ["policy.json"]
    assert Policy.load(path) == Policy({})
    assert stat.S_IMODE(path.stat().st_mode) & 0o444 == 0o444  # readable by the other ranks' users


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    _valid().save(path)
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        Policy({}).save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]


def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "policy.json"
    _valid().save(path)
    path.chmod(0o640)
    _valid().save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
