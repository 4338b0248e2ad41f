"""Sharded PacTrain (ZeRO style): the packed all-reduce as a reduce-scatter plus an all-gather.

Every rank knows the same masks, so the survivors of all gradients form one dense vector that
can be split like a dense one. :class:`ShardedReducer` reduce-scatters it: each rank receives
the summed (averaged) survivors of its own contiguous shard, updates the matching weights
(an optimizer that keeps state only for those: 1/N of the survivors), and all-gathers the
updated weights back into every rank's full, replicated weights. A ring all-reduce *is* a
reduce-scatter plus an all-gather, so the wire carries what replicated PacTrain's does.

Shard layout, defined once (:class:`ShardLayout`): the survivors of every array, in the
arrays' order, concatenated; rank r owns the r-th of ``size`` contiguous parts whose counts
differ by at most one (the first ``total % size`` ranks hold one more; ranks may hold none).
The layout follows from the masks, so it is fixed while they are: a mask that changes between
steps changes every rank's shard and raises (on every rank alike, since the masks are agreed).

No dense fallback: the engine runs with ``stable_steps=0``, so a masked array is packed from
the step its mask is agreed. The fallback exists to skip computing survivor positions while a
pruning schedule moves the masks; a sharded optimizer needs those positions anyway, because its
state lives on the survivors. Unmasked arrays (and masks that keep everything) are shards of
all their elements.

Transports: MPI's ``Reduce_scatter``/``Allgatherv`` (:class:`pacmpi.MPICollectives`), torch's
uneven ``reduce_scatter`` and a padded ``all_gather_single``
(:class:`pacmpi.adapters.torch_collectives.TorchDistCollectives`), Horovod's ``reducescatter``
(whose split is :func:`balanced_counts`) and ``allgather``; any other :class:`Collectives`
falls back to an all-reduce and broadcasts (correct, at all-reduce cost).

Ternary (``quantize="ternary"``) quantizes the reduce-scatter half: the codes of all ranks
are summed in integer words (:mod:`pacmpi.ternary`), and a reduce-scatter sums words as an
all-reduce does, so each rank receives the summed words of its shard and decodes them, with
each tensor's agreed scale, into exactly what replicated ternary PacTrain decodes there. The
shards are then cut on word boundaries (:meth:`pacmpi.segments.SegmentTable.payload_at`): the
words are balanced, and a shard's survivors differ from the lossless one's by at most the
padding of the words (under a word's digits per tensor). The all-gather half carries updated
weights, not gradients, and stays in full precision: quantizing it would make the replicas
drift apart from the shard owners' weights, so a sharded ternary step sends ternary codes one
way and full values the other.
"""
import time

import numpy as np

from .arrays import array_module
from .collectives import block_bounds
from .options import EngineOptions
from .payloads import TernaryWords
from .reducer import PacTrainReducer
from .segments import SegmentTable
from .verify import run_together

__all__ = ["ShardedReducer", "ShardLayout", "ShardPart", "balanced_counts"]

# One fusion bucket for everything: its packed payload *is* the survivors of all the arrays
# concatenated, so the engine encodes the whole shardable vector in one call.
_ONE_BUCKET = 1 << 62


def balanced_counts(total, size):
    """``size`` counts summing to ``total`` that differ by at most one, larger ones first."""
    base, extra = divmod(int(total), int(size))
    return [base + (r < extra) for r in range(size)]


class ShardLayout:
    """Where the packed survivors of a bucket's arrays lie, and which of them rank ``rank``
    owns: packed positions ``[start, stop)`` of ``total``, split by ``counts``.

    ``indices`` are the bucket's survivor positions (``None``: every element survives);
    ``counts``: the split, :func:`balanced_counts` by default."""

    def __init__(self, bucket, indices, size, rank, counts=None):
        self.indices = indices
        self.total = bucket.size if indices is None else int(indices.size)
        self.counts = balanced_counts(self.total, size) if counts is None else \
            [int(c) for c in counts]
        if len(self.counts) != size or sum(self.counts) != self.total or min(self.counts) < 0:
            raise ValueError(f"counts {self.counts} do not split {self.total} survivors over "
                             f"{size} ranks")
        self.start = sum(self.counts[:rank])
        self.stop = self.start + self.counts[rank]
        # Per array: its packed range and its survivors' flat positions (None: all, in order).
        self._members = []
        for m in bucket.members:
            if indices is None:
                self._members.append((m, m.offset, m.offset + m.size, None))
                continue
            xp = array_module(indices)
            bounds = xp.asarray([m.offset, m.offset + m.size])
            lo, hi = (int(i) for i in xp.searchsorted(indices, bounds))
            self._members.append((m, lo, hi, indices[lo:hi] - m.offset))

    @property
    def shard_size(self):
        return self.stop - self.start

    def _pieces(self, lo, hi):
        """``(array index, selection in its flat view, slice of packed[lo:hi])`` per array
        overlapping packed positions ``[lo, hi)``."""
        for m, mlo, mhi, positions in self._members:
            a, b = max(lo, mlo), min(hi, mhi)
            if a >= b:
                continue
            selection = slice(a - mlo, b - mlo) if positions is None else positions[a - mlo:
                                                                                   b - mlo]
            yield m.index, selection, slice(a - lo, b - lo)

    def gather(self, arrays, out, lo, hi):
        """``out = packed(arrays)[lo:hi]``; arrays are C-contiguous."""
        for index, selection, part in self._pieces(lo, hi):
            out[part] = arrays[index].reshape(-1)[selection]
        return out

    def scatter(self, packed, arrays, lo, hi):
        """Write ``packed`` (packed positions ``[lo, hi)``) into ``arrays``' survivors; the
        pruned coordinates are left as they are."""
        for index, selection, part in self._pieces(lo, hi):
            arrays[index].reshape(-1)[selection] = packed[part]

    def part(self, arrays):
        """The :class:`ShardPart` of the arrays numbered ``arrays`` (e.g. a DDP bucket's)."""
        return ShardPart(self, arrays)


