"""Outer steps: local training that synchronizes every ``period`` steps (local SGD, DiLoCo).

Each rank's own optimizer (the *inner* one) steps on its own data without communicating. Every
``period`` inner steps, :class:`OuterSync` reduces the *pseudo-gradient* (global weights minus
local weights) through :class:`pacmpi.PacTrainReducer` and an *outer* optimizer applies the
average to the global weights, which every rank then trains on. With a fixed mask the
pseudo-gradient is exactly zero off the mask, so PacTrain's packing applies unchanged: one
outer step sends the survivors only (lossless, or ternary codes with error feedback carried
from one outer step to the next), verified across ranks like any step, and outer steps are
``period`` times rarer than synchronous ones.

DiLoCo (Douillard et al., 2023) is the default: SGD with Nesterov momentum 0.9, learning rate
0.7; ``outer_lr=1, outer_momentum=0`` is plain model averaging (torch's
``PostLocalSGDOptimizer``), and with ``period=1`` and plain SGD inner steps that is
synchronous PacTrain of the same gradients.

Memory: a global copy of the parameters and the outer momentum, 2x the parameters, on
``state_device`` (default: each parameter's device; ``"cpu"`` keeps a GPU model's GPU memory as
it was and holds a third copy on the host, the pseudo-gradient's staging). The pseudo-gradient
itself is computed in the local parameters' storage, which step 5 overwrites anyway; but the
reducer copies parameters that share a fusion bucket into the bucket's buffer, so with the
default 25 MB buckets a model of small tensors costs a third copy there. ``bucket_bytes``
below the large matrices' size gives each of them a bucket of its own, reduced in place (on
the digits CNN at 4096: 2.11x the parameters in all, 3.03x at the default; more all-reduces
per outer step, each of which pays the link's latency).
:meth:`OuterSync.memory_report` reads the bytes.

Buffers (BatchNorm statistics): ``buffers="average"`` averages the floating-point buffers over
the ranks at each outer step (dense, counted in ``last_outer["buffer_bytes"]``), so evaluation
sees one model; integer buffers (``num_batches_tracked``) are left alone, equal on every rank
that took as many steps. ``buffers="local"`` leaves them to each rank.

Masks change only at outer steps: :meth:`OuterSync.set_masks` takes effect at the next one,
where the global weights and the outer momentum are zeroed off the new masks. A gradual
schedule (:mod:`pacmpi.adapters.recipe`) is called after outer steps, on the weights every
rank then holds::

    if outer.step_in_period == 0:       # right after an outer step
        new = schedule.step(model, step, comm=comm)
        if new is not None:
            enforcer.update(new)        # local weights and inner optimizer state
            outer.set_masks(new)        # global weights and outer momentum, next outer step

Under DDP, run the inner steps' backward inside ``with ddp_model.no_sync():`` (DDP reduces
nothing, as for gradient accumulation), build DDP with ``broadcast_buffers=False`` (else every
forward copies rank 0's buffers) and give :class:`OuterSync` the wrapped module and
``collectives=TorchDistCollectives()``: the outer steps are then the only communication.
"""
import copy
import time
import warnings

import torch

from pacmpi import DEFAULT_BUCKET_BYTES, PacTrainReducer
from pacmpi.adapters.convert import as_array, numpy_dtype
from pacmpi.adapters.pruning import masks_digest
from pacmpi.adapters.torch_sync import broadcast_parameters, model_masks, transport
from pacmpi.verify import raise_together, run_together

__all__ = ["BUFFER_POLICIES", "OuterSync"]

#: What :class:`OuterSync` does with the model's buffers at an outer step.
BUFFER_POLICIES = ("average", "local")

# Counters of the reducer reported per outer step in OuterSync.last_outer.
_STEP_KEYS = ("bytes_sent", "packed_reductions", "dense_reductions", "dense_fallbacks",
              "verifications")


