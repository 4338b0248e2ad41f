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
codes are those of one scale, and a table of one segment is today's bucket bit for bit.
"""
import numpy as np

from . import kernels
from .arrays import array_module, to_host
from .hashing import uniform_from

__all__ = ["SegmentTable"]


class SegmentTable:
    """The segments of one bucket for one survivor layout (built once per mask change).

    ``sizes``: the tensors' element counts, in bucket order (their sum is the bucket's size);
    ``indices``: the survivors' ascending positions in the bucket, ``None`` for a bucket sent
    dense; ``digits``: digits per word of the codec. Attributes (host int64 arrays of one more
    entry than segments): ``offsets`` in the bucket, ``starts`` in the payload, ``word_starts``
    in the words; ``words`` the payload's word count; ``local``: the survivor positions relative
    to their tensor's offset (``indices`` itself for one segment; ``None`` when dense).
    """

    def __init__(self, sizes, indices, digits):
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        if indices is None:
            self.starts, self.local = self.offsets, None
        else:
            xp = array_module(indices)
            self.starts = to_host(xp.searchsorted(indices, xp.asarray(self.offsets)))
            self.starts = self.starts.astype(np.int64)
            self.local = indices
            if len(sizes) > 1:
                shift = xp.asarray(np.repeat(self.offsets[:-1], np.diff(self.starts)))
                self.local = indices - shift.astype(indices.dtype)
        counts = np.diff(self.starts)
        self.word_starts = np.concatenate([[0], np.cumsum(-(-counts // digits))])
        self.words = int(self.word_starts[-1])
        self.filled = np.flatnonzero(counts)  # segments with a survivor: the ones with a scale

    def __len__(self):
        return self.offsets.size - 1

    def _values(self, flat, residual, compact, s):
        """Segment ``s``'s part of ``flat`` (compact: already laid out as the payload) with its
        survivor positions in that part, and its part of the payload-aligned residual."""
        s0, s1 = self.starts[s], self.starts[s + 1]
        part = None if residual is None else residual[s0:s1]
        if self.local is None or compact:
            return flat[s0:s1], None, part
        return flat[self.offsets[s]:self.offsets[s + 1]], self.local[s0:s1], part

    def absmax(self, xp, flat, residual, compact=False):
        """Per segment ``max |flat + residual|`` over its survivors (float64, 0.0 when it has
        none; NaN or Inf when a value is not finite)."""
        maxima = np.zeros(len(self))
        for s in self.filled:
            maxima[s] = kernels.absmax(xp, *self._values(flat, residual, compact, s))
        return maxima

    def encode(self, xp, flat, residual_in, residual_out, scales, key, codec, words,
               compact=False):
        """:func:`pacmpi.kernels.ternary_encode` of each segment with its scale into its words
        (``words``: :attr:`words` of them); ``residual_out`` as there (None: not kept)."""
        for s in self.filled:
            part, local, residual = self._values(flat, residual_in, compact, s)
            out = None if residual_out is None else \
                residual_out[self.starts[s]:self.starts[s + 1]]
            kernels.ternary_encode(xp, part, local, residual, out, float(scales[s]),
                                   uniform_from(key, int(self.starts[s])), codec,
                                   words[self.word_starts[s]:self.word_starts[s + 1]])
        return words

    def decode(self, xp, words, codec, ranks, scales, divisor, flat):
        """:func:`pacmpi.kernels.ternary_decode` of each segment into its tensor's part of the
        bucket's ``flat`` (pruned coordinates, and tensors without survivors, exactly 0)."""
        for s in range(len(self)):
            target = flat[self.offsets[s]:self.offsets[s + 1]]
            if self.starts[s] == self.starts[s + 1]:
                target[...] = 0
                continue
            local = None if self.local is None else \
                self.local[self.starts[s]:self.starts[s + 1]]
            kernels.ternary_decode(xp, words[self.word_starts[s]:self.word_starts[s + 1]],
                                   int(self.starts[s + 1] - self.starts[s]), codec, ranks,
                                   float(scales[s]), divisor, local, target)
        return flat

    def nbytes(self):
        """Bytes of the rebased positions this table adds (none for one segment)."""
        return 0 if self.local is None or len(self) == 1 else int(self.local.nbytes)
