"""What one block knows of the programs its recorded forwards ran.

The verified tapes later forwards follow instead of recording (:class:`~tapesac.follow.VerifiedTape`,
one per input shapes and policy), which program a verification forward last checked at each of
them (replay invariant R6), and the ops whose replay once gave other bytes than the forward's.
A block's state (:class:`~tapesac.block.BlockState`) owns one and asks it at every recorded
forward.
"""

from __future__ import annotations

from typing import Any

from .follow import VerifiedTape
from .recorder import Recorder
from .replay import ReplayProgram, Replayer

MAX_VERIFIED_TAPES = 8
"""Verified tapes (input shapes x policies) a block keeps at once (more: start again)."""


class KnownPrograms:
    """One block's verified tapes and verification bookkeeping. Keys are the block's follow keys:
    (input shapes, keep set, expected signature). Kept across policy changes: planned mode
    switches a block between its plan and replay-only as steps come."""

    def __init__(self, verify_every: int = 0) -> None:
        self.verified_tapes: dict[tuple, VerifiedTape] = {}
        """Key -> the verified forward later forwards follow instead of recording."""
        self._last_key: dict[tuple, int] = {}
        """Key -> ``Tape.fast_key`` of the last recorded forward: a program recorded twice in a
        row (or matching the policy's signature) is followed from then on."""
        self.verify_every = verify_every
        """Also verify every this-many-th forward (0: only the forwards listed in
        :meth:`verifies`); replay invariant R6."""
        self._forwards = 0
        """Forwards asked about so far (the sampling clock of ``verify_every``)."""
        self._verified: dict[tuple, int] = {}
        """Key -> ``Tape.fast_key`` of the program a verification forward recorded there; a
        recorded forward of another program makes the next one verify again."""
        self._pending_verdicts: list[tuple[tuple, int, list]] = []
        """Verification forwards whose backward had not run at the last forward: (key, program,
        the replayer's ``checks``)."""
        self.keep_only_ops: set[int] = set()
        """Op indices whose replay once gave other bytes than the forward's (replay invariant R6):
        kept, never rebuilt, from then on."""

    def verifies(self, key: tuple, measured: bool) -> bool:
        """Whether this forward is a verification forward (replay invariant R6): the first of a
        new input shape or policy, the one after a recorded forward whose program differed from
        the last verified one there, profiled and measured steps (``measured``), and every
        ``verify_every``-th forward. Decided from what every rank of an SPMD program shares
        (shapes, step kind, a count), so ranks verify the same forwards."""
        self._forwards += 1
        if self._pending_verdicts:
            # Decided at the next forward, from what the earlier backwards did (the same on every
            # rank), not when a replayer happens to be collected.
            still = []
            for pending in self._pending_verdicts:
                k, fast, (unpacked, differed) = pending
                if unpacked and not differed:
                    self._verified[k] = fast
                elif not unpacked and len(still) < MAX_VERIFIED_TAPES:
                    still.append(pending)
            self._pending_verdicts = still
        return (key not in self._verified or measured
                or (self.verify_every > 0 and self._forwards % self.verify_every == 0))

    def note_verified(self, rec: Recorder, tape: Any, key: tuple, replayer: Replayer) -> None:
        """Remember which program a recorded forward ran at ``key`` (see :meth:`verifies`): a
        verification forward's counts once its backward ran without a difference (looked at
        from the next forward on); a backward that never reached it verified nothing."""
        if rec.followed or not rec.verify and key not in self._verified:
            return
        fast = tape.fast_key()  # computed once per tape (the policy check asks for it too)
        if not rec.verify:
            if self._verified.get(key) != fast:
                self._verified.pop(key, None)
            return
        if not replayer.fingerprints:  # nothing to rebuild-check: verified as recorded
            self._verified[key] = fast
            return
        self._pending_verdicts.append((key, fast, replayer.checks))

    def learn(self, key: tuple, recording: Any, program: ReplayProgram, checked: bool) -> None:
        """A recorded forward at ``key``: let the next forwards follow its tape once it is known
        good: ``checked`` against the policy's signature, or seen twice in a row."""
        tape = recording.tape
        if not VerifiedTape.eligible(tape, program):
            return
        if not checked:  # replay-only: known good once seen twice in a row
            fast = tape.fast_key()
            known, self._last_key[key] = self._last_key.get(key) == fast, fast
            if not known:
                return
        if len(self.verified_tapes) >= MAX_VERIFIED_TAPES:
            self.verified_tapes.clear()
            self._last_key.clear()
        verified = self.verified_tapes[key] = VerifiedTape(tape, recording.held, recording.owned_vids, recording.segments)
        verified.program = program

    def replay_differed(self, op: int) -> None:
        """Replay invariant 13: op ``op``'s replay gave other bytes than its forward. Keep its
        outputs from the next forward on; tapes followed so far did not, so forget them."""
        self.keep_only_ops.add(op)
        self.verified_tapes.clear()
        self._last_key.clear()
        self._verified.clear()
        self._pending_verdicts.clear()
