"""Flat boolean masks as bitmaps (``packbits`` order, 1 bit per coordinate), and survivor
positions in the narrowest integer type that holds them.

The engine keeps the masks it verified for as long as they hold; as bytes they would cost a
quarter of float32 gradients, as bits 1/32. What it needs from them -- equality with a newly
read mask, the fingerprint, the pruned coordinates of a dense step, the survivor positions --
is read chunk by chunk, so no full-size temporary is made.
"""
import numpy as np

from .arrays import array_module

__all__ = ["Bitmap", "index_dtype"]

# Coordinates per chunk (a multiple of 8, so chunks start on a byte of the bitmap): 256 KiB
# of bools (and up to 2 MiB of int64 positions) at a time, in cache, at a few kernel launches
# per 1 Mi coordinates on a GPU.
CHUNK = 1 << 18
# Set bits per byte value, for counting survivors from packed bits.
POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


def index_dtype(size):
    """int32 positions where every one fits (half int64's bytes), else int64."""
    return np.dtype(np.int32) if size <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)


class _Section:
    """Coordinates ``first`` up to ``last`` of a :class:`Bitmap`, as :meth:`Bitmap.joined`
    reads a part."""

    __slots__ = ("bitmap", "first", "last", "size", "count")

    def __init__(self, bitmap, first, last, count):
        self.bitmap, self.first, self.last = bitmap, first, last
        self.size, self.count = last - first, count

    def _chunks(self):
        return self.bitmap._chunks(self.first, self.last)


