"""StepEngine: the per-step PacTrain logic that every front end shares.

A front end (the :class:`pacmpi.PacTrainReducer` over gradient lists, Horovod's compressor over
single tensors, a DDP communication hook over DDP buckets) maps its unit of work onto numbered
*buckets*: flat arrays of a fixed dtype and size. The engine owns everything else, once:

- the masks' tracker state and the cross-rank verification at the start of a step (one tiny
  MAX all-reduce; errors raised on every rank together; ``on_mismatch="resync"`` adopts rank
  0's masks);
- encoding a bucket into the payload its framework all-reduces (dense with the mask applied,
  packed survivors, float16, or ternary codes in summable integer words with error-feedback
  residuals and the counter-based RNG), and decoding the reduced payload back into the bucket;
- the step counter, abandoned steps, counters and ``state_dict``.

The front end runs the payload's all-reduce itself (MPI ``Iallreduce``, Horovod's background
thread, a DDP future): ``encode`` returns the payload and a context, ``decode`` takes both back.
Buckets whose arrays lie back to back (a DDP bucket's parameters) can be encoded as one *group*:
each keeps its own mask, scale, key and residual, and the group's payload is theirs back to
back, built in a few calls whatever their number.
"""
import operator
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import kernels
from .arrays import array_module, to_host
from .bitmaps import CHUNK, Bitmap, index_dtype
from .errors import LayoutMismatchError, MaskMismatchError
from .hashing import digest_ints, uniform_from
from .segments import SegmentTable
from .ternary import TernaryCodec, ternary_key
from .tracker import MaskTracker
from .verify import agree, gather_details, offending_ranks, raise_together

__all__ = ["StepEngine", "BucketSpec", "Encoded", "JoinedMasks", "QUANTIZE_MODES",
           "MISMATCH_POLICIES", "TERNARY_SCALES", "MEMORY_COMPONENTS"]

QUANTIZE_MODES = (None, "fp16", "ternary")
MISMATCH_POLICIES = ("raise", "resync")
# Ternary scale granularity: one per tensor of a bucket (BucketSpec.segments), or per bucket;
# a positive int n instead: one per n consecutive elements of each tensor.
TERNARY_SCALES = ("tensor", "bucket")
_QUANTIZE_CODES = {None: 0, "fp16": 1, "ternary": 2}
_MAGIC = 0x7AC9
_STRUCTURE_FIELDS = ("magic", "step", "buckets", "elements", "layout0", "layout1", "layout2",
                     "layout3", "quantize", "scales", "average", "word")
_MASK_FIELDS = ("mask0", "mask1", "mask2", "mask3", "survivors", "version")
COUNTERS = ("steps", "verifications", "bytes_sent", "dense_elements_equivalent",
            "dense_bytes_equivalent", "packed_reductions", "dense_reductions", "dense_fallbacks",
            "resyncs", "resync_bytes", "nonfinite_fallbacks", "abandoned_steps", "verify_seconds",
            "pack_seconds", "comm_seconds", "unpack_seconds")
# What StepEngine.memory_report() counts, by what the arrays are for.
MEMORY_COMPONENTS = ("indices", "snapshots", "payloads", "words", "residuals")


@dataclass(frozen=True)
class BucketSpec:
    """One unit of reduction: a flat array of ``size`` elements of ``dtype``, called ``name``
    in error messages. ``segments``: the element counts of the tensors it holds back to back
    (each gets its own ternary scale with ``ternary_scale="tensor"``); empty: one tensor."""

    name: str
    dtype: np.dtype
    size: int
    segments: tuple = ()


class JoinedMasks(list):
    """What ``read_masks()`` may return instead of a plain list: the same flat masks (one per
    bucket, ``None`` for an unmasked one), every one a view of ``whole``, one boolean array
    holding the masked buckets' masks back to back in bucket order. ``token`` is an object that
    stays the same exactly as long as the views partition ``whole`` the same way. The engine
    then checks and compares the masks as one array per step, whatever their number."""

    __slots__ = ("whole", "token")

    def __init__(self, flats, whole, token):
        super().__init__(flats)
        self.whole, self.token = whole, token


@dataclass
class Encoded:
    """What :meth:`StepEngine.decode` needs besides the reduced payload.

    ``kind`` is ``"dense"`` (the payload is the bucket, reduced in place), ``"compact"`` (the
    payload is the front of the bucket, its survivors moved there in place and moved back on
    decode), ``"copy"`` (the payload is a copy of the bucket's values, scattered back on
    decode: packed survivors, a float16 cast, or an unquantized non-finite bucket) or
    ``"ternary"`` (ternary words, one scale per segment of ``segments``, a
    :class:`pacmpi.segments.SegmentTable`).
    ``indices`` says where the payload's values go back: survivor positions (``None``: all
    coordinates), for ``"compact"`` and a ternary payload quantized from the compacted front
    of the bucket the survivors' :class:`pacmpi.bitmaps.Bitmap`.
    ``residual`` is the error-feedback residual to keep once the result is back, so an abandoned
    step leaves the residuals as they were (an encode in place has updated them already).
    ``scratch``: the engine's buffer the payload was written into, lent until the decode.
    """

    bucket: int
    kind: str
    indices: object
    generation: int
    scales: object = None
    segments: object = None
    count: int = 0
    residual: object = None
    scratch: object = None


def _unit(u):
    """A bucket index, or a tuple of several (a group); a tuple of one is its bucket."""
    return u[0] if isinstance(u, tuple) and len(u) == 1 else u


