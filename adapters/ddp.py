"""PacTrain as a DistributedDataParallel communication hook, and :class:`pacmpi.Collectives`
over ``torch.distributed``::

    state = PacTrainHookState(model, masks)   # masks: parameter name -> bool mask; may precede
    ddp_model = DDP(model)                    # init_process_group and DDP, as PowerSGDState
    ddp_model.register_comm_hook(state, pactrain_hook)

Launch with torchrun (gloo on CPU, NCCL on GPU; ``dist.init_process_group()`` reads its env)::

    torchrun --standalone --nproc-per-node 4 train.py
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py

Each parameter is a bucket of a :class:`pacmpi.engine.StepEngine` (its mask's verification,
packing, ternary scale, key and residual), so results do not depend on DDP's bucketing (rebuilt
after the first iterations, and started over by a resumed run). A DDP bucket's parameters are
sent as one group, one async all-reduce: lossless, their survivors moved to the front of the
bucket's own buffer in place and that prefix all-reduced (no payload buffer); float16, one
cast copy; ternary, the codes each parameter would send alone, back to back, with one MAX
all-reduce for the scales. A step's cost then does not grow with the number of parameters in a
bucket. A step begins at DDP bucket 0 and ends when its last bucket is decoded; an unfinished
one is abandoned at the next bucket 0.

bfloat16 buckets (bf16 models; DDP buckets hold one dtype, so bf16 weights beside float32
norms work) travel as bfloat16 and are summed by the process group (NCCL natively; gloo adds
pairwise, rounding each addition). At 2 ranks that is the one rounding of ``a + b``: the hooked
model equals DDP's default all-reduce of masked gradients bit for bit. At more ranks the order
in which a coordinate's values are added follows its place in the payload (gloo's ring sums each
1/N of it in another rotation of the N ranks), so packed and dense payloads may round
differently, as DDP's own all-reduce does when ``bucket_cap_mb`` changes. Ternary codes of
bfloat16 gradients are computed in float32, with float32 residuals. Under AMP an Inf or NaN on
any rank reaches every rank's reduced gradient (lossless and ternary), so ``GradScaler`` skips
that step on every rank together.

A step whose DDP layout (each bucket's parameters) was not seen complete before -- the first,
and the one after DDP rebuilds its buckets, on every rank at once -- is agreed bucket by bucket
(a tiny MAX all-reduce before each payload): ranks whose buckets differ raise
LayoutMismatchError together, from ``backward()``, before posting payloads of other sizes.
"""
import contextlib
import threading

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from pacmpi.adapters.convert import as_array, as_tensor, numpy_dtype
from pacmpi.adapters.masks import MaskBinding
from pacmpi.adapters.torch_collectives import TorchDistCollectives
from pacmpi.engine import COUNTERS, BucketSpec, StepEngine
from pacmpi.faults import ensure_abort_on_error
from pacmpi.options import EngineOptions
from pacmpi.verify import raise_together, run_together

__all__ = ["PacTrainHookState", "TorchDistCollectives", "pactrain_hook"]

_KNOBS = ("quantize", "average", "seed", "verify_every", "on_mismatch", "stable_steps",
          "error_feedback", "ternary_scale")


def _on_stream(tensor):
    """CuPy work on the current torch stream of ``tensor``'s device (nothing on CPU)."""
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(tensor.device).cuda_stream)


