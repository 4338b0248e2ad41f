"""PacTrainReducer: mask-aware packed all-reduce of gradient lists over MPI (or any
:class:`pacmpi.Collectives`), with mask tracking, cross-rank verification and optional fp16 or
summable ternary quantization. The per-step logic is :class:`pacmpi.engine.StepEngine`'s; this
front end maps gradient lists onto fusion buckets and runs their all-reduces."""
import time

import numpy as np

from .arrays import array_module, check_float_dtype, is_device_array, to_host
from .buckets import DEFAULT_BUCKET_BYTES, BucketLayout
from .collectives import default_collectives
from .engine import BucketSpec, StepEngine
from .faults import ensure_abort_on_error
from .hierarchy import HierarchicalCollectives, HierarchicalEngine
from .options import MISMATCH_POLICIES, QUANTIZE_MODES, EngineOptions, knob
from .verify import raise_together, run_together

__all__ = ["PacTrainReducer", "QUANTIZE_MODES", "MISMATCH_POLICIES"]


def _module_of(array, what):
    """``array_module(array)``, with ``what`` (e.g. "mask 3") named in the error."""
    try:
        return array_module(array)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None


class PacTrainReducer:
    """Sums (or averages) gradient lists over ranks, sending only the unpruned coordinates.

    Parameters
    ----------
    masks:
        One entry per gradient: a boolean (or 0/1) array of the gradient's shape, or ``None``
        for an unpruned gradient. The arrays are read again at every verification, so a
        pruning schedule may change them in place; :meth:`set_masks` replaces them.
    comm:
        mpi4py communicator (default: a duplicate of ``COMM_WORLD``). Ignored if
        ``collectives`` is given.
    collectives:
        A :class:`pacmpi.Collectives` transport (e.g. Horovod's), instead of ``comm``.
    options:
        An :class:`pacmpi.options.EngineOptions` holding the knobs below (``quantize`` to
        ``ternary_scale``); those given as keywords replace its values.
    quantize:
        ``None`` (lossless), ``"fp16"`` (values travel as float16) or ``"ternary"``
        (unbiased stochastic ternary codes packed into summable integer words).
    average:
        Divide the sum by the number of ranks.
    bucket_bytes:
        Fusion bucket size; bigger buckets amortize latency, smaller ones overlap better.
    verify_every:
        Verify mask consistency across ranks every this many steps (1 = every step). Masks
        are only re-read on verification steps: between them the last agreed packing is used,
        so coordinates a mask newly unprunes are not sent until the next verification.
    on_mismatch:
        ``"raise"``: :class:`MaskMismatchError` on every rank. ``"resync"``: every rank adopts
        rank 0's masks (written into the mask arrays), reduces dense that step, and the event
        is counted in ``stats["resyncs"]`` (the mask broadcast's bytes in
        ``stats["resync_bytes"]``).
    stable_steps:
        Steps a changed mask must stay unchanged before its bucket is packed again.
    error_feedback:
        Ternary only: keep the quantization error per bucket and add it to the next step. Off
        by default: stochastic rounding is unbiased, so the error is zero-mean noise, and
        feeding it back makes it a random walk (measured 20x the averaged gradient's error
        without it on the digits CNN; the results page has the runs).
    ternary_scale:
        Ternary only: ``"tensor"`` (each gradient array of a bucket is quantized with its own
        scale, the MAX over ranks of its largest |value|), ``"bucket"`` (one scale for the
        whole bucket: arrays with small gradients next to large ones are mostly sent as 0), or
        a positive int ``n``: a scale per ``n`` consecutive elements of each array (its last
        block shorter), which lowers the error further where magnitudes vary inside an array;
        each scale costs 8 bytes in the verification all-reduce and up to a word of padding,
        and on CuPy arrays a kernel launch per block (the Numba route does small blocks in
        one call).
    seed:
        Seed of the counter-based generator behind stochastic rounding.
    shapes, dtypes:
        The gradients' shapes and dtypes, to build buckets before the first step (needed by
        :meth:`mark_ready` before the first full gradient list is seen).
    cuda_aware:
        Passed to the MPI transport.
    word_dtype:
        Ternary word type: ``"auto"`` (uint64 where the transport sums it, as MPI does; else
        int64), ``"uint64"``, ``"int64"`` or ``"int32"``.
    abort_on_error:
        On more than one rank, an unhandled exception ends the whole MPI job instead of
        leaving the other ranks blocked (see :func:`pacmpi.faults.ensure_abort_on_error`);
        ``False`` (or ``PACMPI_ABORT_ON_ERROR=0``) leaves ``sys.excepthook`` alone.
    hierarchical:
        Reduce in two levels (:mod:`pacmpi.hierarchy`): sum over each node, all-reduce
        across one leader per node, broadcast within the node. Ternary codes are then the
        leaders' quantized node sums, in base-(2K+1) digits for K nodes. The same on every
        rank. A :class:`pacmpi.hierarchy.HierarchicalCollectives` given as ``collectives``
        does the same.
    node_comm:
        With ``hierarchical=True``: this rank's node, a sub-communicator of ``comm`` (default:
        ``comm.Split_type(COMM_TYPE_SHARED)`` split further by host name and network
        namespace).
    """

    def __init__(self, masks, *, comm=None, collectives=None, options=None,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, shapes=None, dtypes=None,
                 cuda_aware="auto", abort_on_error=None, hierarchical=False, node_comm=None,
                 **knobs):
        EngineOptions.check_names(knobs, who="PacTrainReducer")  # as a signature would
        if collectives is not None and hierarchical:
            raise ValueError("pass hierarchical=True or collectives=, not both (a "
                             "HierarchicalCollectives as collectives= reduces hierarchically)")
        if node_comm is not None and not hierarchical:
            raise ValueError("node_comm= needs hierarchical=True")
        if hierarchical:
            collectives = HierarchicalCollectives(comm=comm, node_comm=node_comm,
                                                  cuda_aware=cuda_aware)
        self._collectives = collectives = (collectives if collectives is not None else
                                           default_collectives(comm, cuda_aware=cuda_aware))
        self._engine_type = (HierarchicalEngine if isinstance(collectives, HierarchicalCollectives)
                             else StepEngine)
        ensure_abort_on_error(abort_on_error, size=collectives.size)
        self.bucket_bytes = bucket_bytes
        self._layout = None
        error = None
        try:
            self.options = EngineOptions.build(options, knobs, who="PacTrainReducer")
            self._engine = self._engine_type(collectives, (), options=self.options)
            self._masks = self._checked_masks(masks)
            if shapes is not None or dtypes is not None:
                self._build_layout(shapes, dtypes)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(collectives, error)
        self._flat_buffers = {}
        self.reset_step()

    # ------------------------------------------------------------------ configuration
    @property
    def collectives(self):
        if self._collectives is None:  # after unpickling
            self._collectives = self._engine.collectives = (
                HierarchicalCollectives() if self._engine_type is HierarchicalEngine
                else default_collectives())
        return self._collectives

    @property
    def engine(self):
        """The :class:`pacmpi.engine.StepEngine` doing the per-step work."""
        self._engine.collectives = self.collectives
        return self._engine

    @property
    def layout(self):
        """The :class:`BucketLayout` (``None`` until shapes and dtypes are known)."""
        return self._layout

    @property
    def tracker(self):
        return self._engine.tracker if self._layout is not None else None

    @property
    def step(self):
        return self._engine.step

    @property
    def stats(self):
        """Counters: steps, verifications, bytes_sent, packed/dense reductions, dense
        fallbacks, resyncs and their broadcast bytes, nonfinite fallbacks,
        verify/pack/comm/unpack seconds."""
        return self._engine.stats

    quantize, average, verify_every = knob("quantize"), knob("average"), knob("verify_every")
    on_mismatch, error_feedback = knob("on_mismatch"), knob("error_feedback")
    seed, ternary_scale, stable_steps = knob("seed"), knob("ternary_scale"), knob("stable_steps")

    @property
    def word_dtype(self):
        """The ternary word type in use (``"auto"`` resolved for the transport)."""
        return self._engine.word_dtype

    def set_masks(self, masks):
        """Replace the mask arrays (same count and shapes); a collective call."""
        self._masks = run_together(self.collectives, self._masks_for_layout, masks)

    def _masks_for_layout(self, masks):
        checked = self._checked_masks(masks)
        if self._layout is not None:
            self.check_shapes(checked, "mask")
        return checked

    def _checked_masks(self, masks):
        masks = list(masks)
        for i, mask in enumerate(masks):
            if mask is None:
                continue
            xp = _module_of(mask, f"mask {i}")
            if mask.dtype != np.bool_:
                if mask.dtype.kind not in "biuf":
                    raise TypeError(f"mask {i} has dtype {mask.dtype}; use bool or 0/1 values")
                bad = mask[(mask != 0) & (mask != 1)]
                if bad.size:
                    raise ValueError(f"mask {i} must be boolean or 0/1, found value "
                                     f"{to_host(bad)[0].item()!r}")
            if xp is not array_module(next(m for m in masks if m is not None)):
                raise TypeError(f"mask {i} is on another device than mask 0")
        return masks

    def check_shapes(self, arrays, what):
        """ValueError unless ``arrays`` are one per gradient, of its shape (``None`` passes);
        ``what`` names them in the message."""
        if len(arrays) != len(self._layout.shapes):
            raise ValueError(f"expected {len(self._layout.shapes)} {what}s, got {len(arrays)}")
        for i, (array, shape) in enumerate(zip(arrays, self._layout.shapes)):
            if array is not None and tuple(array.shape) != shape:
                raise ValueError(f"{what} {i} has shape {tuple(array.shape)}, expected {shape}")

    def _build_layout(self, shapes, dtypes):
        if shapes is None or dtypes is None:
            raise ValueError("shapes and dtypes must be given together")
        if len(shapes) != len(self._masks):
            raise ValueError(f"{len(self._masks)} masks but {len(shapes)} gradients")
        for i, (mask, shape) in enumerate(zip(self._masks, shapes)):
            if mask is not None and tuple(mask.shape) != tuple(shape):
                raise ValueError(
                    f"mask {i} has shape {tuple(mask.shape)} but its gradient has shape "
                    f"{tuple(shape)}")
        layout = BucketLayout(shapes, dtypes, self.bucket_bytes)
        specs = [BucketSpec(f"bucket {b.index}", b.dtype, b.size,
                            tuple(m.size for m in b.members)) for b in layout.buckets]
        self._engine = self._engine_type(self._engine.collectives, specs,
                                         layout=layout.describe(), options=self.options)
        self._layout = layout

    def check_grads(self, grads):
        """TypeError or ValueError unless ``grads`` fit this reducer (count, shapes, dtypes,
        one device); the first list seen builds the bucket layout."""
        if self._layout is None:
            for i, g in enumerate(grads):
                if g is None or not hasattr(g, "dtype"):
                    raise TypeError(f"gradient {i} is {type(g).__name__}, expected an array")
                check_float_dtype(g.dtype, f"gradient {i}")
            self._build_layout([g.shape for g in grads], [g.dtype for g in grads])
        self.check_shapes(grads, "gradient")
        device = None
        for i, (g, dtype) in enumerate(zip(grads, self._layout.dtypes)):
            if g is None:
                raise ValueError(f"gradient {i} is None; pass zeros for a parameter without "
                                 "a gradient so every rank reduces the same buffers")
            _module_of(g, f"gradient {i}")
            if np.dtype(g.dtype) != dtype:
                raise TypeError(f"gradient {i} has dtype {g.dtype}, expected {dtype}")
            on_device = is_device_array(g)
            if device is None:
                device = on_device
            elif on_device != device:
                raise TypeError(f"gradient {i} is on another device than gradient 0")
        masked = [m for m in self._masks if m is not None]
        if masked and grads and is_device_array(masked[0]) != device:
            raise TypeError("masks and gradients are on different devices")

    # ------------------------------------------------------------------ step protocol
    def reduce(self, grads):
        """Reduce ``grads`` (a list of arrays) in place; a collective call.

        Uses blocking all-reduces: with nothing to overlap, they are the faster kind (Open
        MPI's nonblocking ones take about twice as long for large messages on shared memory).
        """
        self._start(grads, blocking=True)
        self.wait(grads)

    def start(self, grads):
        """Begin the step and launch every bucket (nonblocking); finish with :meth:`wait`."""
        self._start(grads, blocking=False)

    def _start(self, grads, blocking):
        # With every bucket at hand, ternary scales are agreed inside the verification
        # all-reduce (steps that verify) or else in one all-reduce for all buckets.
        def flats():
            return {b: self.bucket_flat(b, grads) for b in range(len(self._layout))}

        self.begin_step(grads, flats)
        buckets = range(len(self._layout))
        if self.quantize == "ternary":
            self.engine.agree_scales(flats())
        self._ready.update(buckets)
        self._launch_ready(grads, blocking)

    def mark_ready(self, bucket, grads):
        """Declare bucket ``bucket`` complete in ``grads``; buckets launch in index order."""
        if not self._in_step:
            self.begin_step(None)
        self._ready.add(bucket)
        self._launch_ready(grads)
        self.progress()

    def progress(self):
        """Let the buckets in flight move on, without waiting for them: call it now and then
        while other work runs (the PyTorch adapter's sync does, from every gradient hook).
        Over MPI this is what moves their data before :meth:`wait`: Open MPI advances a
        non-blocking all-reduce only inside MPI calls (:meth:`MPICollectives.progress`)."""
        if self._pending:
            self.collectives.progress([r for _, _, _, r in self._pending.values()
                                       if r is not None])

    def wait(self, grads):
        """Launch what is left, wait for every bucket and write results into ``grads``."""
        if not self._in_step:
            self.begin_step(grads)
        self._ready.update(range(len(self._layout)))
        self._launch_ready(grads)
        for b in list(self._pending):
            self._finish(b, grads)
        self.engine.end_step()
        self.reset_step()

    def reset_step(self):
        """Forget the step in progress on this side (its bucket flats and pending payloads)."""
        self._in_step = False
        self._ready = set()
        self._next_launch = 0
        self._pending = {}
        self._step_flats = {}

    def begin_step(self, grads=None, scale_flats=None, error=None):
        """Check ``grads`` (when given) and begin the step: verify the masks when due, on
        every rank together (:meth:`pacmpi.engine.StepEngine.begin_step`; ``error``, a front
        end's own bad input, raises on every rank too). For a front end that runs the
        payloads itself (:class:`pacmpi.sharded.ShardedReducer`); :meth:`reset_step` ends
        it on this side."""
        try:
            if grads is not None:
                self.check_grads(list(grads))
            elif self._layout is None:
                raise ValueError("mark_ready() before the first step needs shapes= and dtypes=")
        except (TypeError, ValueError) as exc:
            error = error or exc
        self._in_step = True
        self.engine.begin_step(self.bucket_masks, error, self._write_masks, scale_flats)

    # ------------------------------------------------------------------ masks per bucket
    def bucket_masks(self):
        """Each bucket's current flat boolean mask (a view when the bucket holds one bool
        mask), or ``None`` for a bucket without masks."""
        flats = []
        for bucket in self._layout.buckets:
            masked = [m for m in bucket.members if self._masks[m.index] is not None]
            if not masked:
                flats.append(None)
                continue
            only = self._masks[masked[0].index]
            if len(bucket.members) == 1 and only.dtype == np.bool_ and only.flags.c_contiguous:
                flats.append(only.reshape(-1))
                continue
            xp = array_module(only)
            flat = xp.ones(bucket.size, dtype=xp.bool_)
            for m in masked:
                flat[m.offset:m.offset + m.size] = self._masks[m.index].reshape(-1) != 0
            flats.append(flat)
        return flats

    def _write_masks(self, flats):
        """Store agreed (rank 0's) flat bucket masks into the caller's mask arrays."""
        for bucket, flat in zip(self._layout.buckets, flats):
            for m in bucket.members:
                mask = self._masks[m.index]
                if flat is not None and mask is not None:
                    mask[...] = flat[m.offset:m.offset + m.size].reshape(m.shape)

    # ------------------------------------------------------------------ buckets
    def bucket_flat(self, b, grads):
        """Bucket ``b`` of ``grads`` as one flat array: a view, or the bucket's buffer (filled
        once per step, until :meth:`reset_step`)."""
        if b in self._step_flats:
            return self._step_flats[b]
        bucket = self._layout.buckets[b]
        flat = bucket.flat_view(grads)
        if flat is None:
            xp = array_module(grads[bucket.members[0].index]) if bucket.members else np
            flat = self._flat_buffers.get(b)
            if flat is None or array_module(flat) is not xp:
                flat = xp.empty(bucket.size, dtype=bucket.dtype)
                self._flat_buffers[b] = flat
            bucket.flatten(grads, flat)
        self._step_flats[b] = flat
        return flat

    def _launch_ready(self, grads, blocking=False):
        while self._next_launch in self._ready:
            self._launch(self._next_launch, grads, blocking)
            if blocking:  # done: decode now, so the next bucket reuses its payload buffer
                self._finish(self._next_launch, grads)
            self._next_launch += 1

    def _launch(self, b, grads, blocking):
        flat = self.bucket_flat(b, grads)
        # The bucket is the gradients' own storage or the reducer's buffer: packed lossless
        # payloads are its own front, so they need no buffer.
        wire, ctx = self.engine.encode(b, flat, in_place=True)
        request = None
        if wire.size:
            started = time.perf_counter()
            if blocking:
                self.collectives.allreduce(wire, "sum")
            else:
                request = self.collectives.iallreduce(wire, "sum")
            self.stats["comm_seconds"] += time.perf_counter() - started
        self._pending[b] = (flat, wire, ctx, request)

    def _finish(self, b, grads):
        flat, wire, ctx, request = self._pending.pop(b)
        if request is not None:
            started = time.perf_counter()
            request.wait()
            self.stats["comm_seconds"] += time.perf_counter() - started
        self.engine.decode(wire, ctx, flat)
        bucket = self._layout.buckets[b]
        if bucket.flat_view(grads) is None:
            bucket.unflatten(flat, grads)

    # ------------------------------------------------------------------ state
    def memory_report(self):
        """Bytes of the arrays this reducer keeps between steps, by component: the engine's
        (:meth:`pacmpi.engine.StepEngine.memory_report`) and ``fusion``, the buffers of
        buckets that are not views of the gradients."""
        return dict(self.engine.memory_report(),
                    fusion=sum(int(flat.nbytes) for flat in self._flat_buffers.values()))

    def state_dict(self):
        """Step, tracker, error-feedback residuals (host arrays), counters and the seed."""
        state = self.engine.state_dict()
        state["layout"] = None if self._layout is None else self._layout.describe()
        if self._layout is None:
            state["tracker"] = None
        return state

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output; a collective call that fails on every rank together.

        Packed buckets recompute their survivor indices from the current masks, which must
        match the checkpoint's fingerprints. Residuals are dropped when the world size changed
        (they are per-rank quantization errors) and the step resumes where it left off.
        """
        apply = run_together(self.collectives, self._loader, state,
                             errors=(TypeError, ValueError, KeyError))
        apply()

    def _loader(self, state):
        if state["quantize"] != self.quantize:
            raise ValueError(f"checkpoint has quantize={state['quantize']!r}, "
                             f"reducer has {self.quantize!r}")
        if state["layout"] is None:
            def apply():
                self.engine.step = state["step"]
                self.engine.stats.update(state["stats"])
            return apply
        if self._layout is None:
            raise ValueError("load_state_dict() needs shapes= and dtypes= at construction")
        if [list(map(repr, d)) for d in state["layout"]] != [
                list(map(repr, d)) for d in self._layout.describe()]:
            raise ValueError("checkpoint bucket layout differs from this reducer's")
        return self.engine.loader(state, self.bucket_masks())

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_collectives"], state["_flat_buffers"] = None, {}
        return state