class _Group:
    """Buckets whose flat arrays lie back to back in one array (a DDP bucket's parameters),
    sent as one payload, so a step costs one gather and one scatter whatever the number of
    members. What it sends is described, each made when first asked for, by
    :meth:`positions` (its survivors' positions in that array) or :meth:`bitmap` (1 bit per
    coordinate, what in-place compaction reads); both ``None`` when every coordinate is sent.
    Built when a member's packing or mask changes (``key``), not per step; ``masked``:
    ``(bucket, start, stop, payload start)`` of the members sent dense with a mask to apply."""

    __slots__ = ("slots", "key", "states", "masked", "count", "packed", "size", "nbytes",
                 "offsets", "step", "epoch", "table", "steady", "_positions", "_bitmap",
                 "_kept", "blocks")

    def __init__(self, slots, states, specs, key, step):
        sizes = [specs[s].size for s in slots]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.slots, self.key, self.step, self.size = slots, key, step, int(offsets[-1])
        self.offsets, self.table = offsets, None  # table: the ternary SegmentTable, when asked
        self.blocks = None  # with the table: each member's segments and where each begins in it
        self.states, self._positions, self._bitmap, self._kept = states, None, None, None
        self.nbytes = sum(specs[s].size * specs[s].dtype.itemsize for s in slots)
        self.packed = sum(state.packed for state in states)
        counts = [state.survivors if state.packed else n for state, n in zip(states, sizes)]
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.masked = [(s, int(lo), int(lo) + n, int(at)) for s, state, lo, n, at in
                       zip(slots, states, offsets, sizes, starts)
                       if not state.packed and state.mask is not None and state.survivors < n]
        self.count = int(starts[-1]) if self.packed else self.size
        # Whether what it sends is fixed until a member's mask changes: every member packed,
        # or unmasked, or with nothing pruned (a ternary scale agreed early still holds).
        self.steady = self.count > 0 and all(
            state.packed or state.mask is None or state.survivors == n
            for state, n in zip(states, sizes))

    def positions(self):
        """The survivors' positions in the group's array (``None``: all are sent)."""
        if self._positions is not None or not self.packed:
            return self._positions
        if len(self.slots) == 1:
            self._positions = self.states[0].positions()
            return self._positions
        # Built from each member's mask: the members need no positions of their own.
        xp = next(state.mask.xp for state in self.states if state.packed)
        self._positions = xp.empty(self.count, dtype=index_dtype(self.size))
        at = 0
        for state, lo, hi in zip(self.states, self.offsets, self.offsets[1:]):
            count = state.survivors if state.packed else int(hi - lo)
            part = self._positions[at:at + count]
            part[...] = state.mask.positions() if state.packed else xp.arange(count)
            part += part.dtype.type(lo)
            at += count
        return self._positions

    def bitmap(self):
        """The survivors as a :class:`pacmpi.bitmaps.Bitmap` over the group's array (``None``:
        all are sent): a packed member's mask, the others all set."""
        if self._bitmap is not None or not self.packed:
            return self._bitmap
        if len(self.slots) == 1:
            self._bitmap = self.states[0].mask
        else:
            xp = next(state.mask.xp for state in self.states if state.packed)
            self._bitmap = Bitmap.joined(xp, [
                state.mask if state.packed else int(hi - lo)
                for state, lo, hi in zip(self.states, self.offsets, self.offsets[1:])])
        return self._bitmap

    def kept(self):
        """This rank's survivors over the group's array while every member is sent dense and
        some have a mask to apply (the coordinates whose gradient is not zeroed: what an
        error-feedback residual needs to hold), else None."""
        if self._kept is not None or self.packed or not self.masked:
            return self._kept
        if len(self.slots) == 1:
            self._kept = self.states[0].mask
            return self._kept
        masked = {s for s, *_ in self.masked}
        xp = next(state.mask.xp for state in self.states if state.mask is not None)
        self._kept = Bitmap.joined(xp, [
            state.mask if s in masked else int(hi - lo)
            for s, state, lo, hi in zip(self.slots, self.states, self.offsets, self.offsets[1:])])
        return self._kept


class _Residual:
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
        # Full length: the values themselves when dense (the engine's own array, compacted in
        # place), else a new array; the old values go before the new ones are made.
        full, self.values = self.full(xp, size), None
        if layout is not None:
            kernels.compact(xp, full, layout.bits, layout.count)
            if isinstance(full, np.ndarray) and full.base is not None:
                # A slice of one array shared with other groups (DDP's rebuilt buckets): its
                # survivors stay where they are until the step ends, when the engine moves
                # every group's part of that array to its front and cuts it (_shrink_shared),
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


def _is_block(ternary_scale):
    return (isinstance(ternary_scale, (int, np.integer)) and not isinstance(ternary_scale, bool)
            and ternary_scale >= 1)


