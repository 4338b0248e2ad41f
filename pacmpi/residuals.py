"""Error-feedback residuals: one array per bucket or group, aligned with what it sends.

A residual is full length while its bucket is sent dense, its survivors' only while packed
(or, sent dense with a mask, this rank's survivors': the others' gradient is zeroed, so their
residual stays 0). The store keeps them by unit (a bucket index, or a tuple of buckets sent as
one group) and moves them when the groups change: a new group takes its members' residuals
from the groups they were in, as a slice where they lie back to back in its order, else a
copy. A front end whose new groups hold the old ones' members in reverse order (DDP's rebuilt
buckets) says so with :meth:`ResidualStore.reverse`, so those become slices too. Residuals
sliced from one shared array are cut together when they shrink (:meth:`shrink_shared`).
"""
import numpy as np

from . import kernels
from .arrays import array_module, to_host
from .bitmaps import CHUNK, Bitmap

__all__ = ["Residual", "ResidualStore"]


class Residual:
    """Error-feedback residual of one bucket or group, aligned with its payload: full length
    while it is sent dense, its survivors' while packed (``layout``: their
    :class:`pacmpi.bitmaps.Bitmap`). ``spare``: the buffer an encode that is not in place
    writes the next residual into, swapped in when its result is decoded."""

    __slots__ = ("values", "layout", "spare")

    def __init__(self, values, layout):
        self.values, self.layout, self.spare = values, layout, None

    def aligned(self, xp, layout, size):
        """The residual laid out for ``layout`` (``None``: dense over ``size`` elements)."""
        if self.layout is layout:
            return self.values
        if _same_layout(self.layout, layout):  # e.g. a mask checked dense, now packed
            self.layout = layout
            return self.values
        self.spare = None  # laid out for the old layout: freed before the new one is made
        # Full length: the values themselves when dense (the store's own array, compacted in
        # place), else a new array; the old values go before the new ones are made.
        full, self.values = self.full(xp, size), None
        if layout is not None:
            kernels.compact(xp, full, layout.bits, layout.count)
            if isinstance(full, np.ndarray) and full.base is not None:
                # A slice of one array shared with other groups (DDP's rebuilt buckets): its
                # survivors stay where they are until the step ends, when the store moves
                # every group's part of that array to its front and cuts it (shrink_shared),
                # so no group's survivors are copied beside the whole array (the hook peaked
                # at 1.4x the gradient bytes at density 0.5).
                full = full[:layout.count]
            else:
                try:
                    # NumPy, and no other reference or view (refcheck): cut in place by
                    # realloc, which keeps the front and unmaps the rest of a large block, so
                    # the survivors' residual never sits beside the full one (a peak of 1.6x
                    # the gradient bytes at density 0.5). Here, not in a helper: a second
                    # frame's reference would fail the check.
                    full.resize(layout.count)
                except (AttributeError, ValueError):  # CuPy has no resize: copy
                    full = full[:layout.count].copy()
        self.values, self.layout = full, layout
        return self.values

    def full(self, xp, size):
        if self.layout is None:
            return self.values
        full = xp.zeros(size, dtype=self.values.dtype)
        full[:self.values.size] = self.values
        return kernels.expand(xp, full, self.layout.bits, self.layout.count)


def _same_layout(a, b):
    """Whether :class:`pacmpi.bitmaps.Bitmap` ``a`` and ``b`` hold the same coordinates."""
    return a is not None and b is not None and a.size == b.size and a.count == b.count and \
        bool((a.bits == b.bits).all())


def _address(array):
    """Where ``array``'s first element lies in memory (NumPy or CuPy)."""
    return array.data.ptr if hasattr(array.data, "ptr") else array.__array_interface__["data"][0]


def _move_forward(array, source, target, count):
    """``array[target:target + count] = array[source:source + count]`` for ``target <=
    source``, a chunk at a time from the front: no chunk overwrites one not yet moved, and
    chunks no longer than the shift need no temporary (NumPy buffers overlapping copies)."""
    if source == target:
        return
    chunk = min(CHUNK, max(source - target, 4096))
    for lo in range(0, count, chunk):
        n = min(chunk, count - lo)
        array[target + lo:target + lo + n] = array[source + lo:source + lo + n]


