"""PacTrainReducer: mask-aware packed all-reduce of gradient lists, with mask tracking,
cross-rank verification and optional fp16 or summable ternary quantization."""
import time
import warnings

import numpy as np

from .arrays import array_module, check_float_dtype, is_device_array, to_host
from .buckets import DEFAULT_BUCKET_BYTES, BucketLayout
from .collectives import default_collectives
from .errors import LayoutMismatchError, MaskMismatchError
from .hashing import digest_ints
from .ternary import TernaryCodec, stochastic_ternary, ternary_key
from .tracker import MaskTracker
from .verify import agree, gather_details, offending_ranks, raise_together, run_together

__all__ = ["PacTrainReducer", "QUANTIZE_MODES", "MISMATCH_POLICIES"]

QUANTIZE_MODES = (None, "fp16", "ternary")
MISMATCH_POLICIES = ("raise", "resync")
_QUANTIZE_CODES = {None: 0, "fp16": 1, "ternary": 2}
_MAGIC = 0x7AC7
_STRUCTURE_FIELDS = ("magic", "step", "buckets", "elements", "layout0", "layout1", "layout2",
                     "layout3", "quantize", "average")
_MASK_FIELDS = ("mask0", "mask1", "mask2", "mask3", "survivors", "version")
_COUNTERS = ("steps", "verifications", "bytes_sent", "dense_elements_equivalent",
             "packed_reductions", "dense_reductions", "dense_fallbacks", "resyncs",
             "nonfinite_fallbacks", "verify_seconds", "pack_seconds", "comm_seconds",
             "unpack_seconds")


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
        is counted in ``stats["resyncs"]``.
    stable_steps:
        Steps a changed mask must stay unchanged before its bucket is packed again.
    error_feedback:
        Ternary only: keep the quantization error per bucket and add it to the next step.
    seed:
        Seed of the counter-based generator behind stochastic rounding.
    shapes, dtypes:
        The gradients' shapes and dtypes, to build buckets before the first step (needed by
        :meth:`mark_ready` before the first full gradient list is seen).
    cuda_aware, word_dtype:
        Passed to the MPI transport and to :class:`TernaryCodec`.
    """

    def __init__(self, masks, *, comm=None, collectives=None, quantize=None, average=True,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, verify_every=1, on_mismatch="raise",
                 stable_steps=1, error_feedback=True, seed=0, shapes=None, dtypes=None,
                 cuda_aware="auto", word_dtype="int64"):
        self._collectives = collectives if collectives is not None else default_collectives(
            comm, cuda_aware=cuda_aware)
        error = None
        try:
            if quantize not in QUANTIZE_MODES:
                raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
            if on_mismatch not in MISMATCH_POLICIES:
                raise ValueError(
                    f"on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
            if not isinstance(verify_every, int) or verify_every < 1:
                raise ValueError(f"verify_every must be a positive integer, got {verify_every!r}")
            self.quantize, self.average = quantize, bool(average)
            self.bucket_bytes, self.verify_every = bucket_bytes, verify_every
            self.on_mismatch, self.error_feedback = on_mismatch, bool(error_feedback)
            self.seed, self.word_dtype = int(seed), word_dtype
            self.stable_steps = MaskTracker(0, stable_steps=stable_steps).stable_steps
            self._codec = (TernaryCodec(self._collectives.size, word_dtype)
                           if quantize == "ternary" else None)
            self._masks = self._checked_masks(masks)
            self._layout = self._tracker = None
            if shapes is not None or dtypes is not None:
                self._build_layout(shapes, dtypes)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(self._collectives, error)
        self._step = 0
        self._residuals = {}
        self.stats = dict.fromkeys(_COUNTERS, 0)
        self._clear_caches()
        self._reset_step()

    def _clear_caches(self):
        # Reusable flat/packed buffers and the last agreed mask snapshots with their
        # fingerprints; both are rebuilt on demand, so they are not pickled.
        self._buffers, self._snapshots = {}, {}

    # ------------------------------------------------------------------ configuration
    @property
    def collectives(self):
        if self._collectives is None:  # after unpickling
            self._collectives = default_collectives()
        return self._collectives

    @property
    def layout(self):
        """The :class:`BucketLayout` (``None`` until shapes and dtypes are known)."""
        return self._layout

    @property
    def tracker(self):
        return self._tracker

    @property
    def step(self):
        return self._step

    def set_masks(self, masks):
        """Replace the mask arrays (same count and shapes); a collective call."""
        self._masks = run_together(self.collectives, self._masks_for_layout, masks)

    def _masks_for_layout(self, masks):
        checked = self._checked_masks(masks)
        if self._layout is not None:
            self._check_shapes(checked, "mask")
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
                    raise ValueError(
                        f"mask {i} must be boolean or 0/1, found value {to_host(bad)[0].item()!r}")
            if xp is not array_module(next(m for m in masks if m is not None)):
                raise TypeError(f"mask {i} is on another device than mask 0")
        return masks

    def _check_shapes(self, arrays, what):
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
        self._layout = BucketLayout(shapes, dtypes, self.bucket_bytes)
        self._tracker = MaskTracker(len(self._layout), stable_steps=self.stable_steps)

    def _check_grads(self, grads):
        if self._layout is None:
            for i, g in enumerate(grads):
                if g is None or not hasattr(g, "dtype"):
                    raise TypeError(f"gradient {i} is {type(g).__name__}, expected an array")
                check_float_dtype(g.dtype, f"gradient {i}")
            self._build_layout([g.shape for g in grads], [g.dtype for g in grads])
        self._check_shapes(grads, "gradient")
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
        """Reduce ``grads`` (a list of arrays) in place; a collective call."""
        self.start(grads)
        self.wait(grads)

    def start(self, grads):
        """Begin the step and launch every bucket (nonblocking); finish with :meth:`wait`."""
        self._begin_step(grads)
        for b in range(len(self._layout)):
            self._ready.add(b)
        self._launch_ready(grads)

    def mark_ready(self, bucket, grads):
        """Declare bucket ``bucket`` complete in ``grads``; buckets launch in index order."""
        if not self._in_step:
            self._begin_step(None)
        self._ready.add(bucket)
        self._launch_ready(grads)

    def wait(self, grads):
        """Launch what is left, wait for every bucket and write results into ``grads``."""
        if not self._in_step:
            self._begin_step(grads)
        for b in range(len(self._layout)):
            self._ready.add(b)
        self._launch_ready(grads)
        for b in range(len(self._layout)):
            self._finish(b, grads)
        self._step += 1
        self.stats["steps"] += 1
        self._reset_step()

    def _reset_step(self):
        self._in_step = False
        self._ready = set()
        self._next_launch = 0
        self._pending = {}
        self._force_dense = False

    def _begin_step(self, grads):
        error = None
        try:
            if grads is not None:
                self._check_grads(list(grads))
            elif self._layout is None:
                raise ValueError("mark_ready() before the first step needs shapes= and dtypes=")
        except (TypeError, ValueError) as exc:
            error = exc
        self._in_step = True
        if self._step % self.verify_every == 0:
            self._verify(error)
        elif error is not None:
            raise error

    # ------------------------------------------------------------------ verification
    def _xp(self):
        first = next((m for m in self._masks if m is not None), None)
        return np if first is None else array_module(first)

    def _flat_masks(self, xp):
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
            flat = xp.ones(bucket.size, dtype=xp.bool_)
            for m in masked:
                flat[m.offset:m.offset + m.size] = self._masks[m.index].reshape(-1) != 0
            flats.append(flat)
        return flats

    def _observe(self, xp, flats):
        """Agreed-upon snapshots of ``flats`` with their (fingerprint, survivors).

        An unchanged mask (one comparison pass) reuses the previous snapshot's fingerprint;
        the snapshot, not the caller's array, is what the step packs with.
        """
        cache = self._snapshots
        snapshots, observations = [], []
        for b, flat in enumerate(flats):
            previous = cache.get(b)
            if flat is None:
                cache.pop(b, None)
                snapshots.append(None)
                observations.append((None, None))
                continue
            if previous is None or previous[0].shape != flat.shape or not bool(
                    xp.array_equal(previous[0], flat)):
                snapshot = flat.copy()
                previous = (snapshot, MaskTracker.observe(xp, snapshot))
                cache[b] = previous
            snapshots.append(previous[0])
            observations.append(previous[1])
        return snapshots, observations

    def _verify(self, local_error):
        started = time.perf_counter()
        xp = self._xp()
        fields = dict.fromkeys(_STRUCTURE_FIELDS + _MASK_FIELDS, 0)
        fields["input_error"] = 0 if local_error is None else 1
        flats, observations = [], []
        if local_error is None:
            flats, observations = self._observe(xp, self._flat_masks(xp))
            fields.update(self._fields(observations))
        mismatched, maxima = agree(self.collectives, fields)
        self.stats["verifications"] += 1
        if "input_error" in mismatched or fields["input_error"]:
            raise_together(self.collectives, local_error)
        structure = [f for f in mismatched if f in _STRUCTURE_FIELDS]
        masks_differ = [f for f in mismatched if f in _MASK_FIELDS]
        if structure:
            self._raise_mismatch(LayoutMismatchError, structure, observations)
        if masks_differ and self.on_mismatch == "raise":
            self._raise_mismatch(MaskMismatchError, masks_differ, observations)
        if masks_differ:
            flats, observations = self._resync(xp, flats)
            self._tracker.version = maxima["version"]
            self._tracker.buckets = [type(s)() for s in self._tracker.buckets]
            self._tracker.last_commit_step = None
            self._force_dense = True
            self.stats["resyncs"] += 1
        self._tracker.commit(self._step, observations, flats)
        if not self._force_dense:
            for b, state in enumerate(self._tracker.buckets):
                if self._tracker.ready_to_pack(b):
                    state.indices = xp.flatnonzero(state.mask)
        self.stats["verify_seconds"] += time.perf_counter() - started

    def _fields(self, observations):
        layout = self._layout
        mask_digest = digest_ints([o[0] for o in observations] + [o[1] for o in observations])
        fields = {
            "magic": _MAGIC, "step": self._step, "buckets": len(layout),
            "elements": sum(b.size for b in layout.buckets),
            "quantize": _QUANTIZE_CODES[self.quantize], "average": int(self.average),
            "survivors": sum(o[1] if o[1] is not None else b.size
                             for o, b in zip(observations, layout.buckets)),
            "version": self._tracker.version,
        }
        fields.update(zip(("layout0", "layout1", "layout2", "layout3"),
                          digest_ints(layout.describe())))
        fields.update(zip(("mask0", "mask1", "mask2", "mask3"), mask_digest))
        return fields

    def _descriptor(self, observations):
        return {
            "step": self._step, "quantize": self.quantize, "average": self.average,
            "version": self._tracker.version,
            "buckets": [
                {"dtype": str(b.dtype), "elements": b.size,
                 "fingerprint": None if o[0] is None else f"{o[0]:032x}", "survivors": o[1]}
                for b, o in zip(self._layout.buckets, observations)
            ],
        }

    def _raise_mismatch(self, error_type, fields, observations):
        details = gather_details(self.collectives, self._descriptor(observations))
        keys = ["buckets", "version", "quantize", "average", "step"]
        bad = offending_ranks(details, keys)
        lines = [f"ranks disagree on {', '.join(fields)} at step {self._step}; "
                 f"offending ranks: {bad}"]
        for rank in sorted({0, *bad}):
            d = details[rank]
            prints = [bk["fingerprint"] for bk in d["buckets"]]
            sizes = [(bk["dtype"], bk["elements"], bk["survivors"]) for bk in d["buckets"]]
            lines.append(f"rank {rank} on {d['host']}: version {d['version']}, "
                         f"quantize {d['quantize']}, fingerprints {prints}, "
                         f"(dtype, elements, survivors) {sizes}")
        raise error_type("\n".join(lines), details=details, offending_ranks=bad)

    def _resync(self, xp, flats):
        """Adopt rank 0's masks: broadcast each bucket's mask and write it into the arrays."""
        for bucket, flat in zip(self._layout.buckets, flats):
            if flat is None:
                continue
            received = flat.astype(xp.uint8)
            self.collectives.bcast(received, root=0)
            received = received.astype(xp.bool_)
            for m in bucket.members:
                mask = self._masks[m.index]
                if mask is not None:
                    mask[...] = received[m.offset:m.offset + m.size].reshape(m.shape)
        self._snapshots.clear()
        return self._observe(xp, self._flat_masks(xp))

    # ------------------------------------------------------------------ buckets
    def _launch_ready(self, grads):
        while self._next_launch in self._ready:
            self._launch(self._next_launch, grads)
            self._next_launch += 1

    def _buffer(self, xp, key, size, dtype):
        cache = self._buffers
        buf = cache.get(key)
        if buf is None or buf.size != size or buf.dtype != dtype or array_module(buf) is not xp:
            buf = xp.empty(size, dtype=dtype)
            cache[key] = buf
        return buf

    def _launch(self, b, grads):
        started = time.perf_counter()
        bucket = self._layout.buckets[b]
        xp = array_module(grads[bucket.members[0].index]) if bucket.members else np
        flat = bucket.flat_view(grads)
        if flat is None:
            flat = bucket.flatten(grads, self._buffer(xp, ("flat", b), bucket.size, bucket.dtype))
        state = self._tracker.buckets[b]
        if state.packed and not self._force_dense:
            payload = self._buffer(xp, ("packed", b), state.indices.size, bucket.dtype)
            xp.take(flat, state.indices, out=payload)
            self.stats["packed_reductions"] += 1
        else:
            payload = flat
            if state.mask is not None and state.survivors < bucket.size:
                # copyto, not multiply: NaN * 0 is NaN, and a pruned coordinate must come back
                # exactly 0 on the dense path just as on the packed one.
                xp.copyto(flat, 0, where=~state.mask)
                self.stats["dense_fallbacks"] += 1
            self.stats["dense_reductions"] += 1
        self.stats["dense_elements_equivalent"] += bucket.size
        pending = {"xp": xp, "flat": flat, "payload": payload, "request": None}
        if payload.size:
            if self.quantize == "ternary":
                self._launch_ternary(b, xp, payload, state, pending)
            else:
                wire = payload.astype(np.float16) if self.quantize == "fp16" else payload
                pending["wire"] = wire
                self.stats["bytes_sent"] += wire.nbytes
                self.stats["pack_seconds"] += time.perf_counter() - started
                comm_started = time.perf_counter()
                pending["request"] = self.collectives.iallreduce(wire, "sum")
                self.stats["comm_seconds"] += time.perf_counter() - comm_started
        else:
            self.stats["pack_seconds"] += time.perf_counter() - started
        self._pending[b] = pending

    def _residual(self, xp, b, size, dtype):
        residual = self._residuals.get(b)
        if residual is None or residual.size != size or array_module(residual) is not xp:
            residual = xp.zeros(size, dtype=dtype)
            self._residuals[b] = residual
        return residual

    def _launch_ternary(self, b, xp, payload, state, pending):
        started = time.perf_counter()
        compute = np.float64 if payload.dtype == np.float64 else np.float32
        values = payload.astype(compute)
        packed = state.packed and not self._force_dense
        if self.error_feedback:
            residual = self._residual(xp, b, self._layout.buckets[b].size, compute)
            values += residual[state.indices] if packed else residual
            if not packed and state.mask is not None:
                xp.copyto(values, 0, where=~state.mask)
        local_max = float(xp.max(xp.abs(values)))
        finite = np.isfinite(local_max)
        agreed = np.array([local_max if finite else 0.0, 0.0 if finite else 1.0])
        comm_started = time.perf_counter()
        self.collectives.allreduce(agreed, "max")
        self.stats["comm_seconds"] += time.perf_counter() - comm_started
        self.stats["bytes_sent"] += agreed.nbytes
        if agreed[1]:
            # Some rank has NaN/Inf: send this bucket unquantized so the non-finite values
            # propagate exactly as on the dense path, and the scale never becomes NaN.
            self.stats["nonfinite_fallbacks"] += 1
            pending["wire"] = payload
            self.stats["bytes_sent"] += payload.nbytes
            pending["request"] = self.collectives.iallreduce(payload, "sum")
            return
        scale = float(agreed[0])
        key = ternary_key(self.seed, self._step, b, self.collectives.rank)
        codes = stochastic_ternary(xp, values, scale, key)
        if self.error_feedback:
            new_residual = values - xp.asarray(codes, dtype=compute) * compute(scale)
            if packed:
                residual[state.indices] = new_residual
            else:
                residual[...] = new_residual
        words = self._codec.encode(xp, codes)
        pending.update(words=words, scale=scale)
        self.stats["bytes_sent"] += words.nbytes
        self.stats["pack_seconds"] += time.perf_counter() - started
        comm_started = time.perf_counter()
        pending["request"] = self.collectives.iallreduce(words, "sum")
        self.stats["comm_seconds"] += time.perf_counter() - comm_started

    def _finish(self, b, grads):
        pending = self._pending.pop(b)
        xp, flat, payload = pending["xp"], pending["flat"], pending["payload"]
        if pending["request"] is not None:
            started = time.perf_counter()
            pending["request"].wait()
            self.stats["comm_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        if "words" in pending:
            sums = self._codec.decode(xp, pending["words"], payload.size)
            payload[...] = sums * pending["scale"]
        elif pending.get("wire") is not None and pending["wire"] is not payload:
            payload[...] = pending["wire"]
        if self.average and self.collectives.size > 1:
            payload /= self.collectives.size
        state = self._tracker.buckets[b]
        if payload is not flat:
            flat[...] = 0
            flat[state.indices] = payload
        bucket = self._layout.buckets[b]
        if bucket.flat_view(grads) is None:
            bucket.unflatten(flat, grads)
        self.stats["unpack_seconds"] += time.perf_counter() - started

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """Step, tracker, error-feedback residuals (host arrays), counters and the seed."""
        return {
            "step": self._step,
            "seed": self.seed,
            "quantize": self.quantize,
            "world_size": self.collectives.size,
            "layout": None if self._layout is None else self._layout.describe(),
            "tracker": None if self._tracker is None else self._tracker.state_dict(),
            "residuals": {b: to_host(r).copy() for b, r in self._residuals.items()},
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output; a collective call that fails on every rank together.

        Packed buckets recompute their survivor indices from the current masks, which must
        match the checkpoint's fingerprints. Residuals are dropped when the world size changed
        (they are per-rank quantization errors) and the step resumes where it left off.
        """
        run_together(self.collectives, self._load, state, errors=(TypeError, ValueError, KeyError))

    def _load(self, state):
        if state["quantize"] != self.quantize:
            raise ValueError(f"checkpoint has quantize={state['quantize']!r}, "
                             f"reducer has {self.quantize!r}")
        if state["layout"] is not None:
            if self._layout is None:
                raise ValueError("load_state_dict() needs shapes= and dtypes= at construction")
            if [list(map(repr, d)) for d in state["layout"]] != [
                    list(map(repr, d)) for d in self._layout.describe()]:
                raise ValueError("checkpoint bucket layout differs from this reducer's")
            tracker_state = state["tracker"]
            tracker = MaskTracker(len(self._layout), stable_steps=self.stable_steps)
            tracker.version = tracker_state["version"]
            tracker.last_commit_step = tracker_state["last_commit_step"]
            xp = self._xp()
            flats, observations = self._observe(xp, self._flat_masks(xp))
            for b, (saved, flat, observed) in enumerate(
                    zip(tracker_state["buckets"], flats, observations)):
                bucket_state = tracker.buckets[b]
                bucket_state.fingerprint = saved["fingerprint"]
                bucket_state.survivors = saved["survivors"]
                bucket_state.stable_steps = saved["stable_steps"]
                bucket_state.mask = flat
                if flat is not None and saved["fingerprint"] is not None:
                    if observed[0] != saved["fingerprint"]:
                        raise ValueError(f"masks of bucket {b} differ from the checkpoint's")
                if saved["packed"]:
                    bucket_state.indices = xp.flatnonzero(flat)
            self._tracker = tracker
            same_world = state["world_size"] == self.collectives.size
            if not same_world and state["residuals"]:
                warnings.warn(f"checkpoint was written on {state['world_size']} ranks, this run has "
                              f"{self.collectives.size}: error-feedback residuals start from zero",
                              RuntimeWarning, stacklevel=3)
            self._residuals = ({int(b): xp.asarray(r) for b, r in state["residuals"].items()}
                               if same_world else {})
        self._step = state["step"]
        self.stats = dict(state["stats"])

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_collectives"] = None
        del state["_buffers"], state["_snapshots"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._clear_caches()
