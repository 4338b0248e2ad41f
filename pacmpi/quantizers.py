"""TernaryQuantizer: the ternary part of a :class:`pacmpi.engine.StepEngine` step.

Phase 2, the scales: one per segment of a bucket or group (:mod:`pacmpi.segments`), the MAX
over ranks of its largest |value + residual|, agreed the cheapest way the front end allows:
inside the verification's all-reduce (:meth:`TernaryQuantizer.steady` units, whose payload the
last verification fixed), in one all-reduce for several units (:meth:`TernaryQuantizer.agree`),
or in the encode's own. Phase 3, the words: each unit quantized with its scales, this rank's
counter-based key and its error-feedback residual (:mod:`pacmpi.residuals`) into summable
integer words (:class:`pacmpi.ternary.TernaryCodec`). What a rank takes the scales of and
quantizes is the engine's :attr:`~pacmpi.engine.StepEngine.packing` strategy's.
"""
import time
from typing import NamedTuple

import numpy as np

from . import kernels
from .arrays import array_module
from .bitmaps import index_dtype
from .groups import unit
from .hashing import uniform_from
from .payloads import TernaryWords
from .segments import SegmentTable, block_count, tensor_sizes
from .ternary import ternary_key

__all__ = ["TernaryQuantizer", "MemberBlocks"]


class MemberBlocks(NamedTuple):
    """A group's segments by member, for ``table`` (its SegmentTable): how many each member
    has (``counts``), and where each segment begins in its member (``within``: a member's
    blocks go on along its own key's numbers, as the bucket's do alone)."""
    table: object
    counts: list
    within: object


