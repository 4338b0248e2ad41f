"""What :meth:`pacmpi.engine.StepEngine.encode` hands back besides the payload: one small type
per kind of payload, each knowing how the reduced payload goes back into its bucket.

As Horovod's ``Compressor`` returns ``(tensor, ctx)`` and takes both back, ``encode`` returns
``(wire, payload)`` and ``decode`` calls ``payload.unpack``. Every kind carries the bucket (or
group) it came from, the engine's ``generation`` when it was made (a late result of an
abandoned step keeps no residual), the number of values sent and, when the engine lent it,
the buffer it was written into (``scratch``, taken back at the decode).
"""
from . import kernels

__all__ = ["Encoded", "InPlace", "Gathered", "Compacted", "TernaryWords"]


class Encoded:
    """The common part of every payload kind."""

    __slots__ = ("bucket", "generation", "count", "scratch")

    def __init__(self, bucket, generation, count):
        self.bucket, self.generation, self.count, self.scratch = bucket, generation, count, None

    def unpack(self, xp, wire, flat, divisor, codec):
        """Write the reduced ``wire`` into the bucket's ``flat`` array, divided by
        ``divisor`` (``None``: summed)."""
        raise NotImplementedError


class InPlace(Encoded):
    """The payload is the bucket itself, reduced in place (dense, lossless)."""

    __slots__ = ()

    def unpack(self, xp, wire, flat, divisor, codec):
        if divisor is not None:
            kernels.scatter(xp, wire, None, flat, divisor)


class Gathered(Encoded):
    """The payload is a copy of the bucket's values at ``positions`` (``None``: every
    coordinate), scattered back: packed survivors, a float16 cast, or a ternary bucket sent
    unquantized for a non-finite scale."""

    __slots__ = ("positions",)

    def __init__(self, bucket, generation, count, positions):
        super().__init__(bucket, generation, count)
        self.positions = positions

    def unpack(self, xp, wire, flat, divisor, codec):
        kernels.scatter(xp, wire, self.positions, flat, divisor)


class Compacted(Encoded):
    """The payload is the front of the bucket, its survivors (``bitmap``, a
    :class:`pacmpi.bitmaps.Bitmap`) moved there in place and moved back here."""

    __slots__ = ("bitmap",)

    def __init__(self, bucket, generation, count, bitmap):
        super().__init__(bucket, generation, count)
        self.bitmap = bitmap

    def unpack(self, xp, wire, flat, divisor, codec):
        kernels.expand(xp, flat, self.bitmap.bits, self.count, divisor)


class TernaryWords(Encoded):
    """Ternary words: one scale of ``scales`` per segment of ``segments`` (a
    :class:`pacmpi.segments.SegmentTable`). ``compacted``: the survivors' Bitmap when the
    words were quantized from the bucket's compacted front (decoded there, then expanded),
    else ``None``. ``residual``: the error-feedback residual to keep once the result is back,
    so an abandoned step leaves the residuals as they were (an encode in place has updated
    them already: ``None``)."""

    __slots__ = ("scales", "segments", "compacted", "residual")

    def __init__(self, bucket, generation, count, scales, segments, compacted, residual):
        super().__init__(bucket, generation, count)
        self.scales, self.segments = scales, segments
        self.compacted, self.residual = compacted, residual

    def unpack(self, xp, wire, flat, divisor, codec):
        compacted = self.compacted is not None
        self.segments.decode(xp, wire, codec, codec.world_size, self.scales, divisor, flat,
                             compact=compacted)
        if compacted:
            kernels.expand(xp, flat, self.compacted.bits, self.count)
