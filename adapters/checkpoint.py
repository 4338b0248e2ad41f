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
uninterrupted (given the same thread count and deterministic kernels). At another world size,
what is per-rank cannot carry over: error-feedback residuals restart from zero and each rank's
RNG is reseeded from ``(step, rank)``; both are reported with ``warnings.warn``. The tracker
state (identical on every rank) is taken from rank 0's file.
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


def save_checkpoint(path, *, model, optimizer, sync, step, epoch, extra=None, comm=None):
    """Write a checkpoint of the run (collective: call on every rank with the same arguments).

    ``step`` / ``epoch`` / ``extra`` describe where training stands (``extra`` is any picklable
    value, e.g. ``{"batch_in_epoch": 3}``); :func:`load_checkpoint` returns them. ``comm``:
    communicator for the checkpoint's control messages (default: the sync's transport).
    """
    collectives = _control(sync, comm)
    rank, size = collectives.rank, collectives.size
    tag = collectives.allgather_object(f"s{int(step)}-{uuid.uuid4().hex[:12]}")[0]
    sync_state = sync.state_dict()
    masks = {"masks": sync_state.pop("masks"), "fingerprint": sync_state.pop("fingerprint")}
    per_rank = {"tag": tag, "rank": rank, "world_size": size, "sync": sync_state,
                "rng": _rng_state()}
    _together(collectives, lambda: atomic_save(per_rank, rank_file(path, tag, rank)))

    def commit():
        if rank != 0:
            return
        shared = {"tag": tag, "world_size": size, "step": int(step), "epoch": int(epoch),
                  "extra": extra, "model": model.state_dict(),
                  "optimizer": optimizer.state_dict(), **masks}
        atomic_save(shared, path)
        for stale in glob.glob(glob.escape(path) + ".*.rank*"):
            if not stale.startswith(f"{path}.{tag}.rank"):
                os.unlink(stale)

    _together(collectives, commit)


def load_checkpoint(path, *, model, optimizer, sync, comm=None):
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model``, ``optimizer`` and
    ``sync`` (collective). Returns ``{"step", "epoch", "extra", "world_size"}``."""
    collectives = _control(sync, comm)
    rank, size = collectives.rank, collectives.size

    def read():
        shared = torch.load(path, map_location="cpu", weights_only=False)
        same_world = shared["world_size"] == size
        per_rank = torch.load(rank_file(path, shared["tag"], rank if same_world else 0),
                              map_location="cpu", weights_only=False)
        if per_rank["tag"] != shared["tag"]:
            raise ValueError(f"{path}: per-rank file tag {per_rank['tag']!r} does not match "
                             f"{shared['tag']!r}")
        return shared, per_rank

    shared, per_rank = _together(collectives, read)
    same_world = shared["world_size"] == size
    model.load_state_dict(shared["model"])
    optimizer.load_state_dict(shared["optimizer"])
    sync.load_state_dict({**per_rank["sync"], "masks": shared["masks"],
                          "fingerprint": shared["fingerprint"]})
    if same_world:
        _set_rng_state(per_rank["rng"])
    else:
        warnings.warn(f"resuming at world size {size} from a checkpoint taken at "
                      f"{shared['world_size']}: per-rank RNG states are reseeded from "
                      f"(step, rank)", RuntimeWarning, stacklevel=2)
        _reseed(shared["step"], rank)
    return {"step": shared["step"], "epoch": shared["epoch"], "extra": shared["extra"],
            "world_size": shared["world_size"]}
