"""PacTrain on Horovod: a gradient compressor that all-reduces only unpruned coordinates, and a
:class:`pacmpi.Collectives` transport over Horovod's own collectives.

Usage with ``hvd.DistributedOptimizer``::

    compressor = PacTrainCompressor(model, masks)            # masks: name -> bool mask
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compressor)

Every rank must bind the same parameters (same names, shapes, dtypes, order) and hold the same
masks; :class:`PacTrainCompressor` checks that once per step, through Horovod, so it works under
the MPI and the Gloo controller alike, and a divergent mask raises
:class:`pacmpi.MaskMismatchError` on every rank instead of summing unrelated coordinates.

Where a step starts, and why verification runs there
-----------------------------------------------------
Horovod's ``compress(tensor)`` gets neither a name nor a step number. A *step* here is the span
from the first ``compress`` while no compressed tensor is outstanding to the ``decompress``
that leaves none outstanding. ``DistributedOptimizer`` compresses every gradient (from its
backward hooks, then the missing ones in ``synchronize()``) before it decompresses any, so a
step is exactly one optimizer step (also with ``backward_passes_per_step`` and ``groups``);
a bare ``hvd.allreduce(grad, compression=compressor)`` is a step of its own. This needs no
wiring: an optimizer step-pre hook would fire after backward, when the hooks have already
launched the step's all-reduces, and a ``begin_step()`` call can be forgotten.

The verification all-reduce runs inside that first ``compress``, i.e. before this rank submits
any all-reduce of the step. It blocks the main thread, but it cannot deadlock: every rank
reaches its first ``compress`` without waiting on anyone (the previous step was fully
synchronized), and Horovod's background thread negotiates by name, so tensors other ranks
already submitted simply wait for the next cycle.

Ternary mode
------------
Codes of all ranks are packed into int64 words (:class:`pacmpi.TernaryCodec`) that Horovod
must *sum*: use ``op=hvd.Sum`` (and ``average=True`` here for the mean). Horovod averages
integer tensors by floor division, so each payload carries a sentinel element set to 1; after
a sum it reads ``hvd.size()``, and ``decompress`` raises :class:`ValueError` on every rank
otherwise. The scale of each tensor is agreed by a blocking 16-byte MAX all-reduce from
``compress``, named after the parameter, so ranks must compute gradients in the same order (as
autograd does for identical models); a differing order stalls (Horovod's stall warning) rather
than silently pairing different tensors' scales.
"""
import itertools

import numpy as np
import torch

from pacmpi import Collectives, MaskTracker, TernaryCodec, stochastic_ternary
from pacmpi.errors import LayoutMismatchError, MaskMismatchError
from pacmpi.hashing import digest_ints, splitmix64_int
from pacmpi.verify import agree, gather_details, offending_ranks, raise_together

__all__ = ["HorovodCollectives", "PacTrainCompressor"]

# One sequence for every HorovodCollectives of a process: ranks issue their collectives in the
# same order, so the n-th call carries the same Horovod name on every rank.
_SEQUENCE = itertools.count()
_QUANTIZE_MODES = (None, "ternary")
_MAGIC = 0x7AC8
_STRUCTURE_FIELDS = ("magic", "step", "params", "elements", "layout0", "layout1", "layout2",
                     "layout3", "quantize", "average")
_MASK_FIELDS = ("mask0", "mask1", "mask2", "mask3", "survivors", "version")


def _hvd():
    import horovod.torch as hvd
    return hvd


def _as_xp(tensor):
    """(array module, NumPy/CuPy array sharing ``tensor``'s memory)."""
    if tensor.device.type == "cpu":
        return np, tensor.numpy()
    import cupy
    return cupy, cupy.from_dlpack(tensor)


