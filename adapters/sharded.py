"""ZeRO-1 style sharded optimizer for raw PyTorch loops and DDP: PacTrain's packed
reduce-scatter, the optimizer over this rank's shard of the survivors only, an all-gather of the
updated weights.

Any ``torch.optim`` optimizer runs over flat tensors (one per dtype) holding this rank's
contiguous shard of the model's surviving (unpruned) weights
(:class:`pacmpi.sharded.ShardedReducer` defines the shard), so its state (Adam's two moments)
takes ``1/N x density`` of what a replicated optimizer keeps. The full weights stay replicated;
pruned weights are never written (pruned models keep them at exactly 0). Lossless: the result is
replicated PacTrain's, bit for bit wherever the sums are exact.

Example::

    model = Net()
    broadcast_parameters(model)                      # same start on every rank
    optimizer = ShardedOptimizer(model, torch.optim.Adam, masks=masks, lr=1e-3)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                             # collective

Under ``DistributedDataParallel``, :func:`sharded_hook` overlaps the step with backward::

    optimizer = ShardedOptimizer(model, torch.optim.Adam, masks=masks, lr=1e-3,
                                 collectives=TorchDistCollectives())
    ddp_model.register_comm_hook(optimizer, sharded_hook)   # backward() steps

Each DDP bucket's survivors are reduce-scattered (asynchronously) as soon as DDP hands the
bucket over, while backward goes on; when the last bucket is in, every rank waits for its
blocks, steps the optimizer on its shard and all-gathers the updated weights -- the schedule of
PyTorch's ``hook_with_zero_step`` (``ddp_zero_hook``), whose reduce-scatters are all-reduces
and whose all-gathers are broadcasts. That hook itself is no option here: torch 2.13 refuses it
on gloo ("Gloo backend using Overlapping DDP with ZeRO may meet hangs") and it shards whole
parameters, not survivors. FSDP's sharded hooks (FSDP1 ``register_comm_hook(state, hook)``
with ``hook(state, grad, output)``, FSDP2 ``set_custom_reduce_scatter``) fill a fixed, equal,
dense shard of every flat parameter, pruned coordinates included, so the optimizer state could
shrink by 1/N but never by the density.
"""
import math

import numpy as np
import torch
import torch.distributed as dist

from pacmpi.adapters.convert import as_array, as_tensor, numpy_dtype
from pacmpi.adapters.ddp import DDPStep
from pacmpi.adapters.torch_collectives import TorchDistCollectives
from pacmpi.adapters.torch_sync import model_masks
from pacmpi.collectives import default_collectives
from pacmpi.sharded import ShardedReducer
from pacmpi.verify import run_together

__all__ = ["ShardedOptimizer", "sharded_hook"]

_KNOBS = ("average", "verify_every", "quantize", "seed")


class _Group:
    """The trained parameters of one dtype (``slots``: their indices in the optimizer's
    ``params``): their reducer and ``shard``, this rank's shard of their survivors (one
    parameter of the inner optimizer)."""

    def __init__(self, slots, params, masks, options):
        self.slots = slots
        self.reducer = ShardedReducer(
            [None if masks[s] is None else as_array(masks[s]) for s in slots],
            shapes=[tuple(params[s].shape) for s in slots],
            dtypes=[numpy_dtype(params[s].dtype) for s in slots], **options)
        first = params[slots[0]]
        self.shard = torch.nn.Parameter(torch.empty(self.reducer.layout.shard_size,
                                                    dtype=first.dtype, device=first.device))

    def mine(self, arrays):
        """The group's entries of a list over every parameter."""
        return [arrays[s] for s in self.slots]


