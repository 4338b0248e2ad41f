"""PacTrain in PyTorch Lightning: a callback beside ``DDPStrategy``'s communication hook::

    state = PacTrainHookState(model, masks, quantize="ternary")   # model: the LightningModule
    trainer = Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=pactrain_hook),
                      callbacks=[PacTrainCallback(state)])

Lightning registers ``ddp_comm_hook`` on CUDA only (``DDPStrategy._register_ddp_hooks``); on
other devices it drops it without a word, so the callback registers the hook where Lightning did
not. It also keeps pruned weights and optimizer state at exactly 0 after every optimizer step
(:class:`pacmpi.adapters.pruning.MaskEnforcer`), and carries the state's
:meth:`~pacmpi.adapters.ddp.PacTrainHookState.state_dict` in Lightning's checkpoints
(``ModelCheckpoint``, ``trainer.save_checkpoint``; restored by ``fit(ckpt_path=...)``), with
every rank's error-feedback residuals: Lightning writes rank 0's checkpoint only. Resumed at
another world size, every rank starts from their mean over the old ranks, the rule of
:mod:`pacmpi.adapters.checkpoint`.
"""
import warnings

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from pacmpi.adapters.checkpoint import mean_residuals
from pacmpi.adapters.ddp import pactrain_hook
from pacmpi.adapters.pruning import MaskEnforcer

__all__ = ["PacTrainCallback"]


class PacTrainCallback(Callback):
    """Registers :func:`~pacmpi.adapters.ddp.pactrain_hook` with ``state`` (a
    :class:`~pacmpi.adapters.ddp.PacTrainHookState` of the LightningModule) on Lightning's DDP
    model unless Lightning did, enforces the state's masks after every optimizer step, and saves
    and restores the state with Lightning's checkpoints (collectively, on every rank, as
    Lightning calls callbacks' ``state_dict``)."""

    def __init__(self, state):
        self.state = state

    def on_fit_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"PacTrainCallback needs a DDP strategy (DDPStrategy, 'ddp'); the "
                            f"trainer's {type(trainer.strategy).__name__} wraps the model in "
                            f"{type(ddp).__name__}")
        # DDP lists the hooks registered on it; Lightning registers its own on CUDA only.
        if all(state is not self.state for _, state in getattr(ddp, "_comm_hooks", ())):
            ddp.register_comm_hook(self.state, pactrain_hook)
        enforcer = MaskEnforcer(pl_module, self.state.masks)
        for optimizer in trainer.optimizers:
            enforcer.attach(optimizer)

    def state_dict(self):
        state = self.state.state_dict()
        # Residuals are each rank's own, and Lightning writes rank 0's checkpoint: gather them.
        return dict(state, residuals=self.state.collectives.allgather_object(state["residuals"]))

    def load_state_dict(self, state_dict):
        collectives = self.state.collectives
        ranks = [{name: values.numpy() for name, values in part.items()}
                 for part in state_dict["residuals"]]
        if len(ranks) == collectives.size:
            residuals = ranks[collectives.rank]
        else:  # the rule of pacmpi.adapters.checkpoint: the mean over the old ranks
            residuals = mean_residuals(ranks)
            if residuals:
                warnings.warn(f"resuming at world size {collectives.size} from a checkpoint "
                              f"taken at {len(ranks)}: each rank starts from the mean of the "
                              f"{len(ranks)} ranks' error-feedback residuals "
                              f"({len(residuals)} arrays)", RuntimeWarning, stacklevel=2)
        self.state.load_state_dict(dict(state_dict, residuals=residuals,
                                        world_size=collectives.size))
