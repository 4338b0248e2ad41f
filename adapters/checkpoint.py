"""Crash-safe, resumable checkpoints of a data-parallel PacTrain run.

Layout (the path must be on a file system every rank can read):

* ``PATH`` -- written by rank 0 only: model and optimizer state (identical on all ranks), step,
  epoch, ``extra`` (e.g. the data-loader position), masks with their fingerprint, the world size
  and the checkpoint's ``tag``. This file is the commit point.
* ``PATH.<tag>.rank<r>`` -- one per rank: the sync's engine state (mask tracker, error-feedback
  residuals, step and counters) and the torch / NumPy / ``random`` RNG states of that rank.

Every file is written atomically (temporary file in the same directory, fsync, ``os.replace``).
Per-rank files carry a fresh tag and are all written before rank 0 replaces ``PATH``, and stale
per-rank files are deleted only afterwards, so a crash at any moment leaves the previous
checkpoint loadable and never a mix of two.

Resuming at the same world size restores everything, so the run continues bit for bit as if
uninterrupted (given the same thread count and deterministic kernels). At another world size
(an elastic restart with fewer or more workers), what is per-rank is re-laid by one rule,
reported with one ``warnings.warn``:

* PacTrain's error-feedback residuals: every new rank starts from the mean, over the old ranks,
  of their residuals (a rank without one for a parameter counts as zero). Averaged reductions
  (the default, as DDP's) then still owe exactly what the old run owed:
  ``(1/N') * N' * mean = (1/N) * sum``. Residuals of a hierarchical reduction (node sums kept by
  node leaders) and the state of other methods' syncs are left to the sync, which drops them
  with its own warning.
* RNG states: each rank's is reseeded from ``(step, rank)``.

Masks, the mask tracker and the step are the same on every rank and carry over unchanged (taken
from rank 0's file). A sync whose state holds its masks (:class:`PacTrainSync`) saves them
itself; for the DDP hook state (:class:`pacmpi.adapters.ddp.PacTrainHookState`), pass the mask
tensors it was built with as ``masks=``: they are saved, and restored in place on load before
the hook state (whose tracker checks them).
"""
import glob
import os
import random
import tempfile
import uuid
import warnings

import numpy as np
import torch

from pacmpi import MPICollectives
from pacmpi.adapters.pruning import masks_digest
from pacmpi.verify import raise_together

__all__ = ["atomic_save", "load_checkpoint", "save_checkpoint"]


def rank_file(path, tag, rank):
    """Name of rank ``rank``'s part of the checkpoint ``path`` with tag ``tag``."""
    return f"{path}.{tag}.rank{rank}"


def atomic_save(obj, path):
    """``torch.save(obj, path)`` so that ``path`` holds either the old or the new file, whole."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is flushed.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _rng_state():
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _reseed(step, rank):
    seed = (int(step) * 1_000_003 + int(rank)) % (2 ** 32)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _control(sync, comm):
    """Transport for the checkpoint's few control messages: ``comm`` if given, else the sync's."""
    return sync.collectives if comm is None else MPICollectives(comm=comm)


def _together(collectives, action):
    """Run ``action()``; if it fails on any rank, raise on every rank (nobody is left blocked)."""
    error, result = None, None
    try:
        result = action()
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        error = exc
    raise_together(collectives, error)
    return result


def _split_masks(sync_state, masks):
    """``(masks entry of the checkpoint, sync state without masks)``: the sync's own masks, or
    ``masks`` for a sync that keeps none (the DDP hook state)."""
    if "masks" in sync_state:
        if masks is not None:
            raise ValueError("masks= is for a sync that keeps no masks (the DDP hook state); "
                             "this sync's state holds its own")
        return ({"masks": sync_state.pop("masks"), "fingerprint": sync_state.pop("fingerprint")},
                sync_state)
    if masks is None:
        raise ValueError("this sync's state holds no masks: pass the mask tensors it was built "
                         "with as masks=")
    saved = {name: mask.detach().to(torch.bool).cpu().clone() for name, mask in masks.items()}
    return {"masks": saved, "fingerprint": masks_digest(saved), "external": True}, sync_state


def _restore_masks(shared, masks, sync_state):
    """Return ``sync_state`` with the checkpoint's masks for a sync that keeps them; for one that
    does not, check ``masks`` fits the checkpoint's (raising before anything changes) and return
    a function that writes them into ``masks`` in place."""
    external = shared.get("external", False)
    if (masks is not None) != external:
        raise ValueError("the checkpoint's masks were saved with masks= (DDP hook state): pass "
                         "masks= to load_checkpoint too" if external else "masks= is for a "
                         "checkpoint of a sync that keeps no masks (the DDP hook state)")
    saved = shared["masks"]
    if not external:
        return dict(sync_state, masks=saved, fingerprint=shared["fingerprint"]), None
    if masks_digest(saved) != shared["fingerprint"]:
        raise ValueError("checkpoint masks do not match their fingerprint (corrupt file?)")
    bad = sorted(set(masks) ^ set(saved)) + [name for name in sorted(set(masks) & set(saved))
                                             if tuple(masks[name].shape) != saved[name].shape]
    if bad:
        raise ValueError(f"masks= differ from the checkpoint's in names or shapes: {bad}")

    def write():
        with torch.no_grad():
            for name, mask in masks.items():
                mask.copy_(saved[name].to(mask.dtype))
    return sync_state, write


def _engine_part(sync_state):
    """The reduction engine's state in a sync's: :class:`PacTrainSync` nests it under
    ``"engine"``; the DDP hook state's and the Horovod compressor's is the engine's."""
    return sync_state.get("engine", sync_state)


