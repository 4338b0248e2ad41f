"""pacmpi.adapters: PacTrain inside PyTorch training scripts.

- :mod:`.ddp`: ``pactrain_hook`` and ``PacTrainHookState`` for ``DistributedDataParallel``.
- :mod:`.lightning`: ``PacTrainCallback`` for PyTorch Lightning's ``DDPStrategy``.
- :mod:`.huggingface`: ``PacTrainCallback`` for the Transformers ``Trainer`` (with
  Accelerate, register the hook on the prepared model).
- :mod:`.horovod`: ``PacTrainCompressor`` for ``hvd.DistributedOptimizer(compression=...)``.
- :mod:`.torch_sync`: ``PacTrainSync`` for raw PyTorch loops over mpi4py, and the broadcasts
  that start such a loop.
- :mod:`.sharded`: ``ShardedOptimizer``, ZeRO-1 style: any optimizer over this rank's shard of
  the surviving weights, fed by PacTrain's packed reduce-scatter.
- :mod:`.outer`: ``OuterSync``, outer steps (local SGD, DiLoCo): local optimizer steps, and
  every ``period`` steps PacTrain's reduction of the pseudo-gradients and an outer optimizer.
- :mod:`.pruning`: ``prune`` (magnitude, GraSP), ``GradualPruningSchedule``, ``MaskEnforcer``
  (gradient sparsity enforcement) and ``torch.nn.utils.prune`` interop.
- :mod:`.recipe`: gradual pruning of a pretrained transformer: its linear layers' weights on a
  cubic schedule (``gradual_schedule``, ``linear_weights``).
- :mod:`.checkpoint`: atomic, resumable checkpoints of weights, masks and reducer state.
- :mod:`.convert`: zero-copy tensor <-> NumPy/CuPy conversion.

Submodules are imported on demand so ``import pacmpi.adapters`` stays cheap and Horovod is
only loaded by the code that uses it. The training job, benchmarks and baselines live in
:mod:`pacmpi.experiments`.
"""
__all__ = ["ddp", "lightning", "huggingface", "horovod", "torch_sync", "sharded", "outer",
           "pruning", "recipe", "checkpoint", "convert"]
