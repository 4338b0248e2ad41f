"""StepEngine: the per-step PacTrain logic that every front end shares.

A front end (the :class:`pacmpi.PacTrainReducer` over gradient lists, Horovod's compressor over
single tensors, a DDP communication hook over DDP buckets) maps its unit of work onto numbered
*buckets*: flat arrays of a fixed dtype and size. Buckets whose arrays lie back to back (a DDP
bucket's parameters) can be sent as one *group* (:mod:`pacmpi.groups`): each keeps its own
mask, scale, key and residual, and the group's payload is theirs back to back, built in a few
calls whatever their number. One step, in phases (the code marks them):

1. **Verify** (:meth:`StepEngine.begin_step`, every ``verify_every`` steps): read the masks,
   snapshot and digest them (:mod:`pacmpi.maskcheck`), compare them and the options in one
   tiny MAX all-reduce; errors are raised on every rank together, ``on_mismatch="resync"``
   adopts rank 0's masks. The tracker (:class:`pacmpi.tracker.MaskTracker`) then decides which
   buckets are packed.
2. **Agree scales** (ternary only): the MAX over ranks of each segment's largest |value|,
   inside phase 1's all-reduce where the gradients are at hand, else in one all-reduce for
   several buckets (:meth:`StepEngine.agree_scales`), else in the encode's own.
3. **Encode** (:meth:`StepEngine.encode`): masks applied on the dense path (GSE), then the
   payload (:mod:`pacmpi.payloads`): the bucket itself, its survivors compacted to its front,
   a gathered copy (packed positions, float16), or ternary words with error-feedback
   residuals (:mod:`pacmpi.residuals`) and the counter-based RNG. Buffers come from one pool
   (:mod:`pacmpi.scratch`).
4. **Reduce**: the front end runs the payload's SUM all-reduce itself (MPI ``Iallreduce``,
   Horovod's background thread, a DDP future).
5. **Decode** (:meth:`StepEngine.decode`): the payload's kind writes the result back
   (averaged when configured, pruned coordinates exactly 0); :meth:`StepEngine.settle` keeps
   the new residual and takes the buffer back.
6. **End** (:meth:`StepEngine.end_step`): trim the pool, cut shared residuals, drop the groups
   not sent, count the step; or :meth:`StepEngine.abandon_step` forgets it.

What a rank quantizes is a strategy (:class:`OwnGradient`; the hierarchical engine's
:class:`pacmpi.hierarchy.NodeSum` packs its node's sum instead).
"""
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import kernels
from .arrays import array_module
from .bitmaps import Bitmap
from .errors import LayoutMismatchError, MaskMismatchError
from .groups import GroupCache, unit
from .maskcheck import MASK_FIELDS, STRUCTURE_FIELDS, JoinedMasks, MaskCheck, agree_layout
from .options import (
    MISMATCH_POLICIES,
    QUANTIZE_MODES,
    TERNARY_SCALES,
    EngineOptions,
    check_options,
    knob,
)
from .packing import OwnGradient
from .payloads import Compacted, Encoded, Gathered, InPlace, TernaryWords
from .quantizers import TernaryQuantizer
from .residuals import ResidualStore
from .scratch import BufferPool
from .segments import scale_sizes
from .ternary import TernaryCodec
from .tracker import MaskTracker
from .verify import agree, raise_together