class ShardPart:
    """The survivors of some of a layout's arrays (one DDP bucket's), reduce-scattered on
    their own as soon as those gradients are ready.

    The payload holds the arrays' packed runs in packed order, so its r-th block of
    ``counts[r]`` values is the part of them rank r's shard holds, and every rank derives the
    same ``counts`` from the agreed masks. :meth:`place` writes this rank's block into its
    shard; the parts of a layout's every array fill the whole shard."""

    def __init__(self, layout, arrays):
        wanted = {int(i) for i in arrays}
        members = sorted((run for run in layout._members if run[0].index in wanted),
                         key=lambda run: run[1])
        missing = wanted - {run[0].index for run in members}
        if missing:
            raise ValueError(f"arrays {sorted(missing)} are not in the layout (it has "
                             f"{len(layout._members)})")
        self._runs = [(m.index, lo, hi, positions) for m, lo, hi, positions in members]
        self.size = sum(hi - lo for _, lo, hi, _ in self._runs)
        self.counts = [sum(max(0, min(hi, b) - max(lo, a)) for _, lo, hi, _ in self._runs)
                       for a, b in block_bounds(layout.counts)]
        # This rank's block, run by run, as slices of its shard.
        self._places = [slice(max(lo, layout.start) - layout.start,
                              min(hi, layout.stop) - layout.start)
                        for _, lo, hi, _ in self._runs if min(hi, layout.stop) > max(lo,
                                                                                   layout.start)]

    def gather(self, arrays, out):
        """``out`` (``size`` values) = the survivors of ``arrays[i]`` for the part's arrays
        ``i``, in packed order; ``arrays`` is indexed by array number (a list or a dict)."""
        at = 0
        for index, lo, hi, positions in self._runs:
            flat = arrays[index].reshape(-1)
            out[at:at + hi - lo] = flat if positions is None else flat[positions]
            at += hi - lo
        return out

    def place(self, block, shard):
        """Write this rank's ``block`` of the reduced payload into its ``shard``."""
        at = 0
        for place in self._places:
            n = place.stop - place.start
            shard[place] = block[at:at + n]
            at += n