class ShardedOptimizer:
    """``optimizer_class(**defaults)`` over this rank's shard of ``model``'s survivors.

    Parameters
    ----------
    model:
        The ``torch.nn.Module``; every parameter with ``requires_grad`` is trained. Each dtype
        (float32 weights beside bfloat16 ones) is sharded on its own: a reducer and a flat
        shard per dtype (``self.groups``), all of them parameters of one inner optimizer.
    optimizer_class:
        A ``torch.optim.Optimizer`` class, built over the flat shards (``self.shards``), as
        PyTorch's ``ZeroRedundancyOptimizer`` takes it; ``defaults`` are its arguments.
    masks:
        ``{name: bool tensor}`` keep-masks (as for :class:`PacTrainSync`), changed only by
        :meth:`set_masks`; ``None``: dense (the shard is 1/N of every weight).
    comm, collectives, options, average, verify_every, abort_on_error:
        As for :class:`pacmpi.sharded.ShardedReducer`; ``comm`` defaults to a duplicate of
        ``COMM_WORLD``.
    quantize, seed:
        ``"ternary"``: the reduce-scatter carries ternary codes (one scale per parameter),
        the all-gather full values (:mod:`pacmpi.sharded`); without error feedback, whose
        residual (every survivor, per rank) would cost more than the sharded optimizer state
        saves. :meth:`step` only: :func:`sharded_hook` is lossless.
    max_grad_norm:
        Clip the averaged gradient to this global L2 norm before each step, as
        ``torch.nn.utils.clip_grad_norm_`` would over the whole model (the shards' sums of
        squares are all-reduced, in float64); ``self.grad_norm`` is the last norm.

    ``self.optimizer`` is the inner optimizer (give it to an LR scheduler). ``p.grad`` keeps
    this rank's own gradient: only the shard's is reduced (clip with ``max_grad_norm``, not
    by ``p.grad``). As a DDP hook's state (:func:`sharded_hook`), ``collectives`` must be the
    DDP process group's :class:`TorchDistCollectives`; :meth:`step` after a hooked backward
    does nothing.
    """

    def __init__(self, model, optimizer_class, *, masks=None, comm=None, collectives=None,
                 options=None, abort_on_error=None, max_grad_norm=None, **kwargs):
        # The inner optimizer's arguments, less the knobs (checked by the reducers, on every
        # rank together).
        knobs = {k: kwargs.pop(k) for k in _KNOBS if k in kwargs}
        defaults = kwargs
        self.model = model
        if collectives is None:
            collectives = default_collectives(comm)
        # Raised on every rank together, before the reducer's own collectives.
        self.params, self.names, mask_list, self._mask_names = run_together(
            collectives, _checked_input, model, masks, max_grad_norm)
        self.max_grad_norm, self.grad_norm = max_grad_norm, None
        self.collectives = collectives
        self._reducer_args = dict(collectives=collectives, abort_on_error=abort_on_error,
                                  options=options, **knobs)
        self._shard_survivors(mask_list)
        self.quantize = self.groups[0].reducer.engine.quantize
        self.optimizer = optimizer_class(self.shards, **defaults)
        # The DDP step in progress: its entries are [(group, part, block, payload, work)].
        self._steps = DDPStep()
        self._hooked = False  # the hook stepped since the last step()

    def _shard_survivors(self, mask_list):
        """A :class:`_Group` per dtype for these masks, each shard filled from the weights."""
        self._masks = mask_list
        slots = {}
        for i, p in enumerate(self.params):
            slots.setdefault(p.dtype, []).append(i)
        self.groups = [_Group(s, self.params, mask_list, self._reducer_args)
                       for s in slots.values()]
        self._slot = {id(self.params[s]): (g, k) for g, group in enumerate(self.groups)
                      for k, s in enumerate(group.slots)}
        self._parts = {}  # (DDP bucket index, its parameters' ids) -> (group, ShardPart)
        weights = self._weights()
        with torch.no_grad():
            for group in self.groups:
                group.reducer.param_shard(group.mine(weights), as_array(group.shard.data))

    @property
    def shards(self):
        """This rank's flat shards, one per dtype: the inner optimizer's parameters."""
        return [group.shard for group in self.groups]

    def _only(self, name):
        if len(self.groups) != 1:
            raise AttributeError(f"the model has {len(self.groups)} dtypes, so {name} is one "
                                 "per dtype: use .groups")
        return getattr(self.groups[0], name)

    shard = property(lambda self: self._only("shard"),
                     doc="The flat shard (one dtype; else see ``groups``).")
    reducer = property(lambda self: self._only("reducer"),
                       doc="The :class:`ShardedReducer` (one dtype; else see ``groups``).")

    def set_masks(self, masks):
        """Replace the masks (``{name: bool tensor}``, as at construction); collective. The
        survivors are sharded anew and each per-coordinate optimizer state entry follows its
        coordinates: kept ones keep their state, newly kept ones start at 0. Weights are left
        as they are (zero newly pruned ones yourself, as pruning does). The engine starts
        over: its step count restarts at 0 (that step verifies the new masks); its counters
        run on."""
        _, _, mask_list, mask_names = run_together(
            self.collectives, _checked_input, self.model, masks, self.max_grad_norm)
        saved, old = self.state_dict(), self.groups  # packed by the old masks
        self._mask_names = mask_names
        self._shard_survivors(mask_list)
        for before, group, packed in zip(old, self.groups, saved["groups"]):
            for key, value in before.reducer.stats.items():
                group.reducer.stats[key] += value
            old_layout, new = before.reducer.layout, group.reducer.layout
            for key in packed["sharded"]:
                values = as_array(packed["state"][key])
                dense = [np.zeros(tuple(p.shape), dtype=values.dtype)
                         for p in group.mine(self.params)]
                old_layout.scatter(values, dense, 0, old_layout.total)
                mine = np.empty(new.shard_size, dtype=values.dtype)
                packed["state"][key] = torch.from_numpy(new.gather(dense, mine, new.start,
                                                                   new.stop))
        self.optimizer.param_groups[0]["params"] = self.shards
        self._load_inner(saved, [slice(None)] * len(self.groups))

    @property
    def masks(self):
        """The masks (bool tensors), keyed as given."""
        return {key: self._masks[i] for key, i in self._mask_names.items()}

    def _weights(self):
        return [as_array(p.data) for p in self.params]

    def zero_grad(self, set_to_none=True):
        """Clear the model's gradients (the shard's gradient is set by :meth:`step`)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self):
        """Reduce-scatter the gradients' survivors, step the optimizer on this rank's shards,
        all-gather the updated survivors into every rank's parameters. Collective; a
        parameter without a gradient contributes zeros. Nothing, after :func:`sharded_hook`
        stepped in backward."""
        if self._hooked:
            self._hooked = False
            return
        grads = [as_array(p.grad if p.grad is not None else torch.zeros_like(p))
                 for p in self.params]
        with torch.no_grad():
            weights = self._weights()
            grad_shards = [group.reducer.reduce_scatter(group.mine(grads), group.mine(weights))
                           for group in self.groups]
            self._update(grad_shards, weights)

    def _update(self, grad_shards, weights):
        """Gather each shard's weights, step the inner optimizer on ``grad_shards`` (clipped
        first when asked), all-gather the updated weights. Collective."""
        for group, grad in zip(self.groups, grad_shards):
            group.reducer.param_shard(group.mine(weights), as_array(group.shard.data))
            group.shard.grad = as_tensor(grad)
        try:
            if self.max_grad_norm is not None:
                squares = np.array([sum(float(s.grad.double().square().sum())
                                        for s in self.shards)])
                self.collectives.allreduce(squares, "sum")
                self.grad_norm = math.sqrt(squares[0])
                coefficient = self.max_grad_norm / (self.grad_norm + 1e-6)  # torch's epsilon
                if coefficient < 1:
                    for shard in self.shards:
                        shard.grad.mul_(coefficient)
            self.optimizer.step()
        finally:
            for shard in self.shards:
                shard.grad = None
        for group in self.groups:
            group.reducer.allgather(as_array(group.shard.data), group.mine(weights))

    # ------------------------------------------------------------------ DDP
    def _part(self, bucket):
        """The bucket's group and :class:`ShardPart`; a layout seen for the first time is
        agreed by every rank first (a difference, or a parameter this optimizer does not
        train, raises on every rank together)."""
        params = bucket.parameters()
        key = (bucket.index(), tuple(map(id, params)))
        if key not in self._parts:
            error, slots = None, []
            try:
                if self.quantize is not None:
                    raise ValueError(f"sharded_hook is lossless, this optimizer has quantize="
                                     f"{self.quantize!r}: step it after backward instead")
                if not isinstance(self.collectives, TorchDistCollectives):
                    raise TypeError(f"sharded_hook needs collectives=TorchDistCollectives("
                                    f"process_group), got {type(self.collectives).__name__}")
                for param in params:
                    if id(param) not in self._slot:
                        raise ValueError(f"DDP bucket {key[0]} holds a {tuple(param.shape)} "
                                         "parameter this optimizer does not train")
                    slots.append(self._slot[id(param)])
            except (TypeError, ValueError) as exc:
                error = exc
            DDPStep.agree(self.groups[0].reducer.engine, key[0],
                          [self.names[self.groups[g].slots[k]] for g, k in slots],
                          bucket.is_last(), error)
            group = slots[0][0]  # DDP buckets hold one dtype
            self._parts[key] = group, self.groups[group].reducer.layout.part(
                [k for _, k in slots])
        return self._parts[key]

    def _hook(self, bucket):
        index = bucket.index()
        self._steps.enter(index, self._abandon)
        if index == 0:
            for group in self.groups:
                group.reducer.begin_step()
            self._steps.begin()
        group, part = self._part(bucket)
        grads = {self._slot[id(p)][1]: as_array(g)
                 for p, g in zip(bucket.parameters(), bucket.gradients())}
        buffer = bucket.buffer()
        payload = buffer.new_empty(part.size)
        part.gather(grads, as_array(payload))
        block, work = buffer.new_empty(part.counts[self.collectives.rank]), None
        if part.size:
            work = dist.reduce_scatter(block, list(torch.split(payload, part.counts)),
                                       group=self.collectives.group, async_op=True)
            self.groups[group].reducer.stats["bytes_sent"] += \
                payload.numel() * payload.element_size()
        self._steps.entries.append((group, part, block, payload, work))
        if bucket.is_last():
            self._finish_step()
        done = torch.futures.Future()
        done.set_result(buffer)  # p.grad keeps this rank's own gradient
        return done

    def _abandon(self):
        for group in self.groups:
            group.reducer.engine.abandon_step()

    def _finish_step(self):
        """Wait for every bucket's block, step the shards, all-gather the weights."""
        blocks = self._steps.close()
        grad_shards = [torch.empty_like(shard) for shard in self.shards]
        for g, group in enumerate(self.groups):
            if sum(b[1].size for b in blocks if b[0] == g) != group.reducer.layout.total:
                raise ValueError("DDP's buckets did not hold every parameter this optimizer "
                                 "trains")
        for g, part, block, _, work in blocks:
            if work is not None:
                work.wait()
            part.place(as_array(block), as_array(grad_shards[g]))
        for group, grad in zip(self.groups, grad_shards):
            group.reducer.end_step(as_array(grad))
        with torch.no_grad():
            self._update([as_array(grad) for grad in grad_shards], self._weights())
        self._hooked = True

    # ------------------------------------------------------------------ state
    def _sharded_keys(self, state, shard):
        """Names of the per-coordinate state entries (shaped like ``shard``: Adam's moments,
        momentum), the same on every rank or a ValueError on every rank."""
        mine = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == shard.shape)
        every = self.collectives.allgather_object(mine)
        if any(keys != every[0] for keys in every):
            raise ValueError(f"ranks shard different optimizer state entries: {every}")
        return mine

    def state_dict(self):
        """Per dtype (``"groups"``): the optimizer's state with every per-coordinate entry
        gathered from the shards into one packed vector of all survivors (the same at any
        world size) and the engine's state (step, tracker, counters); the optimizer's
        hyper-parameters. Collective; every rank returns the same, so any rank may save it."""
        saved = self.optimizer.state_dict()
        groups = []
        for g, group in enumerate(self.groups):
            state, layout = saved["state"].get(g, {}), group.reducer.layout
            sharded, full = self._sharded_keys(state, group.shard), {}
            for key, value in state.items():
                full[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
            for key in sharded:
                packed = torch.zeros(layout.total, dtype=full[key].dtype)
                packed[layout.start:layout.stop] = full[key]
                self.collectives.allgather(as_array(packed), layout.counts)
                full[key] = packed
            groups.append({"survivors": layout.total, "engine": group.reducer.state_dict(),
                           "state": full, "sharded": sharded})
        return {"world_size": self.collectives.size, "groups": groups,
                "param_groups": saved["param_groups"]}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output, at this world size or another: each rank takes
        its shard of the packed vectors. The masks must be the checkpoint's. Collective; a
        checkpoint that does not fit raises on every rank together."""
        def check():
            saved = [g["survivors"] for g in state["groups"]]
            mine = [g.reducer.layout.total for g in self.groups]
            if saved != mine:
                raise ValueError(f"checkpoint has {saved} surviving weights (per dtype), this "
                                 f"model's masks keep {mine}")

        run_together(self.collectives, check)
        for group, saved in zip(self.groups, state["groups"]):
            group.reducer.load_state_dict(saved["engine"])
        self._load_inner(state, [slice(g.reducer.layout.start, g.reducer.layout.stop)
                                 for g in self.groups])

    def _load_inner(self, saved, mine):
        """Load :meth:`state_dict` output ``saved`` into the inner optimizer, taking ``mine[g]``
        of group g's per-coordinate entries."""
        # Copies: torch's load_state_dict keeps some tensors (Adam's step) as given and steps
        # them in place, which would change the caller's checkpoint.
        state = {g: {key: (value[mine[g]] if key in group["sharded"] else value).clone()
                     if torch.is_tensor(value) else value
                     for key, value in group["state"].items()}
                 for g, group in enumerate(saved["groups"]) if group["state"]}
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _checked_input(model, masks, max_grad_norm):
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float))
                                          and 0 < max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
    return model_masks(model, masks)


def sharded_hook(optimizer, bucket):
    """DDP communication hook: ``ddp_model.register_comm_hook(optimizer, sharded_hook)`` with
    a :class:`ShardedOptimizer` over the DDP model's module. Reduce-scatters the bucket's
    survivors; the last bucket steps the optimizer and all-gathers the weights. The future
    holds the bucket as it came: ``p.grad`` keeps this rank's own gradient."""
    return optimizer._hook(bucket)
