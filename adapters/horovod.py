"""PacTrain on Horovod: ``hvd.DistributedOptimizer(..., compression=PacTrainCompressor(model,
masks))`` all-reduces only the unpruned coordinates. Each bound parameter is one bucket of a
:class:`pacmpi.engine.StepEngine` (verification through Horovod, under the MPI and the Gloo
controller alike; packing; ternary); this module maps ``compress``/``decompress`` onto it.

A *step* runs from the first ``compress`` with nothing outstanding to the ``decompress`` that
leaves nothing outstanding: ``DistributedOptimizer`` compresses every gradient before it
decompresses any, so that is one optimizer step; a bare ``hvd.allreduce(grad,
compression=...)`` is a step of its own. Verification runs in that first ``compress``, before
this rank submits any all-reduce of the step, so every rank reaches it and Horovod's by-name
negotiation cannot deadlock. A step abandoned midway (backward raised) ends with
:meth:`PacTrainCompressor.reset_step`, or when a gradient it had compressed comes again.

Horovod 0.28.1 cannot all-reduce bfloat16 (horovod#4047): a bfloat16 gradient's payload
(lossless, or a ternary bucket sent unquantized) travels as a float32 copy, summed (or averaged)
by Horovod in float32 and rounded to bfloat16 once in ``decompress``; ``quantize="fp16"`` and
ternary words need no staging.

Ternary words must be *summed* (``op=hvd.Sum``; ``average=True`` here gives the mean): Horovod
averages integers by floor division, so each payload carries a sentinel 1 that must read
``hvd.size()`` after the reduction. Scales are agreed per parameter under its name, so a
differing gradient order stalls (Horovod's warning) instead of pairing the wrong scales.

Elastic Horovod (``hvd.elastic.run``): pass the compressor to the state beside the model and
optimizer, ``hvd.elastic.TorchState(model, optimizer, compression=compressor, ...)`` (a state
handler for it is registered with Horovod when a compressor is built). ``state.commit()`` saves
its engine state (step, mask tracker, residuals, counters) with the model; after a failure
``restore()`` rolls it back to that commit; after every reset each rank binds anew to the new
world together, as at first use (construction is not collective, so a worker that joins may
build its compressor before ``hvd.elastic.run``, as Horovod requires), and the ranks that held
state at the last commit carry it over: the step, tracker and counters of the most advanced
ones, masks verified against it on every rank. Error-feedback residuals: when the world is the
same set of ranks each keeps its own; otherwise every rank starts from the sum of the residuals
the old ranks kept, divided by the old world size (a lost rank's count as zero): with averaged
reductions the new run then owes what the old one did, ``(1/N') * N' * mean = (1/N) * sum``,
the rule of :mod:`pacmpi.adapters.checkpoint`.
"""
import itertools
import warnings

import numpy as np
import torch

from pacmpi.adapters.convert import as_array, as_tensor, numpy_dtype
from pacmpi.adapters.horovod_collectives import (
    HorovodCollectives,
    restart_names,
    summable,
    world_size,
)
from pacmpi.adapters.masks import MaskBinding
from pacmpi.engine import MEMORY_COMPONENTS, BucketSpec, StepEngine
from pacmpi.faults import ensure_abort_on_error
from pacmpi.options import EngineOptions, knob
from pacmpi.payloads import InPlace
from pacmpi.verify import raise_together, run_together

__all__ = ["HorovodCollectives", "PacTrainCompressor"]

# The engine's counters that stats shows (timings are left out: they differ run to run).
_STATS = ("steps", "verifications", "packed_reductions", "dense_reductions", "dense_fallbacks",
          "nonfinite_fallbacks", "abandoned_steps", "bytes_sent", "dense_bytes_equivalent")


