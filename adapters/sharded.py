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
