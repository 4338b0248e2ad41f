"""PacTrain inside the Hugging Face Transformers ``Trainer``: a callback that registers
:func:`~pacmpi.adapters.ddp.pactrain_hook` on the model the Trainer wraps in DDP, and keeps
pruned weights at zero::

    state = PacTrainHookState(model, masks, quantize="ternary")   # as for DDP
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(PacTrainCallback(trainer, state))
    trainer.train()

The Trainer wraps the model in ``DistributedDataParallel`` (through Accelerate) inside
``train()``, after the callbacks are constructed, and hands its callbacks the unwrapped model;
so the callback holds the Trainer and reads ``trainer.model_wrapped`` at ``on_train_begin``, the
first event after the wrapping and before the first backward. Accelerate alone needs no callback:
register the hook on the model ``Accelerator.prepare`` returns (docs/trainers/huggingface.md).
"""
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from pacmpi.adapters.ddp import pactrain_hook
from pacmpi.adapters.pruning import MaskEnforcer

__all__ = ["PacTrainCallback"]


class PacTrainCallback(TrainerCallback):
    """At ``on_train_begin``: register :func:`~pacmpi.adapters.ddp.pactrain_hook` with
    ``state`` (a :class:`~pacmpi.adapters.ddp.PacTrainHookState` of the Trainer's model) on the
    Trainer's DDP model, and attach a :class:`~pacmpi.adapters.pruning.MaskEnforcer` of the
    state's masks to its optimizer, so pruned weights and their optimizer state stay exactly 0.
    A world of one (no DDP) only enforces the masks."""

    def __init__(self, trainer, state):
        self.trainer, self.state = trainer, state
        self.enforcer = self._hooked = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        wrapped, model = self.trainer.model_wrapped, self.trainer.model
        if wrapped is not model and not isinstance(wrapped, DistributedDataParallel):
            raise TypeError(f"PacTrainCallback supports DistributedDataParallel (or no wrapper);"
                            f" the Trainer wrapped the model in a {type(wrapped).__name__}")
        if self.enforcer is None:
            self.enforcer = MaskEnforcer(model, self.state.masks)
        # Accelerate's AcceleratedOptimizer steps the torch optimizer it wraps: hook that one.
        self.enforcer.attach(getattr(optimizer, "optimizer", optimizer))
        if isinstance(wrapped, DistributedDataParallel) and wrapped is not self._hooked:
            wrapped.register_comm_hook(self.state, pactrain_hook)
            self._hooked = wrapped  # a second train() re-uses the hooked DDP model