def _joined(parts):
    """One view over the 1-d ``parts`` if they lie back to back, in this order, in one 1-d
    array (the pieces a group's residual was split into), else ``None``."""
    base, first = parts[0].base, parts[0]
    if base is None or base.ndim != 1 or not base.flags.c_contiguous:
        return None
    at = _address(first)
    for part in parts:
        if part.base is not base or part.dtype != base.dtype or _address(part) != at:
            return None
        at += part.size * base.itemsize
    start = (_address(first) - _address(base)) // base.itemsize
    return base[start:start + (at - _address(first)) // base.itemsize]


def _reverse(values, chunk=1 << 16):
    """Reverse 1-d ``values`` in place, a chunk from each end at a time (``values[:] =
    values[::-1]`` would copy the whole array first)."""
    n, half = values.size, values.size // 2
    for i in range(0, half, chunk):
        k = min(chunk, half - i)
        head = values[i:i + k].copy()
        values[i:i + k] = values[n - i - k:n - i][::-1]
        values[n - i - k:n - i] = head[::-1]


def _reverse_segments(values, sizes):
    """Reverse the order of the segments of 1-d ``values`` (lengths ``sizes``, in order) in
    place, each segment's values kept in their order."""
    _reverse(values)
    start = 0
    for n in reversed(sizes):
        _reverse(values[start:start + n])
        start += n


class ResidualStore:
    """The :class:`Residual` of every bucket or group that has one, by unit; ``sizes``: each
    bucket's element count."""

    def __init__(self, sizes):
        self.sizes, self._entries = tuple(sizes), {}

    def __contains__(self, u):
        return u in self._entries

    def __getitem__(self, u):
        return self._entries[u]

    def entries(self):
        """Every :class:`Residual`, by unit."""
        return dict(self._entries)

    def values_for(self, u, group, layout, xp, compute):
        """The residual of ``u`` (a bucket or a group; ``group``, its
        :class:`pacmpi.groups.Group`) laid out for ``layout`` (``None``: the group's every
        coordinate), in ``compute`` dtype: gathered from its members' when the groups
        changed, zeros when there is none. Coordinates a new mask prunes are dropped."""
        entry = self._entries.get(u)
        if entry is None:
            entry = self._gathered(u if isinstance(u, tuple) else (u,), xp, group)
        if entry is None or entry.values.dtype != compute:  # zeros, laid out as the payload
            size = group.count if layout is None or layout is group.bitmap() else layout.count
            entry = self._entries[u] = Residual(xp.zeros(size, dtype=compute), layout)
        elif array_module(entry.values) is not xp:  # restored from a checkpoint (host)
            entry.values, entry.spare = xp.asarray(to_host(entry.values)), None
        values = entry.aligned(xp, layout, group.size)
        if layout is group.bitmap():
            group.zero_pruned_payload(values)
        return values

    def spare(self, u, like):
        """The buffer the next residual of ``u`` is written into, shaped ``like`` the
        current one."""
        entry = self._entries[u]
        if entry.spare is None or entry.spare.size != like.size:
            entry.spare = array_module(like).empty(like.size, dtype=like.dtype)
        return entry.spare

    def keep(self, u, values):
        """``values`` (a spare written by an encode) become ``u``'s residual."""
        entry = self._entries[u]
        entry.values, entry.spare = values, entry.values

    def _gathered(self, slots, xp, group):
        """The residual of bucket or group ``slots`` from its members' (kept per bucket, or by
        the groups they were in before DDP rebuilt its buckets), which it replaces; None if
        none."""
        for key in [k for k in self._entries if isinstance(k, tuple) and set(k) & set(slots)]:
            self._split(key)
        if len(slots) == 1:
            entry = self._entries.get(slots[0])
            if entry is not None and entry.values.base is not None:
                entry.values = entry.values.copy()  # a view would keep its old group's array
            return entry
        found = [s for s in slots if s in self._entries]
        if not found:
            return None
        if len(found) == len(slots):
            # Members back to back in one array, in this order (the old group's, reversed in
            # place by reverse() where the front end said so): a slice of it, not a copy
            # beside it (the DDP hook peaked at 1.9x the gradient bytes while the old array
            # lived on), laid out as its members' were.
            parts = [self._entries[s] for s in slots]
            joined = _joined([entry.values for entry in parts])
            if joined is not None and array_module(joined) is xp:
                layout = None if all(entry.layout is None for entry in parts) else \
                    Bitmap.joined(xp, [self.sizes[s] if entry.layout is None else
                                       entry.layout for s, entry in zip(slots, parts)])
                for s in slots:
                    del self._entries[s]
                entry = self._entries[slots] = Residual(joined, layout)
                return entry
        first = self._entries[found[0]].values
        module = array_module(first)
        full = module.zeros(group.size, dtype=first.dtype)
        for s, lo in zip(slots, group.offsets):
            entry, size = self._entries.pop(s, None), self.sizes[s]
            if entry is not None:
                full[lo:lo + size] = entry.full(module, size)
        entry = self._entries[slots] = Residual(xp.asarray(full), None)
        return entry

    def _members(self, key):
        """``(bucket, its residual, that residual's layout)`` of each member of group
        ``key``'s entry: views of its array, in the array's order."""
        entry = self._entries[key]
        counts, layouts = self._member_counts(key, entry)
        at = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return [(s, entry.values[lo:lo + n], layout)
                for s, lo, n, layout in zip(key, at, counts, layouts)]

    def _member_counts(self, key, entry):
        """Each member's count of values in group ``key``'s ``entry``, and its layout."""
        sizes = [self.sizes[s] for s in key]
        if entry.layout is None:
            return sizes, [None] * len(key)
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        counts = np.diff(entry.layout.counts_before(offsets)).tolist()
        return counts, [entry.layout.section(lo, hi, n)
                        for lo, hi, n in zip(offsets, offsets[1:], counts)]

    def _split(self, key):
        """Group ``key``'s entry replaced by its members' (views of its array)."""
        for s, values, layout in self._members(key):
            self._entries[s] = Residual(values, layout)
        del self._entries[key]

    def reverse(self, key):
        """Reverse group ``key``'s residual in place, member by member (each member's values
        kept in their order), and keep it per member: for a front end whose next groups hold
        ``key``'s members in the reverse order (DDP's rebuilt buckets), which then take
        slices of it instead of copies. Nothing when ``key`` has no residual."""
        entry = self._entries.get(key)
        if entry is None or len(key) < 2:
            return
        counts, layouts = self._member_counts(key, entry)
        _reverse_segments(entry.values, counts)
        at = np.concatenate([[0], np.cumsum(counts[::-1], dtype=np.int64)])
        for s, lo, n, layout in zip(key[::-1], at, counts[::-1], layouts[::-1]):
            self._entries[s] = Residual(entry.values[lo:lo + n], layout)
        del self._entries[key]

    def shrink_shared(self):
        """Residuals that are slices of one shared NumPy array (DDP's rebuilt buckets) and are
        shorter than it (compacted by :meth:`Residual.aligned`) are moved, in the array's
        order, to its front and the array is cut in place; each then a slice of the cut array.
        Forward moves never overwrite a part not yet moved."""
        shared, owners = {}, set()
        for entry in self._entries.values():
            values = entry.values
            if isinstance(values, np.ndarray) and values.base is not None and \
                    values.base.ndim == 1 and values.base.flags.c_contiguous:
                shared.setdefault(id(values.base), []).append(entry)
            else:
                owners.add(id(values))
        values = None
        for key, entries in shared.items():
            base = entries[0].values.base
            if key in owners or sum(e.values.size for e in entries) == base.size:
                continue  # an entry's own array (never moved), or nothing to cut
            entries.sort(key=lambda e: _address(e.values))
            places, at = [], 0
            for entry in entries:
                start = (_address(entry.values) - _address(base)) // base.itemsize
                _move_forward(base, start, at, entry.values.size)
                places.append((entry, at, entry.values.size))
                at += entry.values.size
                entry.values = None
            entry = entries = None
            try:
                base.resize(at)  # see Residual.aligned; every slice of it was let go above
            except ValueError:  # still referenced elsewhere: kept whole, its parts at the front
                pass
            for entry, start, size in places:
                entry.values = base[start:start + size]

    def full(self):
        """``(bucket, full-length host residual)`` of every bucket that has one."""
        for u, entry in self._entries.items():
            if isinstance(u, tuple):
                yield from ((s, to_host(Residual(values, layout).full(
                    array_module(values), self.sizes[s])).copy())
                    for s, values, layout in self._members(u))
            else:
                yield u, to_host(entry.full(array_module(entry.values), self.sizes[u])).copy()

    def load(self, residuals):
        """Replace every residual by ``residuals`` (bucket -> full-length array), each
        copied: the store's own."""
        self._entries = {int(b): Residual(np.asarray(r).copy(), None)
                         for b, r in residuals.items()}

    def arrays(self):
        """Every array it holds (the residuals and their spares), for memory reports."""
        for entry in self._entries.values():
            yield entry.values
            yield entry.spare