def _as_torch(array):
    """A torch tensor sharing the memory of a NumPy/CuPy array."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class _Request:
    def __init__(self, handle):
        self._handle = handle

    def wait(self):
        _hvd().synchronize(self._handle)


class HorovodCollectives(Collectives):
    """:class:`pacmpi.Collectives` over Horovod (MPI or Gloo controller), global process set.

    NumPy arrays are wrapped as CPU tensors and CuPy arrays via DLPack, without copies, and
    reduced in place. Each call is named ``pacmpi.<kind>.<n>`` from a per-process sequence
    unless ``name=`` is given; a name that is stable across steps (e.g. per parameter) lets
    Horovod's response cache skip negotiation. Needs ``hvd.init()`` first.
    """

    def __init__(self):
        hvd = _hvd()
        self.rank, self.size = hvd.rank(), hvd.size()
        self._ops = {"sum": hvd.Sum, "max": hvd.Max}

    @staticmethod
    def _name(kind, name):
        return name if name is not None else f"pacmpi.{kind}.{next(_SEQUENCE)}"

    def _op(self, op):
        if op not in self._ops:
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return self._ops[op]

    def allreduce(self, buf, op="sum", name=None):
        _hvd().allreduce_(_as_torch(buf), op=self._op(op), name=self._name("allreduce", name))

    def iallreduce(self, buf, op="sum", name=None):
        handle = _hvd().allreduce_async_(_as_torch(buf), op=self._op(op),
                                         name=self._name("iallreduce", name))
        return _Request(handle)

    def bcast(self, buf, root=0, name=None):
        _hvd().broadcast_(_as_torch(buf), root_rank=root, name=self._name("bcast", name))

    def allgather_object(self, obj, name=None):
        return _hvd().allgather_object(obj, name=self._name("gather", name))


class _Context:
    """What decompress needs: the parameter, how its payload was encoded, the ternary scale."""

    __slots__ = ("index", "kind", "packed", "scale", "count")

    def __init__(self, index, kind, packed, scale=None, count=None):
        self.index, self.kind, self.packed, self.scale, self.count = (
            index, kind, packed, scale, count)


class PacTrainCompressor:
    """Horovod compression that sends only the gradient coordinates the shared masks keep.

    Pass it as ``compression=`` to ``hvd.DistributedOptimizer`` or ``hvd.allreduce``; it
    reduces each parameter's ``.grad``, which it recognises by identity (the tensor Horovod
    hands to ``compress`` is ``p.grad``), else by storage pointer and shape. Construction is
    collective (after ``hvd.init()``): bad arguments raise on every rank together.

    Parameters
    ----------
    model_or_named_parameters:
        An ``nn.Module`` or ``(name, parameter)`` pairs: the parameters whose gradients will
        be reduced.
    masks:
        Mapping from parameter name to a bool (or 0/1) keep-mask of the parameter's shape
        (torch tensor, NumPy or CuPy array). Unlisted parameters are not pruned. Masks are
        re-read at every verification, so they may be changed in place (gradual pruning);
        :meth:`set_masks` replaces the mapping. A changed mask is reduced dense (masked)
        until it has been unchanged for ``stable_steps`` steps, then packed.
    quantize:
        ``None`` (lossless) or ``"ternary"`` (unbiased stochastic ternary codes in summable
        int64 words; requires ``op=hvd.Sum``).
    average:
        Ternary only: divide the decoded sum by ``hvd.size()``, giving the mean that
        ``op=hvd.Average`` gives in lossless mode (where Horovod's op decides).
    stable_steps, verify_every, error_feedback, seed:
        As in :class:`pacmpi.PacTrainReducer`: steps a changed mask stays dense; verify (and
        re-read masks) every this many steps; keep each tensor's ternary rounding error for
        the next step; seed of the stochastic rounding.

    Every masked result is masked: pruned coordinates come back as zeros (PacTrain's
    ``G = mask * G``), so the reduced gradients equal Horovod's dense reduction of masked
    gradients. ``stats`` counts steps, verifications, packed/dense tensors and bytes.
    """

    def __init__(self, model_or_named_parameters, masks, *, quantize=None, average=False,
                 stable_steps=1, verify_every=1, error_feedback=True, seed=0):
        self.collectives = HorovodCollectives()
        error = None
        try:
            named = (model_or_named_parameters.named_parameters()
                     if isinstance(model_or_named_parameters, torch.nn.Module)
                     else model_or_named_parameters)
            named = list(named)
            self._names = [name for name, _ in named]
            self._params = [param for _, param in named]
            if len(set(self._names)) != len(self._names):
                raise ValueError("parameter names must be unique")
            if quantize not in _QUANTIZE_MODES:
                raise ValueError(f"quantize must be one of {_QUANTIZE_MODES}, got {quantize!r}")
            if average and quantize != "ternary":
                raise ValueError("average=True is for quantize='ternary'; in lossless mode "
                                 "pass op=hvd.Average to Horovod instead")
            if not isinstance(verify_every, int) or verify_every < 1:
                raise ValueError(f"verify_every must be a positive integer, got {verify_every!r}")
            self._tracker = MaskTracker(len(self._params), stable_steps=stable_steps)
            self.quantize, self.average = quantize, bool(average)
            self.verify_every, self.error_feedback = verify_every, bool(error_feedback)
            self.seed = int(seed)
            self._codec = TernaryCodec(self.collectives.size) if quantize == "ternary" else None
            self._masks = self._checked_names(masks)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(self.collectives, error)
        self._step = 0
        self._outstanding = 0
        self._by_id, self._cached_ids = {}, [None] * len(self._params)
        self._torch_masks = [None] * len(self._params)
        self._indices = [None] * len(self._params)
        self._residuals = {}
        self.stats = dict.fromkeys(
            ("steps", "verifications", "packed_tensors", "dense_tensors", "dense_fallbacks",
             "nonfinite_fallbacks", "bytes_sent", "dense_bytes_equivalent"), 0)

    # ------------------------------------------------------------------ configuration
    @property
    def step(self):
        return self._step

    @property
    def tracker(self):
        return self._tracker

    def set_masks(self, masks):
        """Replace the mask mapping; takes effect at the next verification. Collective."""
        error = None
        try:
            checked = self._checked_names(masks)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(self.collectives, error)
        self._masks = checked

    def _checked_names(self, masks):
        unknown = sorted(set(masks) - set(self._names))
        if unknown:
            raise ValueError(f"masks name parameters that are not bound: {unknown}")
        return masks

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor):
        """Payload for Horovod to all-reduce, and the context :meth:`decompress` needs."""
        error = index = None
        try:
            index = self._index_of(tensor)
        except LookupError as exc:
            error = exc
        if self._outstanding == 0:
            self._begin_step(error)
        elif error is not None:
            raise error
        payload, ctx = self._encode(index, tensor)
        self._outstanding += 1
        return payload, ctx

    def decompress(self, tensor, ctx):
        """The reduced gradient in the parameter's shape and dtype (``ctx=None``: as is)."""
        if ctx is None:  # Horovod's sparse path, or a tensor this compressor never encoded
            return tensor
        try:
            return self._decode(tensor, ctx)
        finally:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._step += 1
                self.stats["steps"] += 1

    # ------------------------------------------------------------------ steps and masks
    def _index_of(self, tensor):
        index = self._by_id.get(id(tensor))
        if index is not None and self._params[index].grad is tensor:
            return index
        for index, param in enumerate(self._params):
            if param.grad is tensor:
                # zero_grad(set_to_none=True) makes new grads every step: drop the stale id.
                self._by_id.pop(self._cached_ids[index], None)
                self._cached_ids[index] = id(tensor)
                self._by_id[id(tensor)] = index
                return index
        for index, param in enumerate(self._params):
            grad = param.grad
            if (grad is not None and grad.data_ptr() == tensor.data_ptr()
                    and grad.shape == tensor.shape and grad.dtype == tensor.dtype):
                return index
        raise LookupError(
            f"PacTrainCompressor.compress got a {tuple(tensor.shape)} {tensor.dtype} tensor "
            f"that is not the .grad of any of its {len(self._params)} bound parameters; bind "
            "the parameters that are reduced and pass their .grad tensors themselves")

    def _begin_step(self, local_error):
        if self._step % self.verify_every == 0:
            self._verify(local_error)
        elif local_error is not None:
            raise local_error

    def _flat_mask(self, index):
        mask = self._masks.get(self._names[index])
        if mask is None:
            return None
        param = self._params[index]
        mask = torch.as_tensor(mask, device=param.device)
        if tuple(mask.shape) != tuple(param.shape):
            raise ValueError(f"mask of {self._names[index]!r} has shape {tuple(mask.shape)}, "
                             f"the parameter has {tuple(param.shape)}")
        if mask.dtype != torch.bool:
            if bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"mask of {self._names[index]!r} must be boolean or 0/1")
            mask = mask != 0
        return mask.reshape(-1).clone()

    def _verify(self, local_error):
        fields = dict.fromkeys(_STRUCTURE_FIELDS + _MASK_FIELDS, 0)
        flats, observations = [], []
        if local_error is None:
            try:
                flats = [self._flat_mask(i) for i in range(len(self._params))]
            except (TypeError, ValueError) as exc:
                local_error = exc
        fields["input_error"] = 0 if local_error is None else 1
        if local_error is None:
            observations = [(None, None) if f is None else MaskTracker.observe(*_as_xp(f))
                            for f in flats]
            fields.update(self._fields(observations))
        mismatched, _ = agree(self.collectives, fields)
        self.stats["verifications"] += 1
        if "input_error" in mismatched or fields["input_error"]:
            raise_together(self.collectives, local_error)
        structure = [f for f in mismatched if f in _STRUCTURE_FIELDS]
        if structure:
            self._raise_mismatch(LayoutMismatchError, structure, observations)
        if mismatched:
            self._raise_mismatch(MaskMismatchError, mismatched, observations)
        self._tracker.commit(self._step, observations,
                             [None if f is None else _as_xp(f)[1] for f in flats])
        for index, (state, flat) in enumerate(zip(self._tracker.buckets, flats)):
            self._torch_masks[index] = flat
            if self._tracker.ready_to_pack(index):
                xp, mask = _as_xp(flat)
                state.indices = xp.flatnonzero(mask)
            self._indices[index] = None if state.indices is None else _as_torch(state.indices)

    def _fields(self, observations):
        layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
        fields = {
            "magic": _MAGIC, "step": self._step, "params": len(self._params),
            "elements": sum(p.numel() for p in self._params),
            "quantize": _QUANTIZE_MODES.index(self.quantize), "average": int(self.average),
            "survivors": sum(p.numel() if s is None else s
                             for p, (_, s) in zip(self._params, observations)),
            "version": self._tracker.version,
        }
        fields.update(zip(("layout0", "layout1", "layout2", "layout3"), digest_ints(layout)))
        fields.update(zip(("mask0", "mask1", "mask2", "mask3"),
                          digest_ints([o for pair in observations for o in pair])))
        return fields

    def _raise_mismatch(self, error_type, fields, observations):
        descriptor = {
            "step": self._step, "quantize": self.quantize, "version": self._tracker.version,
            "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names,
                                                                          self._params)],
            "masks": {n: (f"{fp:032x}", s) for n, (fp, s) in zip(self._names, observations)
                      if fp is not None},
        }
        details = gather_details(self.collectives, descriptor)
        bad = offending_ranks(details, ["params", "masks", "version", "quantize", "step"])
        lines = [f"ranks disagree on {', '.join(fields)} at step {self._step}; "
                 f"offending ranks: {bad}"]
        reference = details[0]["masks"]
        for rank in bad:
            d = details[rank]
            differing = sorted(n for n in set(d["masks"]) | set(reference)
                               if d["masks"].get(n) != reference.get(n))
            lines.append(f"rank {rank} on {d['host']}: masks differ from rank 0's for "
                         f"{differing}; (fingerprint, survivors) here "
                         f"{[d['masks'].get(n) for n in differing]}, on rank 0 "
                         f"{[reference.get(n) for n in differing]}")
        raise error_type("\n".join(lines), details=details, offending_ranks=bad)

    # ------------------------------------------------------------------ encoding
    def _encode(self, index, tensor):
        state = self._tracker.buckets[index]
        packed = state.packed
        flat = tensor.reshape(-1)
        self.stats["dense_bytes_equivalent"] += tensor.numel() * tensor.element_size()
        if packed:
            payload = flat.index_select(0, self._indices[index])
            self.stats["packed_tensors"] += 1
        else:
            payload = flat
            mask = self._torch_masks[index]
            if mask is not None and state.survivors < mask.numel():
                payload = flat.masked_fill(~mask, 0)
                self.stats["dense_fallbacks"] += 1
            self.stats["dense_tensors"] += 1
        if self.quantize == "ternary":
            return self._encode_ternary(index, payload, packed)
        self.stats["bytes_sent"] += payload.numel() * payload.element_size()
        if payload is flat:  # unmasked: reduce the gradient itself, as Compression.none does
            return tensor, _Context(index, "as_is", packed)
        return payload, _Context(index, "float", packed)

    def _residual(self, index, compute):
        param = self._params[index]
        residual = self._residuals.get(index)
        if residual is None or residual.dtype != compute:
            residual = torch.zeros(param.numel(), dtype=compute, device=param.device)
            self._residuals[index] = residual
        return residual

    def _encode_ternary(self, index, payload, packed):
        compute = torch.float64 if payload.dtype == torch.float64 else torch.float32
        values = payload.to(compute, copy=True)
        mask = self._torch_masks[index]
        if self.error_feedback:
            residual = self._residual(index, compute)
            values += residual[self._indices[index]] if packed else residual
            if not packed and mask is not None:
                values.masked_fill_(~mask, 0)
        local_max = float(values.abs().max()) if values.numel() else 0.0
        finite = bool(np.isfinite(local_max))
        agreed = np.array([local_max if finite else 0.0, 0.0 if finite else 1.0])
        self.collectives.allreduce(agreed, "max", name=f"pacmpi.scale.{self._names[index]}")
        self.stats["bytes_sent"] += agreed.nbytes
        if agreed[1]:
            # NaN/Inf somewhere: send unquantized so they propagate as on the dense path.
            self.stats["nonfinite_fallbacks"] += 1
            wire = torch.cat([payload.reshape(-1), payload.new_ones(1)])
            self.stats["bytes_sent"] += wire.numel() * wire.element_size()
            return wire, _Context(index, "float_sentinel", packed, count=payload.numel())
        scale = float(agreed[0])
        xp, values_xp = _as_xp(values)
        key = splitmix64_int(self.seed ^ splitmix64_int(
            (self._step << 32) ^ (index << 16) ^ self.collectives.rank))
        codes = stochastic_ternary(xp, values_xp, scale, key)
        if self.error_feedback:
            new_residual = values - _as_torch(codes).to(compute) * scale
            if packed:
                residual[self._indices[index]] = new_residual
            else:
                residual.copy_(new_residual)
        words = _as_torch(self._codec.encode(xp, codes))
        wire = torch.cat([words, words.new_ones(1)])
        self.stats["bytes_sent"] += wire.numel() * wire.element_size()
        return wire, _Context(index, "ternary", packed, scale=scale, count=payload.numel())

    def _decode(self, tensor, ctx):
        param = self._params[ctx.index]
        if ctx.kind == "as_is":
            return tensor
        if ctx.kind in ("ternary", "float_sentinel"):
            summed = int(tensor[-1].item())
            if summed != self.collectives.size:
                raise ValueError(
                    f"PacTrainCompressor(quantize='ternary') payloads must be summed with "
                    f"op=hvd.Sum (its sentinel reads {summed}, not hvd.size()="
                    f"{self.collectives.size}: Horovod averaged or otherwise did not sum "
                    f"them; integer averaging floors). Pass op=hvd.Sum, and average=True to "
                    f"PacTrainCompressor for the mean")
            tensor = tensor[:-1]
        if ctx.kind == "ternary":
            xp, words = _as_xp(tensor)
            sums = _as_torch(self._codec.decode(xp, words, ctx.count))
            compute = torch.float64 if param.dtype == torch.float64 else torch.float32
            tensor = sums.to(compute) * ctx.scale
        if self.average:
            tensor = tensor / self.collectives.size
        tensor = tensor.to(param.dtype)
        if ctx.packed:
            out = torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
            out[self._indices[ctx.index]] = tensor
            tensor = out
        return tensor.reshape(param.shape).contiguous()
