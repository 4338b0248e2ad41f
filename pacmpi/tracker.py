"""MaskTracker: follows each bucket's flattened mask and decides when packing is safe.

All state changes happen in :meth:`MaskTracker.commit`, which the reducer calls only with
fingerprints that every rank has just agreed on, so every rank always takes the same path.
"""
from dataclasses import dataclass

from .hashing import bits_fingerprint

__all__ = ["MaskTracker"]


@dataclass
class BucketMaskState:
    """Tracker state of one bucket.

    ``mask`` is the last flat mask read, a :class:`pacmpi.bitmaps.Bitmap` (``None`` when no
    array of the bucket is masked); ``packed`` whether the bucket sends its survivors only;
    ``indices`` their positions (:func:`pacmpi.bitmaps.index_dtype`), made from the mask when
    first asked for (:meth:`positions`; a bucket sent in a group never needs its own), else
    ``None``.
    """

    fingerprint: int = None
    survivors: int = 0
    stable_steps: int = 0
    mask: object = None
    packed: bool = False
    indices: object = None

    def positions(self):
        """The survivor positions while packed (made once), else ``None``."""
        if self.packed and self.indices is None:
            self.indices = self.mask.positions()
        return self.indices

    def pack(self, packed=True):
        self.packed, self.indices = packed, None


class MaskTracker:
    """Per-bucket mask fingerprints, a version counter and stability counters.

    Parameters
    ----------
    stable_steps:
        Steps a changed mask must stay unchanged before the bucket is packed again; until then
        the bucket is reduced dense (with the mask applied), which needs no survivor indices.
        ``0`` packs in the very step a new mask is agreed.
    """

    def __init__(self, n_buckets, *, stable_steps=1):
        if not isinstance(stable_steps, int) or stable_steps < 0:
            raise ValueError(f"stable_steps must be a non-negative integer, got {stable_steps!r}")
        self.stable_steps = stable_steps
        self.version = 0
        self.buckets = [BucketMaskState() for _ in range(n_buckets)]
        self.last_commit_step = None
        # The observations list last committed, and the buckets waiting to be packed (None:
        # to be found): what lets an unchanged step skip the per-bucket work.
        self._committed = self._waiting = None
        # Steps every bucket's stable_steps still owes (an unchanged commit adds them here, not
        # bucket by bucket), and a count of the changes of any bucket's mask or packing.
        self._owed, self.changes = 0, 0

    def _settle(self):
        """Add the steps owed to every bucket's ``stable_steps``."""
        if self._owed:
            for state in self.buckets:
                state.stable_steps += self._owed
            self._owed = 0

    @staticmethod
    def observe(bitmap):
        """Fingerprint and survivor count of one bucket's :class:`pacmpi.bitmaps.Bitmap`
        (``None``: unmasked)."""
        if bitmap is None:
            return None, None
        return bits_fingerprint(bitmap.xp, bitmap.bits, bitmap.size), bitmap.count

    def commit(self, step, observations, masks):
        """Adopt agreed observations ``[(fingerprint, survivors)]`` and flat ``masks`` of ``step``.

        Returns the indices of buckets whose mask changed in this step.
        """
        elapsed = 1 if self.last_commit_step is None else step - self.last_commit_step
        if self.last_commit_step is not None and observations is self._committed:
            # The very list of the last commit (the engine found every mask as it was then).
            self._owed += elapsed
            self.last_commit_step = step
            return []
        self._settle()
        self._committed, self._waiting = observations, None
        self.changes += 1
        changed = []
        for b, (state, (fingerprint, survivors), mask) in enumerate(
                zip(self.buckets, observations, masks)):
            state.mask = mask
            if fingerprint != state.fingerprint or self.last_commit_step is None:
                changed.append(b)
                state.fingerprint, state.survivors = fingerprint, survivors
                state.stable_steps = 0
                state.pack(False)
            else:
                state.stable_steps += elapsed
        if changed:
            self.version += 1
        self.last_commit_step = step
        return changed

    def pack_ready(self):
        """Pack the buckets that are masked, not yet packed and stable long enough. (Only the
        ones waiting are looked at: none, once all are packed.)"""
        if self._waiting is None:
            self._waiting = [b for b, state in enumerate(self.buckets)
                             if state.mask is not None and not state.packed
                             and state.survivors < state.mask.size]
        if not self._waiting:
            return
        self._settle()
        ready = [b for b in self._waiting if self.buckets[b].stable_steps >= self.stable_steps]
        for b in ready:
            self.buckets[b].pack()
        if ready:
            self._waiting = [b for b in self._waiting if not self.buckets[b].packed]
            self.changes += 1

    def reset(self, version):
        """Forget every bucket's state (after a resync): each is reduced dense until its mask
        has been stable again; ``version`` is the agreed (largest) version."""
        self.version = version
        self.buckets = [BucketMaskState() for _ in self.buckets]
        self.last_commit_step = self._committed = self._waiting = None
        self._owed, self.changes = 0, self.changes + 1

    def load_state_dict(self, state, masks):
        """Restore :meth:`state_dict` output with the current flat ``masks`` (whose
        fingerprints the caller has checked)."""
        self.version, self.last_commit_step = state["version"], state["last_commit_step"]
        self._committed = self._waiting = None
        self._owed, self.changes = 0, self.changes + 1
        for bucket, mask, saved in zip(self.buckets, masks, state["buckets"]):
            bucket.fingerprint, bucket.survivors = saved["fingerprint"], saved["survivors"]
            bucket.stable_steps, bucket.mask = saved["stable_steps"], mask
            bucket.pack(saved["packed"])

    def state_dict(self):
        self._settle()
        return {
            "version": self.version,
            "last_commit_step": self.last_commit_step,
            "stable_steps": self.stable_steps,
            "buckets": [
                {"fingerprint": s.fingerprint, "survivors": s.survivors,
                 "stable_steps": s.stable_steps, "packed": s.packed}
                for s in self.buckets
            ],
        }
