"""Ternary scales per tensor: where a bucket's tensors (segments) lie in its payload and words.

A fusion bucket holds tensors whose gradients differ by orders of magnitude; one scale for the
whole bucket (the largest |value|) quantizes a small tensor's values to zero nearly always, an
unbiased estimate with a huge variance. With a scale per tensor, each tensor's survivors form
one *segment* of the payload, quantized with the segment's own scale.

A segment starts in the payload where its tensor starts in the bucket less the coordinates
pruned before it (the survivors before it), and in the words on a word boundary: each word
holds one segment's digits (at most one word of padding per segment), so the one-scale kernels
of :mod:`pacmpi.kernels` encode and decode each segment as they would a bucket, and the
reference kernel stays the oracle of every route. Random number ``j`` of a segment is number
``start + j`` of the bucket's key (:func:`pacmpi.hashing.uniform_from`): with equal scales the
codes are those of one scale, and a table of one segment is today's bucket bit for bit. A
group of buckets (a DDP bucket's parameters) is a table of one segment per bucket, each with
its bucket's own key: the codes each bucket would send alone.
"""
import numpy as np

from . import kernels
from .arrays import array_module, to_host
from .bitmaps import Bitmap
from .hashing import uniform_from

__all__ = ["SegmentTable", "scale_sizes"]


def tensor_sizes(buckets, u, ternary_scale):
    """What one scale spans at most, before ``ternary_scale``'s blocks cut it: the members of
    group ``u`` (a tuple of indices into ``buckets``, :class:`pacmpi.engine.BucketSpec`), or
    the tensors of bucket ``u`` (its whole, for "bucket")."""
    if isinstance(u, tuple):
        if any(buckets[s].segments for s in u):
            raise ValueError("the buckets of a group hold one tensor each")
        return [buckets[s].size for s in u]
    spec = buckets[u]
    return spec.segments if ternary_scale != "bucket" and spec.segments else (spec.size,)