class TernaryQuantizer:
    """Ternary scales and words for one engine (passed to each call); ``agreed``: this step's
    agreed scales by unit, until its encode."""

    # In place, a packed ternary payload is quantized from the bucket's compacted front unless
    # its survivor positions take at most this fraction of its gradient bytes (float32
    # gradients: density <= 0.25): reading the bits costs a pass over every coordinate each
    # for the scales, the compaction and the expansion, where positions read the survivors
    # only (4 Mi float32 values, one thread: 6.1 ms against 1.8 at density 0.2, 7.1 against
    # 4.2 at 0.5), and so few positions cost little memory.
    POSITIONS_AT_MOST = 0.25

    def __init__(self):
        self.agreed = {}

    def forget(self):
        """The step ended or was abandoned: scales agreed for it no longer hold."""
        self.agreed = {}

    # ------------------------------------------------------------------ 2. agree scales
    def steady(self, engine, units):
        """The buckets or groups among ``units`` whose payload the last agreed verification
        fixed (:attr:`pacmpi.groups.Group.steady`), as ``(unit, its group, its number of
        segments)``. Every rank finds the same ones; none before a first agreed verification,
        whose layout they rely on."""
        if engine.tracker.last_commit_step is None or not engine.packing.fuses_scales:
            return []
        groups = [(u, engine.group(u)) for u in units]
        return [(u, group, len(self.segment_table(engine, u)))
                for u, group in groups if group.steady]

    def scale_bits(self, engine, fused, scale_flats):
        """The local absmax of every segment of the units of ``fused`` (:meth:`steady`), in
        their order, as the int64 of its float64 bits: for non-negative floats the integer
        order is the float order, so MAX over the bits is the MAX scale (NaN as Inf's bits: a
        scale is never NaN). Zeros when ``scale_flats`` is None (a rank with bad input: the
        step raises anyway)."""
        flats = {} if not fused or scale_flats is None else {
            unit(u): flat for u, flat in scale_flats().items()}
        local = [self.local_scales(engine, u, flats[u]) if flats else np.zeros(n)
                 for u, _, n in fused]
        local = np.concatenate(local) if local else np.zeros(0)
        return np.where(np.isnan(local), np.inf, local).astype(np.float64).view(np.int64)

    def keep(self, engine, fused, scale_bits):
        """Keep the scales the verification agreed (``scale_bits``, their MAX) for the units
        of ``fused``. They hold where each unit is sent as it was when they were computed (its
        group is the same object: rebuilt whenever a member's packing or mask changes)."""
        scales = np.split(scale_bits.view(np.float64), np.cumsum([n for *_, n in fused]))
        self.agreed = {u: agreed.copy() for (u, group, _), agreed in zip(fused, scales)
                       if engine.group(u) is group}

    def agree(self, engine, flats):
        """Agree on the scales of the units of ``flats`` (unit -> flat gradient) in one MAX
        all-reduce, but those agreed already or sending nothing."""
        flats = {unit(u): flat for u, flat in flats.items()}
        order = [u for u in sorted(flats) if engine.group(u).count and u not in self.agreed]
        if not order:
            return
        local = [self.local_scales(engine, u, flats[u]) for u in order]
        agreed = np.concatenate(local)
        self._max(engine, agreed, name=f"pacmpi.scales.{engine.step}")
        self.agreed.update(zip(order, np.split(agreed, np.cumsum([s.size for s in local])[:-1])))

    def scales(self, engine, u, flat):
        """``u``'s scales this step, one per segment: the ones agreed beforehand
        (verification or :meth:`agree`), else agreed now in a MAX all-reduce of their own."""
        scales = self.agreed.pop(u, None)
        if scales is None:
            scales = self.local_scales(engine, u, flat)
            self._max(engine, scales, name=f"pacmpi.scale.{engine.name(u)}")
        return scales

    def local_scales(self, engine, u, flat):
        """This rank's part of ``u``'s scales, before the MAX over ranks: per segment, the
        max |value + residual| over what it sends (masking first on the dense path, a no-op
        for the steady units) of what the engine's packing takes the scales of."""
        engine.apply_mask(u, flat)
        values, compact = engine.packing.scaled(engine, u, flat)
        table = self.segment_table(engine, u)
        if values is None:
            return np.zeros(len(table))
        xp = array_module(values)
        residual = engine.residual(u, xp, kernels.compute_dtype(flat.dtype))
        return table.absmax(xp, values, residual, compact=compact)

    @staticmethod
    def _max(engine, local, name):
        """MAX of ``local`` (per-segment maxima) over ranks, in place; non-finite -> inf."""
        finite = np.isfinite(local)
        buf = np.concatenate([np.where(finite, local, 0.0), (~finite).astype(np.float64)])
        started = time.perf_counter()
        engine.collectives.allreduce(buf, "max", name=name)
        engine.stats["comm_seconds"] += time.perf_counter() - started
        engine.stats["bytes_sent"] += buf.nbytes
        count = local.size
        local[...] = np.where(buf[count:] > 0, np.inf, buf[:count])

    def segment_table(self, engine, u):
        """The :class:`pacmpi.segments.SegmentTable` of bucket ``u`` (its tensors; one segment
        with ``ternary_scale="bucket"``) or of group ``u`` (a tuple: one segment per member)
        for their current survivors: built when they change, not per step."""
        group = engine.group(u)
        if group.table is None:
            digits = engine.codec.digits_per_word if engine.codec is not None else 1
            kept = engine.residual_layout(group) if engine.error_feedback else None
            group.table = SegmentTable(engine.segment_sizes(u), group.bitmap(), digits,
                                       group.positions,
                                       kept=None if kept is group.bitmap() else kept)
        return group.table

    # ------------------------------------------------------------------ 3. words
    def _compacts(self, engine, group):
        """Whether packed ``group``, encoded in place, is quantized from its compacted front
        (else through survivor positions)."""
        return engine.packing.compacts_in_place and group.count * index_dtype(
            group.size).itemsize > self.POSITIONS_AT_MOST * group.nbytes

    def encode(self, engine, b, xp, flat, group, in_place):
        """Ternary words of bucket or group ``b`` and their context. ``in_place`` (the bucket
        is the front end's storage, which holds no gradient until the decode): packed
        survivors are compacted to the front first, and the error-feedback residual is
        updated right here, with no second buffer; otherwise read through survivor positions,
        with the new residual kept aside until the result is decoded (an abandoned step keeps
        the old)."""
        count = group.count
        scales = self.scales(engine, b, flat)
        # Fetched even for a step sent unquantized: the residual then still drops what this
        # step's mask prunes, as on every other step.
        residual = engine.residual(b, xp, kernels.compute_dtype(flat.dtype))
        compact = in_place and group.packed and self._compacts(engine, group)
        if not np.isfinite(scales).all():
            # NaN/Inf on some rank: send this bucket unquantized, so the non-finite values
            # propagate exactly as on the dense path and the scale is never NaN.
            engine.stats["nonfinite_fallbacks"] += 1
            if compact:
                return engine.compacted(b, flat)
            return engine.packing.unquantized(engine, b, flat)
        table = self.segment_table(engine, b)
        if compact:
            flat = kernels.compact(xp, flat, group.bitmap().bits, count)
        values, quantized_compact = engine.packing.quantized(engine, b, flat, compact)
        words = engine.pool.lend(xp, table.words, engine.codec.word_dtype)
        new_residual = None
        if values is None:  # digit 0 everywhere: adds nothing to the digit sums
            words[...] = 0
        else:
            new_residual = self._quantize(engine, b, xp, values, residual, scales, table,
                                          words, quantized_compact, in_place)
        return words, TernaryWords(b, engine.generation, count, scales, table,
                                   group.bitmap() if compact else None, new_residual)

    def _quantize(self, engine, b, xp, values, residual, scales, table, words, compact,
                  in_place):
        """Quantize ``values`` (what ``b`` sends of them; ``compact``: laid out as the
        payload already) plus ``residual`` into ``words``, segment by segment of ``table``
        with this rank's key; returns the new residual to keep at the decode (``None``: not
        kept, or, ``in_place``, written over ``residual`` already)."""
        new_residual = None
        if residual is not None:
            new_residual = residual if in_place else engine.residuals.spare(b, residual)
        members = np.array(b, dtype=np.uint64) if isinstance(b, tuple) else b
        key = ternary_key(engine.seed, engine.step, members, engine.collectives.rank)
        if isinstance(b, tuple):  # a member's blocks go on along its key's numbers
            group = engine.group(b)
            if group.blocks is None or group.blocks.table is not table:
                counts = [block_count(n, engine.ternary_scale)
                          for n in tensor_sizes(engine.buckets, b, engine.ternary_scale)]
                first = np.repeat(table.starts[np.cumsum([0] + counts[:-1])], counts)
                group.blocks = MemberBlocks(table, counts,
                                            (table.starts[:-1] - first).astype(np.uint64))
            blocks = group.blocks
            key = uniform_from(np.repeat(key, blocks.counts), blocks.within)
        table.encode(xp, values, residual, new_residual, scales, key, engine.codec, words,
                     compact)
        return None if in_place else new_residual
