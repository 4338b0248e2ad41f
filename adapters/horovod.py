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

A step that never completes (backward raised after some hooks had compressed their
gradients) is ended by :meth:`PacTrainCompressor.reset_step`, or else when the next step
compresses one of those gradients again, which cannot happen within a step; either way the
retried step keeps its step number and no error-feedback state of the abandoned one.

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

Checkpoints
-----------
:meth:`PacTrainCompressor.state_dict` holds the step, the mask tracker, the error-feedback
residuals (host arrays) and the counters; a new compressor resumes from it bit for bit (same
world size), after the masks and the model have been restored. Loading is collective and checks
the checkpoint against the compressor on every rank, so a wrong checkpoint fails everywhere.
"""
import itertools
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from pacmpi import Collectives, MaskTracker, TernaryCodec, stochastic_ternary
from pacmpi.adapters.pruning import named_prunable_parameters
from pacmpi.errors import LayoutMismatchError, MaskMismatchError
from pacmpi.hashing import digest_ints, splitmix64_int
from pacmpi.verify import agree, gather_details, offending_ranks, raise_together, run_together

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
    """What decompress needs, self-contained so that a late result of an abandoned step still
    decodes: the parameter, its encoding, survivor indices, ternary scale, the step generation
    and the error-feedback residual to commit once the result is back."""

    __slots__ = ("index", "kind", "indices", "generation", "scale", "count", "residual")

    def __init__(self, index, kind, indices, generation, scale=None, count=None, residual=None):
        self.index, self.kind, self.indices, self.generation = index, kind, indices, generation
        self.scale, self.count, self.residual = scale, count, residual

    @property
    def packed(self):
        return self.indices is not None


def _every_parameter(name, param):
    """``include=`` for named_prunable_parameters: any parameter may carry a mask here."""
    return True


def _observe(flat_mask):
    """(fingerprint, survivors) of a flat torch mask, ``(None, None)`` for none."""
    return (None, None) if flat_mask is None else MaskTracker.observe(*_as_xp(flat_mask))


def _survivors(flat_mask):
    xp, mask = _as_xp(flat_mask)
    return xp.flatnonzero(mask)


def _new_stats():
    return dict.fromkeys(
        ("steps", "verifications", "packed_tensors", "dense_tensors", "dense_fallbacks",
         "nonfinite_fallbacks", "abandoned_steps", "bytes_sent", "dense_bytes_equivalent"), 0)


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
        (torch tensor, NumPy or CuPy array). Unlisted parameters are not pruned. A name is a
        key of the bound ``(name, parameter)`` pairs or, when a module is given, a logical
        name of :func:`pacmpi.adapters.pruning.named_prunable_parameters`: ``"fc.weight"``
        of a module reparametrized by ``torch.nn.utils.prune`` names ``fc.weight_orig``, the
        leaf that receives ``.grad`` (as :func:`~pacmpi.adapters.pruning.masks_from_torch_prune`
        keys them). Unknown names, or two names of one parameter, raise on every rank.
        Masks are re-read at every verification, so they may be changed in place (gradual
        pruning); :meth:`set_masks` replaces the mapping. A changed mask is reduced dense
        (masked) until it has been unchanged for ``stable_steps`` steps, then packed.
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
    gradients. ``stats`` counts steps, verifications, packed/dense tensors, abandoned steps
    and bytes.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict`. Pickling drops the Horovod
    transport (rebuilt on first use, after ``hvd.init()``) but keeps the bound parameters by
    identity, so an unpickled compressor reduces the gradients of the parameters pickled with
    it: pickle it together with its model (one ``pickle.dumps((model, compressor))``), or
    use :meth:`state_dict` with a new compressor.
    """

    def __init__(self, model_or_named_parameters, masks, *, quantize=None, average=False,
                 stable_steps=1, verify_every=1, error_feedback=True, seed=0):
        self._collectives = HorovodCollectives()
        error = None
        try:
            if isinstance(model_or_named_parameters, torch.nn.Module):
                named = list(model_or_named_parameters.named_parameters())
                logical = named_prunable_parameters(model_or_named_parameters,
                                                    include=_every_parameter)
            else:
                named, logical = list(model_or_named_parameters), {}
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
            self._key_index = self._mask_keys(logical)
            self._masks = self._resolve(masks)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(self.collectives, error)
        self._step = 0
        # Indices compressed and not yet decompressed in the current step, and the step's
        # generation: reset_step() moves on to a new one, and results of older ones are stale.
        self._pending, self._generation = set(), 0
        self._by_id, self._cached_ids = {}, [None] * len(self._params)
        self._torch_masks = [None] * len(self._params)
        self._indices = [None] * len(self._params)
        self._residuals = {}
        self.stats = _new_stats()

    # ------------------------------------------------------------------ configuration
    @property
    def collectives(self):
        if self._collectives is None:  # unpickled: Horovod state belongs to the process
            self._collectives = HorovodCollectives()
        return self._collectives

    @property
    def step(self):
        """Completed steps (an abandoned step does not count)."""
        return self._step

    @property
    def outstanding(self):
        """Gradients of the current step compressed and not yet decompressed."""
        return len(self._pending)

    @property
    def tracker(self):
        return self._tracker

    def set_masks(self, masks):
        """Replace the mask mapping; takes effect at the next verification. Collective."""
        resolved = run_together(self.collectives, self._resolve, masks)
        self._masks = resolved

    def _mask_keys(self, logical):
        """Mask key -> parameter index: the bound names, then the logical names of ``logical``
        (name -> leaf parameter) that lead to a bound parameter under another name."""
        index_of = {id(param): index for index, param in enumerate(self._params)}
        keys = {name: index for index, name in enumerate(self._names)}
        for name, param in logical.items():
            if id(param) in index_of:
                keys.setdefault(name, index_of[id(param)])
        return keys

    def _resolve(self, masks):
        """``masks`` keyed by parameter index; the mask objects themselves, so in-place
        updates stay visible."""
        if not isinstance(masks, Mapping):
            raise TypeError(f"masks must be a mapping from parameter name to mask, got "
                            f"{type(masks).__name__}")
        unknown = [key for key in masks if key not in self._key_index]
        if unknown:
            aliases = sorted(k for k in self._key_index if k not in self._names)
            raise ValueError(
                f"masks name parameters that are not bound: {unknown}; keys are the bound "
                f"parameter names or, when the compressor is given the nn.Module, "
                f"torch.nn.utils.prune's logical names (known here: {aliases})")
        resolved, keys = {}, {}
        for key, mask in masks.items():
            index = self._key_index[key]
            if index in resolved:
                raise ValueError(f"masks {keys[index]!r} and {key!r} both name parameter "
                                 f"{self._names[index]!r}")
            resolved[index], keys[index] = mask, key
        return resolved

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor):
        """Payload for Horovod to all-reduce, and the context :meth:`decompress` needs."""
        error = index = None
        try:
            index = self._index_of(tensor)
        except LookupError as exc:
            error = exc
        if index in self._pending:
            # Each gradient is compressed once per step: this one again means that the step
            # in progress was abandoned (backward raised after some hooks had fired).
            warnings.warn(f"PacTrainCompressor: {self._names[index]!r} compressed again with "
                          f"{len(self._pending)} gradient(s) of step {self._step} outstanding; "
                          "treating that step as abandoned (call reset_step() after abandoning "
                          "a step to avoid this warning)", RuntimeWarning, stacklevel=2)
            self.reset_step()
        if not self._pending:
            self._begin_step(error)
        elif error is not None:
            raise error
        payload, ctx = self._encode(index, tensor)
        self._pending.add(index)
        return payload, ctx

    def decompress(self, tensor, ctx):
        """The reduced gradient in the parameter's shape and dtype (``ctx=None``: as is)."""
        if ctx is None:  # Horovod's sparse path, or a tensor this compressor never encoded
            return tensor
        current = ctx.generation == self._generation
        try:
            result = self._decode(tensor, ctx)
            if current and ctx.residual is not None:
                self._commit_residual(ctx)
            return result
        finally:
            if current:
                self._pending.discard(ctx.index)
                if not self._pending:
                    self._step += 1
                    self.stats["steps"] += 1

    def reset_step(self):
        """Abandon the step in progress, e.g. after backward raised midway.

        The next ``compress`` starts the step afresh (verifying first, when due) under the
        same step number; results of the abandoned step that still arrive decode but change
        nothing, and its ternary rounding errors are not kept. Local and a no-op between
        steps; call it on every rank that abandons the step. A rank that does not is reset at
        its next ``compress`` of a gradient the abandoned step had already compressed (with a
        warning), which in a fixed backward order is the first one.

        Horovod's own in-flight all-reduces are the caller's: wait for them and drop them
        (``hvd.DistributedOptimizer.load_state_dict`` clears its handles), or instead finish
        the step with ``optimizer.synchronize()``, which needs no reset.
        """
        if self._pending:
            self.stats["abandoned_steps"] += 1
        self._pending = set()
        self._generation += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """Step, mask tracker, error-feedback residuals (host arrays, by parameter name),
        counters, and what :meth:`load_state_dict` checks. Only between steps."""
        self._check_between_steps("state_dict")
        return {
            "step": self._step,
            "seed": self.seed,
            "quantize": self.quantize,
            "world_size": self.collectives.size,
            "params": self._describe(),
            "tracker": self._tracker.state_dict(),
            "residuals": {self._names[i]: r.detach().cpu().numpy().copy()
                          for i, r in self._residuals.items()},
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output. Collective: fails on every rank together,
        leaving the compressor as it was, unless the quantize mode and the bound parameters
        (names, shapes, dtypes) match the checkpoint's and every mask has the fingerprint of
        the checkpoint's last verification (restore the masks first). Residuals are per-rank
        quantization errors: at another world size they are dropped, with a warning. Any step
        in progress is abandoned."""
        restored = run_together(self.collectives, self._restored, state,
                                errors=(TypeError, ValueError, KeyError))
        tracker, flats, residuals = restored
        if state["world_size"] != self.collectives.size and residuals:
            warnings.warn(f"PacTrainCompressor: resuming at world size {self.collectives.size} "
                          f"from a checkpoint taken at {state['world_size']}: error-feedback "
                          "residuals are per-rank and restart from zero", RuntimeWarning,
                          stacklevel=2)
            residuals = {}
        self.reset_step()
        self._tracker, self._residuals, self._step = tracker, residuals, state["step"]
        self._use_tracker(flats)
        self.stats = dict(_new_stats(), **state["stats"])

    def _restored(self, state):
        """(tracker, flat masks, residuals) of a checkpoint, checked against this compressor."""
        if state["quantize"] != self.quantize:
            raise ValueError(f"checkpoint has quantize={state['quantize']!r}, "
                             f"compressor has {self.quantize!r}")
        saved_params = [(n, tuple(s), d) for n, s, d in state["params"]]
        if saved_params != self._describe():
            differing = [(saved, here) for saved, here in
                         itertools.zip_longest(saved_params, self._describe()) if saved != here]
            raise ValueError(f"checkpoint parameters (name, shape, dtype) differ from the bound "
                             f"ones; first (checkpoint, here): {differing[:3]}")
        saved = state["tracker"]
        flats = [self._flat_mask(i) for i in range(len(self._params))]
        if saved["last_commit_step"] is not None:
            changed = [name for name, flat, bucket in zip(self._names, flats, saved["buckets"])
                       if _observe(flat)[0] != bucket["fingerprint"]]
            if changed:
                raise ValueError(f"masks of {changed} differ from those verified at step "
                                 f"{saved['last_commit_step']} of the checkpoint; restore the "
                                 "checkpoint's masks before loading it")
        tracker = MaskTracker(len(self._params), stable_steps=self._tracker.stable_steps)
        tracker.version, tracker.last_commit_step = saved["version"], saved["last_commit_step"]
        for bucket, flat, entry in zip(tracker.buckets, flats, saved["buckets"]):
            bucket.fingerprint, bucket.survivors = entry["fingerprint"], entry["survivors"]
            bucket.stable_steps = entry["stable_steps"]
            bucket.mask = None if flat is None else _as_xp(flat)[1]
            bucket.indices = _survivors(flat) if entry["packed"] else None
        index_of = {name: index for index, name in enumerate(self._names)}
        residuals = {index_of[name]: torch.tensor(array, device=self._params[index_of[name]].device)
                     for name, array in state["residuals"].items()}
        return tracker, flats, residuals

    def _describe(self):
        return [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]

    def _check_between_steps(self, what):
        if self._pending:
            raise RuntimeError(f"PacTrainCompressor.{what}() with {len(self._pending)} "
                               f"gradient(s) of step {self._step} outstanding; call it between "
                               "optimizer steps (or reset_step() first)")

    def __getstate__(self):
        self._check_between_steps("__getstate__")
        state = self.__dict__.copy()
        # Horovod's transport and tensor ids are only valid in this process.
        state["_collectives"] = None
        state["_by_id"], state["_cached_ids"] = {}, [None] * len(self._params)
        return state

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
        mask = self._masks.get(index)
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
            observations = [_observe(f) for f in flats]
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
        for index, flat in enumerate(flats):
            if self._tracker.ready_to_pack(index):
                self._tracker.buckets[index].indices = _survivors(flat)
        self._use_tracker(flats)

    def _use_tracker(self, flats):
        """Encode with the tracker's state: each parameter's flat mask, survivors if packed."""
        for index, (state, flat) in enumerate(zip(self._tracker.buckets, flats)):
            self._torch_masks[index] = flat
            self._indices[index] = None if state.indices is None else _as_torch(state.indices)

    def _fields(self, observations):
        fields = {
            "magic": _MAGIC, "step": self._step, "params": len(self._params),
            "elements": sum(p.numel() for p in self._params),
            "quantize": _QUANTIZE_MODES.index(self.quantize), "average": int(self.average),
            "survivors": sum(p.numel() if s is None else s
                             for p, (_, s) in zip(self._params, observations)),
            "version": self._tracker.version,
        }
        fields.update(zip(("layout0", "layout1", "layout2", "layout3"),
                          digest_ints(self._describe())))
        fields.update(zip(("mask0", "mask1", "mask2", "mask3"),
                          digest_ints([o for pair in observations for o in pair])))
        return fields

    def _raise_mismatch(self, error_type, fields, observations):
        descriptor = {
            "step": self._step, "quantize": self.quantize, "version": self._tracker.version,
            "params": self._describe(),
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
        indices = self._indices[index] if state.packed else None
        flat = tensor.reshape(-1)
        self.stats["dense_bytes_equivalent"] += tensor.numel() * tensor.element_size()
        if indices is not None:
            payload = flat.index_select(0, indices)
            self.stats["packed_tensors"] += 1
        else:
            payload = flat
            mask = self._torch_masks[index]
            if mask is not None and state.survivors < mask.numel():
                payload = flat.masked_fill(~mask, 0)
                self.stats["dense_fallbacks"] += 1
            self.stats["dense_tensors"] += 1
        if self.quantize == "ternary":
            return self._encode_ternary(index, payload, indices)
        self.stats["bytes_sent"] += payload.numel() * payload.element_size()
        if payload is flat:  # unmasked: reduce the gradient itself, as Compression.none does
            return tensor, _Context(index, "as_is", indices, self._generation)
        return payload, _Context(index, "float", indices, self._generation)

    def _residual(self, index, compute):
        param = self._params[index]
        residual = self._residuals.get(index)
        if residual is None or residual.dtype != compute:
            residual = torch.zeros(param.numel(), dtype=compute, device=param.device)
            self._residuals[index] = residual
        return residual

    def _encode_ternary(self, index, payload, indices):
        compute = torch.float64 if payload.dtype == torch.float64 else torch.float32
        values = payload.to(compute, copy=True)
        mask = self._torch_masks[index]
        if self.error_feedback:
            residual = self._residual(index, compute)
            values += residual if indices is None else residual[indices]
            if indices is None and mask is not None:
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
            return wire, _Context(index, "float_sentinel", indices, self._generation,
                                  count=payload.numel())
        scale = float(agreed[0])
        xp, values_xp = _as_xp(values)
        key = splitmix64_int(self.seed ^ splitmix64_int(
            (self._step << 32) ^ (index << 16) ^ self.collectives.rank))
        codes = stochastic_ternary(xp, values_xp, scale, key)
        # Kept by decompress, once the codes have been summed: an abandoned step leaves the
        # residual as it was.
        new_residual = (values - _as_torch(codes).to(compute) * scale
                        if self.error_feedback else None)
        words = _as_torch(self._codec.encode(xp, codes))
        wire = torch.cat([words, words.new_ones(1)])
        self.stats["bytes_sent"] += wire.numel() * wire.element_size()
        return wire, _Context(index, "ternary", indices, self._generation, scale=scale,
                              count=payload.numel(), residual=new_residual)

    def _commit_residual(self, ctx):
        residual = self._residuals[ctx.index]
        if ctx.packed:
            residual[ctx.indices] = ctx.residual
        else:
            residual.copy_(ctx.residual)

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
            out[ctx.indices] = tensor
            tensor = out
        return tensor.reshape(param.shape).contiguous()
