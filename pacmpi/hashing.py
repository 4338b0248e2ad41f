"""Counter-based hashing on array modules: mask fingerprints and reproducible uniform numbers.

Both are built on SplitMix64 over uint64 counters, so NumPy and CuPy produce identical bits, the
work stays on the device, and the only state worth saving is an integer counter.
"""
import hashlib

import numpy as np

__all__ = ["splitmix64_int", "mask_fingerprint", "bits_fingerprint", "uniform", "uniform_from",
           "digest_ints"]

_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# Two independent multilinear hashes: each collides with probability <= 2**-32 for two fixed,
# different masks (32-bit words, random 64-bit weights), so together about 2**-64.
_FINGERPRINT_KEYS = (0x5DEECE66D1234567, 0x2545F4914F6CDD1D)
_FINGERPRINT_CHUNK = 1 << 14  # 32-bit words per pass: 512 Ki coordinates, 128 KiB per temporary


def splitmix64_int(value):
    """SplitMix64 finalizer on one Python integer (mod 2**64)."""
    z = (value + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def splitmix64(xp, counters):
    """SplitMix64 finalizer applied elementwise to a uint64 array (wrapping arithmetic)."""
    z = counters + xp.uint64(_GAMMA)
    z ^= z >> xp.uint64(30)
    z *= xp.uint64(_MIX1)
    z ^= z >> xp.uint64(27)
    z *= xp.uint64(_MIX2)
    z ^= z >> xp.uint64(31)
    return z


def _weights(xp, count, key, start=0):
    counters = xp.arange(start, start + count, dtype=xp.uint64)
    counters *= xp.uint64(_GAMMA)
    counters += xp.uint64(key)
    return splitmix64(xp, counters)


def mask_fingerprint(xp, flat_mask):
    """128-bit fingerprint (a Python int) of a flat boolean mask, computed on its device.

    The mask is bit-packed into 32-bit words and hashed with two multilinear hashes whose
    weights come from SplitMix64 counters; only the two 64-bit sums leave the device.
    """
    return bits_fingerprint(xp, xp.packbits(flat_mask.astype(xp.bool_, copy=False)),
                            flat_mask.size)


def bits_fingerprint(xp, bits, length):
    """:func:`mask_fingerprint` of the ``length``-coordinate mask whose ``xp.packbits`` is
    ``bits`` (a :class:`pacmpi.bitmaps.Bitmap` keeps them)."""
    length = int(length)
    pad = (-bits.size) % 4
    if pad:
        bits = xp.concatenate([bits, xp.zeros(pad, dtype=xp.uint8)])
    words = bits.view(xp.uint32)
    pair = xp.zeros(2, dtype=xp.uint64)
    # Chunk by chunk, so the temporaries stay small: the sums wrap modulo 2**64 either way.
    for start in range(0, words.size, _FINGERPRINT_CHUNK):
        chunk = words[start:start + _FINGERPRINT_CHUNK].astype(xp.uint64)
        for k, key in enumerate(_FINGERPRINT_KEYS):
            product = _weights(xp, chunk.size, key ^ length, start)
            product *= chunk
            xp.add(pair[k:k + 1], product.sum(dtype=xp.uint64), out=pair[k:k + 1])
    high, low = (int(v) for v in (pair.get() if hasattr(pair, "get") else pair))
    return (splitmix64_int(high ^ length) << 64) | splitmix64_int(low + length)


def _lowbias32(xp, x):
    """Chris Wellons' lowbias32 integer hash, in place on a uint32 array."""
    x ^= x >> xp.uint32(16)
    x *= xp.uint32(0x7FEB352D)
    x ^= x >> xp.uint32(15)
    x *= xp.uint32(0x846CA68B)
    x ^= x >> xp.uint32(16)
    return x


def uniform(xp, count, key):
    """``count`` float32 numbers in [0, 1) determined by the 64-bit ``key`` alone.

    Two rounds of a 32-bit hash (a quarter of SplitMix64's memory traffic): the low key word
    offsets the counter, the high word decorrelates streams whose offsets happen to overlap.
    """
    bits = xp.arange(count, dtype=xp.uint32)
    bits += xp.uint32(key & 0xFFFFFFFF)
    _lowbias32(xp, bits)
    bits ^= xp.uint32((key >> 32) & 0xFFFFFFFF)
    _lowbias32(xp, bits)
    bits >>= xp.uint32(8)
    result = bits.astype(xp.float32)
    result *= xp.float32(2.0 ** -24)
    return result


def uniform_from(key, start):
    """The key whose :func:`uniform` number ``j`` is ``key``'s number ``start + j``: the
    counter starts at the low key word, so moving it moves the stream (the high word stays).
    Elementwise on uint64 arrays too."""
    low = 0xFFFFFFFF
    return (key - (key & low)) | ((key + start) & low)


def digest_ints(values):
    """A 128-bit digest of a sequence of integers/strings, as four non-negative 32-bit ints."""
    h = hashlib.blake2b(digest_size=16)
    for value in values:
        h.update(repr(value).encode())
        h.update(b"\x00")
    raw = np.frombuffer(h.digest(), dtype="<u4")
    return [int(v) for v in raw]
