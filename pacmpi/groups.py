"""Groups: buckets whose flat arrays lie back to back in one array (a DDP bucket's parameters),
sent as one payload, so a step costs one gather and one scatter whatever the number of members.

:class:`Group` describes what a group sends for its members' current packing and masks;
:class:`GroupCache` keeps one per group of buckets, built when a member's packing or mask
changes, not per step. A single bucket is a group of one.
"""
import operator

import numpy as np

from .bitmaps import Bitmap, index_dtype

__all__ = ["Group", "GroupCache", "unit"]


def unit(u):
    """A bucket index, or a tuple of several (a group); a tuple of one is its bucket."""
    return u[0] if isinstance(u, tuple) and len(u) == 1 else u


class Group:
    """What buckets ``slots`` send as one payload. Described, each made when first asked for,
    by :meth:`positions` (its survivors' positions in its array) or :meth:`bitmap` (1 bit per
    coordinate, what in-place compaction reads); both ``None`` when every coordinate is sent.
    ``masked``: ``(bucket, start, stop, payload start)`` of the members sent dense with a mask
    to apply; ``count``: the payload's values; ``steady``: whether what it sends is fixed until
    a member's mask changes (every member packed, or unmasked, or with nothing pruned: a
    ternary scale agreed early still holds). ``table`` (the ternary
    :class:`pacmpi.segments.SegmentTable`) and ``blocks`` (with it, a
    :class:`pacmpi.quantizers.MemberBlocks`) are the quantizer's, made when first needed."""

    __slots__ = ("slots", "key", "states", "masked", "count", "packed", "size", "nbytes",
                 "offsets", "step", "epoch", "table", "steady", "_positions", "_bitmap",
                 "_kept", "blocks", "_pruners")

    def __init__(self, slots, states, specs, key, step):
        sizes = [specs[s].size for s in slots]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.slots, self.key, self.step, self.size = slots, key, step, int(offsets[-1])
        self.offsets, self.table, self.blocks, self.epoch = offsets, None, None, None
        self.states, self._positions, self._bitmap, self._kept = states, None, None, None
        self.nbytes = sum(specs[s].size * specs[s].dtype.itemsize for s in slots)
        self.packed = sum(state.packed for state in states)
        counts = [state.survivors if state.packed else n for state, n in zip(states, sizes)]
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        masked = [(s, int(lo), int(lo) + n, int(at), state.mask) for s, state, lo, n, at in
                  zip(slots, states, offsets, sizes, starts)
                  if not state.packed and state.mask is not None and state.survivors < n]
        self.masked = [entry[:4] for entry in masked]
        self._pruners = [entry[1:] for entry in masked]
        self.count = int(starts[-1]) if self.packed else self.size
        self.steady = self.count > 0 and all(
            state.packed or state.mask is None or state.survivors == n
            for state, n in zip(states, sizes))

    def positions(self):
        """The survivors' positions in the group's array (``None``: all are sent)."""
        if self._positions is not None or not self.packed:
            return self._positions
        if len(self.slots) == 1:
            self._positions = self.states[0].positions()
            return self._positions
        # Built from each member's mask: the members need no positions of their own.
        xp = next(state.mask.xp for state in self.states if state.packed)
        self._positions = xp.empty(self.count, dtype=index_dtype(self.size))
        at = 0
        for state, lo, hi in zip(self.states, self.offsets, self.offsets[1:]):
            count = state.survivors if state.packed else int(hi - lo)
            part = self._positions[at:at + count]
            part[...] = state.mask.positions() if state.packed else xp.arange(count)
            part += part.dtype.type(lo)
            at += count
        return self._positions

    def bitmap(self):
        """The survivors as a :class:`pacmpi.bitmaps.Bitmap` over the group's array (``None``:
        all are sent): a packed member's mask, the others all set."""
        if self._bitmap is not None or not self.packed:
            return self._bitmap
        if len(self.slots) == 1:
            self._bitmap = self.states[0].mask
        else:
            self._bitmap = self._joined(lambda state, slot: state.packed)
        return self._bitmap

    def kept(self):
        """This rank's survivors over the group's array while every member is sent dense and
        some have a mask to apply (the coordinates whose gradient is not zeroed: what an
        error-feedback residual needs to hold), else None."""
        if self._kept is not None or self.packed or not self.masked:
            return self._kept
        if len(self.slots) == 1:
            self._kept = self.states[0].mask
        else:
            masked = {s for s, *_ in self.masked}
            self._kept = self._joined(lambda state, slot: slot in masked)
        return self._kept

    def _joined(self, takes_mask):
        """One Bitmap over the group's array: the mask of each member ``takes_mask(state,
        slot)`` picks, the others all set."""
        xp = next(state.mask.xp for state, s in zip(self.states, self.slots)
                  if takes_mask(state, s))
        return Bitmap.joined(xp, [
            state.mask if takes_mask(state, s) else int(hi - lo)
            for s, state, lo, hi in zip(self.slots, self.states, self.offsets, self.offsets[1:])])

    def zero_pruned(self, flat):
        """GSE on the dense path: pruned coordinates of the members in ``masked``, laid out as
        the group's array, become exactly 0 (copyto, not multiply: NaN * 0 is NaN)."""
        for lo, hi, _, mask in self._pruners:
            mask.zero_pruned(flat[lo:hi])

    def zero_pruned_payload(self, values):
        """As :meth:`zero_pruned`, for ``values`` laid out as the payload."""
        for lo, hi, at, mask in self._pruners:
            mask.zero_pruned(values[at:at + hi - lo])

    def arrays(self):
        """The index arrays it holds (positions, bitmaps), for memory reports."""
        return self._positions, self._bitmap, self._kept


class GroupCache:
    """The :class:`Group` of each set of buckets sent together, checked against the
    tracker's packing and masks once per change of them (only a verification changes them).
    Never pickled: rebuilt on demand."""

    def __init__(self):
        self.clear()

    def clear(self):
        # epoch: counts the tracker's changes (of any bucket's mask or packing, seen after a
        # verification: changes is the tracker's count then; a checkpoint load starts anew).
        self._groups, self.epoch, self._changes = {}, 0, None

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.clear()

    def seen(self, tracker):
        """After a verification: the groups check their members again if the tracker
        changed."""
        if tracker.changes != self._changes:
            self._changes = tracker.changes
            self.epoch += 1

    def invalidate(self):
        """The tracker was replaced (a checkpoint load): every group checks again."""
        self._changes = None
        self.epoch += 1

    def get(self, slots, tracker, specs, step):
        """The :class:`Group` of buckets ``slots`` (a tuple) for their current packing and
        masks, marked as sent in ``step``."""
        group = self._groups.get(slots)
        if group is None or group.epoch != self.epoch:
            states = [tracker.buckets[s] for s in slots]
            key = [x for state in states for x in (state.packed, state.mask)]
            if group is None or not all(map(operator.is_, key, group.key)):
                group = self._groups[slots] = Group(slots, states, specs, key, step)
            group.epoch = self.epoch
        group.step = step
        return group

    def keep_sent(self, step):
        """Groups not sent in ``step`` (DDP rebuilt its buckets) let go of their positions."""
        self._groups = {k: g for k, g in self._groups.items() if g.step == step}

    def __iter__(self):
        return iter(self._groups.values())

    def keys(self):
        return self._groups.keys()

    def __getitem__(self, slots):
        return self._groups[slots]
