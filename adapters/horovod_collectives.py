"""A :class:`pacmpi.Collectives` transport over Horovod's own collectives (MPI or Gloo
controller), so pacmpi's engine can verify and agree through Horovod."""
import itertools

import torch

from pacmpi import Collectives
from pacmpi.adapters.convert import as_tensor
from pacmpi.collectives import check_blocks
from pacmpi.sharded import balanced_counts

__all__ = ["HorovodCollectives", "summable"]

# One sequence for every HorovodCollectives of a process: ranks issue their collectives in the
# same order, so the n-th call carries the same Horovod name on every rank.
_SEQUENCE = itertools.count()


def _hvd():
    import horovod.torch as hvd
    return hvd


def restart_names():
    """Start the name sequence over. After an elastic reset, ranks that just joined start from
    zero while the others have counted on: every rank restarts at the same collective point."""
    global _SEQUENCE
    _SEQUENCE = itertools.count()


def world_size():
    """Horovod's current world size (it changes at an elastic reset)."""
    return _hvd().size()


def summable(tensor):
    """``tensor`` in a dtype Horovod can sum: bfloat16 as a float32 copy (Horovod 0.28.1 has no
    bfloat16 all-reduce, horovod#4047; float32 holds every bfloat16 exactly, so the sum is
    rounded to bfloat16 once, when it comes back), any other dtype as it is."""
    return tensor.float() if tensor.dtype == torch.bfloat16 else tensor


class _Request:
    """Completes a Horovod all-reduce; ``wait`` writes a float32-staged sum back (rounding)."""

    def __init__(self, handle, staged, tensor):
        self._handle, self._staged, self._tensor = handle, staged, tensor

    def wait(self):
        _hvd().synchronize(self._handle)
        if self._staged is not self._tensor:
            self._tensor.copy_(self._staged)


class HorovodCollectives(Collectives):
    """:class:`pacmpi.Collectives` over Horovod (MPI or Gloo controller), global process set.

    Arrays are wrapped as tensors without copies and reduced in place. Each call is named
    ``pacmpi.<kind>.<n>`` from a per-process sequence unless ``name=`` is given; a name that is
    stable across steps lets Horovod's response cache skip negotiation. Needs ``hvd.init()``.
    Horovod has no unsigned integer SUM, so ternary words are int64, and no bfloat16 SUM, so
    bfloat16 arrays are summed as float32 copies (:func:`summable`).
    """

    def __init__(self):
        hvd = _hvd()
        self.rank, self.size = hvd.rank(), hvd.size()
        self._ops = {"sum": hvd.Sum, "max": hvd.Max}

    @staticmethod
    def _name(kind, name):
        return name if name is not None else f"pacmpi.{kind}.{next(_SEQUENCE)}"

    def _op(self, op):
        if op not in self._ops:
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return self._ops[op]

    def allreduce(self, buf, op="sum", name=None):
        self.iallreduce(buf, op, name=self._name("allreduce", name)).wait()

    def iallreduce(self, buf, op="sum", name=None):
        tensor = as_tensor(buf)
        staged = summable(tensor)
        return _Request(_hvd().allreduce_async_(staged, op=self._op(op),
                                                name=self._name("iallreduce", name)),
                        staged, tensor)

    def bcast(self, buf, root=0, name=None):
        _hvd().broadcast_(as_tensor(buf), root_rank=root, name=self._name("bcast", name))

    def reduce_scatter(self, buf, out, counts, op="sum", name=None):
        """Horovod's reduce-scatter splits as :func:`pacmpi.sharded.balanced_counts` does
        (the first ``total % size`` ranks take one more); other splits, and MAX, which it
        lacks, take the interface's all-reduce fallback."""
        check_blocks(self, counts, buf, out)
        if not buf.size:
            return None
        if op != "sum" or [int(c) for c in counts] != balanced_counts(buf.size, self.size):
            return super().reduce_scatter(buf, out, counts, op, name=name)
        tensor = as_tensor(buf)
        result = _hvd().reducescatter(summable(tensor), op=self._op(op),
                                      name=self._name("reducescatter", name))
        as_tensor(out).copy_(result)  # rounds a float32-staged bfloat16 sum once

    def allgather(self, buf, counts, name=None):
        start, stop = check_blocks(self, counts, buf)
        if not buf.size:
            return
        tensor = as_tensor(buf)
        # Bits only: 16-bit floats as 16-bit integers, which Horovod gathers in any version.
        wire = tensor.view(torch.int16) if tensor.element_size() == 2 else tensor
        wire.copy_(_hvd().allgather(wire[start:stop], name=self._name("allgather", name)))

    def allgather_object(self, obj, name=None):
        return _hvd().allgather_object(obj, name=self._name("gather", name))