def _positive(value, what, kind=float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
            kind is int and value != int(value)):
        raise ValueError(f"{what} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


class OuterSync:
    """Train locally and synchronize every ``period`` inner steps by an outer step.

    The outer step, run by the inner optimizer's step post-hook at every ``period``-th
    ``optimizer.step()`` (or by :meth:`outer_step`), on every rank:

    1. masks given to :meth:`set_masks` since the last outer step take effect: written into
       the reducer's mask tensors, the global weights and outer momentum zeroed off them (the
       reducer verifies and packs them in step 3);
    2. pseudo-gradient ``global - local`` of every parameter, zero off the masks (GSE);
    3. :meth:`pacmpi.PacTrainReducer.reduce`: masks verified across ranks, survivors packed
       (lossless, or ternary with the error-feedback residual of the last outer step added),
       unmasked parameters dense; the ranks' pseudo-gradients averaged;
    4. the outer optimizer (``torch.optim.SGD`` over the global weights) steps on the average;
    5. local weights take the global ones; with ``buffers="average"`` the floating-point
       buffers are averaged over the ranks.

    Parameters
    ----------
    model:
        The ``torch.nn.Module`` (under DDP: ``ddp_model.module``). Every parameter with
        ``requires_grad`` is held; rank 0's weights are broadcast at construction.
    optimizer:
        The inner optimizer, any ``torch.optim.Optimizer`` over parameters of ``model`` only.
        It steps locally; its state is this rank's and is part of :meth:`state_dict`.
    period:
        Inner steps per outer step (DiLoCo's H), a positive int.
    masks:
        ``{name: bool tensor}`` keep-masks, the same on every rank (e.g. from
        :func:`pacmpi.adapters.pruning.prune`); ``None``: every parameter dense.
    quantize:
        ``None`` (lossless packed survivors) or ``"ternary"`` (their ternary codes; pass
        ``error_feedback=True`` to carry each rank's quantization error to the next outer
        step), as :class:`pacmpi.PacTrainReducer` takes it.
    outer_lr, outer_momentum, nesterov:
        The outer SGD: learning rate (> 0), momentum (>= 0), Nesterov (only with momentum).
    buffers:
        ``"average"`` or ``"local"``, see :data:`BUFFER_POLICIES` and the module docstring.
    state_device:
        Where the global weights and outer momentum live: ``None`` (each parameter's device)
        or a device such as ``"cpu"``; the reduction then runs on that device's arrays.
    comm, collectives:
        The transport, as :func:`pacmpi.adapters.torch_sync.transport` takes it (mpi4py
        communicator, default ``COMM_WORLD``, or any :class:`pacmpi.Collectives`).
    bucket_bytes, abort_on_error, knobs:
        Passed to :class:`pacmpi.PacTrainReducer` (``error_feedback``, ``ternary_scale``,
        ``seed``, ``on_mismatch``, ...); its ``verify_every`` and ``stable_steps`` count outer
        steps, and ``stable_steps`` defaults to 0 here: a new mask is packed at the outer step
        that verifies it.

    Example::

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        enforcer = MaskEnforcer(model, masks)
        enforcer.attach(optimizer)
        outer = OuterSync(model, optimizer, period=16, masks=masks)
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()   # no communication
            optimizer.step()                  # every 16th: the outer step too
    """

    def __init__(self, model, optimizer, *, period, masks=None, quantize=None, outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True, buffers="average", state_device=None,
                 comm=None, collectives=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 abort_on_error=None, **knobs):
        collectives = transport(comm, collectives)
        self.model, self.optimizer = model, optimizer
        error = None
        try:
            self.period = _positive(period, "period", int)
            outer_lr = _positive(outer_lr, "outer_lr")
            if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
                    or not outer_momentum >= 0:
                raise ValueError(f"outer_momentum must be >= 0, got {outer_momentum!r}")
            if buffers not in BUFFER_POLICIES:
                raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
            self.params, self.names, self._masks, self._mask_names = model_masks(model, masks)
            self._check_optimizer(optimizer)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_together(collectives, error)
        self.buffers = buffers
        broadcast_parameters(model, collectives=collectives, buffers=buffers == "average")
        with torch.no_grad():
            self.globals = [p.detach().to(state_device, copy=True) for p in self.params]
            self._masks = [None if m is None else m.to(g.device)
                           for m, g in zip(self._masks, self.globals)]
            self._pruned = [None if m is None else ~m for m in self._masks]
            for g, p, pruned in zip(self.globals, self.params, self._pruned):
                if pruned is not None:
                    g.masked_fill_(pruned, 0)
                    p.copy_(g)
        self.outer_optimizer = torch.optim.SGD(self.globals, lr=outer_lr,
                                               momentum=outer_momentum,
                                               nesterov=nesterov and outer_momentum > 0)
        # Every outer step verifies the masks, and outer steps are rare: a mask is packed at the
        # first one that verifies it rather than after a dense one (the reducer's default).
        knobs.setdefault("stable_steps", 0)
        self.reducer = PacTrainReducer(
            [None if m is None else as_array(m) for m in self._masks], collectives=collectives,
            quantize=quantize, bucket_bytes=bucket_bytes, abort_on_error=abort_on_error,
            shapes=[tuple(p.shape) for p in self.params],
            dtypes=[numpy_dtype(p.dtype) for p in self.params], **knobs)
        self.step_in_period = 0
        self.outer_steps = 0
        self.last_outer = {}
        self._pending = None
        self._bind()

    def _check_optimizer(self, optimizer):
        held = {id(p) for p in self.params}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in held:
                    raise ValueError(
                        f"the inner optimizer's param_groups[{g}]['params'][{i}] (shape "
                        f"{tuple(p.shape)}) is not a trainable parameter of the model given to "
                        "OuterSync; build the optimizer over model.parameters()")

    def _bind(self):
        """Point each global weight's ``.grad`` at the pseudo-gradient's storage: the local
        parameter itself where both share a device and dtype (step 5 overwrites it anyway),
        so no third copy is kept; a staging tensor otherwise. Hook the inner optimizer."""
        for g, p in zip(self.globals, self.params):
            g.grad = (p.detach() if (g.device, g.dtype) == (p.device, p.dtype)
                      else torch.empty_like(g))
        self._deltas = [as_array(g.grad) for g in self.globals]
        self._handle = self.optimizer.register_step_post_hook(self._after_inner_step)

    @property
    def collectives(self):
        """The transport (the reducer's)."""
        return self.reducer.collectives

    @property
    def stats(self):
        """The reducer's cumulative counters (:attr:`pacmpi.PacTrainReducer.stats`)."""
        return self.reducer.stats

    @property
    def masks(self):
        """The masks in effect (bool tensors on the state device), keyed as given."""
        return {key: self._masks[i] for key, i in self._mask_names.items()}

    def set_masks(self, masks):
        """New masks (every masked name, no new one), taking effect at the next outer step."""
        if set(masks) != set(self._mask_names):
            raise ValueError(f"set_masks() needs exactly the masks given at construction: "
                             f"{sorted(self._mask_names)}, got {sorted(masks)}")
        self._pending = {key: torch.as_tensor(m).detach().to(torch.bool).cpu().clone()
                         for key, m in masks.items()}

    # ------------------------------------------------------------------ the outer step
    def _after_inner_step(self, optimizer, args, kwargs):
        self.step_in_period += 1
        if self.step_in_period == self.period:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self):
        """Run the outer step now (collective; the inner optimizer's hook calls it every
        ``period`` steps) and start a new period."""
        started, before = time.perf_counter(), dict(self.stats)
        # Step 1: masks set since the last outer step.
        if self._pending is not None:
            self._apply_masks(self._pending)
            self._pending = None
        # Step 2: the pseudo-gradient, in the storage _bind chose.
        for g, p, pruned in zip(self.globals, self.params, self._pruned):
            delta = g.grad
            if delta.data_ptr() != p.data_ptr():
                delta.copy_(p)
            delta.neg_().add_(g)  # g + (-p) rounds exactly as g - p
            if pruned is not None:
                delta.masked_fill_(pruned, 0)
        # Step 3: averaged over the ranks, packed and verified.
        self.reducer.reduce(self._deltas)
        # Step 4: the outer optimizer.
        self.outer_optimizer.step()
        # Step 5: every rank continues from the global weights.
        for g, p in zip(self.globals, self.params):
            p.copy_(g)
        buffer_bytes = self._average_buffers() if self.buffers == "average" else 0
        self.step_in_period = 0
        self.outer_steps += 1
        self.last_outer = {key: self.stats[key] - before.get(key, 0) for key in _STEP_KEYS}
        self.last_outer.update(buffer_bytes=buffer_bytes, seconds=time.perf_counter() - started)

    def _apply_masks(self, masks):
        for key, i in self._mask_names.items():
            self._masks[i].copy_(masks[key])
            torch.logical_not(self._masks[i], out=self._pruned[i])
            g = self.globals[i]
            g.masked_fill_(self._pruned[i], 0)
            for value in self.outer_optimizer.state.get(g, {}).values():
                if torch.is_tensor(value) and value.shape == g.shape:
                    value.masked_fill_(self._pruned[i], 0)

    def _average_buffers(self):
        sent = 0
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                self.collectives.allreduce(as_array(buffer), "sum")
                buffer.div_(self.collectives.size)
                sent += buffer.numel() * buffer.element_size()
        return sent

    # ------------------------------------------------------------------ memory and state
    def memory_report(self):
        """Bytes this object keeps beyond the model and the inner optimizer: ``global``
        (the global weights), ``outer_optimizer`` (its momentum, from the first outer step
        on), ``staging`` (pseudo-gradient buffers where ``state_device`` differs from the
        parameters') and ``reducer`` (:meth:`pacmpi.PacTrainReducer.memory_report`'s total:
        survivor indices, ternary words, error-feedback residuals, ...)."""
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        momentum = [v for state in self.outer_optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v)]
        staging = [g.grad for g, p in zip(self.globals, self.params)
                   if g.grad.data_ptr() != p.data_ptr()]
        return {"global": nbytes(self.globals), "outer_optimizer": nbytes(momentum),
                "staging": nbytes(staging),
                "reducer": sum(self.reducer.memory_report().values())}

    def state_dict(self):
        """Everything a resumed run needs, on the host: the global weights, the outer
        optimizer's state, the position in the period, masks (with their fingerprint) and
        masks still pending, the reducer's state under ``"engine"`` (tracker, error-feedback
        residuals), and this rank's own: the model's weights and buffers and the inner
        optimizer's state (both differ between ranks within a period). Laid out as
        :func:`pacmpi.adapters.checkpoint.save_checkpoint` expects of a sync."""
        masks = {key: m.detach().cpu().clone() for key, m in self.masks.items()}
        return copy.deepcopy({
            "period": self.period, "world_size": self.collectives.size,
            "step_in_period": self.step_in_period, "outer_steps": self.outer_steps,
            "masks": masks, "fingerprint": masks_digest(masks) if masks else None,
            "pending_masks": self._pending,
            "global": [g.detach().cpu() for g in self.globals],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "engine": self.reducer.state_dict(),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "inner_optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output (collective; bad state raises on every rank).
        At the same world size the run continues bit for bit. At another, the rule of
        :mod:`pacmpi.adapters.checkpoint` applies: through ``load_checkpoint`` every rank
        starts from rank 0's state with the ranks' mean error-feedback residuals; loaded by
        hand, the reducer drops the residuals with a warning."""
        run_together(self.collectives, self._check_state, state,
                     errors=(TypeError, ValueError, KeyError))
        if state["world_size"] != self.collectives.size:
            warnings.warn(f"OuterSync resumes at world size {self.collectives.size} from "
                          f"state taken at {state['world_size']}: every rank continues "
                          "this period from the given rank's local weights and inner "
                          "optimizer state", RuntimeWarning, stacklevel=2)
        with torch.no_grad():
            if state["masks"]:
                self._apply_masks(state["masks"])
            for g, saved in zip(self.globals, state["global"]):
                g.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.reducer.load_state_dict(state["engine"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["inner_optimizer"])
        self.step_in_period, self.outer_steps = state["step_in_period"], state["outer_steps"]
        self._pending = state["pending_masks"]

    def _check_state(self, state):
        if state["period"] != self.period:
            raise ValueError(f"the state was taken with period={state['period']!r}, this "
                             f"OuterSync has period={self.period!r}")
        masks = state["masks"]
        if (masks_digest(masks) if masks else None) != state["fingerprint"]:
            raise ValueError("the state's masks do not match their fingerprint (corrupt file?)")
        if set(masks) != set(self._mask_names):
            raise ValueError(f"the state has masks for {sorted(masks)}, this OuterSync for "
                             f"{sorted(self._mask_names)}")
        shapes = [tuple(g.shape) for g in state["global"]]
        if shapes != [tuple(g.shape) for g in self.globals]:
            raise ValueError(f"the state's global weights have shapes {shapes}, the model's "
                             f"{[tuple(g.shape) for g in self.globals]}")

    def __getstate__(self):
        # The hook handle points into the optimizer's hook table; _bind makes a new one.
        state = self.__dict__.copy()
        del state["_handle"], state["_deltas"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bind()