__all__ = ["StepEngine", "BucketSpec", "Encoded", "JoinedMasks", "OwnGradient",
           "QUANTIZE_MODES", "MISMATCH_POLICIES", "TERNARY_SCALES", "MEMORY_COMPONENTS",
           "EngineOptions", "check_options"]

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
    options, **knobs:
        An :class:`pacmpi.options.EngineOptions` and knobs replacing its values (quantize,
        average, verify_every, on_mismatch, stable_steps, error_feedback, seed, word_dtype,
        ternary_scale, as documented on :class:`pacmpi.PacTrainReducer`). ``word_dtype``
        ``"auto"`` picks uint64 where ``collectives.word_dtypes`` offers it.
    packing:
        What a rank packs: :class:`OwnGradient` (default) or another strategy of its shape.
    """

    def __init__(self, collectives, buckets, *, layout=(), options=None, packing=None,
                 **knobs):
        self.options = options = EngineOptions.build(options, knobs, who="StepEngine")
        self.collectives = collectives
        self.buckets = tuple(buckets)
        for spec in self.buckets:
            if spec.segments and sum(spec.segments) != spec.size:
                raise ValueError(f"segments of {spec.name} add up to {sum(spec.segments)} "
                                 f"elements, the bucket has {spec.size}")
        self.layout = list(layout)
        self.packing = OwnGradient() if packing is None else packing
        self.tracker = MaskTracker(len(self.buckets), stable_steps=options.stable_steps)
        word_dtype = options.word_dtype
        if word_dtype == "auto":
            word_dtype = "uint64" if "uint64" in getattr(collectives, "word_dtypes", ()) \
                else "int64"
        self.codec = (TernaryCodec(self.packing.ranks(collectives), word_dtype)
                      if options.quantize == "ternary" else None)
        self.word_dtype = word_dtype
        self.step = 0
        self.generation = 0  # counts abandoned steps: a late result of one keeps no residual
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.ternary = TernaryQuantizer()
        self.check = MaskCheck(self.buckets, self.layout)
        self.residuals = ResidualStore(spec.size for spec in self.buckets)
        self.groups, self.pool = GroupCache(), BufferPool()

    quantize, average, verify_every = knob("quantize"), knob("average"), knob("verify_every")
    on_mismatch, error_feedback = knob("on_mismatch"), knob("error_feedback")
    seed, ternary_scale = knob("seed"), knob("ternary_scale")

    def __getstate__(self):
        return dict(self.__dict__, collectives=None)

    # ------------------------------------------------------------------ 1. verify
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
        fields = dict.fromkeys(STRUCTURE_FIELDS + MASK_FIELDS, 0)
        flats = observations = None
        if local_error is None:
            try:
                flats = self.check.checked(read_masks())
            except (TypeError, ValueError) as exc:
                local_error = exc
        fields["input_error"] = 0 if local_error is None else 1
        if local_error is None:
            flats, observations = self.check.observe(flats)
            fields.update(self.check.fields(
                observations, self.step, self.options,
                0 if self.codec is None else self.codec.word_dtype.num, self.tracker.version))
        # 2. (fused) ternary scales of the gradients at hand ride in the same all-reduce.
        fused = [] if scale_flats is None or self.quantize != "ternary" else \
            self.ternary.steady(self, range(len(self.buckets)) if scale_units is None
                                else map(unit, scale_units))
        scale_bits = self.ternary.scale_bits(self, fused,
                                             scale_flats if local_error is None else None)
        mismatched, maxima = agree(self.collectives, fields, scale_bits)
        self.stats["verifications"] += 1
        if "input_error" in mismatched or fields["input_error"]:
            raise_together(self.collectives, local_error)
        structure = [f for f in mismatched if f in STRUCTURE_FIELDS]
        masks_differ = [f for f in mismatched if f in MASK_FIELDS]
        if structure:
            self._raise_mismatch(LayoutMismatchError, structure, observations)
        if masks_differ and (self.on_mismatch == "raise" or write_masks is None):
            self._raise_mismatch(MaskMismatchError, masks_differ, observations)
        if masks_differ:
            write_masks(self.check.broadcast_rank0(self.collectives, flats, self.stats))
            self.check.forget_snapshots()
            flats, observations = self.check.observe(self.check.checked(read_masks()))
            self.tracker.reset(version=maxima["version"])
            self.stats["resyncs"] += 1
        self.tracker.commit(self.step, observations, flats)
        if not masks_differ:
            self.tracker.pack_ready()
        self.groups.seen(self.tracker)
        if not masks_differ:
            self.ternary.keep(self, fused, scale_bits)
        self.stats["verify_seconds"] += time.perf_counter() - started

    def _raise_mismatch(self, error_type, fields, observations):
        self.check.raise_mismatch(self.collectives, error_type, fields, observations,
                                  self.step, self.options, self.tracker.version)

    def agree_layout(self, unit, description, local_error=None):
        """Check that every rank maps the front end's ``unit`` (e.g. ``"DDP bucket 3"``) onto
        the same thing: ``description``, a list of hashable items such as bucket names. One
        tiny MAX all-reduce; a difference raises LayoutMismatchError, and ``local_error`` on
        any rank RankInputError, on every rank together. For front ends whose units of work
        can change between steps (DDP rebuilds its buckets), before their payloads are posted.
        """
        agree_layout(self.collectives, unit, description, self.step, local_error)

    # ------------------------------------------------------------------ 2. agree scales
    def agree_scales(self, flats):
        """Ternary only: agree on the scales of several buckets in one MAX all-reduce.

        ``flats`` maps bucket index (or group: a tuple of them) -> flat gradient;
        :meth:`encode` of those buckets in this step then needs no collective of its own.
        """
        if self.quantize == "ternary":
            self.ternary.agree(self, flats)

    def segment_table(self, u):
        """The :class:`pacmpi.segments.SegmentTable` of bucket or group ``u`` (see
        :meth:`pacmpi.quantizers.TernaryQuantizer.segment_table`)."""
        return self.ternary.segment_table(self, u)

    def segment_sizes(self, u):
        """The element counts of bucket or group ``u``'s segments: one scale each."""
        return scale_sizes(self.buckets, u, self.ternary_scale)

    # ------------------------------------------------------------------ 3. encode
    def name(self, u):
        """Bucket or group ``u``'s name in collectives and messages."""
        if not isinstance(u, tuple):
            return self.buckets[u].name
        return f"{self.buckets[u[0]].name}+{len(u) - 1}"

    def group(self, u):
        """The :class:`pacmpi.groups.Group` of bucket or group ``u`` for the current packing
        and masks."""
        return self.groups.get(u if isinstance(u, tuple) else (u,), self.tracker, self.buckets,
                               self.step)

    def packed_indices(self, b):
        """Survivor positions of bucket ``b`` while it is packed, else ``None``."""
        return self.tracker.buckets[b].positions()

    def apply_mask(self, u, flat):
        """GSE on the dense path: pruned coordinates of the masked buckets of ``u`` (a bucket
        or a group) sent dense become exactly 0; packed buckets never send them. Returns how
        many buckets that was."""
        group = self.group(u)
        group.zero_pruned(flat)
        return len(group.masked)

    def residual_layout(self, group):
        """What group's residual holds: its payload's coordinates, or its survivors (see
        :class:`OwnGradient`)."""
        kept = group.kept() if self.packing.residual_of_survivors else None
        return group.bitmap() if kept is None else kept

    def residual(self, u, xp, compute):
        """The error-feedback residual of ``u`` (a bucket or a group: one array over the
        group, aligned with its payload, or with this rank's survivors while it is sent
        dense with a mask); ``None`` without error feedback."""
        if not self.error_feedback or not self.packing.keeps_residual(self.collectives):
            return None
        group = self.group(u)
        return self.residuals.values_for(u, group, self.residual_layout(group), xp, compute)

    def reverse_residuals(self, u):
        """For a front end whose next groups hold group ``u``'s members in reverse order
        (DDP's rebuilt buckets): reverse ``u``'s residual in place, member by member, so they
        take slices of it instead of copies (:meth:`pacmpi.residuals.ResidualStore.reverse`).
        """
        self.residuals.reverse(u)

    def encode(self, b, flat, in_place=False):
        """Payload of bucket ``b`` from its flat gradient (which may be modified in place:
        pruned coordinates are zeroed on the dense path) and its context, one of
        :mod:`pacmpi.payloads`.

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
        b = unit(b)
        xp = array_module(flat)
        group = self.group(b)
        self.stats["dense_fallbacks"] += self.apply_mask(b, flat)
        self.stats["packed_reductions"] += group.packed
        self.stats["dense_reductions"] += len(group.slots) - group.packed
        self.stats["dense_elements_equivalent"] += group.size
        self.stats["dense_bytes_equivalent"] += group.nbytes
        if self.quantize == "ternary" and group.count:
            wire, ctx = self.ternary.encode(self, b, xp, flat, group, in_place)
        elif self.quantize != "fp16" and in_place and group.packed:  # (ternary: nothing sent)
            wire, ctx = self.compacted(b, flat)
        elif group.packed or self.quantize == "fp16":
            wire, ctx = self.gathered(b, flat, np.float16 if self.quantize == "fp16" else None)
        else:
            wire, ctx = flat, InPlace(b, self.generation, group.count)
        ctx.scratch = self.pool.take_back(wire)
        self.stats["bytes_sent"] += wire.nbytes
        self.stats["pack_seconds"] += time.perf_counter() - started
        return wire, ctx

    def gathered(self, u, flat, dtype=None):
        """``u``'s survivors (all of it while dense) copied out of ``flat`` into a pool buffer
        of ``dtype`` (default: ``flat``'s), and its context; ``flat`` itself when every
        coordinate is sent in its own dtype."""
        group, xp = self.group(u), array_module(flat)
        positions = group.positions()
        if positions is None and dtype is None:
            return flat, InPlace(u, self.generation, group.count)
        wire = self.pool.lend(xp, group.count, flat.dtype if dtype is None else dtype)
        wire = kernels.gather(xp, flat, positions, wire)
        return wire, Gathered(u, self.generation, group.count, positions)

    def compacted(self, u, flat):
        """``u``'s survivors moved to the front of ``flat`` in place (its payload, no buffer)
        and the context that moves them back."""
        group = self.group(u)
        bitmap = group.bitmap()
        wire = kernels.compact(array_module(flat), flat, bitmap.bits, group.count)
        return wire, Compacted(u, self.generation, group.count, bitmap)

    # ------------------------------------------------------------------ 5. decode
    def decode(self, wire, ctx, flat):
        """Write the reduced ``wire`` (the payload :meth:`encode` returned, summed over ranks)
        into bucket ``ctx.bucket``'s flat array ``flat``: averaged if configured, pruned
        coordinates exactly 0. Keeps the error-feedback residual of a current step."""
        started = time.perf_counter()
        divisor = self.collectives.size if self.average and self.collectives.size > 1 else None
        ctx.unpack(array_module(flat), wire, flat, divisor, self.codec)
        self.settle(ctx)
        self.stats["unpack_seconds"] += time.perf_counter() - started

    def settle(self, ctx):
        """What :meth:`decode` does once the result is written: keep the step's new
        error-feedback residual (a current step's) and take the payload's buffer back. For a
        front end that decodes the reduced payload itself (a reduce-scattered block of it)."""
        if isinstance(ctx, TernaryWords) and ctx.residual is not None and \
                ctx.generation == self.generation:
            self.residuals.keep(ctx.bucket, ctx.residual)
            ctx.residual = None  # kept once
        if ctx.scratch is not None:
            self.pool.give_back(ctx.scratch)
            ctx.scratch = None  # a context decoded twice gives its buffer back once

    # ------------------------------------------------------------------ 6. end
    def end_step(self):
        """The step's every bucket is decoded: count it and move on."""
        self.pool.trim()
        self.residuals.shrink_shared()
        self.groups.keep_sent(self.step)
        self.step += 1
        self.stats["steps"] += 1
        self.ternary.forget()

    def abandon_step(self):
        """Forget the step in progress (it keeps its number); late results of it still decode
        but keep no residual."""
        self.generation += 1
        self.stats["abandoned_steps"] += 1
        self.ternary.forget()

    # ------------------------------------------------------------------ state
    def memory_report(self):
        """Bytes of the arrays the engine keeps between steps, by :data:`MEMORY_COMPONENTS`:
        survivor indices, mask snapshots, payload buffers (packed survivors, float16 copies,
        what the pool keeps for others), ternary words and error-feedback residuals (with the
        spares the next encode writes). Read from the live arrays, each counted once; a front
        end adds its own."""
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
        for group in self.groups:
            for array in group.arrays():
                add("indices", array)
        for array in self.check.arrays():
            add("snapshots", array)
        for buffer in self.pool.arrays():
            add("payloads" if buffer.dtype.kind == "f" else "words", buffer)
        for array in self.residuals.arrays():
            add("residuals", array)
        return report

    def state_dict(self):
        """Step, tracker, error-feedback residuals (full-length host arrays), counters."""
        return {
            "step": self.step,
            "seed": self.seed,
            "quantize": self.quantize,
            "world_size": self.collectives.size,
            "tracker": self.tracker.state_dict(),
            "residuals": dict(sorted(self.residuals.full(), key=lambda item: item[0])),
            "stats": dict(self.stats),
        }

    def loader(self, state, flats):
        """Check :meth:`state_dict` output against this engine and the current flat masks
        (which must carry the checkpoint's fingerprints); returns a function that applies it.

        The checks raise and change nothing, so a front end runs them on every rank together
        (:func:`pacmpi.verify.run_together`) and applies only when every rank passed.
        """
        if state["quantize"] != self.quantize:
            raise ValueError(f"checkpoint has quantize={state['quantize']!r}, "
                             f"this one has {self.quantize!r}")
        tracker = self.check.restored_tracker(state["tracker"], flats, self.tracker.stable_steps)
        same_world = state["world_size"] == self.collectives.size

        def apply():
            if not same_world and state["residuals"]:
                warnings.warn(f"checkpoint was written on {state['world_size']} ranks, this run "
                              f"has {self.collectives.size}: error-feedback residuals are "
                              "per-rank and start from zero at another world size",
                              RuntimeWarning, stacklevel=4)
            self.tracker = tracker
            self.groups.invalidate()
            self.residuals.load(state["residuals"] if same_world else {})
            self.step = state["step"]
            self.stats = dict(dict.fromkeys(COUNTERS, 0), **state["stats"])
            self.ternary.forget()
        return apply