class ShardedReducer:
    """Reduce-scatters gradients' survivors, lets the caller update its shard, all-gathers
    the updated weights; a collective call per step (:meth:`step`).

    Parameters
    ----------
    masks:
        One entry per array: a boolean (or 0/1) array of its shape, or ``None`` (unpruned).
        Fixed for the reducer's life (a change raises at the next verification).
    shapes, dtypes:
        The arrays' shapes and their dtype (one for all: the survivors form one vector).
    comm, collectives, options, cuda_aware, abort_on_error:
        As for :class:`pacmpi.PacTrainReducer`. Any :class:`pacmpi.Collectives` works; those
        without a native reduce-scatter fall back to an all-reduce (:class:`Collectives`).
    average, verify_every, quantize, error_feedback, seed, word_dtype, ternary_scale:
        As for :class:`pacmpi.PacTrainReducer`: ``quantize`` ``None`` (lossless) or
        ``"ternary"`` (the reduce-scatter carries ternary words; the all-gather full values).
        No dense fallback and no resync: ``stable_steps=0``, ``on_mismatch="raise"``.

    Example::

        reducer = ShardedReducer(masks, shapes=[w.shape for w in weights],
                                 dtypes=[w.dtype for w in weights])
        state = np.zeros(reducer.layout.shard_size)  # e.g. momentum, for the shard only

        def sgd_momentum(grad, weight):  # this rank's shard of the survivors, in place
            state[...] = 0.9 * state + grad
            weight -= 0.1 * state

        reducer.step(grads, weights, sgd_momentum)  # weights: identical on every rank after
    """

    def __init__(self, masks, *, shapes, dtypes, comm=None, collectives=None, options=None,
                 cuda_aware="auto", abort_on_error=None, **knobs):
        EngineOptions.check_names(knobs, who="ShardedReducer", takes=(
            "average", "verify_every", "quantize", "error_feedback", "seed", "word_dtype",
            "ternary_scale"))
        # (Values checked by the reducer, on every rank together.)
        self._reducer = PacTrainReducer(
            masks, comm=comm, collectives=collectives, bucket_bytes=_ONE_BUCKET,
            shapes=shapes, dtypes=dtypes, cuda_aware=cuda_aware, abort_on_error=abort_on_error,
            options=options, **knobs, stable_steps=0, on_mismatch="raise")
        self.word_counts = None  # ternary: the words of each rank's shard
        self.layout = run_together(self.collectives, self._initial_layout)

    @property
    def collectives(self):
        return self._reducer.collectives

    @property
    def engine(self):
        return self._reducer.engine

    @property
    def stats(self):
        """The engine's counters (``bytes_sent``: packed gradient bytes reduce-scattered)."""
        return self._reducer.stats

    def _initial_layout(self):
        layout = self._reducer.layout
        if len(layout) > 1:
            raise TypeError(f"sharded reduction needs one dtype for every array, got "
                            f"{sorted({str(b.dtype) for b in layout.buckets})}")
        if not len(layout):
            raise ValueError("sharded reduction needs at least one array")
        if self.engine.quantize == "fp16":
            raise ValueError("sharded reduction takes quantize=None or 'ternary', not 'fp16'")
        flat = self._reducer.bucket_masks()[0]
        indices = None
        if flat is not None and not bool(flat.all()):
            indices = array_module(flat).flatnonzero(flat)
        size, counts = self.collectives.size, None
        if self.engine.quantize == "ternary":
            # Balanced words (the split Horovod's reduce-scatter takes), each rank with the
            # survivors its words hold.
            table = SegmentTable(self.engine.segment_sizes(0), indices,
                                 self.engine.codec.digits_per_word)
            self.word_counts = balanced_counts(table.words, size)
            counts = np.diff(table.payload_at(np.cumsum([0] + self.word_counts)))
        return ShardLayout(layout.buckets[0], indices, size, self.collectives.rank, counts)

    def _buffer(self, xp, key, size, dtype):
        """A buffer the engine's pool keeps for this reducer under ``key``."""
        return self.engine.pool.kept(xp, ("sharded", key), size, dtype)

    def memory_report(self):
        """Bytes of the arrays kept between steps, by component: the engine's
        (:meth:`pacmpi.engine.StepEngine.memory_report`, whose payloads include this
        reducer's shard, weights and words buffers) and the reducer's ``fusion`` buffer."""
        return self._reducer.memory_report()

    def _check_params(self, params, xp):
        dtype = self._reducer.layout.dtypes[0]
        self._reducer.check_shapes(params, "parameter")
        for i, p in enumerate(params):
            if array_module(p) is not xp or np.dtype(p.dtype) != dtype:
                raise TypeError(f"parameter {i} is a {type(p).__name__} of {p.dtype}, "
                                f"gradients are {xp.__name__} arrays of {dtype}")
            if not p.flags.c_contiguous:
                raise ValueError(f"parameter {i} is not C-contiguous")

    def _check_layout(self):
        """The engine packs what the layout shards, or the masks changed since it was made."""
        packed = self.engine.packed_indices(0)
        if packed is self.layout.indices:
            return
        mine = self.layout.indices
        same = (packed is not None and mine is not None and packed.size == mine.size
                and bool(array_module(mine).array_equal(packed, mine)))
        if not same:
            keep = self._reducer.layout.buckets[0].size if packed is None else packed.size
            raise ValueError(
                f"the agreed masks changed at step {self.engine.step} (they keep {keep} "
                f"coordinates; this reducer shards the {self.layout.total} its masks kept at "
                "construction): masks are fixed for a sharded reducer's life (ShardedOptimizer."
                "set_masks shards anew)")
        self.layout.indices = packed  # identical: from now on an identity test

    def reduce_scatter(self, grads, params=None, out=None):
        """Begin a step (verification included) and return this rank's shard of the summed
        (averaged) survivors of ``grads``: ``layout.shard_size`` elements, in ``out`` when
        given. ``params`` (optional) are checked with the gradients, so a bad parameter list
        raises on every rank before any data moves. ``grads`` may be modified (as by
        :meth:`pacmpi.PacTrainReducer.reduce`)."""
        reducer = self._reducer
        error = None
        try:
            grads = list(grads)
            reducer.check_grads(grads)
            if params is not None:
                self._check_params(list(params), array_module(grads[0]))
        except (TypeError, ValueError) as exc:
            error = exc
        try:
            # Ternary scales agreed inside the verification all-reduce when it runs.
            self.begin_step(error, lambda: {0: reducer.bucket_flat(0, grads)})
            flat = reducer.bucket_flat(0, grads)
            wire, ctx = self.engine.encode(0, flat)
            xp = array_module(flat)
            if out is None:
                out = self._buffer(xp, "shard", self.layout.shard_size, flat.dtype)
            if isinstance(ctx, TernaryWords):
                words = self._buffer(xp, "words", self.word_counts[self.collectives.rank],
                                     wire.dtype)
                self._reduce_scatter(wire, words, self.word_counts)
                self._decode(words, ctx, out)
            else:  # lossless, or ternary sent as it is (a non-finite scale on some rank)
                self._reduce_scatter(wire, out, self.layout.counts)
                self._average(out)
            self.engine.settle(ctx)
            self.engine.end_step()
        finally:
            reducer.reset_step()
        return out

    def _reduce_scatter(self, wire, out, counts):
        if wire.size:
            started = time.perf_counter()
            self.collectives.reduce_scatter(wire, out, counts, "sum",
                                            name="pacmpi.reduce_scatter")
            self.stats["comm_seconds"] += time.perf_counter() - started

    def _decode(self, words, ctx, out):
        """This rank's block of the summed ternary ``words`` into its ``out`` shard, averaged
        when configured, each segment with its agreed scale."""
        first = sum(self.word_counts[:self.collectives.rank])
        size = self.collectives.size
        divisor = size if self.engine.average and size > 1 else None
        codec = self.engine.codec
        ctx.segments.window(first, first + words.size).decode(
            array_module(out), words, codec, codec.world_size, ctx.scales, divisor, out,
            compact=True)

    def begin_step(self, error=None, scale_flats=None):
        """Begin a step for a front end that reduce-scatters :class:`ShardPart` payloads
        itself (as the DDP hook does, bucket by bucket): verify the masks when due
        (collective; ``error``, this rank's bad input, raises on every rank together) and check
        they are still the layout's. Then reduce-scatter every part's payload with SUM,
        :meth:`ShardPart.place` each block into the shard, and :meth:`end_step`.
        ``scale_flats``: as for :meth:`pacmpi.engine.StepEngine.begin_step`."""
        self._reducer.begin_step(scale_flats=scale_flats, error=error)
        self._check_layout()

    def end_step(self, shard):
        """Average the reduce-scattered ``shard`` (when configured) and count the step."""
        self._average(shard)
        self.engine.end_step()

    def _average(self, shard):
        size = self.collectives.size
        if self.engine.average and size > 1:
            # As kernels.scatter divides on the replicated path: same dtype, same bits.
            array_module(shard).divide(shard, shard.dtype.type(size), out=shard)

    def allgather(self, shard, params):
        """Write every rank's updated ``shard`` (this rank's survivors of ``params``) into
        every rank's ``params``; pruned coordinates are left as they are. Collective."""
        xp = array_module(shard)
        full = self._buffer(xp, "full", self.layout.total, shard.dtype)
        full[self.layout.start:self.layout.stop] = shard
        started = time.perf_counter()
        self.collectives.allgather(full, self.layout.counts, name="pacmpi.allgather")
        self.stats["comm_seconds"] += time.perf_counter() - started
        self.layout.scatter(full, params, 0, self.layout.total)

    def param_shard(self, params, out=None):
        """This rank's shard of ``params``' survivors (a copy, in ``out`` when given)."""
        if out is None:
            out = self._buffer(array_module(params[0]), "params", self.layout.shard_size,
                               params[0].dtype)
        return self.layout.gather(params, out, self.layout.start, self.layout.stop)

    def step(self, grads, params, update, param_shard=None):
        """One sharded step: ``update(grad_shard, param_shard)`` changes ``param_shard`` (this
        rank's survivors of ``params``, gathered into ``param_shard`` when given) in place,
        between the reduce-scatter of ``grads`` and the all-gather into ``params``."""
        params = list(params)
        grad_shard = self.reduce_scatter(grads, params)
        weights = self.param_shard(params, param_shard)
        update(grad_shard, weights)
        self.allgather(weights, params)

    def state_dict(self):
        """The engine's state (step, tracker, counters), as :meth:`PacTrainReducer.state_dict`."""
        return self._reducer.state_dict()

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output; collective, fails on every rank together."""
        self._reducer.load_state_dict(state)
