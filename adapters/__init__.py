"""pacmpi.adapters: PacTrain for PyTorch training scripts.

- :mod:`.pruning`: ``prune`` (magnitude, GraSP), ``GradualPruningSchedule``, ``MaskEnforcer``
  (gradient sparsity enforcement) and ``torch.nn.utils.prune`` interop.
- :mod:`.torch_sync`: ``PacTrainSync`` for raw PyTorch loops over mpi4py (hooks launch packed
  buckets during backward), ``broadcast_parameters``, the TopK baseline.
- :mod:`.checkpoint`: atomic, resumable checkpoints of weights, masks and reducer state.
- :mod:`.horovod`: ``PacTrainCompressor`` for ``hvd.DistributedOptimizer(compression=...)``.
- :mod:`.train`: the fine-tuning job behind ``pacmpi train``.
- :mod:`.data`, :mod:`.models`: offline datasets (scikit-learn digits, CIFAR-10 on disk) and
  small models.

Submodules are imported on demand so ``import pacmpi.adapters`` stays cheap and Horovod is
only loaded by the code that uses it.
"""
__all__ = ["pruning", "torch_sync", "checkpoint", "horovod", "train", "data", "models"]
