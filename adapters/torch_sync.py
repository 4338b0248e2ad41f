"""PacTrain gradient synchronization for raw PyTorch training loops over mpi4py.

:class:`PacTrainSync` wraps a :class:`pacmpi.PacTrainReducer`. Per-parameter hooks
(``Tensor.register_post_accumulate_grad_hook``) apply the gradient sparsity mask (GSE,
``G = mask * G``) as soon as a gradient is accumulated and launch a bucket's all-reduce the
moment its last gradient arrives, while backward still runs; :meth:`PacTrainSync.synchronize`
(called by hand or by the optimizer step pre-hook that :meth:`PacTrainSync.attach` installs)
waits, unpacks and averages. The same object runs the baselines (``method="dense"`` / ``"fp16"``)
so one script measures itself against them (the compression baselines, TopK among them, are
in :mod:`pacmpi.experiments.baselines`).

Tensors reach pacmpi zero-copy: CPU tensors as NumPy views (``Tensor.numpy()``; bfloat16 as
``ml_dtypes.bfloat16`` views), CUDA tensors as CuPy arrays via DLPack (CuPy is imported only
when a CUDA tensor is seen); see :mod:`pacmpi.adapters.convert`. Mixed-dtype models get a bucket
per dtype; bfloat16 buckets are summed in bfloat16 by MPI through pacmpi's compiled sum
(:mod:`pacmpi.half_sum`; device buffers host-staged).

Parameters without a gradient in a step (``p.grad is None`` because the parameter did not take
part in the forward pass on this rank) are given a zero gradient in :meth:`synchronize`, so every
rank reduces the same buffers; their buckets are launched only then. A parameter whose
``.grad`` was kept from an earlier step (``zero_grad(set_to_none=False)``) and that is unused in
this step contributes that ``.grad`` as it stands.
"""
import time
import warnings

import numpy as np
import torch

from pacmpi import DEFAULT_BUCKET_BYTES, Collectives, MPICollectives, PacTrainReducer
from pacmpi.adapters.convert import as_array, numpy_dtype
from pacmpi.adapters.pruning import masks_digest
from pacmpi.methods import ALLREDUCE_METHODS, lookup_method
from pacmpi.options import EngineOptions

