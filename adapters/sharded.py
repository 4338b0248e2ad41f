"""ZeRO-1 style sharded optimizer for raw PyTorch loops: PacTrain's packed reduce-scatter, the
optimizer over this rank's shard of the survivors only, an all-gather of the updated weights.

Any ``torch.optim`` optimizer runs over one flat tensor holding this rank's contiguous shard of
the model's surviving (unpruned) weights (:class:`pacmpi.sharded.ShardedReducer` defines the
shard), so its state (Adam's two moments) takes ``1/N x density`` of what a replicated optimizer
keeps. The full weights stay replicated; pruned weights are never written (pruned models keep
them at exactly 0). Lossless: the result is replicated PacTrain's, bit for bit wherever the sums
are exact.

Example::

    model = Net()
    broadcast_parameters(model)                      # same start on every rank
    optimizer = ShardedOptimizer(model, torch.optim.Adam, masks=masks, lr=1e-3)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                             # collective
"""
import torch

from pacmpi.adapters.convert import as_array, as_tensor, numpy_dtype
from pacmpi.adapters.torch_sync import model_masks
from pacmpi.collectives import default_collectives
from pacmpi.sharded import ShardedReducer
from pacmpi.verify import run_together

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """``optimizer_class(**defaults)`` over this rank's shard of ``model``'s survivors.

    Parameters
    ----------
    model:
        The ``torch.nn.Module``; every parameter with ``requires_grad`` is trained (one dtype).
    optimizer_class:
        A ``torch.optim.Optimizer`` class, built over one flat tensor (``self.shard``), as
        PyTorch's ``ZeroRedundancyOptimizer`` takes it; ``defaults`` are its arguments.
    masks:
        ``{name: bool tensor}`` keep-masks (as for :class:`PacTrainSync`), fixed for the
        optimizer's life; ``None``: dense (the shard is 1/N of every weight).
    comm, collectives, average, verify_every, abort_on_error:
        As for :class:`pacmpi.sharded.ShardedReducer`; ``comm`` defaults to a duplicate of
        ``COMM_WORLD``.

    ``self.optimizer`` is the inner optimizer (give it to an LR scheduler). ``p.grad`` keeps
    this rank's own gradient: only the shard's is reduced, so clipping by the global norm
    needs the shard's norms summed over ranks (not provided yet).
    """

    def __init__(self, model, optimizer_class, *, masks=None, comm=None, collectives=None,
                 average=True, verify_every=1, abort_on_error=None, **defaults):
        self.model = model
        if collectives is None:
            collectives = default_collectives(comm)
        # Raised on every rank together, before the reducer's own collectives.
        self.params, self.names, mask_list, self._mask_names = run_together(
            collectives, model_masks, model, masks)
        self._masks = mask_list
        self.reducer = ShardedReducer(
            [None if m is None else as_array(m) for m in mask_list], collectives=collectives,
            average=average, verify_every=verify_every,
            abort_on_error=abort_on_error, shapes=[tuple(p.shape) for p in self.params],
            dtypes=[numpy_dtype(p.dtype) for p in self.params])
        first = self.params[0]
        with torch.no_grad():
            self.shard = torch.nn.Parameter(torch.empty(self.reducer.layout.shard_size,
                                                        dtype=first.dtype, device=first.device))
            self.reducer.param_shard(self._weights(), as_array(self.shard.data))
        self.optimizer = optimizer_class([self.shard], **defaults)

    @property
    def collectives(self):
        return self.reducer.collectives

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
        """Reduce-scatter the gradients' survivors, step the optimizer on this rank's shard,
        all-gather the updated survivors into every rank's parameters. Collective; a
        parameter without a gradient contributes zeros."""
        grads = [as_array(p.grad if p.grad is not None else torch.zeros_like(p))
                 for p in self.params]

        def update(grad_shard, weight_shard):
            self.shard.grad = as_tensor(grad_shard)
            self.optimizer.step()

        with torch.no_grad():
            self.reducer.step(grads, self._weights(), update, as_array(self.shard.data))
        self.shard.grad = None

    # ------------------------------------------------------------------ state
    def _sharded_keys(self, state):
        """Names of the per-coordinate state entries (shaped like the shard: Adam's moments,
        momentum), the same on every rank or a ValueError on every rank."""
        mine = sorted(k for k, v in state.items()
                      if torch.is_tensor(v) and v.shape == self.shard.shape)
        every = self.collectives.allgather_object(mine)
        if any(keys != every[0] for keys in every):
            raise ValueError(f"ranks shard different optimizer state entries: {every}")
        return mine

    def state_dict(self):
        """The optimizer's state with every per-coordinate entry gathered from the shards into
        one packed vector of all survivors (the same at any world size), its
        hyper-parameters, and the engine's state (step, tracker, counters). Collective; every
        rank returns the same, so any rank may save it."""
        saved = self.optimizer.state_dict()
        state = saved["state"].get(0, {})
        layout = self.reducer.layout
        sharded, full = self._sharded_keys(state), {}
        for key in state:
            value = state[key].detach().cpu() if torch.is_tensor(state[key]) else state[key]
            full[key] = value.clone() if torch.is_tensor(value) else value
        for key in sharded:
            packed = torch.zeros(layout.total, dtype=full[key].dtype)
            packed[layout.start:layout.stop] = full[key]
            self.collectives.allgather(as_array(packed), layout.counts)
            full[key] = packed
        return {"survivors": layout.total, "world_size": self.collectives.size,
                "engine": self.reducer.state_dict(),
                "optimizer": {"state": full, "param_groups": saved["param_groups"],
                              "sharded": sharded}}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output, at this world size or another: each rank takes
        its shard of the packed vectors. The masks must be the checkpoint's. Collective; a
        checkpoint that does not fit raises on every rank together."""
        layout = self.reducer.layout

        def check():
            if state["survivors"] != layout.total:
                raise ValueError(f"checkpoint has {state['survivors']} surviving weights, this "
                                 f"model's masks keep {layout.total}")

        run_together(self.collectives, check)
        self.reducer.load_state_dict(state["engine"])
        saved = state["optimizer"]
        # Copies: torch's load_state_dict keeps some tensors (Adam's step) as given and steps
        # them in place, which would change the caller's checkpoint.
        mine = {key: (value[layout.start:layout.stop] if key in saved["sharded"] else value)
                .clone() if torch.is_tensor(value) else value
                for key, value in saved["state"].items()}
        self.optimizer.load_state_dict({"state": {0: mine} if mine else {},
                                        "param_groups": saved["param_groups"]})
