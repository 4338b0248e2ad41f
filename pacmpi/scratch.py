"""BufferPool: the arrays a step writes payloads into, kept between steps.

One pool per engine, shared by what builds on it (the hierarchical engine's node sums, the
sharded reducer's shards and words), so one memory report counts them all. Two kinds:

- *kept* buffers, one per key (:meth:`kept`): the same array every step while its size,
  dtype and module hold;
- *lent* buffers (:meth:`lend`): a payload's, lent from its encode until its decode
  (:meth:`take_back` then :meth:`give_back`). Buckets encoded one after another share one
  buffer per dtype; only buckets in flight together need more.
"""
import numpy as np

from .arrays import array_module

__all__ = ["BufferPool"]


class BufferPool:
    """Kept and lent buffers by (array module, dtype); never pickled (rebuilt on demand)."""

    def __init__(self):
        self.clear()

    def clear(self):
        # kept: key -> buffer; free: (module, dtype) -> size -> buffers; lent: id of a payload
        # -> its buffer; largest: the largest payload asked for in this step, per (module,
        # dtype).
        self._kept, self._free, self._lent, self._largest = {}, {}, {}, {}

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.clear()

    def kept(self, xp, key, size, dtype):
        """The buffer kept under ``key``: ``size`` values of ``dtype``, made anew when those or
        the module change."""
        buf = self._kept.get(key)
        if buf is None or buf.size != size or buf.dtype != dtype or array_module(buf) is not xp:
            buf = self._kept[key] = xp.empty(size, dtype=dtype)
        return buf

    def lend(self, xp, size, dtype):
        """A payload of ``size`` ``dtype`` values, lent until :meth:`take_back`. A free buffer
        of that size serves, else the smallest larger one; else the largest free one is
        replaced. (Free buffers by size: a step asks for the sizes of the last.)"""
        key = (xp.__name__, np.dtype(dtype))
        free = self._free.setdefault(key, {})
        self._largest[key] = max(self._largest.get(key, 0), size)
        fits = [size] if size in free else [n for n in free if n > size]
        if fits:
            base = self._take(free, min(fits))
        else:
            if free:
                self._take(free, max(free))
            base = xp.empty(size, dtype=dtype)
        payload = base[:size]
        self._lent[id(payload)] = base
        return payload

    def take_back(self, payload):
        """The buffer ``payload`` was lent from (``None``: not lent), to :meth:`give_back`."""
        return self._lent.pop(id(payload), None)

    @staticmethod
    def _take(free, size):
        buffers = free[size]
        base = buffers.pop()
        if not buffers:
            del free[size]
        return base

    def give_back(self, base):
        key = (array_module(base).__name__, base.dtype)
        self._free.setdefault(key, {}).setdefault(base.size, []).append(base)

    def trim(self):
        """At the end of a step, free the buffers much larger than any payload of theirs in it
        (a mask that pruned more, a dtype no longer sent): the next step allocates to fit."""
        for key, free in self._free.items():
            limit = self._largest.get(key, 0) * 5 // 4
            for size in [n for n in free if n > limit]:
                del free[size]
        self._largest.clear()

    def arrays(self):
        """Every buffer it holds, kept or free."""
        yield from self._kept.values()
        for free in self._free.values():
            yield from (buf for buffers in free.values() for buf in buffers)
