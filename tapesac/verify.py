"""Replay invariant R6: on verification forwards, a value replay rebuilt has the bytes autograd
saved, or the unpack fails naming the producer (:class:`Verification`, mixed into
:class:`~tapesac.replay.Replayer`; the fingerprints come from the recorder)."""

from __future__ import annotations

import torch

from .errors import ReplayError, modified_error
from .fingerprints import fingerprint
from .ops import op_info

Tensor = torch.Tensor


def comparable(tape, fingerprints: dict, held: dict, device: torch.device) -> dict:
    """The fingerprints replay can be held to (invariant R6): on a GPU, unless deterministic
    algorithms are on, not those of values whose rebuild runs an op tagged
    ``nondeterministic_bitwise`` (``index_add_``, ``scatter_add_`` accumulate in another order
    each run): a difference there is not a write TapeSAC missed."""
    if not fingerprints or device.type == "cpu" or torch.are_deterministic_algorithms_enabled():
        return fingerprints
    tag = torch.Tag.nondeterministic_bitwise
    kept = set(held)
    return {vid: fp for vid, fp in fingerprints.items()
            if not any(tag in getattr(tape.ops[i].func, "tags", ()) for i in tape.producer_closure([vid], kept))}


class Verification:
    """What a :class:`~tapesac.replay.Replayer` checks on verification forwards: its
    ``fingerprints`` (vid -> fingerprint of what autograd saved), ``handles`` (the forward's saved
    handles, whose version checks explain a difference first) and ``on_mismatch``."""

    def _differs(self, t: Tensor, fp: Tensor) -> bool:
        with torch._C._DisableTorchDispatch():
            now = fingerprint(t)
            return now is not None and not bool(torch.equal(now, fp))

    def _explain_by_versions(self) -> None:
        """A rebuilt value differs because a tensor it was made from changed in place where
        autograd's version counters saw it: raise what autograd would raise for that instead."""
        for vid, (carrier, version) in self._versions.items():
            if carrier._version != version:
                raise self._modified(vid, carrier, version)
        for ref in self.handles:
            h = ref()
            if h is None:
                continue
            if not hasattr(h, "family"):  # left as it is (AsIs): the tensor itself
                t = h.tensor
                if t._version != h.version:
                    raise modified_error(t.dtype, t.device, t.shape, t._version, h.version, self.block)
                continue
            current = h.final if h.family is None else h.family._version
            if current is not None and current != h.version:
                v = self.tape.values[h.vid]
                raise modified_error(v.dtype, self.device, v.shape, current, h.version, self.block)

    def _describe(self, vid: int) -> str:
        """``op 3 (aten.view.default, a view of op 2 aten.addmm.default) slot 0, shape [...]``."""
        tape, values = self.tape, self.tape.values
        v = values[vid]
        name = tape.op_name(v.op)
        base = v
        while base.op >= 0 and op_info(tape.ops[base.op].func).view_of is not None and tape.ops[base.op].deps:
            base = values[tape.ops[base.op].deps[0]]
        if base is not v and base.op >= 0:
            name += f", a view of op {base.op} {tape.op_name(base.op)}"
        return f"op {v.op} ({name}) slot {v.slot}, shape {list(v.shape)} {v.dtype}"

    def _verify(self, vid: int, t: Tensor, fp: Tensor) -> None:
        """Invariant R6: a rebuilt value has the bytes autograd saved, or the unpack fails.

        On a difference, every fingerprinted value replay can rebuild is checked, and the ones
        that differ while nothing they are rebuilt from does are blamed: their producers are
        made keep-only for the block's next forwards, so one failure covers them all."""
        if not self._differs(t, fp):
            return
        self.checks[1] = True
        self._explain_by_versions()
        tape = self.tape
        values = tape.values
        differ = {vid}
        originals = set(self.pinned) | set(self.kept)
        for u in sorted(self.fingerprints):
            if u == vid or u in originals or any(
                    op_info(tape.ops[i].func).collective for i in tape.producer_closure([u], originals)):
                continue  # a collective would run on this rank alone
            try:
                other = self._available(u)
                if other is None:
                    other = self._materialize(u)
            except ReplayError:
                continue
            if self._differs(other, self.fingerprints[u]):
                differ.add(u)
        roots = []
        for u in sorted(differ):
            made = {o for i in tape.producer_closure([u], originals) for o in tape.ops[i].outs if o is not None}
            if not (made - {u}) & differ:
                roots.append(u)
        notify = self.on_mismatch() if self.on_mismatch is not None else None
        if notify is not None:
            for u in roots:
                notify(values[u].op)
        where = "; ".join(self._describe(u) for u in roots)
        raise ReplayError(
            f"TapeSAC block {self.block}: replay rebuilt other bytes than the forward saved, first "
            f"from {where}: something wrote {'it' if len(roots) == 1 else 'them'} where the dispatcher "
            "could not see (a Triton or CUDA-extension kernel, numpy, ctypes). Register that kernel "
            "as a torch.library custom op (or launch it as a Triton kernel, which TapeSAC records), "
            "or let TapeSAC keep the value: from the block's next forward on, those outputs are "
            "kept, never rebuilt, so later steps are exact. (A kernel whose results differ from run "
            "to run, such as one with atomic adds, differs here too: make it deterministic, or keep "
            "its outputs.)")
