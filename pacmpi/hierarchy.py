"""Two-level reduction for ``PacTrainReducer(hierarchical=True)``: within each node, then across
nodes.

Ranks of one node first sum over their node communicator (fast local memory) into the node's
leader (its node rank 0), the leaders reduce across nodes over a leaders' communicator, and
each node broadcasts the result. :class:`HierarchicalCollectives` is that transport: every
reduction, the verification's MAX included, passes through both levels, so one verification
still covers every rank and every rank fails together.

:class:`HierarchicalEngine` changes only the ternary payload, through the engine's packing
strategy (:class:`NodeSum`: what a rank packs is its node's sum). The leader quantizes its node's
exact sum (``E[s q] = node sum``, so the estimator stays unbiased), non-leaders contribute
all-zero words, and the words of K nodes, not N ranks, are summed: base-(2K+1) digits. The
error-feedback residual is the node sum's, kept by the leader; non-leaders keep none.
"""
import os
import socket
import time
import warnings

from . import kernels
from .arrays import array_module
from .collectives import Collectives, MPICollectives
from .engine import StepEngine
from .packing import OwnGradient
from .payloads import Gathered
from .ternary import wire_bits_table
from .verify import run_together

__all__ = ["HierarchicalCollectives", "HierarchicalEngine", "NodeSum", "node_communicator"]


def _node_identity():
    """What tells nodes apart on one host: its name and its network namespace (the test bed
    runs each simulated node as a namespace of one machine)."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = None
    return socket.gethostname(), namespace


def node_communicator(comm):
    """The ranks of ``comm`` on this rank's node: ``comm.Split_type(COMM_TYPE_SHARED)``,
    split further by host name and network namespace; a collective call over ``comm``."""
    from mpi4py import MPI

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        identities = shared.allgather(_node_identity())
        return shared.Split(identities.index(identities[shared.Get_rank()]),
                            key=shared.Get_rank())
    finally:
        shared.Free()


def _node_members(MPI, comm, node_comm):
    """The ranks (in ``comm``) of ``node_comm``'s members, in node-rank order."""
    if not isinstance(node_comm, MPI.Intracomm) or node_comm == MPI.COMM_NULL:
        raise TypeError(f"node_comm must be an mpi4py intracommunicator, got {node_comm!r}")
    node_group, group = node_comm.Get_group(), comm.Get_group()
    try:
        members = MPI.Group.Translate_ranks(node_group, list(range(node_group.Get_size())),
                                            group)
    finally:
        node_group.Free()
        group.Free()
    outside = [r for r, m in enumerate(members) if m == MPI.UNDEFINED]
    if outside:
        raise ValueError(f"node_comm is not a sub-communicator of comm: its ranks {outside} "
                         f"(of {len(members)}) are not in comm")
    return tuple(members)


def _check_partition(table, rank):
    """Every member of this rank's node must name the same members in the same order."""
    for member in table[rank]:
        if table[member] != table[rank]:
            raise ValueError(f"node_comm is inconsistent: comm rank {rank}'s node is ranks "
                             f"{list(table[rank])}, but rank {member} says its node is ranks "
                             f"{list(table[member])}")


class HierarchicalCollectives(Collectives):
    """Reductions over ``comm`` in two levels: node reduce -> leaders' all-reduce -> node
    broadcast; broadcasts and gathers run over ``comm`` itself.

    Parameters
    ----------
    comm:
        mpi4py communicator of every rank (default: a duplicate of ``COMM_WORLD``).
    node_comm:
        This rank's node: a sub-communicator of ``comm`` whose members all pass the same one
        (checked: errors on every rank together). Default: :func:`node_communicator`. Its
        rank 0 is the node's leader.
    cuda_aware, watchdog:
        As for :class:`pacmpi.MPICollectives`.

    Attributes: ``rank``/``size`` (in ``comm``), ``nodes`` (K), ``node`` (the node's
    transport), ``leaders`` (the leaders' transport; ``None`` on non-leaders), ``is_leader``,
    ``node_layout`` (each node's ranks in ``comm``, ordered by leader).
    """

    word_dtypes = MPICollectives.word_dtypes

    def __init__(self, *, comm=None, node_comm=None, cuda_aware="auto", watchdog=None):
        from mpi4py import MPI

        self.world = MPICollectives(comm=comm, cuda_aware=cuda_aware, watchdog=watchdog)
        self.rank, self.size = self.world.rank, self.world.size
        self.cuda_aware = self.world.cuda_aware
        comm = self.world.comm
        if node_comm is None:
            node_comm = node_communicator(comm)
        members = run_together(self.world, _node_members, MPI, comm, node_comm)
        table = self.world.allgather_object(members)
        run_together(self.world, _check_partition, table, self.rank)
        self.node_layout = tuple(sorted(set(table)))
        self.nodes = len(self.node_layout)
        self.node = MPICollectives(comm=node_comm, cuda_aware=cuda_aware, watchdog=watchdog)
        self.is_leader = self.node.rank == 0
        leaders = comm.Split(0 if self.is_leader else MPI.UNDEFINED, key=self.rank)
        self.leaders = (None if leaders == MPI.COMM_NULL else
                        MPICollectives(comm=leaders, cuda_aware=cuda_aware, watchdog=watchdog))

    def __getstate__(self):
        raise TypeError("HierarchicalCollectives holds communicators and cannot be pickled")

    def allreduce(self, buf, op="sum", name=None):
        if self.node.size > 1:
            self.node.reduce(buf, op, root=0)
        if self.leaders is not None and self.leaders.size > 1:
            self.leaders.allreduce(buf, op)
        if self.node.size > 1:
            self.node.bcast(buf, root=0)

    def bcast(self, buf, root=0, name=None):
        self.world.bcast(buf, root=root)

    def allgather_object(self, obj, name=None):
        return self.world.allgather_object(obj)