class PacTrainCompressor:
    """Horovod compression that sends only the gradient coordinates the shared masks keep.

    Pass it as ``compression=`` to ``hvd.DistributedOptimizer`` or ``hvd.allreduce``. It reduces
    the ``.grad`` of bound parameters, recognised by identity (else by storage and shape).
    Construction checks the options only; :meth:`bind` (collective, after ``hvd.init()``; the
    first ``compress`` binds when nobody did) checks the masks on every rank together.

    Parameters
    ----------
    model_or_named_parameters:
        An ``nn.Module`` or ``(name, parameter)`` pairs: the parameters whose gradients are
        reduced.
    masks:
        Parameter name -> bool (or 0/1) keep-mask of its shape (torch, NumPy or CuPy). With a
        module, ``torch.nn.utils.prune``'s logical names work too (``"fc.weight"`` names
        ``fc.weight_orig``). Re-read at every verification (in-place changes are seen);
        :meth:`set_masks` replaces the mapping. Unlisted parameters are not pruned.
    quantize:
        One of :data:`pacmpi.QUANTIZE_MODES`: ``None`` (lossless), ``"fp16"`` (survivors as
        float16) or ``"ternary"`` (requires ``op=hvd.Sum``).
    average:
        Ternary only: divide the decoded sum by ``hvd.size()`` (in lossless mode Horovod's
        ``op`` decides).
    options, stable_steps, verify_every, error_feedback, seed, abort_on_error, ternary_scale:
        As in :class:`pacmpi.PacTrainReducer` (each gradient is reduced on its own here, so
        ``ternary_scale`` ``"tensor"`` and ``"bucket"`` give the same scales; an int cuts each
        gradient into blocks of that many elements).

    Pruned coordinates come back as zeros (PacTrain's ``G = mask * G``). ``stats`` counts
    steps, verifications, packed/dense reductions (one per tensor), abandoned steps and
    bytes. Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (restore the masks
    first). Pickling drops the Horovod transport and keeps the bound parameters by identity:
    pickle it with its model.
    """

    def __init__(self, model_or_named_parameters, masks, *, options=None, abort_on_error=None,
                 **knobs):
        options = EngineOptions.build(
            options, knobs, who="PacTrainCompressor", average=False,
            takes=("quantize", "average", "stable_steps", "verify_every", "error_feedback",
                   "seed", "ternary_scale"))
        if options.on_mismatch != "raise":
            raise ValueError(f"PacTrainCompressor takes on_mismatch='raise' only, got "
                             f"{options.on_mismatch!r}: it writes no masks back")
        quantize, average = options.quantize, options.average
        if average and quantize != "ternary":  # Horovod's op averages the other payloads
            raise ValueError(f"average=True is for quantize='ternary', not {quantize!r}: "
                             "pass op=hvd.Average to Horovod instead")
        # Horovod sums no unsigned 64-bit words.
        self.options = options.replace(word_dtype="int64")
        self._source, self._masks, self._bound = model_or_named_parameters, masks, None
        self._abort_on_error = abort_on_error
        self._engine = self._world = None  # bound: the engine, and the world size it was for
        self._pending, self._by_id = set(), {}
        _register_elastic_handler()

    quantize, average = knob("quantize"), knob("average")
    step = property(lambda self: self._engine.step if self._engine else 0,
                    doc="Completed steps.")
    tracker = property(lambda self: self._engine.tracker if self._engine else None,
                       doc="The mask tracker (``None`` until bound).")
    outstanding = property(lambda self: len(self._pending),
                           doc="Gradients of the current step compressed, not decompressed.")

    def memory_report(self):
        """Bytes of the arrays the engine keeps between steps, by component
        (:meth:`pacmpi.engine.StepEngine.memory_report`); all zero until bound."""
        if self._engine is None:
            return dict.fromkeys(MEMORY_COMPONENTS, 0)
        return self._engine.memory_report()

    @property
    def stats(self):
        stats = self._engine.stats if self._engine else {}
        return {name: stats.get(name, 0) for name in _STATS}

    @property
    def collectives(self):
        if self._engine is None:
            return HorovodCollectives()
        if self._engine.collectives is None:  # unpickled: Horovod state is the process's
            self._engine.collectives = HorovodCollectives()
        return self._engine.collectives

    def set_masks(self, masks):
        """Replace the mask mapping; takes effect at the next verification. Collective once
        bound (a bad mapping raises on every rank); before, checked when binding."""
        if self._bound is None:
            self._masks = masks
        else:
            self._bound.masks = run_together(self.collectives, self._bound.resolve, masks)

    # ------------------------------------------------------------------ binding
    def bind(self):
        """Bind to the parameters, the masks and Horovod's current world: collective, on every
        rank together (after ``hvd.init()``); bad masks raise RankInputError on every rank. The
        first ``compress``, :meth:`state_dict` or :meth:`load_state_dict` binds when nobody
        did, and so does an elastic reset (module docstring)."""
        self._join()

    def _join(self):
        """Bind on every rank together to Horovod's current world, carrying the state of the
        ranks that hold one by the rule in the module docstring."""
        restart_names()  # ranks that just joined start their Horovod names from zero too
        collectives = HorovodCollectives()
        ensure_abort_on_error(self._abort_on_error, size=collectives.size)
        error = engine = None
        try:
            if self._bound is None:
                module = self._source
                is_module = isinstance(module, torch.nn.Module)
                named = list(module.named_parameters() if is_module else module)
                self._bound = MaskBinding(named, self._masks, module if is_module else None)
                self._names, self._params = self._bound.names, self._bound.params
            engine = StepEngine(collectives, [BucketSpec(n, numpy_dtype(p.dtype), p.numel())
                                              for n, p in zip(self._names, self._params)],
                                layout=self._describe(), options=self.options)
        except (TypeError, ValueError) as exc:
            self._bound = None
            error = exc
        raise_together(collectives, error)
        held = None if self._engine is None else self._held_state()
        infos = collectives.allgather_object(
            held and dict(held, residuals={b: (r.dtype.str, r.size)
                                           for b, r in held["residuals"].items()}))
        self._pending, self._by_id = set(), {}
        if any(infos):
            state = self._carried(collectives, infos, held)
            run_together(collectives, engine.loader, state, self._flat_masks(),
                         errors=(TypeError, ValueError, KeyError))()
        self._engine, self._world = engine, collectives.size

    def _held_state(self):
        """This rank's engine state, for the world size it was bound to."""
        engine = self._engine
        engine.collectives = engine.collectives or HorovodCollectives()  # unpickled
        return dict(engine.state_dict(), world_size=self._world)

    @staticmethod
    def _carried(collectives, infos, held):
        """The state every rank resumes from: the most advanced holders' (their tracker, step,
        counters), with residuals re-laid unless the world is the same set of ranks."""
        step = max(info["step"] for info in infos if info)
        holders = [rank for rank, info in enumerate(infos) if info and info["step"] == step]
        root = infos[holders[0]]
        old = root["world_size"]
        if old == collectives.size and len(holders) == old:
            return dict(held, world_size=collectives.size)
        mine = held["residuals"] if collectives.rank in holders else {}
        residuals = {}
        for bucket, (dtype, size) in root["residuals"].items():
            total = np.zeros(size, dtype=np.float64)
            if bucket in mine:
                total += mine[bucket]
            collectives.allreduce(total)
            residuals[bucket] = (total / old).astype(dtype)
        if residuals:
            warnings.warn(f"Horovod elastic reset from {old} to {collectives.size} ranks "
                          f"({len(holders)} of the {old} kept their state): every rank starts "
                          f"from the sum of the kept error-feedback residuals divided by {old}",
                          RuntimeWarning, stacklevel=4)
        return dict(root, residuals=residuals, world_size=collectives.size)

    def _flat_masks(self):
        return [self._bound.flat(index) for index in range(len(self._params))]

    def _describe(self):
        return [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]

    def _index_of(self, tensor):
        index = self._by_id.get(id(tensor))
        if index is None or self._params[index].grad is not tensor:
            # New grads (zero_grad(set_to_none=True)) or a new step: map the current ones.
            self._by_id = {id(p.grad): i for i, p in enumerate(self._params) if p.grad is not None}
            index = self._by_id.get(id(tensor))
        if index is not None:
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

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor):
        """Payload for Horovod to all-reduce, and the context :meth:`decompress` needs."""
        if self._engine is None or world_size() != self._world:
            self.reset_step()  # a step begun in the old world died with it
            self._join()  # the first use, or Horovod's world changed (an elastic reset)
        error = index = None
        try:
            index = self._index_of(tensor)
        except LookupError as exc:
            error = exc
        if index in self._pending:
            warnings.warn(f"PacTrainCompressor: {self._names[index]!r} compressed again with "
                          f"{len(self._pending)} gradient(s) of step {self.step} outstanding; "
                          "treating that step as abandoned (call reset_step() after abandoning "
                          "a step to avoid this warning)", RuntimeWarning, stacklevel=2)
            self.reset_step()
        if not self._pending:
            self._engine.collectives = self.collectives  # rebuilt after unpickling
            self._engine.begin_step(self._flat_masks, error)
        elif error is not None:
            raise error
        wire, ctx = self._engine.encode(index, as_array(tensor).reshape(-1))
        payload = as_tensor(wire)  # dense lossless: the gradient itself, reduced in place
        if self.quantize == "ternary":
            payload = torch.cat([payload, torch.ones(1, dtype=payload.dtype,
                                                     device=tensor.device)])
        elif not isinstance(ctx, InPlace):
            payload = payload.clone()  # the engine's buffer is reused next step
        payload = summable(payload)  # bfloat16 travels as float32
        self._engine.stats["bytes_sent"] += payload.nbytes - wire.nbytes
        self._pending.add(index)
        return payload, ctx

    def decompress(self, tensor, ctx):
        """The reduced gradient in the parameter's shape and dtype (``ctx=None``: as is)."""
        if ctx is None:  # Horovod's sparse path, or a tensor this compressor never encoded
            return tensor
        current = ctx.generation == self._engine.generation
        try:
            if self.quantize == "ternary":
                summed = int(tensor[-1].item())
                if summed != self.collectives.size:
                    raise ValueError(
                        f"ternary payloads must be summed with op=hvd.Sum (the sentinel reads "
                        f"{summed}, not hvd.size()={self.collectives.size}; integer averaging "
                        f"floors); for the mean pass average=True to PacTrainCompressor")
                tensor = tensor[:-1]
            param = self._params[ctx.bucket]
            if param.dtype == torch.bfloat16 and tensor.dtype == torch.float32:
                tensor = tensor.to(param.dtype)  # staged by summable(): rounded once, here
            out = tensor.reshape(-1) if isinstance(ctx, InPlace) else torch.empty(
                param.numel(), dtype=param.dtype, device=param.device)
            self._engine.decode(as_array(tensor).reshape(-1), ctx, as_array(out))
            return out.view(param.shape)
        finally:
            if current:
                self._pending.discard(ctx.bucket)
                if not self._pending:
                    self._engine.end_step()

    def reset_step(self):
        """Abandon the step in progress (backward raised midway): the next ``compress`` retries
        it under the same number; its late results decode but change nothing. Local; a no-op
        between steps. Horovod's own in-flight all-reduces are the caller's to drop."""
        if self._pending:
            self._engine.abandon_step()
        self._pending = set()

    # ------------------------------------------------------------------ checkpoints
    def _check_between_steps(self, what):
        if self._pending:
            raise RuntimeError(f"PacTrainCompressor.{what}() with {len(self._pending)} "
                               f"gradient(s) of step {self.step} outstanding; call it between "
                               "optimizer steps (or reset_step() first)")

    def state_dict(self):
        """Step, mask tracker, error-feedback residuals (CPU tensors by parameter name, so
        ``torch.load``'s default ``weights_only=True`` reads a saved copy), counters, and the
        bound parameters. Only between steps; collective when it binds."""
        self._check_between_steps("state_dict")
        if self._engine is None:
            self._join()
        state = self._engine.state_dict()
        state["residuals"] = {self._names[b]: torch.from_numpy(r)
                              for b, r in state["residuals"].items()}
        state["params"] = self._describe()
        return state

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output. Collective: fails on every rank together, leaving
        the compressor as it was, unless quantize mode, bound parameters and every mask's
        fingerprint match the checkpoint. Residuals are dropped (with a warning) at another
        world size (an elastic reset carries them by the module docstring's rule). Any step in
        progress is abandoned."""
        if self._engine is None:
            self._join()
        apply = run_together(self.collectives, self._loader, state,
                             errors=(TypeError, ValueError, KeyError))
        self.reset_step()
        apply()

    def _loader(self, state):
        saved_params = [(n, tuple(s), d) for n, s, d in state["params"]]
        if saved_params != self._describe():
            differing = [(saved, here) for saved, here in
                         itertools.zip_longest(saved_params, self._describe()) if saved != here]
            raise ValueError(f"checkpoint parameters (name, shape, dtype) differ from the bound "
                             f"ones; first (checkpoint, here): {differing[:3]}")
        index_of = {name: index for index, name in enumerate(self._names)}
        state = dict(state, residuals={index_of[n]: r for n, r in state["residuals"].items()})
        return self._engine.loader(state, self._flat_masks())

    def __getstate__(self):
        self._check_between_steps("__getstate__")
        state = self.__dict__.copy()
        state["_by_id"] = {}  # tensor ids are process-local
        return state

    # ------------------------------------------------------------------ Horovod elastic
    def _snapshot(self):
        """The engine's state at ``state.commit()`` (``None`` while unbound)."""
        return None if self._engine is None else self._held_state()

    def _rollback(self, snapshot):
        """Back to :meth:`_snapshot` output, locally (Horovod is down when this runs)."""
        self.reset_step()
        if snapshot is None:
            self._engine = None
        else:
            self._engine.loader(snapshot, self._flat_masks())()


class _ElasticHandler:
    """How ``hvd.elastic.TorchState`` keeps a :class:`PacTrainCompressor` (module docstring):
    saved at ``commit()``, rolled back at ``restore()``, joined to the new world at ``sync()``.
    Horovod's ``StateHandler`` protocol: ``value``, ``save``, ``restore``, ``sync``,
    ``set_value``."""

    def __init__(self, compressor):
        self.set_value(compressor)

    def set_value(self, compressor):
        self.value = compressor
        self.save()

    def save(self):
        self._saved = self.value._snapshot()

    def restore(self):
        self.value._rollback(self._saved)

    def sync(self):
        self.value._join()


def _register_elastic_handler():
    """Let ``hvd.elastic.TorchState(..., compression=compressor)`` carry the compressor."""
    from horovod.torch.elastic import state
    registry = state.get_handler_registry()
    if all(kind is not PacTrainCompressor for kind, _ in registry):
        state.set_handler_registry([*registry, (PacTrainCompressor, _ElasticHandler)])