class Bitmap:
    """A flat boolean mask of ``size`` coordinates, ``count`` of them True, stored as ``bits``
    (``xp.packbits`` of the mask, on the mask's device)."""

    __slots__ = ("bits", "size", "count")

    def __init__(self, flat):
        xp = array_module(flat)
        flat = flat if flat.dtype == np.bool_ else flat != 0
        self.bits = xp.packbits(flat)
        self.size, self.count = int(flat.size), int(xp.count_nonzero(flat))

    @classmethod
    def joined(cls, xp, parts):
        """The masks of ``parts`` laid end to end: each a :class:`Bitmap` or, for a stretch
        whose every coordinate is kept, its size. Made a chunk at a time (a part's bits do not
        start on a byte of the result), with no full-size boolean temporary."""
        self = cls.__new__(cls)
        self.size = sum(p if isinstance(p, int) else p.size for p in parts)
        self.count = sum(p if isinstance(p, int) else p.count for p in parts)
        self.bits = xp.empty((self.size + 7) // 8, dtype=np.uint8)
        pending, held, done = [], 0, 0
        for part in parts:
            chunks = ((xp.ones(min(CHUNK, part - at), dtype=xp.bool_)
                       for at in range(0, part, CHUNK)) if isinstance(part, int)
                      else (chunk for _, _, chunk in part._chunks()))
            for chunk in chunks:
                pending.append(chunk)
                held += chunk.size
                if held >= CHUNK:
                    pending, held, done = self._pack(xp, pending, done, held // 8 * 8)
        self._pack(xp, pending, done, held)
        return self

    def _pack(self, xp, pending, done, n):
        """Pack the first ``n`` pending coordinates (a multiple of 8 but at the very end) at
        coordinate ``done``; returns what is left pending, its length and the new ``done``."""
        flat = xp.concatenate(pending) if len(pending) > 1 else pending[0] if pending else \
            xp.empty(0, dtype=xp.bool_)
        self.bits[done // 8:(done + n + 7) // 8] = xp.packbits(flat[:n])
        rest = flat[n:]
        return [rest], rest.size, done + n

    @property
    def nbytes(self):
        return int(self.bits.nbytes)

    def lend(self, parts):
        """Let each of ``parts`` -- the masks of this one's consecutive stretches, in order
        (Bitmaps equal to them; ``None`` skipped) -- that starts and ends on a byte of it hold
        a view of these bits instead of its own copy: the very bytes ``packbits`` of the
        stretch makes. The others keep theirs. The parts stay the same objects."""
        at = 0
        for part in parts:
            if part is None:
                continue
            if at % 8 == 0 and part.size % 8 == 0:
                part.bits = self.bits[at // 8:(at + part.size) // 8]
            at += part.size
        if at != self.size:
            raise ValueError(f"the parts hold {at} coordinates, the mask {self.size}")

    @property
    def xp(self):
        return array_module(self.bits)

    def matches(self, flat):
        """Whether the flat boolean ``flat`` (same module) is this mask. Chunk by chunk (a whole
        mask's bits and their comparison would cost 1/16 of float32 gradients at each step's
        peak), read once at the end (one device synchronization on a GPU)."""
        xp = self.xp
        if flat.size != self.size or array_module(flat) is not xp:
            return False
        differ = 0
        for start in range(0, self.size, CHUNK):
            stop = min(start + CHUNK, self.size)
            differ = differ + xp.count_nonzero(
                xp.packbits(flat[start:stop]) != self.bits[start // 8:(stop + 7) // 8])
        return int(differ) == 0

    def _chunks(self, first=0, last=None):
        """``(start, stop, bools)`` of consecutive chunks of the mask's coordinates ``first``
        up to ``last`` (default: all), ``start`` and ``stop`` counted from ``first``."""
        xp, last = self.xp, self.size if last is None else last
        for start in range(first, last, CHUNK):
            stop = min(start + CHUNK, last)
            bits = self.bits[start // 8:(stop + 7) // 8]
            yield (start - first, stop - first,
                   xp.unpackbits(bits)[start % 8:start % 8 + stop - start].view(xp.bool_))

    def section(self, first, last, count=None):
        """Coordinates ``first`` up to ``last`` as a mask of their own, or None when every one
        of them is set (the layout of a stretch kept whole). Made a chunk at a time; ``count``:
        how many are set, when known (:meth:`counts_before` reads the bits up to ``last``)."""
        if count is None:
            count = np.diff(self.counts_before(np.array([first, last], dtype=np.int64)))[0]
        if count == last - first:
            return None
        part = _Section(self, first, last, int(count))
        return Bitmap.joined(self.xp, [part])

    def unpack(self):
        """The mask as a flat boolean array (a full-size copy: for tests and small masks)."""
        xp = self.xp
        flat = xp.empty(self.size, dtype=xp.bool_)
        for start, stop, chunk in self._chunks():
            flat[start:stop] = chunk
        return flat

    def zero_pruned(self, array):
        """``array[~mask] = 0`` in place (copyto, not multiply: NaN * 0 is NaN)."""
        xp = self.xp
        for start, stop, chunk in self._chunks():
            xp.copyto(array[start:stop], 0, where=~chunk)

    def counts_before(self, offsets):
        """How many coordinates are set before each of the ascending coordinates ``offsets``
        (a host int64 array): where a segment starting there begins among the survivors.
        One pass over the bytes, whatever the number of offsets."""
        xp = self.xp
        table = xp.asarray(POPCOUNT)
        out = np.empty(len(offsets), dtype=np.int64)
        total = done = 0
        for k, at in enumerate(int(o) for o in offsets):
            byte, rest = divmod(at, 8)
            for start in range(done, byte, CHUNK):  # whole bytes not counted yet
                total += int(table[self.bits[start:min(start + CHUNK, byte)]].sum(
                    dtype=np.int64))
            done = max(done, byte)
            out[k] = total + (int(POPCOUNT[int(self.bits[byte]) >> (8 - rest)]) if rest else 0)
        return out

    def positions(self):
        """The survivors' positions, ascending, as :func:`index_dtype` of the size."""
        xp = self.xp
        out = xp.empty(self.count, dtype=index_dtype(self.size))
        filled = 0
        for start, _, chunk in self._chunks():
            found = xp.flatnonzero(chunk)
            out[filled:filled + found.size] = found
            out[filled:filled + found.size] += start
            filled += found.size
            del found  # before the next chunk's: one chunk of int64 positions at a time
        return out