def mean_residuals(parts):
    """The world-size rule for error-feedback residuals (module docstring): ``parts`` holds each
    old rank's residuals (name -> array); every new rank starts from their mean over the old
    ranks, a rank without one for a name counting as zero."""
    names = sorted({name for part in parts for name in part}, key=str)
    residuals = {}
    for name in names:
        present = [part[name] for part in parts if name in part]
        total = np.sum([np.asarray(r, dtype=np.float64) for r in present], axis=0)
        residuals[name] = (total / len(parts)).astype(np.asarray(present[0]).dtype)
    return residuals


def _relaid(states, size):
    """Rank 0's sync state of ``states`` (one per rank of another world size), re-laid for
    ``size`` ranks: PacTrain residuals become their mean over the old ranks (module docstring).
    Returns ``(state, number of residual arrays re-laid)``; ``(states[0], 0)`` for states the
    rule does not cover (another method's, hierarchical), which the sync then handles itself."""
    engine = _engine_part(states[0])
    if "tracker" not in engine or "node_layout" in engine:
        return states[0], 0
    residuals = mean_residuals([_engine_part(state)["residuals"] for state in states])
    engine = dict(engine, residuals=residuals, world_size=size)
    state = dict(states[0], engine=engine, world_size=size) if "engine" in states[0] else engine
    return state, len(residuals)


def save_checkpoint(path, *, model, optimizer, sync, step, epoch, extra=None, masks=None,
                    comm=None):
    """Write a checkpoint of the run (collective: call on every rank with the same arguments).

    ``step`` / ``epoch`` / ``extra`` describe where training stands (``extra`` is any picklable
    value, e.g. ``{"batch_in_epoch": 3}``); :func:`load_checkpoint` returns them. ``masks``: the
    mask tensors of a sync that keeps none itself (the DDP hook state). ``comm``: communicator
    for the checkpoint's control messages (default: the sync's transport).
    """
    collectives = _control(sync, comm)
    rank, size = collectives.rank, collectives.size
    tag = collectives.allgather_object(f"s{int(step)}-{uuid.uuid4().hex[:12]}")[0]
    mask_entry, sync_state = _together(collectives, lambda: _split_masks(sync.state_dict(),
                                                                         masks))
    per_rank = {"tag": tag, "rank": rank, "world_size": size, "sync": sync_state,
                "rng": _rng_state()}
    _together(collectives, lambda: atomic_save(per_rank, rank_file(path, tag, rank)))

    def commit():
        if rank != 0:
            return
        shared = {"tag": tag, "world_size": size, "step": int(step), "epoch": int(epoch),
                  "extra": extra, "model": model.state_dict(),
                  "optimizer": optimizer.state_dict(), **mask_entry}
        atomic_save(shared, path)
        for stale in glob.glob(glob.escape(path) + ".*.rank*"):
            if not stale.startswith(f"{path}.{tag}.rank"):
                os.unlink(stale)

    _together(collectives, commit)


def load_checkpoint(path, *, model, optimizer, sync, masks=None, comm=None):
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model``, ``optimizer``,
    ``sync`` and (if it was saved with them) the ``masks`` tensors, in place (collective). At
    another world size the per-rank state is re-laid (module docstring), with a warning.
    Returns ``{"step", "epoch", "extra", "world_size"}`` (``world_size``: the checkpoint's)."""
    collectives = _control(sync, comm)
    rank, size = collectives.rank, collectives.size

    def read():
        shared = torch.load(path, map_location="cpu", weights_only=False)
        old = shared["world_size"]
        states = []
        for r in [rank] if old == size else range(old):
            part = torch.load(rank_file(path, shared["tag"], r), map_location="cpu",
                              weights_only=False)
            if part["tag"] != shared["tag"]:
                raise ValueError(f"{path}: per-rank file tag {part['tag']!r} does not match "
                                 f"{shared['tag']!r}")
            states.append(part)
        sync_state, relaid = ((states[0]["sync"], None) if old == size else
                              _relaid([part["sync"] for part in states], size))
        sync_state, write_masks = _restore_masks(shared, masks, sync_state)
        return shared, states[0]["rng"], sync_state, relaid, write_masks

    shared, rng, sync_state, relaid, write_masks = _together(collectives, read)
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    if write_masks is not None:
        write_masks()
    if relaid is None:
        sync.load_state_dict(sync_state)
        _set_rng_state(rng)
    else:
        residuals = (f"each rank starts from the mean of the {shared['world_size']} ranks' "
                     f"error-feedback residuals ({relaid} arrays); " if relaid else "")
        warnings.warn(f"resuming at world size {size} from a checkpoint taken at "
                      f"{shared['world_size']}: {residuals}per-rank RNG states are reseeded "
                      f"from (step, rank)", RuntimeWarning, stacklevel=2)
        sync.load_state_dict(sync_state)
        _reseed(shared["step"], rank)
    return {"step": shared["step"], "epoch": shared["epoch"], "extra": shared["extra"],
            "world_size": shared["world_size"]}
