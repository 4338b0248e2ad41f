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


def index_dtype(size):
    """int32 positions where every one fits (half int64's bytes), else int64."""
    return np.dtype(np.int32) if size <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)


class Bitmap:
    """A flat boolean mask of ``size`` coordinates, ``count`` of them True, stored as ``bits``
    (``xp.packbits`` of the mask, on the mask's device)."""

    __slots__ = ("bits", "size", "count")

    def __init__(self, flat):
        xp = array_module(flat)
        flat = flat if flat.dtype == np.bool_ else flat != 0
        self.bits = xp.packbits(flat)
        self.size, self.count = int(flat.size), int(xp.count_nonzero(flat))

    @property
    def nbytes(self):
        return int(self.bits.nbytes)

    @property
    def xp(self):
        return array_module(self.bits)

    def matches(self, flat):
        """Whether the flat boolean ``flat`` (same module) is this mask."""
        xp = self.xp
        return (flat.size == self.size and array_module(flat) is xp
                and bool(xp.array_equal(xp.packbits(flat), self.bits)))

    def _chunks(self):
        """``(start, stop, bools)`` of consecutive chunks of the mask."""
        xp = self.xp
        for start in range(0, self.size, CHUNK):
            stop = min(start + CHUNK, self.size)
            bits = self.bits[start // 8:(stop + 7) // 8]
            yield start, stop, xp.unpackbits(bits)[:stop - start].view(xp.bool_)

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