__all__ = ["PacTrainSync", "barrier", "broadcast_buffers", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters", "transport"]

# The method sets quantize; word_dtype is the reducer's choice.
_KNOBS = ("average", "verify_every", "on_mismatch", "stable_steps", "error_feedback", "seed",
          "ternary_scale")
_STAT_KEYS = ("pack_seconds", "comm_seconds", "unpack_seconds", "verify_seconds", "bytes_sent",
              "dense_elements_equivalent", "packed_reductions", "dense_reductions",
              "dense_fallbacks", "resyncs")


def transport(comm=None, collectives=None):
    """The :class:`pacmpi.Collectives` that a helper taking ``comm=`` / ``collectives=`` runs on.

    ``collectives`` (any transport, e.g. :class:`pacmpi.adapters.horovod.HorovodCollectives`)
    is used as it is; so is a ``Collectives`` passed as ``comm``. An mpi4py communicator is
    wrapped as it stands, without duplicating it; neither given: ``COMM_WORLD``. Passing both
    is an error, since they could name different process groups.
    """
    if comm is not None and collectives is not None:
        raise ValueError("pass comm= or collectives=, not both")
    if collectives is not None:
        return collectives
    if isinstance(comm, Collectives):
        return comm
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return MPICollectives(comm=comm)


# ---------------------------------------------------------------------------------- broadcasts
def barrier(collectives):
    """Block until every rank of ``collectives`` arrives: a one-element all-reduce, which any
    transport has (MPI's or Horovod's). Collective."""
    collectives.allreduce(np.zeros(1, dtype=np.int64), "max")


def broadcast_object(collectives, obj, root=0):
    """``root``'s ``obj`` (any picklable value) on every rank; the others pass anything, e.g.
    ``None``. Collective; one object all-gather, so keep ``obj`` small on non-root ranks."""
    return collectives.allgather_object(obj if collectives.rank == root else None)[root]


def _bcast_tensor(collectives, tensor, root):
    with torch.no_grad():
        staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        # As bytes, so every dtype (int64 counters, bool, bfloat16) travels the same way.
        collectives.bcast(as_array(staged.view(-1).view(torch.uint8)), root=root)
        if staged is not tensor:
            tensor.copy_(staged)


def broadcast_parameters(model, *, comm=None, root=0, buffers=True, collectives=None):
    """Copy ``root``'s parameters (and, with ``buffers``, BatchNorm statistics and other buffers)
    into every rank's ``model`` in place. Collective over ``comm`` (mpi4py, default
    ``COMM_WORLD``) or ``collectives`` (any :class:`pacmpi.Collectives`), see :func:`transport`."""
    collectives = transport(comm, collectives)
    tensors = list(model.parameters()) + (list(model.buffers()) if buffers else [])
    for tensor in tensors:
        _bcast_tensor(collectives, tensor, root)


def broadcast_buffers(model, *, comm=None, root=0, collectives=None):
    """Copy ``root``'s buffers (BatchNorm running statistics) into every rank's ``model``.

    Synchronized training keeps parameters identical on every rank, but each rank's BatchNorm
    statistics follow its own data shard; this is the cheap sync before an evaluation."""
    collectives = transport(comm, collectives)
    for tensor in model.buffers():
        _bcast_tensor(collectives, tensor, root)


def broadcast_optimizer_state(optimizer, *, comm=None, root=0, collectives=None):
    """Make every rank's optimizer state (momentum, Adam moments, step counts, hyper-parameters)
    ``root``'s. Collective over ``comm`` or ``collectives`` (see :func:`transport`); the state
    travels pickled, so keep it to optimizers of small models or call it once after loading a
    checkpoint."""
    import io

    collectives = transport(comm, collectives)
    payload = None
    if collectives.rank == root:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        payload = buffer.getvalue()
    payload = broadcast_object(collectives, payload, root=root)
    if collectives.rank != root:
        optimizer.load_state_dict(torch.load(io.BytesIO(payload), map_location="cpu",
                                             weights_only=False))


# ---------------------------------------------------------------------------------- base
def model_masks(model, masks):
    """``(params, names, mask_list, mask_names)``: the model's trainable parameters in reverse
    registration order (like DDP: the last layers' gradients arrive first), their names, a bool
    mask tensor (a copy, on the parameter's device) or ``None`` per parameter, and
    ``{key as given: parameter index}``. ``"fc.weight"`` also matches torch-prune's
    ``"fc.weight_orig"``; a mask of another shape than its parameter is a ValueError."""
    names = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    params = [p for p in names if p.requires_grad][::-1]
    names = [names[p] for p in params]
    index = {name: i for i, name in enumerate(names)}
    mask_list, mask_names = [None] * len(params), {}
    for key, mask in (masks or {}).items():
        # torch.nn.utils.prune keeps the gradient on "<name>_orig"; masks use "<name>".
        i = next((index[c] for c in (key, key + "_orig") if c in index), None)
        if i is None:
            raise ValueError(f"mask {key!r} names no trainable parameter of the model")
        mask = torch.as_tensor(mask).to(device=params[i].device, dtype=torch.bool).clone()
        if mask.shape != params[i].shape:
            raise ValueError(f"mask {key!r} has shape {tuple(mask.shape)}, parameter "
                             f"{names[i]!r} has {tuple(params[i].shape)}")
        mask_list[i], mask_names[key] = mask, i
    return params, names, mask_list, mask_names


class HookedSync:
    """Parameter discovery, mask handling (GSE), gradient hooks, step timing and state shared by
    :class:`PacTrainSync` and the baselines of :mod:`pacmpi.experiments.baselines`. Subclasses
    implement ``grad_ready(i)`` (optional early launch), ``reduce_grads(arrays)`` and
    ``engine_state()`` / ``load_engine_state(state, same_world)``."""

    def __init__(self, model, masks, collectives, method):
        self.model = model
        self.method = method
        self.collectives = collectives
        self.params, self.names, self._masks, self._mask_names = model_masks(model, masks)
        self._pruned = [None if m is None else ~m for m in self._masks]
        self.dense_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._arrays = [None] * len(self.params)
        self._seen = [False] * len(self.params)
        self._in_step = False
        self._forward_started = None
        self._hook_seconds = 0.0
        self._stats_mark = {}
        self.last_step = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)]
        self._handles.append(model.register_forward_pre_hook(self._on_forward))

    # ------------------------------------------------------------------ masks
    @property
    def masks(self):
        """The current masks (bool tensors, shared with the sync), keyed as given."""
        return {key: self._masks[i] for key, i in self._mask_names.items()}

    def set_masks(self, masks):
        """Write new masks (e.g. from a pruning schedule) into the sync's mask tensors, in place,
        so the reducer sees them at its next verification. Every masked name must be given and
        no new one: to prune a parameter later, pass an all-True mask for it at construction."""
        if set(masks) != set(self._mask_names):
            raise ValueError(f"set_masks() needs exactly the masks given at construction: "
                             f"{sorted(self._mask_names)}, got {sorted(masks)}")
        with torch.no_grad():
            for key, i in self._mask_names.items():
                self._masks[i].copy_(torch.as_tensor(masks[key]).to(torch.bool))
                torch.logical_not(self._masks[i], out=self._pruned[i])

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, module, args):
        if module.training and self._forward_started is None:
            self._forward_started = time.perf_counter()
            self._in_step = True

    def _hook(self, i):
        def hook(param):
            if self._seen[i]:
                raise RuntimeError(
                    f"gradient of {self.names[i]!r} accumulated twice before synchronize(); "
                    "call synchronize() (or optimizer.step() on an attached optimizer) after "
                    "every backward")
            started = time.perf_counter()
            self._in_step = True
            self._prepare(i)
            self.grad_ready(i)
            self._hook_seconds += time.perf_counter() - started

        return hook

    def _prepare(self, i):
        param = self.params[i]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if self._pruned[i] is not None:
            with torch.no_grad():
                param.grad.masked_fill_(self._pruned[i], 0)  # GSE; masked_fill also zeroes inf/NaN
        self._arrays[i] = as_array(param.grad)
        self._seen[i] = True

    def grad_ready(self, i):
        """Called once gradient ``i`` is masked and viewed; subclasses may launch work."""

    # ------------------------------------------------------------------ step
    def synchronize(self):
        """Finish this step's reduction: gradients of every rank summed (averaged) into
        ``p.grad``. A no-op when no training forward or backward ran since the last call, so
        calling it by hand before an attached ``optimizer.step()`` is harmless. Collective."""
        if not self._in_step:
            return
        started = time.perf_counter()
        for i, seen in enumerate(self._seen):
            if not seen:
                self._prepare(i)
        self.reduce_grads(self._arrays)
        finished = time.perf_counter()
        # Deltas since the previous step, so work launched from the hooks is counted too.
        step = {key: self.stats[key] - self._stats_mark.get(key, 0) for key in _STAT_KEYS}
        self._stats_mark = dict(self.stats)
        forward = self._forward_started if self._forward_started is not None else started
        step.update(compute_seconds=max(0.0, started - forward - self._hook_seconds),
                    hook_seconds=self._hook_seconds, wait_seconds=finished - started,
                    dense_bytes=self.dense_bytes)
        self.last_step = step
        self._arrays = [None] * len(self.params)
        self._seen = [False] * len(self.params)
        self._in_step = False
        self._forward_started = None
        self._hook_seconds = 0.0

    def attach(self, optimizer):
        """Run :meth:`synchronize` before every ``optimizer.step()``; returns the hook handle."""
        handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.synchronize())
        self._handles.append(handle)
        return handle

    def remove(self):
        """Remove every hook this sync installed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """Method, world size, masks (CPU bool tensors) with their SHA-256 fingerprint, and the
        reduction engine's state (tracker, error-feedback residuals, step, counters)."""
        masks = {key: mask.detach().cpu().clone() for key, mask in self.masks.items()}
        return {"method": self.method, "world_size": self.collectives.size, "masks": masks,
                "fingerprint": masks_digest(masks) if masks else None,
                "engine": self.engine_state()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output (collective). Masks are written in place and checked
        against their fingerprint. At another world size the per-rank error-feedback residuals
        cannot carry over: they are reset, with a warning."""
        if state["method"] != self.method:
            raise ValueError(f"checkpoint was taken with method {state['method']!r}, this sync "
                             f"runs {self.method!r}")
        masks = state["masks"]
        if (masks_digest(masks) if masks else None) != state["fingerprint"]:
            raise ValueError("checkpoint masks do not match their fingerprint (corrupt file?)")
        if masks:
            self.set_masks(masks)
        if state["world_size"] != self.collectives.size and self._has_residuals(state["engine"]):
            warnings.warn(f"resuming {self.method} at world size {self.collectives.size} from a "
                          f"checkpoint taken at {state['world_size']}: error-feedback residuals "
                          "are per-rank and restart from zero", RuntimeWarning, stacklevel=2)
        self.load_engine_state(state["engine"],
                               same_world=state["world_size"] == self.collectives.size)
        self._stats_mark = dict(self.stats)

    @staticmethod
    def _has_residuals(engine_state):
        return bool(engine_state.get("residuals"))


# ---------------------------------------------------------------------------------- PacTrain
class PacTrainSync(HookedSync):
    """Hook-driven PacTrain all-reduce of a model's gradients.

    Parameters
    ----------
    model:
        The ``torch.nn.Module``; every parameter with ``requires_grad`` is synchronized,
        bucketed in reverse registration order (as DDP does) so early buckets complete first.
    comm:
        mpi4py communicator (default: a duplicate of ``COMM_WORLD``).
    masks:
        ``{name: bool tensor}`` keep-masks, e.g. from :func:`pacmpi.adapters.pruning.prune`
        (``"fc.weight"`` also matches torch-prune's ``"fc.weight_orig"``). Gradients are
        masked (GSE) whatever the method; ``None``: no masks, dense.
    method:
        ``"pactrain"`` (only surviving coordinates are sent), ``"pactrain-ternary"`` (those,
        ternary-quantized), ``"dense"`` (plain all-reduce of whole
        gradients) or ``"fp16"`` (whole gradients as float16); see :mod:`pacmpi.methods`.
    bucket_bytes, options, verify_every, on_mismatch, stable_steps, seed, average,
    error_feedback, ternary_scale:
        Passed to :class:`pacmpi.PacTrainReducer` (``error_feedback`` and ``ternary_scale``
        only matter for ``"pactrain-ternary"``; ``method`` sets ``quantize``).
    collectives:
        Another :class:`pacmpi.Collectives` transport instead of ``comm``.
    abort_on_error:
        See :class:`pacmpi.PacTrainReducer`: by default an unhandled exception on one of
        several ranks ends the whole MPI job instead of hanging it.
    """

    def __init__(self, model, *, comm=None, masks=None, method="pactrain",
                 bucket_bytes=DEFAULT_BUCKET_BYTES, collectives=None, abort_on_error=None,
                 options=None, **knobs):
        try:
            spec = lookup_method(method, ALLREDUCE_METHODS)
        except ValueError as exc:
            raise ValueError(f"{exc} (the all-gather baselines are TopKSync, TernGradSync and "
                             "DGCSync in pacmpi.experiments.baselines)") from None
        EngineOptions.check_names(knobs, who="PacTrainSync", takes=_KNOBS)
        super().__init__(model, masks, None, spec.name)
        reducer_masks = [as_array(m) if (spec.packed and m is not None) else None
                         for m in self._masks]
        self.reducer = PacTrainReducer(
            reducer_masks, comm=comm, collectives=collectives, bucket_bytes=bucket_bytes,
            options=options, quantize=spec.quantize, **knobs, abort_on_error=abort_on_error,
            shapes=[tuple(p.shape) for p in self.params],
            dtypes=[numpy_dtype(p.dtype) for p in self.params])
        self.collectives = self.reducer.collectives
        layout = self.reducer.layout
        self._bucket_of = [layout.bucket_of(i) for i in range(len(self.params))]
        self._missing = [len(b.members) for b in layout.buckets]

    @property
    def stats(self):
        """The reducer's cumulative counters (see :class:`pacmpi.PacTrainReducer`)."""
        return self.reducer.stats

    def grad_ready(self, i):
        b = self._bucket_of[i]
        self._missing[b] -= 1
        if self._missing[b] == 0:
            self.reducer.mark_ready(b, self._arrays)
        else:  # the buckets in flight move on while backward computes (MPI needs the calls)
            self.reducer.progress()

    def reduce_grads(self, arrays):
        self.reducer.wait(arrays)
        self._missing = [len(b.members) for b in self.reducer.layout.buckets]

    def engine_state(self):
        return self.reducer.state_dict()

    def load_engine_state(self, state, same_world):
        self.reducer.load_state_dict(state)
