"""A :class:`pacmpi.Collectives` transport over Horovod's own collectives (MPI or Gloo
controller), so pacmpi's engine can verify and agree through Horovod."""
import itertools

from pacmpi import Collectives
from pacmpi.adapters.convert import as_tensor

__all__ = ["HorovodCollectives"]

# One sequence for every HorovodCollectives of a process: ranks issue their collectives in the
# same order, so the n-th call carries the same Horovod name on every rank.
_SEQUENCE = itertools.count()


def _hvd():
    import horovod.torch as hvd
    return hvd


class _Request:
    def __init__(self, handle):
        self._handle = handle

    def wait(self):
        _hvd().synchronize(self._handle)


class HorovodCollectives(Collectives):
    """:class:`pacmpi.Collectives` over Horovod (MPI or Gloo controller), global process set.

    Arrays are wrapped as tensors without copies and reduced in place. Each call is named
    ``pacmpi.<kind>.<n>`` from a per-process sequence unless ``name=`` is given; a name that is
    stable across steps lets Horovod's response cache skip negotiation. Needs ``hvd.init()``.
    Horovod has no unsigned integer SUM, so ternary words are int64.
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
        _hvd().allreduce_(as_tensor(buf), op=self._op(op), name=self._name("allreduce", name))

    def iallreduce(self, buf, op="sum", name=None):
        return _Request(_hvd().allreduce_async_(as_tensor(buf), op=self._op(op),
                                                name=self._name("iallreduce", name)))

    def bcast(self, buf, root=0, name=None):
        _hvd().broadcast_(as_tensor(buf), root_rank=root, name=self._name("bcast", name))

    def allgather_object(self, obj, name=None):
        return _hvd().allgather_object(obj, name=self._name("gather", name))
