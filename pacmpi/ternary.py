"""Unbiased ternary quantization (TernGrad-style) with codes that a plain integer SUM can add.

Each value ``v`` becomes ``scale * q`` with ``q`` in {-1, 0, +1}, ``P(q = sign v) = |v|/scale``,
so ``E[scale * q] = v``. The biased code ``q + 1`` is in {0, 1, 2}; with ``n`` ranks a sum of
codes is at most ``2n``, so codes are stored as base-``(2n+1)`` digits of int64, uint64 or
int32 words: a word-wise SUM over ranks never carries from one digit into the next and decodes
exactly. A value then costs ``word_bits / digits_per_word`` bits on the wire, within a fraction
of a bit of the ``log2(2n+1)`` bits its sum needs.

TernGrad itself all-gathers its codes instead, four 2-bit codes per byte (:func:`pack_codes`).
"""
import math

import numpy as np

from .arrays import array_module
from .hashing import splitmix64, splitmix64_int, uniform

__all__ = ["TernaryCodec", "format_wire_bits", "pack_codes", "stochastic_ternary", "ternary_key",
           "unpack_codes", "wire_bits_table"]

_WORD_DTYPES = {"int64": np.int64, "int32": np.int32, "uint64": np.uint64}


class TernaryCodec:
    """Packs biased ternary codes of ``world_size`` ranks into summable integer words.

    Parameters
    ----------
    world_size:
        Number of ranks whose codes will be summed (at least 1).
    word_dtype:
        ``"int64"`` (default), ``"uint64"`` (densest: one more bit per word, for transports that
        sum unsigned integers, such as MPI; Horovod's and PyTorch's reductions have none) or
        ``"int32"`` (for transports without 64-bit integers).
    """

    def __init__(self, world_size, word_dtype="int64"):
        if not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if word_dtype not in _WORD_DTYPES:
            raise ValueError(
                f"word_dtype must be one of {sorted(_WORD_DTYPES)}, got {word_dtype!r}")
        self.world_size = int(world_size)
        self.word_dtype = np.dtype(_WORD_DTYPES[word_dtype])
        self.base = 2 * self.world_size + 1
        # Python ints: base**k of a uint64 word does not fit int64.
        largest_sum = int(np.iinfo(self.word_dtype).max)
        digits = 0
        while self.base ** (digits + 1) - 1 <= largest_sum:
            digits += 1
        if digits == 0:
            raise ValueError(
                f"{self.world_size} ranks need base-{self.base} digits, which do not fit a "
                f"{word_dtype} word; at most {self.max_world_size(word_dtype)} ranks are supported"
            )
        self.digits_per_word = digits

    @staticmethod
    def max_world_size(word_dtype="int64"):
        """Largest rank count whose digit sums still fit one word (one base-(2n+1) digit)."""
        largest_sum = int(np.iinfo(_WORD_DTYPES[word_dtype]).max)
        return (largest_sum - 1) // 2

    @property
    def sum_dtype(self):
        """Dtype of :meth:`decode`'s signed sums: the word dtype, int64 for uint64 words."""
        return np.dtype(np.int64) if self.word_dtype == np.uint64 else self.word_dtype

    @property
    def bits_per_value(self):
        return self.word_dtype.itemsize * 8 / self.digits_per_word

    def words_for(self, count):
        return -(-int(count) // self.digits_per_word)

    def encode(self, xp, codes, out=None):
        """Pack codes in {-1, 0, 1} (any integer dtype) into words; returns the word array."""
        k = self.digits_per_word
        nwords = self.words_for(codes.size)
        # uint8 digits add to every word dtype without promotion (int8 + uint64 is float64).
        digits = xp.zeros(nwords * k, dtype=xp.uint8)
        xp.add(codes, 1, out=digits[:codes.size], casting="unsafe")
        digits = digits.reshape(nwords, k)
        words = xp.zeros(nwords, dtype=self.word_dtype) if out is None else out
        words[...] = 0
        for j in range(k - 1, -1, -1):  # Horner: words = sum_j digit_j * base**j
            words *= self.base
            words += digits[:, j]
        return words

    def decode(self, xp, words, count, ranks=None):
        """Sum of the ``ranks`` ranks' codes (:attr:`sum_dtype`, in [-ranks, ranks]) from summed
        words."""
        ranks = self.world_size if ranks is None else ranks
        k = self.digits_per_word
        remaining = words.copy()
        sums = xp.empty((words.size, k), dtype=self.sum_dtype)
        for j in range(k):
            remaining, sums[:, j] = xp.divmod(remaining, self.base)
        sums = sums.reshape(-1)[:count]
        sums -= ranks
        return sums


def ternary_key(seed, step, bucket, rank):
    """The 64-bit random key of one (step, bucket, rank): independent noise per rank, and a
    run that is reproduced exactly from the seed and the step counter alone. ``bucket`` may
    be a uint64 array: the keys of those buckets, elementwise (a group's members)."""
    if isinstance(bucket, np.ndarray):
        mixed = splitmix64(np, np.uint64(step << 32) ^ (bucket << np.uint64(16)) ^ np.uint64(rank))
        return splitmix64(np, np.uint64(seed) ^ mixed)
    return splitmix64_int(seed ^ splitmix64_int((step << 32) ^ (bucket << 16) ^ rank))


def stochastic_ternary(xp, values, scale, key):
    """Codes in {-1, 0, 1} (int8) with ``E[scale * code] == values`` for ``|values| <= scale``.

    ``key`` (a 64-bit integer) fixes the random numbers, so a run is reproducible and NumPy and
    CuPy agree bit for bit.
    """
    if scale <= 0:
        return xp.zeros(values.shape, dtype=xp.int8)
    probability = xp.abs(values).astype(xp.float32) / xp.float32(scale)
    keep = uniform(xp, values.size, key).reshape(values.shape) < probability
    codes = xp.sign(values).astype(xp.int8)
    codes *= keep
    return codes


def pack_codes(q):
    """Ternary values ``q`` (int8 in {-1, 0, 1}, 1-d NumPy or CuPy) as 2-bit codes ``q + 1``,
    four per byte (the first value in the lowest bits); the length is padded to a multiple of 4
    with zeros."""
    xp = array_module(q)
    codes = xp.zeros(4 * math.ceil(q.size / 4), dtype=xp.uint8)
    codes[:q.size] = q + 1
    codes = codes.reshape(-1, 4)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


_BYTE_VALUES = ((np.arange(256, dtype=np.uint8)[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
                ).astype(np.int8) - 1
"""The four values each byte of :func:`pack_codes` holds, by byte."""


def unpack_codes(packed, size):
    """Inverse of :func:`pack_codes` along the last axis: int8 values in {-1, 0, 1}, ``size``
    per row."""
    xp = array_module(packed)
    # One table look-up per byte: a seventh of the time of shifting each code out (NumPy).
    values = xp.take(xp.asarray(_BYTE_VALUES), packed, axis=0)
    return xp.ascontiguousarray(values.reshape(*packed.shape[:-1], -1)[..., :size])


def wire_bits_table(world_sizes=(2, 4, 8, 16, 64, 256, 1024), word_dtype="int64"):
    """Rows of (ranks, word dtype, digits per word, bits per value on the wire, log2(2n+1)
    lower bound); ``word_dtype`` is one name or a sequence of names (rows per rank count, one
    per word dtype)."""
    word_dtypes = (word_dtype,) if isinstance(word_dtype, str) else tuple(word_dtype)
    rows = []
    for n in world_sizes:
        for name in word_dtypes:
            codec = TernaryCodec(n, name)
            rows.append({
                "ranks": n,
                "word_dtype": name,
                "digits_per_word": codec.digits_per_word,
                "bits_per_value": codec.bits_per_value,
                "log2_2n_plus_1": math.log2(2 * n + 1),
            })
    return rows


def format_wire_bits(world_sizes=(2, 4, 8, 16, 64, 256, 1024), word_dtypes=("int64", "uint64")):
    """A text table: ternary bits per value on the wire for each word type (digits per word in
    brackets) next to the ``log2(2n+1)`` bound, one line per rank count."""
    rows = wire_bits_table(world_sizes, word_dtypes)
    lines = [f"{'ranks':>6} " + " ".join(f"{w + ' bits':>17}" for w in word_dtypes)
             + f" {'log2(2n+1)':>11}"]
    for n in world_sizes:
        mine = [r for r in rows if r["ranks"] == n]
        lines.append(f"{n:>6} " + " ".join(
            f"{r['bits_per_value']:>11.3f} ({r['digits_per_word']:>2})" for r in mine)
            + f" {mine[0]['log2_2n_plus_1']:>11.3f}")
    return "\n".join(lines)
