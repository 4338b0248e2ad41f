"""An elastic DDP training job with PacTrain's hook, for tests/test_elastic.py (torchrun, gloo).

``elastic_train.py WORKDIR STEPS EVERY KILL_AT``: trains two pruned float32 models in lockstep,
one per mode (lossless, ternary), for STEPS steps, each with its DDP hook state, a
``MaskEnforcer`` and Adam; dropout draws from each rank's torch RNG. Every EVERY steps it saves
both with ``pacmpi.adapters.checkpoint`` (WORKDIR/<mode>/ckpt.pt); a worker that finds a
checkpoint resumes from it, with masks first built from another seed, so the checkpoint's must
come back. On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) the last rank SIGKILLs itself
at step KILL_AT (-1: never), after writing WORKDIR/killed. Each step checks the pruned
weights are exactly 0.

A restarted worker first trains, in the same process group, the uninterrupted reference run
(from scratch, as the first attempt began) and a negative control: the same resume with the
ternary model's error-feedback residuals cleared (its final weights must differ). A worker that
resumes on its first attempt (another world size) first checks that a checkpoint of the hook
state needs ``masks=`` both ways (RankInputError on every rank otherwise).

Rank r writes WORKDIR/result.rank<r>.pt: per model its final weights, the hook state's stats and
state_dict, the step it resumed from, the restart count, the world size, and the warnings the
resume raised.
"""
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pacmpi import RankInputError
from pacmpi.adapters.checkpoint import load_checkpoint, save_checkpoint
from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.pruning import MaskEnforcer

MODES = {"lossless": None, "ternary": "ternary"}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.drop, self.b = nn.Linear(12, 16), nn.Dropout(0.25), nn.Linear(16, 6)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


class Job:
    """One mode's model, masks (from ``mask_seed``), DDP, hook state, enforcer and Adam;
    resumed from ``checkpoint`` if that exists (``None``: never), the hook state then kept as
    loaded in ``loaded``."""

    def __init__(self, quantize, mask_seed, checkpoint=None):
        self.module, self.path = Net(), checkpoint
        gen = torch.Generator().manual_seed(mask_seed)
        self.masks = {n: torch.rand(p.shape, generator=gen) < 0.5
                      for n, p in self.module.named_parameters() if n.endswith("weight")}
        self.built_masks = {k: v.clone() for k, v in self.masks.items()}
        self.enforcer = MaskEnforcer(self.module, self.masks)
        self.ddp = DDP(self.module, bucket_cap_mb=0.0005)  # several buckets once rebuilt
        self.state = PacTrainHookState(self.ddp, self.masks, quantize=quantize,
                                       error_feedback=quantize is not None)
        self.ddp.register_comm_hook(self.state, pactrain_hook)
        self.opt = torch.optim.Adam(self.module.parameters(), lr=0.01)
        self.enforcer.attach(self.opt)
        self.start, self.caught, self.loaded = 0, [], None
        if checkpoint and os.path.exists(checkpoint):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                where = load_checkpoint(checkpoint, model=self.module, optimizer=self.opt,
                                        sync=self.state, masks=self.masks)
            self.enforcer.update(self.masks)
            self.start, self.caught = where["step"], [str(w.message) for w in caught]
            self.loaded = self.state.state_dict()

    def step(self, step, rank):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 6, (8,), generator=gen)
        self.opt.zero_grad()
        F.cross_entropy(self.ddp(x), y).backward()
        self.opt.step()
        for name, param in self.module.named_parameters():
            if name in self.masks:
                assert not param[~self.masks[name]].any(), f"pruned {name} moved at {step}"

    def save(self, step):
        save_checkpoint(self.path, model=self.module, optimizer=self.opt, sync=self.state,
                        step=step, epoch=0, masks=self.masks)

    def result(self):
        return {"weights": {k: v.clone() for k, v in self.module.state_dict().items()},
                "stats": dict(self.state.stats), "state": self.state.state_dict(),
                "start": self.start, "warnings": self.caught, "loaded": self.loaded,
                "masks": {k: v.clone() for k, v in self.masks.items()},
                "built_masks": self.built_masks}