class NodeSum(OwnGradient):
    """What a rank packs under :class:`HierarchicalEngine`: its node's sum. Lossless and
    float16 payloads are summed by the two-level all-reduce as they are; a ternary payload is
    the leader's quantized node sum, the others' all-zero words (see the module's
    docstring). Its scales come from node sums, which exist only after the verification, so
    none ride in it; its residual is the node sum's (the leader's; nonzero where this rank
    prunes), laid out as the payload."""

    fuses_scales = compacts_in_place = residual_of_survivors = False

    def __init__(self):
        self.sums = {}  # unit -> this step's node sum, from its scales to its encode

    def __getstate__(self):
        return {"sums": {}}

    def ranks(self, collectives):
        return collectives.nodes

    def keeps_residual(self, collectives):
        return collectives.is_leader

    def scaled(self, engine, u, flat):
        """Sum what ``u`` sends over the node, in the compute dtype, into the leader's buffer
        (kept for the encode, complete on the leader only); the leader takes the scales of
        it, the others none."""
        xp = array_module(flat)
        group = engine.group(u)
        total = kernels.gather(xp, flat, group.positions(), engine.pool.kept(
            xp, ("node", u), group.count, kernels.compute_dtype(flat.dtype)))
        started = time.perf_counter()
        engine.collectives.node.reduce(total, "sum", root=0)
        engine.stats["comm_seconds"] += time.perf_counter() - started
        self.sums[u] = total
        return (total if engine.collectives.is_leader else None), True

    def quantized(self, engine, u, flat, compact):
        # The leader quantizes the node sum (laid out as the payload), not its own gradient;
        # the others send digit 0 everywhere, which adds nothing to the leaders' digit sums.
        total = self.sums.pop(u)
        return (total if engine.collectives.is_leader else None), True

    def unquantized(self, engine, u, flat):
        # NaN/Inf in some node's sum: send the node sums unquantized (the leader's holds this
        # rank's values already), so they propagate as on the dense path.
        total = self.sums.pop(u)
        if not engine.collectives.is_leader:
            total[...] = 0
        group = engine.group(u)
        return total, Gathered(u, engine.generation, group.count, group.positions())


class HierarchicalEngine(StepEngine):
    """:class:`pacmpi.engine.StepEngine` over a :class:`HierarchicalCollectives`, packing
    each node's sum (:class:`NodeSum`)."""

    def __init__(self, collectives, buckets, **kwargs):
        super().__init__(collectives, buckets, packing=NodeSum(), **kwargs)

    def state_dict(self):
        """As :meth:`StepEngine.state_dict`, with the node layout the leaders' residuals
        belong to."""
        return dict(super().state_dict(), node_layout=self.collectives.node_layout)

    def loader(self, state, flats):
        """As :meth:`StepEngine.loader`; residuals of another node layout (each is a node
        sum's) start from zero, with a warning."""
        if state.get("node_layout") != self.collectives.node_layout and state["residuals"]:
            warnings.warn("checkpoint was written with another node layout: the nodes' "
                          "error-feedback residuals start from zero", RuntimeWarning,
                          stacklevel=4)
            state = dict(state, residuals={})
        return super().loader(state, flats)


def hierarchical_wire_bits(ranks_per_node, nodes, word_dtype="uint64"):
    """Ternary bits per value on the wire, flat (codes of every rank summed) vs hierarchical
    (codes of one leader per node): ``{"flat": row, "hierarchical": row}`` with the rows of
    :func:`pacmpi.ternary.wire_bits_table`."""
    flat, hierarchical = wire_bits_table((ranks_per_node * nodes, nodes), word_dtype)
    return {"flat": flat, "hierarchical": hierarchical}