def block_count(n, ternary_scale):
    """How many scales ``n`` elements get: ``ternary_scale`` elements a scale, or one."""
    return 1 if isinstance(ternary_scale, str) or n <= ternary_scale else -(-n // ternary_scale)


def scale_sizes(buckets, u, ternary_scale):
    """The element counts of bucket or group ``u``'s segments, one scale each: each tensor
    (:func:`tensor_sizes`) cut into ``ternary_scale`` elements a scale (the last block
    shorter), or whole."""
    sizes = []
    for n in tensor_sizes(buckets, u, ternary_scale):
        if block_count(n, ternary_scale) == 1:
            sizes.append(n)
        else:
            sizes += [ternary_scale] * (n // ternary_scale) + [n % ternary_scale] * bool(
                n % ternary_scale)
    return sizes


class SegmentTable:
    """The segments of one bucket for one survivor layout (built once per mask change).

    ``sizes``: the tensors' element counts, in bucket order (their sum is the bucket's size);
    ``indices``: the survivors' ascending positions in the bucket, or their
    :class:`pacmpi.bitmaps.Bitmap` (``positions``: where its positions come from when asked for,
    default the bitmap's), ``None`` for a bucket sent dense; ``digits``: digits per word of the
    codec. A bitmap's table finds the scales (:meth:`absmax`) from its bits and works on
    compacted payloads (``compact=True``) without positions. Attributes (host int64 arrays of
    one more entry than segments): ``offsets`` in the bucket, ``starts`` in the payload,
    ``word_starts`` in the words; ``words`` the payload's word count. A segment done on its own
    reads the bucket through its slice of ``indices`` and decodes into its tensor through
    positions rebased to it, made for that call only: the table keeps no copy of the positions.

    On the Numba route the segments with fewer than its ``SERIAL_BELOW`` values are done in one
    serial call for all of them (:func:`pacmpi.kernels.segments_module`), so a bucket of many
    small tensors costs a few calls, not a few per tensor; larger segments, and every segment
    on the reference and CuPy routes, one call each.
    """

    def __init__(self, sizes, indices, digits, positions=None, kept=None):
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.digits = int(digits)
        self.bits, self._indices, self._make_positions = None, indices, positions
        # A dense table whose error-feedback residual holds the coordinates set in ``kept``
        # only (a Bitmap: the rank's survivors, its other coordinates zeroed): their bits, and
        # where each segment's residual starts.
        self.kept_bits = self.kept_starts = None
        if kept is not None and indices is None:
            self.kept_bits, self.kept_starts = kept.bits, kept.counts_before(self.offsets)
        if isinstance(indices, Bitmap):
            self.bits, self._indices = indices.bits, None
            self._make_positions = positions or indices.positions
            self.starts = indices.counts_before(self.offsets)
        elif indices is None:
            self.starts = self.offsets
        else:
            xp = array_module(indices)
            self.starts = to_host(xp.searchsorted(indices, xp.asarray(self.offsets)))
            self.starts = self.starts.astype(np.int64)
        counts = np.diff(self.starts)
        self._place(np.concatenate([[0], np.cumsum(-(-counts // digits))]))

    def _place(self, word_starts):
        """The attributes that follow from ``starts`` and ``word_starts``."""
        self.word_starts = word_starts
        self.counts = np.diff(self.starts)
        self.words = int(word_starts[-1])
        self.filled = np.flatnonzero(self.counts)  # segments with a survivor: the ones with a scale

    @property
    def indices(self):
        """The survivors' positions (``None``: dense); a table made from a bitmap asks for them
        only when a segment is read or written through them (:meth:`encode` and :meth:`decode`
        of a payload that is not compacted)."""
        if self._indices is None and self._make_positions is not None:
            self._indices = self._make_positions()
        return self._indices

    def __len__(self):
        return self.offsets.size - 1

    def payload_at(self, words):
        """The payload position where word ``words`` (ascending word boundaries, up to
        :attr:`words`) begins: cutting the words there cuts the payload there, with every word's
        digits on one side (a reduce-scatter's blocks of words)."""
        words = np.asarray(words, dtype=np.int64)
        s = np.clip(np.searchsorted(self.word_starts, words, side="right") - 1, 0, len(self) - 1)
        return np.minimum(self.starts[s] + (words - self.word_starts[s]) * self.digits,
                          self.starts[s + 1])

    def window(self, first, stop):
        """The table of words ``[first, stop)`` alone and the payload they hold (from
        :meth:`payload_at` ``first`` on), its segments the same (empty where outside): what
        :meth:`decode` with ``compact=True`` needs to decode a reduce-scattered block of words
        into its block of the payload, with each segment's scale."""
        lo, hi = self.payload_at([first, stop])
        part = object.__new__(SegmentTable)
        part.digits, part.bits = self.digits, None
        part.kept_bits = part.kept_starts = None
        part._indices = part._make_positions = None
        part.offsets = part.starts = np.clip(self.starts, lo, hi) - lo
        part._place(np.clip(self.word_starts, first, stop) - first)
        return part

    def _split(self, fused, segments):
        """``segments`` as (the ones for one serial call, the ones done one by one)."""
        if fused is None:
            return segments[:0], segments
        small = self.counts[segments] < fused.SERIAL_BELOW
        return segments[small], segments[~small]

    def _values(self, flat, residual, compact, s):
        """What segment ``s`` reads: ``flat`` (compact: already laid out as the payload) or
        its part, the survivor positions in that, and its part of the payload-aligned
        residual."""
        s0, s1 = self.starts[s], self.starts[s + 1]
        part = None if residual is None else residual[s0:s1]
        if compact or self.indices is None:
            return flat[s0:s1], None, part
        return flat, self.indices[s0:s1], part

    def absmax(self, xp, flat, residual, compact=False):
        """Per segment ``max |flat + residual|`` over its survivors (float64, 0.0 when it has
        none; NaN or Inf when a value is not finite)."""
        maxima = np.zeros(len(self))
        if self.kept_bits is not None and residual is not None and not compact:
            # Dense, the residual kept for the survivors: their maxima are every coordinate's
            # (the others are 0, as their residual would be).
            return kernels.absmax_bits(xp, flat, self.kept_bits, residual, self.offsets,
                                       self.kept_starts, self.filled, maxima)
        # Through the bits only while no positions exist: once made (a payload read through
        # them: Horovod), reading the survivors alone is the faster way.
        if self.bits is not None and self._indices is None and not compact:
            return kernels.absmax_bits(xp, flat, self.bits, residual, self.offsets, self.starts,
                                       self.filled, maxima)
        indices = None if compact else self.indices
        fused = kernels.segments_module(xp, flat, indices, residual)
        together, alone = self._split(fused, self.filled)
        if together.size:
            fused.absmax_segments(flat, indices, residual, self.starts, together, maxima)
        for s in alone:
            maxima[s] = kernels.absmax(xp, *self._values(flat, residual, compact, s))
        return maxima

    def encode(self, xp, flat, residual_in, residual_out, scales, key, codec, words,
               compact=False):
        """:func:`pacmpi.kernels.ternary_encode` of each segment with its scale into its words
        (``words``: :attr:`words` of them); ``residual_out`` as there (None: not kept).
        ``key``: the bucket's (segment ``s`` draws its numbers from ``starts[s]`` on), or a
        uint64 array of one key per segment (a group's members, each from 0)."""
        indices = None if compact else self.indices
        keys = key if isinstance(key, np.ndarray) else \
            uniform_from(key, self.starts[:-1].astype(np.uint64))
        if self.kept_bits is not None and residual_in is not None and not compact:
            return kernels.ternary_encode_kept(
                xp, flat, self.kept_bits, residual_in, residual_out, self.offsets,
                self.kept_starts, self.word_starts, self.filled, np.asarray(scales, np.float64),
                keys, codec, words)
        fused = kernels.segments_module(xp, flat, indices, residual_in, residual_out, words)
        together, alone = self._split(fused, self.filled)
        if together.size:
            fused.ternary_encode_segments(
                flat, indices, residual_in, residual_out, np.asarray(scales, np.float64),
                keys, codec, words, self.starts, self.word_starts, together)
        for s in alone:
            part, local, residual = self._values(flat, residual_in, compact, s)
            out = None if residual_out is None else \
                residual_out[self.starts[s]:self.starts[s + 1]]
            kernels.ternary_encode(xp, part, local, residual, out, float(scales[s]),
                                   int(keys[s]), codec,
                                   words[self.word_starts[s]:self.word_starts[s + 1]])
        return words

    def decode(self, xp, words, codec, ranks, scales, divisor, flat, compact=False):
        """:func:`pacmpi.kernels.ternary_decode` of each segment into its tensor's part of the
        bucket's ``flat`` (pruned coordinates, and tensors without survivors, exactly 0);
        ``compact``: into the payload's place instead, ``flat[starts[s]:starts[s + 1]]`` (the
        survivors at the front, as :func:`pacmpi.kernels.expand` takes them)."""
        indices = None if compact else self.indices
        targets = self.starts if compact else self.offsets
        fused = kernels.segments_module(xp, words, indices, flat)
        together, alone = self._split(fused, np.arange(len(self)))
        if together.size:
            fused.ternary_decode_segments(words, codec, ranks, np.asarray(scales, np.float64),
                                          divisor, indices, flat, targets, self.starts,
                                          self.word_starts, together)
        for s in alone:
            target = flat[targets[s]:targets[s + 1]]
            if self.starts[s] == self.starts[s + 1]:
                target[...] = 0
                continue
            local = None if indices is None else \
                indices[self.starts[s]:self.starts[s + 1]] - \
                indices.dtype.type(self.offsets[s])  # for this call only
            kernels.ternary_decode(xp, words[self.word_starts[s]:self.word_starts[s + 1]],
                                   int(self.starts[s + 1] - self.starts[s]), codec, ranks,
                                   float(scales[s]), divisor, local, target)
        return flat