def check_options(*, quantize=None, on_mismatch="raise", verify_every=1, ternary_scale="tensor"):
    """Raise ValueError for a bad option of :class:`StepEngine`: a front end that builds its
    engine later (once the process group exists) calls this at construction."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if not (ternary_scale in TERNARY_SCALES or _is_block(ternary_scale)):
        raise ValueError(f"ternary_scale must be one of {TERNARY_SCALES} or a positive int "
                         f"(elements per scale), got {ternary_scale!r}")
    if on_mismatch not in MISMATCH_POLICIES:
        raise ValueError(f"on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
    if not isinstance(verify_every, int) or verify_every < 1:
        raise ValueError(f"verify_every must be a positive integer, got {verify_every!r}")


class StepEngine:
    """Mask tracking, verification, encoding and state for a fixed set of buckets.

    Parameters
    ----------
    collectives:
        The :class:`pacmpi.Collectives` the engine's own small collectives (verification,
        ternary scales, resync broadcasts) run on; calls carry a ``name`` for transports that
        match collectives by name (Horovod).
    buckets:
        :class:`BucketSpec` list, identical on every rank (verified).
    layout:
        Hashable description of how the front end maps its tensors onto buckets (shapes,
        names); its digest is verified too, so ranks that bucket differently fail together.
    quantize, average, verify_every, on_mismatch, stable_steps, error_feedback, seed,
    ternary_scale:
        As documented on :class:`pacmpi.PacTrainReducer`.
    word_dtype:
        Ternary word type: ``"int64"``, ``"int32"``, or ``"uint64"`` (densest; needs an
        unsigned 64-bit SUM, which MPI has and Horovod/torch do not). ``"auto"`` picks uint64
        where ``collectives.word_dtypes`` offers it.
    """

    def __init__(self, collectives, buckets, *, layout=(), quantize=None, average=True,
                 verify_every=1, on_mismatch="raise", stable_steps=1, error_feedback=False,
                 seed=0, word_dtype="auto", ternary_scale="tensor"):
        check_options(quantize=quantize, on_mismatch=on_mismatch, verify_every=verify_every,
                      ternary_scale=ternary_scale)
        self.collectives = collectives
        self.buckets = tuple(buckets)
        for spec in self.buckets:
            if spec.segments and sum(spec.segments) != spec.size:
                raise ValueError(f"segments of {spec.name} add up to {sum(spec.segments)} "
                                 f"elements, the bucket has {spec.size}")
        self.ternary_scale = int(ternary_scale) if _is_block(ternary_scale) else ternary_scale
        self.layout = list(layout)
        self.quantize, self.average = quantize, bool(average)
        self.verify_every, self.on_mismatch = verify_every, on_mismatch
        self.error_feedback, self.seed = bool(error_feedback), int(seed)
        self.tracker = MaskTracker(len(self.buckets), stable_steps=stable_steps)
        if word_dtype == "auto":
            word_dtype = "uint64" if "uint64" in getattr(collectives, "word_dtypes", ()) \
                else "int64"
        self.codec = (TernaryCodec(self._code_ranks(collectives), word_dtype)
                      if quantize == "ternary" else None)
        self.word_dtype = word_dtype
        self.step = 0
        self.generation = 0
        # _epoch counts the tracker's changes (of any bucket's mask or packing, seen after a
        # verification: _changes is the tracker's count then; checkpoint loads).
        self._epoch, self._changes = 0, None
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._residuals = {}
        self._scales = {}
        self._clear_caches()

    def _code_ranks(self, collectives):
        """How many ranks' ternary codes one payload sum adds up: every rank's, here."""
        return collectives.size

    # Reusable buffers (kept per key; lent per payload: free ones by (module, dtype), lent ones
    # by id of the payload until its encode returns), the last agreed mask snapshots with
    # their fingerprints, the groups (buckets tuple -> _Group, with its segment table), the
    # small masks' runs (buckets tuple -> (their bits read together, the snapshots they
    # matched)) and what the last verification read and digested ("observed", "masks",
    # "layout"): dicts rebuilt on demand, so never pickled.
    _CACHES = ("_buffers", "_free", "_lent", "_largest", "_snapshots", "_groups", "_batches",
               "_digests")

    def _clear_caches(self):
        for name in self._CACHES:
            setattr(self, name, {})

    def __getstate__(self):
        state = self.__dict__.copy()
        state["collectives"] = None
        for name in self._CACHES:
            del state[name]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._clear_caches()

    # ------------------------------------------------------------------ steps
    def verification_due(self):
        return self.step % self.verify_every == 0

    def begin_step(self, read_masks, local_error=None, write_masks=None, scale_flats=None,
                   scale_units=None):
        """Start a step: verify when due, then every rank knows which buckets it packs.

        ``read_masks()`` returns each bucket's current flat boolean mask (an array of the
        bucket's module, or ``None`` for an unmasked bucket); it is called only on verified
        steps and only when ``local_error`` is ``None``. ``local_error`` (an exception found by
        the front end's own input checks) is raised on every rank as a RankInputError.
        ``write_masks(flats)`` stores rank 0's masks during a resync. ``scale_flats()``, when
        gradients are already at hand (bucket or group -> flat: ``scale_units``, every bucket
        when None, the same on every rank), lets a ternary step agree on their scales inside
        the verification all-reduce instead of in one of their own.
        """
        if not self.verification_due():
            if local_error is not None:
                raise local_error
            return
        started = time.perf_counter()
        fields = dict.fromkeys(_STRUCTURE_FIELDS + _MASK_FIELDS, 0)
        flats = observations = None
        if local_error is None:
            try:
                flats = self._checked_flats(read_masks())
            except (TypeError, ValueError) as exc:
                local_error = exc
        fields["input_error"] = 0 if local_error is None else 1
        if local_error is None:
            flats, observations = self._observe(flats)
            fields.update(self._fields(observations))
        fused = [] if scale_flats is None else self._steady(
            range(len(self.buckets)) if scale_units is None else map(_unit, scale_units))
        scale_bits = self._scale_bits(fused, scale_flats if local_error is None else None)
        mismatched, maxima = agree(self.collectives, fields, scale_bits)
        self.stats["verifications"] += 1
        if "input_error" in mismatched or fields["input_error"]:
            raise_together(self.collectives, local_error)
        structure = [f for f in mismatched if f in _STRUCTURE_FIELDS]
        masks_differ = [f for f in mismatched if f in _MASK_FIELDS]
        if structure:
            self._raise_mismatch(LayoutMismatchError, structure, observations)
        if masks_differ and (self.on_mismatch == "raise" or write_masks is None):
            self._raise_mismatch(MaskMismatchError, masks_differ, observations)
        if masks_differ:
            flats, observations = self._resync(flats, read_masks, write_masks)
            self.tracker.reset(version=maxima["version"])
            self.stats["resyncs"] += 1
        self.tracker.commit(self.step, observations, flats)
        if not masks_differ:
            self.tracker.pack_ready()
        if self.tracker.changes != self._changes:  # the groups check their members again
            self._changes = self.tracker.changes
            self._epoch += 1
        if not masks_differ:
            # The scales hold where each unit is sent as it was when they were computed (its
            # group is the same object: rebuilt whenever a member's packing or mask changes).
            scales = np.split(scale_bits.view(np.float64), np.cumsum([n for *_, n in fused]))
            self._scales = {u: agreed.copy() for (u, group, _), agreed in zip(fused, scales)
                            if self._group_of(u) is group}
        self.stats["verify_seconds"] += time.perf_counter() - started

    def _steady(self, units):
        """The ternary buckets or groups among ``units`` whose payload the last agreed
        verification fixed (every member packed, or unmasked, or with nothing pruned), as
        ``(unit, its group, its number of segments)``. Every rank finds the same ones; none
        before a first agreed verification, whose layout they rely on."""
        if self.quantize != "ternary" or self.tracker.last_commit_step is None:
            return []
        groups = [(u, self._group_of(u)) for u in units]
        return [(u, group, len(self.segment_table(u))) for u, group in groups if group.steady]

    def _scale_bits(self, fused, scale_flats):
        """The local absmax of every segment of the units of ``fused`` (:meth:`_steady`), in
        their order, as the int64 of its float64 bits: for non-negative floats the integer
        order is the float order, so MAX over the bits is the MAX scale (NaN as Inf's bits: a
        scale is never NaN). Zeros when ``scale_flats`` is None (a rank with bad input: the
        step raises anyway)."""
        flats = {} if not fused or scale_flats is None else {
            _unit(u): flat for u, flat in scale_flats().items()}
        local = [self._local_scale(u, flats[u]) if flats else np.zeros(n) for u, _, n in fused]
        local = np.concatenate(local) if local else np.zeros(0)
        return np.where(np.isnan(local), np.inf, local).astype(np.float64).view(np.int64)

    def segment_table(self, u):
        """The :class:`pacmpi.segments.SegmentTable` of bucket ``u`` (its tensors; one segment
        with ``ternary_scale="bucket"``) or of group ``u`` (a tuple: one segment per member)
        for their current survivors: built when they change, not per step."""
        group = self._group_of(u)
        if group.table is None:
            digits = self.codec.digits_per_word if self.codec is not None else 1
            kept = self._residual_layout(group) if self.error_feedback else None
            group.table = SegmentTable(self.segment_sizes(u), group.bitmap(), digits,
                                       group.positions,
                                       kept=None if kept is group.bitmap() else kept)
        return group.table

    def segment_sizes(self, u):
        """The element counts of bucket or group ``u``'s segments: one scale each."""
        return [n for tensor in self._tensor_sizes(u) for n in self._blocks(tensor)]

    def _tensor_sizes(self, u):
        """What one scale spans at most, before ``ternary_scale``'s blocks cut it: the
        members of group ``u``, or the tensors of bucket ``u`` (its whole, for "bucket")."""
        if isinstance(u, tuple):
            if any(self.buckets[s].segments for s in u):
                raise ValueError("the buckets of a group hold one tensor each")
            return [self.buckets[s].size for s in u]
        spec = self.buckets[u]
        return spec.segments if self.ternary_scale != "bucket" and spec.segments \
            else (spec.size,)

    def _block_count(self, n):
        """How many scales ``n`` elements get: ``ternary_scale`` elements a scale, or one."""
        block = self.ternary_scale
        return 1 if isinstance(block, str) or n <= block else -(-n // block)

    def _blocks(self, n):
        """``n`` elements cut into ``ternary_scale`` elements a scale (the last block shorter),
        or whole."""
        if self._block_count(n) == 1:
            return [n]
        block = self.ternary_scale
        return [block] * (n // block) + [n % block] * bool(n % block)

    def end_step(self):
        """The step's every bucket is decoded: count it and move on."""
        self._trim_scratch()
        self._shrink_shared()
        # Groups not sent in this step (DDP rebuilt its buckets) let go of their positions.
        self._groups = {k: g for k, g in self._groups.items() if g.step == self.step}
        self.step += 1
        self.stats["steps"] += 1
        self._scales = {}

    def abandon_step(self):
        """Forget the step in progress (it keeps its number); late results of it still decode
        but keep no residual."""
        self.generation += 1
        self.stats["abandoned_steps"] += 1
        self._scales = {}

    def agree_layout(self, unit, description, local_error=None):
        """Check that every rank maps the front end's ``unit`` (e.g. ``"DDP bucket 3"``) onto
        the same thing: ``description``, a list of hashable items such as bucket names. One
        tiny MAX all-reduce; a difference raises LayoutMismatchError, and ``local_error`` on
        any rank RankInputError, on every rank together. For front ends whose units of work
        can change between steps (DDP rebuilds its buckets), before their payloads are posted.
        """
        fields = dict(zip(("layout0", "layout1", "layout2", "layout3"),
                          digest_ints(list(description))),
                      magic=_MAGIC, step=self.step, input_error=int(local_error is not None))
        mismatched, maxima = agree(self.collectives, fields)
        if maxima["input_error"]:
            raise_together(self.collectives, local_error)
        if mismatched:
            details = gather_details(self.collectives, {"description": list(description)})
            bad = offending_ranks(details, ["description"])
            raise LayoutMismatchError("\n".join(
                [f"ranks disagree on {unit} at step {self.step}; offending ranks: {bad}"]
                + [f"rank {r} on {details[r]['host']}: {unit} is {details[r]['description']}"
                   for r in sorted({0, *bad})]), details=details, offending_ranks=bad)

    def _checked_flats(self, flats):
        token = getattr(flats, "token", None)
        if token is not None and token is self._digests.get("checked"):
            return flats  # the same partition, sizes checked already
        flats = flats if isinstance(flats, list) else list(flats)
        if len(flats) != len(self.buckets):
            raise ValueError(f"{len(flats)} masks for {len(self.buckets)} buckets")
        for spec, flat in zip(self.buckets, flats):
            if flat is not None and flat.size != spec.size:
                raise ValueError(f"mask of {spec.name} has {flat.size} elements, the bucket "
                                 f"has {spec.size}")
        if token is not None:
            self._digests["checked"] = token
        return flats

    # ------------------------------------------------------------------ verification
    def _observe(self, flats):
        """Agreed-upon snapshots of ``flats`` with their (fingerprint, survivors).

        An unchanged mask costs one comparison pass and reuses the previous snapshot's
        fingerprint; the snapshot (a :class:`pacmpi.bitmaps.Bitmap`: 1 bit per coordinate),
        not the caller's array, is what the step packs with.
        """
        last = self._digests.get("observed")
        joined = None
        if isinstance(flats, JoinedMasks):
            if (last is not None and last[3] is not None and last[3][0] is flats.token
                    and last[3][1].matches(flats.whole)):
                return last[1], last[2]  # every mask as at the last read, read as one array
            joined = (flats.token, Bitmap(flats.whole))
        if joined:
            # Compared one by one when not read as before (a mask changed, or a new layout):
            # the runs' bits, another copy of the masks, are not kept for them.
            runs, unchanged = [], {
                b for b, flat in enumerate(flats) if flat is not None and b in self._snapshots
                and self._snapshots[b][0].matches(flat)}
        else:
            runs = list(self._mask_batches(flats))
            unchanged = self._unchanged(runs)
        unmasked = [b for b, flat in enumerate(flats) if flat is None]
        if last is not None and last[0] == unmasked and len(unchanged) + len(unmasked) == len(
                flats):  # every mask as its snapshot, as at the last read: its result holds
            self._digests["observed"] = last[:3] + (joined,)
            if joined:
                joined[1].lend(last[1])
            return last[1], last[2]
        snapshots, observations = [], []
        for b, flat in enumerate(flats):
            previous = self._snapshots.get(b)
            if flat is None:
                self._snapshots.pop(b, None)
                snapshots.append(None)
                observations.append((None, None))
                continue
            if b not in unchanged:
                if flat.dtype != np.bool_:
                    flat = flat != 0
                # (joined masks not unchanged were compared above already)
                if previous is None or joined or not previous[0].matches(flat):
                    snapshot = Bitmap(flat)
                    previous = (snapshot, MaskTracker.observe(snapshot))
                    self._snapshots[b] = previous
            snapshots.append(previous[0])
            observations.append(previous[1])
        # Each run kept with the snapshots its masks now match.
        self._batches = {run: (bits, [self._snapshots[b][0] for b in run]) for run, bits in runs}
        if joined:  # the snapshots hold views of the masks' bits where they can
            joined[1].lend(snapshots)
        self._digests["observed"] = (unmasked, snapshots, observations, joined)
        return snapshots, observations

    def _mask_batches(self, flats):
        """Runs of small masked buckets (under :data:`pacmpi.bitmaps.CHUNK` coordinates
        together; unmasked ones between them skipped) with boolean masks of one module: the
        masks a step compares with one concatenation and one ``packbits`` per run instead of
        one per bucket, so the comparison's cost does not grow with the number of tensors.
        Yields ``(buckets, bits)``."""
        run, size = [], 0
        for b, flat in enumerate(flats + [False]):
            if flat is None:  # an unmasked bucket does not end a run
                continue
            small = flat is not False and flat.dtype == np.bool_ and flat.size < CHUNK
            if run and (not small or size + flat.size > CHUNK
                        or type(flat) is not type(flats[run[0]])):
                if len(run) > 1:
                    xp = array_module(flats[run[0]])
                    yield tuple(run), xp.packbits(xp.concatenate([flats[r] for r in run]))
                run, size = [], 0
            if small:
                run.append(b)
                size += flat.size

    def _unchanged(self, runs):
        """Buckets whose masks are those of their snapshots, found run by run of
        :meth:`_mask_batches`: the runs that read exactly as when they last matched."""
        same = set()
        for run, bits in runs:
            cached = self._batches.get(run)
            if (cached is not None
                    and all(self._snapshots.get(b, (None,))[0] is snapshot
                            for b, snapshot in zip(run, cached[1]))
                    and bool(array_module(bits).array_equal(bits, cached[0]))):
                same.update(run)
        return same

    def _fields(self, observations):
        fields = {
            "magic": _MAGIC, "step": self.step, "buckets": len(self.buckets),
            "quantize": _QUANTIZE_CODES[self.quantize], "average": int(self.average),
            "scales": (0 if self.quantize != "ternary" else
                       TERNARY_SCALES.index(self.ternary_scale) + 1
                       if isinstance(self.ternary_scale, str) else
                       len(TERNARY_SCALES) + self.ternary_scale),
            "word": 0 if self.codec is None else self.codec.word_dtype.num,
            "version": self.tracker.version,
        }
        fields.update(self._layout_fields())
        fields.update(self._mask_fields(observations))
        return fields

    def _layout_fields(self):
        """The element count and the digest of the buckets and the front end's layout: fixed
        for the engine's life, computed once."""
        if "layout" not in self._digests:
            describe = [(str(b.dtype), b.size, tuple(b.segments)) for b in self.buckets]
            self._digests["layout"] = dict(
                zip(("layout0", "layout1", "layout2", "layout3"),
                    digest_ints(describe + self.layout)),
                elements=sum(b.size for b in self.buckets))
        return self._digests["layout"]

    def _mask_fields(self, observations):
        """The survivor count and the observations' digest, kept for the next step's (mostly
        the very same list: :meth:`_observe` returns it again when no mask changed)."""
        cached = self._digests.get("masks")
        if cached is not None and cached[0] is observations:
            return cached[2]
        values = tuple(o for pair in observations for o in pair)
        if cached is None or cached[1] != values:
            fields = dict(zip(("mask0", "mask1", "mask2", "mask3"), digest_ints(values)),
                          survivors=sum(b.size if s is None else s
                                        for b, (_, s) in zip(self.buckets, observations)))
            cached = (observations, values, fields)
        self._digests["masks"] = (observations, cached[1], cached[2])
        return cached[2]

    def _descriptor(self, observations):
        return {
            "step": self.step, "quantize": self.quantize, "average": self.average,
            "ternary_scale": self.ternary_scale,
            "version": self.tracker.version, "layout": repr(self.layout),
            "buckets": [
                {"name": b.name, "dtype": str(b.dtype), "elements": b.size,
                 "fingerprint": None if fp is None else f"{fp:032x}", "survivors": s}
                for b, (fp, s) in zip(self.buckets, observations)
            ],
        }

    def _raise_mismatch(self, error_type, fields, observations):
        details = gather_details(self.collectives, self._descriptor(observations))
        bad = offending_ranks(details, ["buckets", "layout", "version", "quantize",
                                        "ternary_scale", "average", "step"])
        lines = [f"ranks disagree on {', '.join(fields)} at step {self.step}; "
                 f"offending ranks: {bad}"]
        reference = {bk["name"]: bk for bk in details[0]["buckets"]}
        unknown = {"fingerprint": None, "survivors": None}

        def mask_of(bk):
            return bk["fingerprint"], bk["survivors"]

        def on_rank0(bk):
            return mask_of(reference.get(bk["name"], unknown))

        for rank in sorted({0, *bad}):
            d = details[rank]
            sizes = [(bk["dtype"], bk["elements"], bk["survivors"]) for bk in d["buckets"]]
            lines.append(f"rank {rank} on {d['host']}: version {d['version']}, "
                         f"quantize {d['quantize']}, ternary_scale {d['ternary_scale']}, "
                         f"(dtype, elements, survivors) {sizes}")
            if rank == 0:
                continue
            differing = [bk for bk in d["buckets"] if mask_of(bk) != on_rank0(bk)]
            if differing:
                lines.append(
                    f"rank {rank} on {d['host']}: masks differ from rank 0's for "
                    f"{[bk['name'] for bk in differing]}; (fingerprint, survivors) here "
                    f"{[mask_of(bk) for bk in differing]}, on rank 0 "
                    f"{[on_rank0(bk) for bk in differing]}")
        raise error_type("\n".join(lines), details=details, offending_ranks=bad)

    def _resync(self, snapshots, read_masks, write_masks):
        """Adopt rank 0's masks: broadcast each masked bucket's mask (its snapshot's bits),
        hand it to the front end to store, and observe the result."""
        received = []
        for b, snapshot in enumerate(snapshots):
            if snapshot is None:
                received.append(None)
                continue
            wire = snapshot.bits.copy()
            self.collectives.bcast(wire, root=0, name=f"pacmpi.resync.{self.buckets[b].name}")
            self.stats["resync_bytes"] += wire.nbytes
            xp = array_module(wire)
            received.append(xp.unpackbits(wire)[:snapshot.size].view(xp.bool_))
        write_masks(received)
        self._snapshots.clear()
        return self._observe(self._checked_flats(read_masks()))

    # ------------------------------------------------------------------ encoding
    def packed_indices(self, b):
        """Survivor positions of bucket ``b`` while it is packed, else ``None``."""
        return self.tracker.buckets[b].positions()

    def _payload_count(self, u):
        if isinstance(u, tuple):
            return self._group(u).count
        state = self.tracker.buckets[u]
        return state.survivors if state.packed else self.buckets[u].size

    def _buffer(self, xp, key, size, dtype):
        buf = self._buffers.get(key)
        if buf is None or buf.size != size or buf.dtype != dtype or array_module(buf) is not xp:
            buf = xp.empty(size, dtype=dtype)
            self._buffers[key] = buf
        return buf

    def _scratch(self, xp, size, dtype):
        """A payload of ``size`` ``dtype`` values, lent until its decode: buckets encoded one
        after another share one buffer per dtype; only buckets in flight together need more.
        A free buffer of that size serves, else the smallest larger one; else the largest free
        one is replaced. (Free buffers by size: a step asks for the sizes of the last.)"""
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

    @staticmethod
    def _take(free, size):
        buffers = free[size]
        base = buffers.pop()
        if not buffers:
            del free[size]
        return base

    def _give_back(self, base):
        key = (array_module(base).__name__, base.dtype)
        self._free.setdefault(key, {}).setdefault(base.size, []).append(base)

    def _trim_scratch(self):
        """At the end of a step, free the buffers much larger than any payload of theirs in it
        (a mask that pruned more, a dtype no longer sent): the next step allocates to fit."""
        for key, free in self._free.items():
            limit = self._largest.get(key, 0) * 5 // 4
            for size in [n for n in free if n > limit]:
                del free[size]
        self._largest.clear()

    def agree_scales(self, flats):
        """Ternary only: agree on the scales of several buckets in one MAX all-reduce.

        ``flats`` maps bucket index (or group: a tuple of them) -> flat gradient;
        :meth:`encode` of those buckets in this step then needs no collective of its own.
        """
        if self.quantize != "ternary":
            return
        flats = {_unit(u): flat for u, flat in flats.items()}
        order = [b for b in sorted(flats) if self._payload_count(b) and b not in self._scales]
        if not order:
            return
        local = [self._local_scale(b, flats[b]) for b in order]
        agreed = np.concatenate(local)
        self._agree(agreed, name=f"pacmpi.scales.{self.step}")
        self._scales.update(zip(order, np.split(agreed, np.cumsum([s.size for s in local])[:-1])))

    def _agreed_scales(self, b, flat):
        """Bucket ``b``'s ternary scales this step, one per segment: the ones agreed beforehand
        (verification or :meth:`agree_scales`), else agreed now in a MAX all-reduce of their
        own."""
        scales = self._scales.pop(b, None)
        if scales is None:
            scales = self._local_scale(b, flat)
            self._agree(scales, name=f"pacmpi.scale.{self._name(b)}")
        return scales

    def _name(self, u):
        """Bucket or group ``u``'s name in collectives and messages."""
        if not isinstance(u, tuple):
            return self.buckets[u].name
        return f"{self.buckets[u[0]].name}+{len(u) - 1}"

    def _local_scale(self, b, flat):
        """This rank's part of bucket ``b``'s scales, before the MAX over ranks: per segment,
        its max |gradient + residual| over what the bucket sends (masking first on the dense
        path, a no-op for the steady buckets of :meth:`_steady`)."""
        xp = array_module(flat)
        self._apply_mask(b, flat)
        residual = self._residual_for(b, xp, kernels.compute_dtype(flat.dtype))
        return self.segment_table(b).absmax(xp, flat, residual)

    def _agree(self, local, name):
        """MAX of ``local`` (per-bucket maxima) over ranks, in place; non-finite -> inf."""
        finite = np.isfinite(local)
        buf = np.concatenate([np.where(finite, local, 0.0), (~finite).astype(np.float64)])
        started = time.perf_counter()
        self.collectives.allreduce(buf, "max", name=name)
        self.stats["comm_seconds"] += time.perf_counter() - started
        self.stats["bytes_sent"] += buf.nbytes
        count = local.size
        local[...] = np.where(buf[count:] > 0, np.inf, buf[:count])

    def _group_of(self, u):
        return self._group(u if isinstance(u, tuple) else (u,))

    def _apply_mask(self, u, flat):
        """GSE on the dense path: pruned coordinates of the masked buckets of ``u`` (a bucket
        or a group) sent dense become exactly 0 (copyto, not multiply: NaN * 0 is NaN);
        packed buckets never send them. Returns how many buckets that was."""
        group = self._group_of(u)
        for s, lo, hi, _ in group.masked:
            self.tracker.buckets[s].mask.zero_pruned(flat[lo:hi])
        return len(group.masked)

    # A ternary bucket sent dense while its mask is checked keeps the residual of this rank's
    # survivors only: the others' gradient is zeroed, so their residual stays 0 (kept, it
    # made every coordinate's residual 1x the gradient bytes for those steps, the hook's
    # and the reducer's peak). A subclass that quantizes other values (node sums, nonzero
    # where this rank prunes) keeps the residual aligned with its payload.
    _RESIDUAL_OF_SURVIVORS = True

    def _residual_layout(self, group):
        """What group's residual holds: its payload's coordinates, or its survivors (above)."""
        kept = group.kept() if self._RESIDUAL_OF_SURVIVORS else None
        return group.bitmap() if kept is None else kept

    def _residual_for(self, u, xp, compute):
        """The error-feedback residual of ``u`` (a bucket or a group: one array over the
        group, aligned with its payload, or with this rank's survivors while it is sent
        dense with a mask, see :meth:`_residual_layout`)."""
        if not self.error_feedback:
            return None
        group = self._group_of(u)
        layout = self._residual_layout(group)
        entry = self._residuals.get(u)
        if entry is None:
            entry = self._gathered_residual(u if isinstance(u, tuple) else (u,), xp)
        if entry is None or entry.values.dtype != compute:  # zeros, laid out as the payload
            size = group.count if layout is None or layout is group.bitmap() else layout.count
            entry = _Residual(xp.zeros(size, dtype=compute), layout)
            self._residuals[u] = entry
        elif array_module(entry.values) is not xp:  # restored from a checkpoint (host)
            entry.values, entry.spare = xp.asarray(to_host(entry.values)), None
        values = entry.aligned(xp, layout, group.size)
        if layout is group.bitmap():
            for s, lo, hi, at in group.masked:
                # Residuals of coordinates a new mask prunes are dropped with them.
                self.tracker.buckets[s].mask.zero_pruned(values[at:at + hi - lo])
        return values

    def _gathered_residual(self, slots, xp):
        """The residual of bucket or group ``slots`` from its members' (kept per bucket, or by
        the groups they were in before DDP rebuilt its buckets), which it replaces; None if
        none."""
        for key in [k for k in self._residuals if isinstance(k, tuple) and set(k) & set(slots)]:
            for s, values, layout in self._members(key, slots):  # views: joined or copied
                self._residuals[s] = _Residual(values, layout)
            del self._residuals[key]
        if len(slots) == 1:
            entry = self._residuals.get(slots[0])
            if entry is not None and entry.values.base is not None:
                entry.values = entry.values.copy()  # a view would keep its old group's array
            return entry
        found = [s for s in slots if s in self._residuals]
        if not found:
            return None
        if len(found) == len(slots):
            # Members back to back in one array, in this order (the old group's, reversed in
            # place by _members where DDP's rebuild reversed them): a slice of it, not a copy
            # beside it (the DDP hook peaked at 1.9x the gradient bytes while the old array
            # lived on), laid out as its members' were.
            parts = [self._residuals[s] for s in slots]
            joined = _joined([entry.values for entry in parts])
            if joined is not None and array_module(joined) is xp:
                layout = None if all(entry.layout is None for entry in parts) else \
                    Bitmap.joined(xp, [self.buckets[s].size if entry.layout is None else
                                       entry.layout for s, entry in zip(slots, parts)])
                for s in slots:
                    del self._residuals[s]
                entry = self._residuals[slots] = _Residual(joined, layout)
                return entry
        first = self._residuals[found[0]].values
        module, group = array_module(first), self._group(slots)
        full = module.zeros(group.size, dtype=first.dtype)
        for s, lo in zip(slots, group.offsets):
            entry, size = self._residuals.pop(s, None), self.buckets[s].size
            if entry is not None:
                full[lo:lo + size] = entry.full(module, size)
        entry = self._residuals[slots] = _Residual(xp.asarray(full), None)
        return entry

    def _members(self, key, slots=()):
        """``(bucket, its residual, that residual's layout)`` of each member of group ``key``'s
        entry: views of its array, in the array's order. When ``slots`` are a run of ``key``'s
        members in reverse order (DDP's first bucket holds the parameters in the model's order,
        its rebuilt ones in the order backward made them ready, the reverse), the array's
        segments are reversed in place first, so the new groups can take slices of it."""
        entry = self._residuals[key]
        sizes = [self.buckets[s].size for s in key]
        counts, layouts = sizes, [None] * len(key)
        if entry.layout is not None:
            offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            counts = np.diff(entry.layout.counts_before(offsets)).tolist()
            layouts = [entry.layout.section(lo, hi, n)
                       for lo, hi, n in zip(offsets, offsets[1:], counts)]
        if self._reversed(key, slots):
            _reverse_segments(entry.values, counts)
            key, counts, layouts = key[::-1], counts[::-1], layouts[::-1]
        at = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return [(s, entry.values[lo:lo + n], layout)
                for s, lo, n, layout in zip(key, at, counts, layouts)]

    @staticmethod
    def _reversed(key, slots):
        """Whether ``slots`` are a run of group ``key``'s members in reverse order."""
        back = tuple(reversed(slots))
        return len(slots) > 1 and back in (key[i:i + len(slots)]
                                           for i in range(len(key) - len(slots) + 1))

    def _shrink_shared(self):
        """Residuals that are slices of one shared NumPy array (DDP's rebuilt buckets) and are
        shorter than it (compacted by :meth:`_Residual.aligned`) are moved, in the array's
        order, to its front and the array is cut in place; each then a slice of the cut array.
        Forward moves never overwrite a part not yet moved."""
        shared, owners = {}, set()
        for entry in self._residuals.values():
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
                base.resize(at)  # see _Residual.aligned; every slice of it was let go above
            except ValueError:  # still referenced elsewhere: kept whole, its parts at the front
                pass
            for entry, start, size in places:
                entry.values = base[start:start + size]

    def encode(self, b, flat, in_place=False):
        """Payload of bucket ``b`` from its flat gradient (which may be modified in place:
        pruned coordinates are zeroed on the dense path) and the :class:`Encoded` context.

        ``b`` may be a tuple of buckets whose flat arrays lie back to back in ``flat``, in that
        order (a group: a DDP bucket's parameters): their payloads are sent as one, built in one
        call whatever their number; ternary: each member its own scale (:meth:`agree_scales`
        of the group first, or one all-reduce here) and key.
        The payload is ``flat`` itself (dense lossless: reduce it in place), with
        ``in_place=True`` a packed lossless bucket's ``flat[:survivors]`` (its survivors moved
        to the front: no buffer; ``flat`` holds no gradient until :meth:`decode` gets this
        prefix back, in place), or else a buffer the engine owns until :meth:`decode`. Reduce
        it with SUM. ``in_place=True`` is for front ends whose step, once encoded, is decoded
        or given up with its gradient: a packed ternary bucket is quantized from its compacted
        front too, and its error-feedback residual is updated by the encode (no spare).
        """
        started = time.perf_counter()
        b = _unit(b)
        xp = array_module(flat)
        group = self._group_of(b)
        self.stats["dense_fallbacks"] += self._apply_mask(b, flat)
        self.stats["packed_reductions"] += group.packed
        self.stats["dense_reductions"] += len(group.slots) - group.packed
        self.stats["dense_elements_equivalent"] += group.size
        self.stats["dense_bytes_equivalent"] += group.nbytes
        count = group.count
        if self.quantize == "ternary" and count:
            wire, ctx = self._encode_ternary(b, xp, flat, group, in_place)
        elif self.quantize != "fp16" and in_place and group.packed:  # (ternary: nothing sent)
            wire, ctx = self._compacted(b, xp, flat, group)
        elif group.packed or self.quantize == "fp16":
            indices = group.positions()
            wire_dtype = np.dtype(np.float16) if self.quantize == "fp16" else flat.dtype
            wire = kernels.gather(xp, flat, indices, self._scratch(xp, count, wire_dtype))
            ctx = Encoded(b, "copy", indices, self.generation, count=count)
        else:
            wire, ctx = flat, Encoded(b, "dense", None, self.generation, count=count)
        ctx.scratch = self._lent.pop(id(wire), None)
        self.stats["bytes_sent"] += wire.nbytes
        self.stats["pack_seconds"] += time.perf_counter() - started
        return wire, ctx

    def _group(self, slots):
        """The :class:`_Group` of buckets ``slots`` for their current packing and masks
        (checked against them once per verification: only a verification changes them)."""
        group = self._groups.get(slots)
        if group is None or group.epoch != self._epoch:
            states = [self.tracker.buckets[s] for s in slots]
            key = [x for state in states for x in (state.packed, state.mask)]
            if group is None or not all(map(operator.is_, key, group.key)):
                group = self._groups[slots] = _Group(slots, states, self.buckets, key,
                                                     self.step)
            group.epoch = self._epoch
        group.step = self.step
        return group

    def _compacted(self, b, xp, flat, group):
        """Bucket ``b``'s survivors moved to the front of ``flat`` in place (its payload, no
        buffer) and the context that moves them back."""
        bitmap = group.bitmap()
        wire = kernels.compact(xp, flat, bitmap.bits, group.count)
        return wire, Encoded(b, "compact", bitmap, self.generation, count=group.count)

    # In place, a packed ternary payload is quantized from the bucket's own front (no survivor
    # positions); a subclass that quantizes other values (node sums) says no.
    _TERNARY_IN_PLACE = True
    # ... unless its survivor positions take at most this fraction of its gradient bytes
    # (float32 gradients: density <= 0.25): reading the bits costs a pass over every
    # coordinate each for the scales, the compaction and the expansion, where positions read
    # the survivors only (4 Mi float32 values, one thread: 6.1 ms against 1.8 at density 0.2,
    # 7.1 against 4.2 at 0.5), and so few positions cost little memory.
    _TERNARY_POSITIONS_AT_MOST = 0.25

    def _ternary_compacts(self, group):
        """Whether packed ternary ``group``, encoded in place, is quantized from its compacted
        front (else through survivor positions)."""
        return self._TERNARY_IN_PLACE and group.count * index_dtype(group.size).itemsize > \
            self._TERNARY_POSITIONS_AT_MOST * group.nbytes

    def _encode_ternary(self, b, xp, flat, group, in_place):
        """Ternary words of bucket ``b`` and their context. ``in_place`` (the bucket is the
        front end's storage, which holds no gradient until the decode): packed survivors are
        compacted to the front first, and the error-feedback residual is updated right here,
        with no second buffer; otherwise read through survivor positions, with the new
        residual kept aside until the result is decoded (an abandoned step keeps the old)."""
        count = group.count
        scales = self._agreed_scales(b, flat)
        # Fetched even for a step sent unquantized: the residual then still drops what this
        # step's mask prunes, as on every other step.
        residual = self._residual_for(b, xp, kernels.compute_dtype(flat.dtype))
        compact = in_place and group.packed and self._ternary_compacts(group)
        if not np.isfinite(scales).all():
            # NaN/Inf on some rank: send this bucket unquantized, so the non-finite values
            # propagate exactly as on the dense path and the scale is never NaN.
            self.stats["nonfinite_fallbacks"] += 1
            if compact:
                return self._compacted(b, xp, flat, group)
            return self._unquantized(b, xp, flat, group.positions(), count)
        table = self.segment_table(b)
        if compact:
            flat = kernels.compact(xp, flat, group.bitmap().bits, count)
        words, new_residual = self._ternary_words(b, xp, flat, residual, scales, table,
                                                  compact=compact, in_place=in_place)
        return words, Encoded(b, "ternary", group.bitmap() if compact else group.positions(),
                              self.generation, scales=scales, segments=table, count=count,
                              residual=new_residual)

    def _unquantized(self, b, xp, flat, indices, count):
        """Payload and context of a ternary bucket sent as it is (a non-finite scale)."""
        if indices is None:
            return flat, Encoded(b, "dense", None, self.generation, count=count)
        wire = kernels.gather(xp, flat, indices, self._scratch(xp, count, flat.dtype))
        return wire, Encoded(b, "copy", indices, self.generation, count=count)

    def _ternary_words(self, b, xp, flat, residual, scales, table, compact=False,
                       in_place=False):
        """Quantize what bucket ``b`` sends of ``flat`` (``compact``: ``flat`` is already the
        payload's values) plus ``residual`` into its words, segment by segment of ``table``
        with this rank's key; returns the words and the new residual to keep at the decode
        (``None``: not kept, or, ``in_place``, written over ``residual`` already)."""
        new_residual = None
        if residual is not None and in_place:
            new_residual = residual
        elif residual is not None:
            entry = self._residuals[b]
            if entry.spare is None or entry.spare.size != residual.size:
                entry.spare = xp.empty(residual.size, dtype=residual.dtype)
            new_residual = entry.spare
        members = np.array(b, dtype=np.uint64) if isinstance(b, tuple) else b
        key = ternary_key(self.seed, self.step, members, self.collectives.rank)
        if isinstance(b, tuple):  # a member's blocks go on along its key's numbers
            group = self._group_of(b)
            if group.blocks is None or group.blocks[0] is not table:
                blocks = [self._block_count(n) for n in self._tensor_sizes(b)]
                first = np.repeat(table.starts[np.cumsum([0] + blocks[:-1])], blocks)
                group.blocks = (table, blocks, (table.starts[:-1] - first).astype(np.uint64))
            _, blocks, within = group.blocks
            key = uniform_from(np.repeat(key, blocks), within)
        words = self._scratch(xp, table.words, self.codec.word_dtype)
        table.encode(xp, flat, residual, new_residual, scales, key, self.codec, words, compact)
        return words, None if in_place else new_residual

    def decode(self, wire, ctx, flat):
        """Write the reduced ``wire`` (the payload :meth:`encode` returned, summed over ranks)
        into bucket ``ctx.bucket``'s flat array ``flat``: averaged if configured, pruned
        coordinates exactly 0. Keeps the error-feedback residual of a current step."""
        started = time.perf_counter()
        xp = array_module(flat)
        divisor = self.collectives.size if self.average and self.collectives.size > 1 else None
        if ctx.kind == "ternary":
            compacted = isinstance(ctx.indices, Bitmap)
            ctx.segments.decode(xp, wire, self.codec, self.codec.world_size, ctx.scales,
                                divisor, flat, compact=compacted)
            if compacted:
                kernels.expand(xp, flat, ctx.indices.bits, ctx.count)
        elif ctx.kind == "dense" and divisor is None:
            pass
        elif ctx.kind == "compact":
            kernels.expand(xp, flat, ctx.indices.bits, ctx.count, divisor)
        else:
            kernels.scatter(xp, wire, ctx.indices, flat, divisor)
        self.settle(ctx)
        self.stats["unpack_seconds"] += time.perf_counter() - started

    def settle(self, ctx):
        """What :meth:`decode` does once the result is written: keep the step's new
        error-feedback residual (a current step's) and take the payload's buffer back. For a
        front end that decodes the reduced payload itself (a reduce-scattered block of it)."""
        if ctx.kind == "ternary" and ctx.residual is not None and \
                ctx.generation == self.generation:
            entry = self._residuals[ctx.bucket]
            entry.values, entry.spare = ctx.residual, entry.values
            ctx.residual = None  # kept once
        if ctx.scratch is not None:
            self._give_back(ctx.scratch)
            ctx.scratch = None  # a context decoded twice gives its buffer back once

    # ------------------------------------------------------------------ state
    def memory_report(self):
        """Bytes of the arrays the engine keeps between steps, by :data:`MEMORY_COMPONENTS`:
        survivor indices, mask snapshots, payload buffers (packed survivors, float16 copies),
        ternary words and error-feedback residuals (with the spares the next encode writes).
        Read from the live arrays, each counted once; a front end adds its own."""
        report, seen = dict.fromkeys(MEMORY_COMPONENTS, 0), set()

        def add(component, array):
            if isinstance(array, Bitmap):  # its bits may be a view of the joined masks'
                array = array.bits
                while array.base is not None:
                    array = array.base
            if array is not None and id(array) not in seen:
                seen.add(id(array))
                report[component] += int(array.nbytes)

        for state in self.tracker.buckets:
            add("indices", state.indices)
            add("snapshots", state.mask)
        for group in self._groups.values():
            add("indices", group._positions)
            add("indices", group._bitmap)
            add("indices", group._kept)
        for snapshot, _ in self._snapshots.values():
            add("snapshots", snapshot)
        for bits, _ in self._batches.values():
            add("snapshots", bits)
        observed = self._digests.get("observed")
        if observed is not None and observed[3] is not None:
            add("snapshots", observed[3][1])  # the joined masks' bits
        for (kind, _), buffer in self._buffers.items():
            add("words" if kind == "words" else "payloads", buffer)
        for (_, dtype), free in self._free.items():
            for buffer in (buf for buffers in free.values() for buf in buffers):
                add("payloads" if dtype.kind == "f" else "words", buffer)
        for entry in self._residuals.values():
            add("residuals", entry.values)
            add("residuals", entry.spare)
        return report

    def state_dict(self):
        """Step, tracker, error-feedback residuals (full-length host arrays), counters."""
        return {
            "step": self.step,
            "seed": self.seed,
            "quantize": self.quantize,
            "world_size": self.collectives.size,
            "tracker": self.tracker.state_dict(),
            "residuals": dict(sorted(self._full_residuals(), key=lambda item: item[0])),
            "stats": dict(self.stats),
        }

    def _full_residuals(self):
        """``(bucket, full-length host residual)`` of every bucket that has one."""
        for u, entry in self._residuals.items():
            if isinstance(u, tuple):
                yield from ((s, to_host(_Residual(values, layout).full(
                    array_module(values), self.buckets[s].size)).copy())
                    for s, values, layout in self._members(u))
            else:
                yield u, to_host(entry.full(array_module(entry.values),
                                            self.buckets[u].size)).copy()

    def loader(self, state, flats):
        """Check :meth:`state_dict` output against this engine and the current flat masks
        (which must carry the checkpoint's fingerprints); returns a function that applies it.

        The checks raise and change nothing, so a front end runs them on every rank together
        (:func:`pacmpi.verify.run_together`) and applies only when every rank passed.
        """
        if state["quantize"] != self.quantize:
            raise ValueError(f"checkpoint has quantize={state['quantize']!r}, "
                             f"this one has {self.quantize!r}")
        saved = state["tracker"]
        snapshots, observations = self._observe(self._checked_flats(flats))
        if saved["last_commit_step"] is not None:
            changed = [spec.name for spec, (fp, _), entry in
                       zip(self.buckets, observations, saved["buckets"])
                       if entry["fingerprint"] is not None and fp != entry["fingerprint"]]
            if changed:
                raise ValueError(f"masks of {changed} differ from those verified at step "
                                 f"{saved['last_commit_step']} of the checkpoint; restore the "
                                 "checkpoint's masks before loading it")
        tracker = MaskTracker(len(self.buckets), stable_steps=self.tracker.stable_steps)
        tracker.load_state_dict(saved, snapshots)
        same_world = state["world_size"] == self.collectives.size

        def apply():
            if not same_world and state["residuals"]:
                warnings.warn(f"checkpoint was written on {state['world_size']} ranks, this run "
                              f"has {self.collectives.size}: error-feedback residuals are "
                              "per-rank and start from zero at another world size",
                              RuntimeWarning, stacklevel=4)
            self.tracker, self._changes = tracker, None
            self._epoch += 1
            self._residuals = ({int(b): _Residual(np.asarray(r).copy(), None)  # its own
                                for b, r in state["residuals"].items()} if same_world else {})
            self.step = state["step"]
            self.stats = dict(dict.fromkeys(COUNTERS, 0), **state["stats"])
            self._scales = {}
        return apply