def train(jobs, steps, every, rank, before=lambda step: None):
    """Train ``jobs`` in lockstep from their common start step, calling ``before(step)`` first;
    save every ``every`` steps unless ``every`` is 0."""
    start = {job.start for job in jobs.values()}
    assert len(start) == 1, {mode: job.start for mode, job in jobs.items()}
    for step in range(start.pop(), steps):
        before(step)
        for job in jobs.values():
            job.step(step, rank)
        if every and (step + 1) % every == 0 and step + 1 < steps:
            for job in jobs.values():
                job.save(step + 1)


def check_mask_errors(checkpoint):
    """A DDP hook state's checkpoint needs masks= both ways; without, every rank raises and the
    hook state is unchanged."""
    job = Job("ternary", 1)
    for call, needle in ((lambda: load_checkpoint(checkpoint, model=job.module, optimizer=job.opt,
                                                  sync=job.state), "pass masks= to load"),
                         (lambda: save_checkpoint(checkpoint + ".nomasks", model=job.module,
                                                  optimizer=job.opt, sync=job.state, step=0,
                                                  epoch=0), "pass the mask tensors")):
        try:
            call()
        except RankInputError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"no RankInputError ({needle})")
    assert job.state.step == 0


def main(workdir, steps, every, kill_at):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    paths = {mode: os.path.join(workdir, mode, "ckpt.pt") for mode in MODES}
    if rank == 0:
        for path in paths.values():
            os.makedirs(os.path.dirname(path), exist_ok=True)
    dist.barrier()
    if attempt == 0 and os.path.exists(paths["ternary"]):  # resumed at another world size
        check_mask_errors(paths["ternary"])
    seed = 1 + 10 * attempt  # masks of another seed: the checkpoint's must come back
    result = {}
    if attempt > 0:
        # The uninterrupted run, from scratch, as the first attempt began it.
        reference = {mode: Job(q, 1) for mode, q in MODES.items()}
        torch.manual_seed(100 + rank)
        train(reference, steps, 0, rank)
        result.update((f"reference-{mode}", job.result()) for mode, job in reference.items())
        # Negative control: the same resume with the ternary model's residuals cleared.
        control = {mode: Job(q, seed, paths[mode]) for mode, q in MODES.items()}
        state = control["ternary"].state.state_dict()
        control["ternary"].state.load_state_dict(dict(state, residuals={}))
        train(control, steps, 0, rank)
        result["control"] = control["ternary"].result()
    jobs = {mode: Job(q, seed, paths[mode]) for mode, q in MODES.items()}
    if jobs["ternary"].start == 0:
        torch.manual_seed(100 + rank)  # each rank's dropout stream; a resume restores it

    def die(step):  # leaves a note first: the test checks the kill happened
        if attempt == 0 and step == kill_at and rank == size - 1:
            with open(os.path.join(workdir, "killed"), "w") as note:
                note.write(f"rank {rank} at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    train(jobs, steps, every, rank, die)
    result.update((mode, job.result()) for mode, job in jobs.items())
    torch.save(dict(result, attempt=attempt, world_size=size),
               os.path.join(workdir, f"result.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def leave():
    """End the process without interpreter finalization. A gloo worker thread can still be
    releasing the last step's hook callback and tensors when the main thread finishes; their
    release takes the GIL, and a thread that asks for it once finalization began is ended
    inside a C++ destructor: std::terminate, SIGABRT, a failed attempt for torchrun
    (pytorch/pytorch#190489; caught here in a core dump: ``PythonFunctionGuard`` disposal on
    ``pt_gloo_runloop``, 1 run in 90 under load). Results are written and the group destroyed
    by then, so nothing is lost."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
    leave()