class DDPStep:
    """A step as a DDP communication hook sees it, for :func:`pactrain_hook` and
    :func:`pacmpi.adapters.sharded.sharded_hook`: DDP bucket 0 begins one (a step still open
    then never finished: it is abandoned), a later bucket needs one open, and the step ends
    once the last bucket was posted and every posted one finished. ``entries``: what the hook
    records per bucket of the open step (``None`` between steps)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.entries, self._open, self._saw_last = None, set(), False

    @property
    def active(self):
        return self.entries is not None

    def enter(self, index, abandon):
        """DDP bucket ``index`` arrives: ``abandon()`` the step bucket 0 finds still open;
        RuntimeError for a later bucket outside a step."""
        if index == 0 and self.active:  # the last step never finished
            abandon()
            self.reset()
        if index != 0 and not self.active:
            raise RuntimeError(f"DDP bucket {index} reduced outside a step (bucket 0 failed?)")

    def begin(self):
        """Bucket 0 began the step (its collectives passed)."""
        self.entries = []

    def posted(self, index, last):
        """Bucket ``index`` (DDP's last when ``last``) is in flight."""
        self._open.add(index)  # before the last flag: a finish must not end the step early
        self._saw_last |= last

    def finished(self, index):
        """Bucket ``index`` is back; whether that ends the step (then :meth:`close`)."""
        self._open.discard(index)
        return self._saw_last and not self._open

    def close(self):
        """End the step; returns its entries."""
        entries = self.entries
        self.reset()
        return entries

    @staticmethod
    def agree(engine, index, names, last, error=None):
        """Agree across ranks on DDP bucket ``index``'s parameters (``names``) and on whether
        it is the last (:meth:`pacmpi.engine.StepEngine.agree_layout`)."""
        engine.agree_layout(f"DDP bucket {index}",
                            list(names) + ["(last)" if last else "(not last)"], error)


class PacTrainHookState:
    """State of :func:`pactrain_hook` for one DDP model (the DDP module or the one it wraps).

    Like ``PowerSGDState`` it may be built before ``init_process_group`` and before DDP wraps
    the model: construction only checks the options; the rest -- masks against the model's
    parameters, the process group (``None``: the default group, resolved then), the engine --
    is bound by :meth:`bind`, which the first hook call makes when nobody did. Binding is
    collective: bad input (a mask of the wrong shape or naming no parameter, on any rank)
    raises RankInputError on every rank together, from ``backward()`` when the hook binds.

    ``masks``: parameter name (``torch.nn.utils.prune``'s logical names work too) -> bool or
    0/1 mask of its shape, re-read at every verification; ``quantize``: one of
    :data:`pacmpi.QUANTIZE_MODES` (``None``, ``"fp16"``, ``"ternary"``); ``average`` as DDP's
    default hook; ``options`` (an :class:`pacmpi.options.EngineOptions`) and the other knobs as
    :class:`pacmpi.PacTrainReducer`'s (the engine reduces each
    parameter on its own, so ``ternary_scale`` ``"tensor"`` and ``"bucket"`` agree here; an
    int cuts each parameter into blocks of that many elements).
    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (restore the masks first).
    Pickling drops the process group and the model: :meth:`bind` the new model.
    """

    def __init__(self, model, masks, *, process_group=None, options=None, abort_on_error=None,
                 **knobs):
        options = EngineOptions.build(options, knobs, who="PacTrainHookState", takes=_KNOBS)
        self.options = options.replace(word_dtype="int64")  # torch sums no uint64 words
        self._model = _module(model)
        self.masks = masks  # as given: re-read at every verification, kept through pickling
        self._abort_on_error = abort_on_error
        self.process_group, self.engine, self._collectives = process_group, None, None
        self._specs = self._params = None  # _params is None: not bound (yet, or since pickling)
        self._lock = threading.Lock()

    step = property(lambda self: self.engine.step if self.engine else 0, doc="Completed steps.")

    @property
    def stats(self):
        """The engine's counters; all zero until the hook first ran (and bound the engine)."""
        return self.engine.stats if self.engine else dict.fromkeys(COUNTERS, 0)

    @property
    def collectives(self):
        if self._collectives is None:
            device = self._params[0].device if self._params else None
            self._collectives = TorchDistCollectives(self.process_group, device)
        return self._collectives

    # ------------------------------------------------------------------ parameters and masks
    def bind(self, model=None):
        """Bind to ``model`` (default: the one given at construction; after unpickling, pass
        the new one; its parameters must match) and to the process group. Collective: every
        rank binds together, or raises RankInputError together and stays unbound."""
        if model is None and self._model is None:
            raise RuntimeError("PacTrainHookState was unpickled: call state.bind(model) first")
        saved, error = dict(self.__dict__), None
        try:
            self._bind(_module(model) if model is not None else self._model, self.masks)
            self.engine = self.engine or StepEngine(
                self.collectives, [BucketSpec(n, numpy_dtype(p.dtype), p.numel()) for n, p in
                                   zip(self._names, self._params)], layout=self._specs,
                options=self.options)
            self.engine.collectives = self.collectives  # None after unpickling
            self._flat_masks()
        except (TypeError, ValueError) as exc:
            error = exc
        try:
            ensure_abort_on_error(self._abort_on_error, size=self.collectives.size)
            raise_together(self.collectives, error)
        except BaseException:
            self.__dict__.update(saved)  # unbound again on every rank: the next call retries
            raise

    def _bind(self, model, masks):
        named = list(model.named_parameters())
        specs = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        if self._specs not in (None, specs):
            raise ValueError(f"the model's parameters (name, shape, dtype) differ from the "
                             f"state's; first: {[s for s in specs if s not in self._specs][:3]}")
        self._bound = MaskBinding(named, masks, model)
        self._model, self._collectives = model, None  # collectives on the parameters' device
        self._names, self._params, self._specs = self._bound.names, self._bound.params, specs
        self._slot = {id(p): i for i, p in enumerate(self._params)}
        # _layout: [(buffer's place, weak reference to its storage, slots, their size)] per
        # DDP bucket of the last complete step, or None; the step in progress's are
        # _steps.entries.
        self._layout, self._steps, self._trusted = None, DDPStep(), False

    def _flat_masks(self):
        """Each parameter's bool mask, flat in the parameter's memory order (DDP's order)."""
        return self._bound.flats(memory_order=True)

    def _write_masks(self, flats):
        """``on_mismatch="resync"``: store rank 0's masks into this rank's mask tensors."""
        for index, flat in enumerate(flats):
            if flat is not None:
                self._bound.store(index, flat, memory_order=True)

    # ------------------------------------------------------------------ the hook
    def _check_bucket(self, bucket, index, last):
        """Agree across ranks on DDP bucket ``index``'s parameters; returns their slots."""
        error, slots, offset, buffer = None, [], 0, bucket.buffer()
        try:
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                if id(param) not in self._slot or param.dtype != buffer.dtype:
                    raise ValueError(f"DDP bucket {index} holds a {tuple(param.shape)} "
                                     f"{param.dtype} parameter this state is not bound to")
                if param.numel() and grad.data_ptr() != buffer[offset:].data_ptr():
                    raise ValueError(f"DDP bucket {index}'s gradients are not its buffer's views")
                slots.append(self._slot[id(param)])
                offset += param.numel()
        except ValueError as exc:
            error = exc
        DDPStep.agree(self.engine, index, [self._names[s] for s in slots], last, error)
        return tuple(slots)

    def _regroup(self, slots):
        """DDP's rebuilt buckets hold the parameters in the reverse of its first buckets'
        order: a new bucket holding a run of an old one's parameters backwards has the engine
        reverse that one's residuals in place, so it takes a slice of them, not a copy (the
        hook peaked at 1.9x the gradient bytes while the old array lived on)."""
        back, n = slots[::-1], len(slots)
        for *_, old, _ in self._layout or ():
            if n > 1 and any(old[i:i + n] == back for i in range(len(old) - n + 1)):
                self.engine.reverse_residuals(old)

    def _hook(self, bucket):
        index, last, buffer = bucket.index(), bucket.is_last(), bucket.buffer()
        # A DDP bucket keeps one buffer for its life, and a rebuild makes new ones: while the
        # storage a layout entry saw is alive (its weak reference), no other buffer can hold
        # its address, so the same address means the same bucket, whatever its number of
        # parameters (reading them costs a tensor object each).
        storage = buffer.untyped_storage()
        place = (storage.data_ptr(), buffer.storage_offset(), buffer.numel())
        self._steps.enter(index, self.engine.abandon_step)
        known = self._layout if index == 0 or self._trusted else None
        self._trusted = bool(known) and index < len(known) and known[index][0] == place and (
            not known[index][1].expired()) and (index == len(known) - 1) == last
        if self._trusted:
            slots, size = known[index][2:]
        else:
            slots = self._check_bucket(bucket, index, last)
            size = sum(self.engine.buckets[s].size for s in slots)
            self._regroup(slots)
        # One payload: lossless, the survivors moved to the bucket's front (or all of it).
        flat = as_array(buffer)[:size]
        with _on_stream(buffer):
            if index == 0:  # ternary: bucket 0's scales ride in the verification all-reduce
                self.engine.begin_step(self._flat_masks, None, self._write_masks,
                                       scale_flats=lambda: {slots: flat}, scale_units=(slots,))
                self._steps.begin()
            self._steps.entries.append((place, StorageWeakRef(storage), slots, size))
            self.engine.agree_scales({slots: flat})  # ternary: one MAX all-reduce, if any
            with self._lock:
                wire, ctx = self.engine.encode(slots, flat, in_place=True)
        payloads, parts = [as_tensor(wire)], [(wire, ctx, flat)]
        generation = self.engine.generation
        self._steps.posted(index, last)
        futures = [dist.all_reduce(p, group=self.process_group, async_op=True).get_future()
                   for p in payloads if p.numel()]

        def finish(done):  # runs on the transport's thread: no collectives here
            # wait(), not value(): it re-raises a failed all-reduce and, on CUDA, makes this
            # thread's current stream wait for the collective's kernels (collect_all's future
            # carries no CUDA events; read unsynchronized, a payload can still be in flight).
            for future in done.value():
                future.wait()
            with _on_stream(buffer), self._lock:
                for wire, ctx, view in parts:
                    self.engine.decode(wire, ctx, view)
                if generation == self.engine.generation and self._steps.finished(index):
                    self.engine.end_step()
                    self._layout = self._steps.close()
            if buffer.is_cuda:  # the future DDP waits on carries no CUDA events either
                torch.cuda.current_stream(buffer.device).synchronize()
            return buffer

        return torch.futures.collect_all(futures).then(finish)

    # ------------------------------------------------------------------ checkpoints, pickling
    def state_dict(self):
        """Step, mask tracker, error-feedback residuals (CPU tensors by parameter name, so
        ``torch.load``'s default ``weights_only=True`` reads a saved copy), counters and the
        parameters' (name, shape, dtype). Between steps only; before the first step it binds
        (collective)."""
        if self._params is None:
            self.bind()
        if self._steps.active:
            raise RuntimeError("PacTrainHookState.state_dict() during a step")
        state = self.engine.state_dict()
        state["residuals"] = {self._names[b]: torch.from_numpy(r)
                              for b, r in state["residuals"].items()}
        return dict(state, params=self._specs)

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output. Collective: fails on every rank together (other
        parameters, quantize mode, or masks than the checkpoint's), changing nothing. Binds
        first when nobody has (before the first step)."""
        if self._params is None:
            self.bind()
        apply = run_together(self.collectives, self._loader, state,
                             errors=(TypeError, ValueError, KeyError))
        if self._steps.active:
            self.engine.abandon_step()
        self._steps.reset()
        apply()

    def _loader(self, state):
        if [(n, tuple(s), d) for n, s, d in state["params"]] != self._specs:
            raise ValueError("checkpoint parameters (name, shape, dtype) differ from the model's")
        index = {name: i for i, name in enumerate(self._names)}
        return self.engine.loader(dict(state, residuals={
            index[n]: r for n, r in state["residuals"].items()}), self._flat_masks())

    def __getstate__(self):
        state = dict(self.__dict__, _layout=None, _steps=DDPStep())
        state.update(dict.fromkeys(("process_group", "_collectives", "_lock", "_params",
                                    "_slot", "_bound", "_model"), None))
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())


def pactrain_hook(state, bucket):
    """DDP communication hook: ``ddp_model.register_comm_hook(state, pactrain_hook)`` with a
    :class:`PacTrainHookState`; a future of the averaged bucket, pruned coordinates exactly 0."""
    if state._params is None:  # the first call, every rank's bucket 0: bind together
        state.bind()
    return state._hook(bucket)


def _module(model):
    """The module whose parameters DDP reduces: ``model`` or the one a DDP ``model`` wraps."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (or DDP of one), got "
                        f"{type(model).__name__}")
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model
