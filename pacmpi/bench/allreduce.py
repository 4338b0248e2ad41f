"""``pacmpi bench allreduce``: time the dense, packed and ternary all-reduces (and the peers) per
size and mask density, like nccl-tests; rank 0 prints a row per (size, density, method) and
``--json`` writes the rows.

Columns: time per all-reduce (slowest rank), algbw = dense-equivalent bytes / time, busbw =
algbw * 2(n-1)/n, bytes each rank puts into the all-reduce, pacmpi's pack+unpack (including
quantization) and verification time, and #wrong elements from a validation pass.

Every method reduces the same integer-valued gradients under the same mask, so a validation
pass can count wrong elements exactly; sizes are dense-equivalent float32 bytes.

``--model NAME`` replaces the sizes by a published architecture's parameter tensors
(:mod:`pacmpi.bench.models`): a global magnitude mask at each density, and fusion buckets of
the reducer's ``bucket_bytes`` (25 MiB, like DDP) filled in gradient-ready (reverse) order; the
dense baselines all-reduce the same buckets, and fp16's "codec" is its two casts.

The peers run as their baselines do (``experiments/baselines.py``, torch's ``powerSGD_hook``),
on NumPy/CuPy arrays, once per size like the dense baselines; a peer's "codec" is everything but
its collectives:

- ``topk`` (``TopKSync``): one top-k of the whole gradient (``--topk-ratio`` of its values),
  whose int64 positions and float32 values every rank all-gathers (two calls) and adds up;
- ``dgc`` (``DGCSync``): the same per tensor, ``--dgc-ratio`` of each (at least one value);
- ``terngrad`` (``TernGradSync``, without its clipping, which changes no byte): each tensor
  stochastically ternarized at its own scale ``max |g|``; the 2-bit codes, four per byte, and
  a float32 scale per tensor all-gathered (two calls); every rank decodes every rank's codes;
- ``powersgd`` (``powerSGD_hook`` of rank ``--powersgd-rank``): per fusion bucket, the tensors
  that compression would not shrink all-reduced whole; each other gradient ``M`` (an ``n x m``
  matrix, ``n`` its first dimension) gives ``P = M Q`` (``Q`` warm-started from the previous
  call; random on the first), ``P`` is all-reduced and orthonormalized (QR), ``Q = M^T P``
  all-reduced, and ``M`` becomes ``P Q^T``: three all-reduces per bucket. It needs ``--model``:
  a ``--sizes`` buffer is one vector, which the hook sends uncompressed (the cost model refuses
  PowerSGD for a byte count too).

A ``--sizes`` buffer is one tensor (one DGC top-k, one TernGrad scale). The results are sums,
as in the other rows, and no peer keeps state between calls beyond PowerSGD's warm start (no
error feedback, no DGC momentum), so every timed call reduces the same gradients. A peer's
``dens`` is its ratio (TopK, DGC), 1 (TernGrad: every value, at 2 bits) or the share of the
values it sends (PowerSGD); its wire bytes are those :func:`pacmpi.costmodel.peer_step_seconds`
counts for the same tensors.

Validation of the peers: TopK's and DGC's result must be the exact sum of every rank's selected
pairs, TernGrad's the exact sum of every rank's scale times its codes, redrawn from the same
keys (the gradients are integers, so nothing rounds); PowerSGD's whole tensors must be the
exact sum and its approximations the float64 projection of the summed gradient ``M`` onto the
span of ``M Q``, ``Q`` the Qs the last call started from (all-reduces are sums, so that is what
``P Q^T`` was), within 1e-4 of each matrix's largest summed value: float32 products, sums and
QR against float64 ones (on ResNet-50's, VGG19's, BERT-base's and GPT-2's tensors at 2 ranks
they agree to 4e-7 of it), while a corrupted payload is off by its own size. PowerSGD's
products run on NumPy's BLAS: where ranks share cores, give each one thread (``mpirun -x
OMP_NUM_THREADS=1``), or their threads contend.
"""
import math
import time

import numpy as np

from .. import kernels
from ..arrays import to_host
from ..buckets import DEFAULT_BUCKET_BYTES, BucketLayout
from ..cli_options import (
    add_densities,
    add_device,
    add_iters,
    add_json_file,
    add_peer_options,
    add_warmup,
    command_parser,
)
from ..collectives import allreduce_algorithm, block_bounds, default_collectives
from ..costmodel import PEER_DEFAULTS, check_int, powersgd_values, ring_factor, topk_count
from ..hierarchy import HierarchicalCollectives
from ..methods import ALLREDUCE_METHODS, METHODS, lookup_method
from ..reducer import PacTrainReducer
from ..ternary import (
    format_wire_bits,
    pack_codes,
    stochastic_ternary,
    ternary_key,
    unpack_codes,
    wire_bits_table,
)
from ..units import parse_size
from . import harness
from .models import MODELS, magnitude_mask, model_params, random_weights

__all__ = ["BENCH_METHODS", "run", "format_table", "main"]

BENCH_METHODS = tuple(METHODS)
"""What this benchmark runs: the engine's all-reduce methods and the peers."""

POWERSGD_TOLERANCE = 1e-4
"""How far PowerSGD's approximations may be from the float64 replay, in units of each matrix's
largest summed gradient (see the module docstring)."""


def _bounds(shapes):
    """``(start, stop)`` of each tensor of ``shapes`` in their flat concatenation."""
    return block_bounds([math.prod(s) for s in shapes])


def _views(flat, shapes):
    return [flat[a:b].reshape(s) for (a, b), s in zip(_bounds(shapes), shapes)]


def _shapes(layout):
    return [m.shape for bucket in layout.buckets for m in bucket.members]


def _dense(collectives, wire_dtype, layout, xp):
    # Every array has the same dtype and keeps its order, so bucket k is one contiguous run.
    bounds = np.cumsum([0] + [bucket.size for bucket in layout.buckets])
    wires = ([xp.empty(int(b - a), dtype=wire_dtype) for a, b in zip(bounds[:-1], bounds[1:])]
             if wire_dtype != np.float32 else None)

    def reduce(flat):
        wire_bytes, cast_seconds = 0, 0.0
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            if wires is None:
                wire = flat[a:b]
                collectives.allreduce(wire, "sum")
            else:
                # The compiled casts (F16C on x86), as torch's .half() or Horovod's fp16
                # compression would do them; timed as this baseline's codec.
                started = time.perf_counter()
                wire = kernels.gather(xp, flat[a:b], None, wires[k])
                cast_seconds += time.perf_counter() - started
                collectives.allreduce(wire, "sum")
                started = time.perf_counter()
                kernels.scatter(xp, wire, None, flat[a:b])
                cast_seconds += time.perf_counter() - started
            wire_bytes += wire.nbytes
        return wire_bytes, cast_seconds, 0.0
    return reduce


def _packed(collectives, mask, quantize, layout):
    shapes = _shapes(layout)
    reducer = PacTrainReducer(_views(mask, shapes), collectives=collectives, quantize=quantize,
                              average=False, stable_steps=0, error_feedback=False,
                              bucket_bytes=layout.bucket_bytes)
    keys = ("bytes_sent", "pack_seconds", "unpack_seconds", "verify_seconds")

    def reduce(flat):
        before = [reducer.stats[k] for k in keys]
        reducer.reduce(_views(flat, shapes))
        sent, pack, unpack, verify = (reducer.stats[k] - b for k, b in zip(keys, before))
        return sent, pack + unpack, verify
    return reduce


def _top_positions(xp, flat, k):
    """Positions (int64) of ``flat``'s ``k`` largest magnitudes."""
    return xp.argpartition(xp.abs(flat), flat.size - k)[flat.size - k:].astype(np.int64)


def _selection(method, shapes, knobs, xp):
    """``(k, select)`` of TopK or DGC: ``select(flat)`` gives this rank's ``k`` positions, of
    the whole gradient (TopK) or of each tensor (DGC, at least one each)."""
    bounds = _bounds(shapes)
    if method == "topk":
        k = topk_count(knobs["topk_ratio"], bounds[-1][1])
        return k, lambda flat: _top_positions(xp, flat, k)
    ks = [topk_count(knobs["dgc_ratio"], b - a) for a, b in bounds]
    return sum(ks), lambda flat: xp.concatenate(
        [_top_positions(xp, flat[a:b], k) + a for (a, b), k in zip(bounds, ks)])


def _gathered_pairs(collectives, k, select, xp):
    """TopK's and DGC's exchange: this rank's ``k`` (int64 position, float32 value) pairs
    all-gathered, two calls, and every rank's added up in place of the gradient."""
    world = collectives.size
    # Every rank's block, gathered in place: made once, not in the timed calls.
    all_values = xp.empty(k * world, dtype=np.float32)
    all_positions = xp.empty(k * world, dtype=np.int64)
    mine = slice(collectives.rank * k, (collectives.rank + 1) * k)

    def reduce(flat):
        started = time.perf_counter()
        positions = select(flat)
        all_values[mine], all_positions[mine] = flat[positions], positions
        codec = time.perf_counter() - started
        collectives.allgather(all_values, [k] * world)
        collectives.allgather(all_positions, [k] * world)
        started = time.perf_counter()
        flat[...] = 0
        if xp is np:
            np.add.at(flat, all_positions, all_values)
        else:
            import cupyx
            cupyx.scatter_add(flat, all_positions, all_values)
        return 12 * k, codec + time.perf_counter() - started, 0.0
    return reduce


def _terngrad_keys(seed, rank, tensors):
    # The same keys on every call: the timed calls draw alike and the validation redraws them.
    return [ternary_key(seed, 0, t, rank) for t in range(tensors)]


def _ternarize(xp, flat, bounds, keys, codes):
    """TernGrad's encoding of one rank's gradient: each tensor's scale ``max |g|`` (returned,
    float32) and its values stochastically ternarized at that scale into ``codes`` (int8)."""
    scales = xp.stack([xp.abs(flat[a:b]).max() for a, b in bounds]).astype(np.float32)
    for (a, b), scale, key in zip(bounds, to_host(scales), keys):
        codes[a:b] = stochastic_ternary(xp, flat[a:b], scale, key)
    return scales


def _terngrad(collectives, shapes, seed, xp):
    bounds = _bounds(shapes)
    count, tensors, world, rank = bounds[-1][1], len(bounds), collectives.size, collectives.rank
    width = math.ceil(count / 4)
    keys = _terngrad_keys(seed, rank, tensors)
    codes = xp.empty(count, dtype=np.int8)
    all_codes = xp.empty(width * world, dtype=np.uint8)
    all_scales = xp.empty(tensors * world, dtype=np.float32)

    def reduce(flat):
        started = time.perf_counter()
        all_scales[rank * tensors:(rank + 1) * tensors] = _ternarize(xp, flat, bounds, keys, codes)
        all_codes[rank * width:(rank + 1) * width] = pack_codes(codes)
        codec = time.perf_counter() - started
        collectives.allgather(all_codes, [width] * world)
        collectives.allgather(all_scales, [tensors] * world)
        started = time.perf_counter()
        flat[...] = 0
        scales = to_host(all_scales).reshape(world, tensors)
        for r in range(world):  # a rank at a time: all ranks' decoded values at once would not fit
            values = unpack_codes(all_codes[r * width:(r + 1) * width], count)
            for (a, b), scale in zip(bounds, scales[r]):
                flat[a:b] += values[a:b] * scale
        return width + 4 * tensors, codec + time.perf_counter() - started, 0.0
    return reduce


def _powersgd_split(members, rank):
    """``(whole, matrices)`` of one bucket's ``members`` (``((start, stop), shape)`` pairs):
    the ``(start, stop)`` of each tensor ``powerSGD_hook`` of ``rank`` sends whole, and ``(start,
    n, m, r, p_offset, q_offset)`` of each it compresses as an ``n x m`` matrix of rank ``r``,
    with its factors' offsets in the bucket's P and Q buffers."""
    whole, matrices, p_size, q_size = [], [], 0, 0
    for (a, b), shape in members:
        # The cost model's count decides, so the two agree on what is sent.
        if powersgd_values([shape], rank) == b - a:
            whole.append((a, b))
            continue
        n = shape[0]
        m = (b - a) // n
        r = min(n, m, rank)
        matrices.append((a, n, m, r, p_size, q_size))
        p_size, q_size = p_size + n * r, q_size + m * r
    return whole, matrices


def _block(flat, start, rows, cols):
    return flat[start:start + rows * cols].reshape(rows, cols)


def _orthonormalize(xp, matrix):
    # QR where torch's hook uses Gram-Schmidt below rank 3: the same span, so the same P Q^T.
    matrix[...] = xp.linalg.qr(matrix)[0]


def _factor_sizes(matrices):
    return sum(n * r for _, n, _, r, _, _ in matrices), sum(m * r for _, _, m, r, _, _ in matrices)


class _PowerSGD:
    """``powerSGD_hook`` of ``rank`` over ``layout``'s buckets, without error feedback (see the
    module docstring). ``start[b]``: the (orthonormal) Qs bucket ``b``'s last call started from,
    which the validation pass replays."""

    def __init__(self, collectives, layout, rank, seed, xp):
        bounds = _bounds(_shapes(layout))
        self.collectives, self.xp = collectives, xp
        self.buckets = [_powersgd_split([(bounds[m.index], m.shape) for m in bucket.members],
                                        rank) for bucket in layout.buckets]
        self.p = [xp.empty(_factor_sizes(matrices)[0], dtype=np.float32)
                  for _, matrices in self.buckets]
        self.q = [None] * len(self.buckets)
        self.start = [None] * len(self.buckets)
        self._random = np.random.default_rng(seed)  # the same Qs on every rank, as torch's

    def __call__(self, flat):
        wire, codec = 0, 0.0
        for b in range(len(self.buckets)):
            sent, seconds = self._bucket(b, flat)
            wire, codec = wire + sent, codec + seconds
        return wire, codec, 0.0

    def _bucket(self, b, flat):
        xp, collectives, p = self.xp, self.collectives, self.p[b]
        whole, matrices = self.buckets[b]
        started = time.perf_counter()
        q = self.q[b]  # the previous call's all-reduced Qs: the warm start
        if q is None:
            q = xp.asarray(self._random.standard_normal(_factor_sizes(matrices)[1],
                                                        dtype=np.float32))
        for a, n, m, r, po, qo in matrices:
            _orthonormalize(xp, _block(q, qo, m, r))
            xp.matmul(_block(flat, a, n, m), _block(q, qo, m, r), out=_block(p, po, n, r))
        uncompressed = xp.concatenate([flat[a:z] for a, z in whole]
                                      or [xp.empty(0, np.float32)])
        codec = time.perf_counter() - started
        collectives.allreduce(uncompressed, "sum")
        collectives.allreduce(p, "sum")
        started = time.perf_counter()
        offset = 0
        for a, z in whole:
            flat[a:z] = uncompressed[offset:offset + z - a]
            offset += z - a
        new_q = xp.empty_like(q)
        for a, n, m, r, po, qo in matrices:
            _orthonormalize(xp, _block(p, po, n, r))
            xp.matmul(_block(flat, a, n, m).T, _block(p, po, n, r), out=_block(new_q, qo, m, r))
        codec += time.perf_counter() - started
        collectives.allreduce(new_q, "sum")
        started = time.perf_counter()
        for a, n, m, r, po, qo in matrices:
            xp.matmul(_block(p, po, n, r), _block(new_q, qo, m, r).T, out=_block(flat, a, n, m))
        self.start[b], self.q[b] = q, new_q
        wire = uncompressed.nbytes + p.nbytes + new_q.nbytes
        return wire, codec + time.perf_counter() - started


def _make_reduce(method, collectives, mask, layout, xp, knobs, seed):
    if method in ("topk", "dgc"):
        return _gathered_pairs(collectives, *_selection(method, _shapes(layout), knobs, xp), xp)
    if method == "terngrad":
        return _terngrad(collectives, _shapes(layout), seed, xp)
    if method == "powersgd":
        return _PowerSGD(collectives, layout, knobs["powersgd_rank"], seed, xp)
    spec = METHODS[method]
    if not spec.packed:
        return _dense(collectives, np.float16 if spec.quantize == "fp16" else np.float32,
                      layout, xp)
    return _packed(collectives, mask, spec.quantize, layout)


def _count_wrong(method, result, reference, mask, scale, world, tolerance=0.0):
    if METHODS[method].quantize != "ternary":
        # Not `> tolerance`: a NaN is wrong too.
        return int(np.count_nonzero(~(np.abs(result - reference) <= tolerance)))
    lattice = result / scale if scale > 0 else result
    off_lattice = np.abs(lattice - np.rint(lattice)) > 1e-3 * world
    out_of_range = np.abs(np.rint(lattice)) > world
    pruned_nonzero = (~mask) & (result != 0)
    return int(np.count_nonzero(off_lattice | out_of_range | pruned_nonzero))


def _quantized(collectives, grads):
    """What one ternary quantizer sees: this rank's gradients, or its node's sum under a
    hierarchical transport (the leader quantizes the node sum)."""
    if not isinstance(collectives, HierarchicalCollectives):
        return grads
    total = grads.copy()
    collectives.node.allreduce(total, "sum")
    return total


def _contribution(method, grads, shapes, knobs, seed, rank):
    """What this rank's gradients add to the exact result (float64): all of them, or what a
    peer sends of them (TopK's and DGC's pairs; TernGrad's scales times its codes, drawn from
    the keys the timed calls used, so each value is ``-s``, ``0`` or ``s``)."""
    if method in ("topk", "dgc"):
        positions = _selection(method, shapes, knobs, np)[1](grads)
        sent = np.zeros(grads.size)
        sent[positions] = grads[positions]
        return sent
    if method == "terngrad":
        bounds = _bounds(shapes)
        codes = np.empty(grads.size, dtype=np.int8)
        scales = _ternarize(np, grads, bounds, _terngrad_keys(seed, rank, len(shapes)), codes)
        return codes * np.repeat(scales.astype(np.float64), [b - a for a, b in bounds])
    return grads.astype(np.float64)


def _powersgd_reference(reference, powersgd):
    """``reference`` (the exact sum, float64) with each compressed matrix ``M`` replaced, in
    place, by the last call's approximation, and each value's tolerance (0 where the sum is
    exact). The all-reduces are sums, so ``P`` was ``M Q`` (``Q`` the Qs the call started from)
    and ``P Q^T`` is ``M`` projected onto the span of ``P``."""
    tolerance = np.zeros(reference.size)
    for (_, matrices), start in zip(powersgd.buckets, powersgd.start):
        start = to_host(start).astype(np.float64)
        for a, n, m, r, _, qo in matrices:
            summed = _block(reference, a, n, m)
            basis = np.linalg.qr(summed @ _block(start, qo, m, r))[0]
            tolerance[a:a + n * m] = POWERSGD_TOLERANCE * np.abs(summed).max()
            summed[...] = basis @ (basis.T @ summed)
    return tolerance


def _sent(method, density, mask, shapes, knobs):
    """``(density, kept)`` of a row: the mask's, or a peer's ratio (TernGrad: 1; PowerSGD: the
    share of the values it sends) and the values it sends."""
    if method in ("topk", "dgc"):
        return knobs[f"{method}_ratio"], _selection(method, shapes, knobs, np)[0]
    if method == "terngrad":
        return 1.0, mask.size
    if method == "powersgd":
        sent = powersgd_values(shapes, knobs["powersgd_rank"])
        return sent / mask.size, sent
    return density, int(np.count_nonzero(mask))


def _bench_one(collectives, method, layout, mask, density, iters, warmup, seed, xp,
               knobs=PEER_DEFAULTS):
    world, rank = collectives.size, collectives.rank
    count = mask.size
    shapes = _shapes(layout)
    grads = (np.random.default_rng(seed + 1 + rank).integers(-8, 9, size=count)
             .astype(np.float32) * mask)
    reduce = _make_reduce(method, collectives, xp.asarray(mask), layout, xp, knobs, seed)
    device_grads = xp.asarray(grads)
    work = xp.empty_like(device_grads)

    def refill():  # the reduction works in place
        work[...] = device_grads

    timing = harness.time_op(lambda: reduce(work), iters, warmup=warmup, setup=refill,
                     collectives=collectives)
    wire, overhead, verify = (sum(part) for part in zip(*timing.results))
    reference = _contribution(method, grads, shapes, knobs, seed, rank)
    collectives.allreduce(reference, "sum")
    tolerance = _powersgd_reference(reference, reduce) if method == "powersgd" else 0.0
    scale = np.array([np.abs(_quantized(collectives, grads)).max() if count else 0.0])
    collectives.allreduce(scale, "max")
    wrong = np.array([_count_wrong(method, to_host(work), reference, mask, scale[0], world,
                                   tolerance)], dtype=np.int64)
    collectives.allreduce(wrong, "sum")
    density, kept = _sent(method, density, mask, shapes, knobs)
    dense_bytes = count * 4
    algbw = dense_bytes / timing.mean / 1e9
    return {
        "size_bytes": dense_bytes, "count": count, "density": density, "method": method,
        "ranks": world, "time_avg_us": timing.mean * 1e6, "time_min_us": timing.min * 1e6,
        "time_max_us": timing.max * 1e6, "algbw_GBps": algbw,
        "busbw_GBps": algbw * ring_factor(world),
        "wire_bytes_per_rank": wire // iters, "pack_unpack_us": overhead / iters * 1e6,
        "verify_us": verify / iters * 1e6, "wrong": int(wrong[0]),
        "buckets": len(layout.buckets), "kept": kept,
    }


def _cases(sizes, densities, model, bucket_bytes, seed):
    """(label, layout, mask for each density) per size, or the model's tensors once."""
    if model is not None:
        params = model_params(model)[::-1]  # gradients become ready last layer first
        weights = random_weights(params, seed)
        shapes = [p.shape for p in params]
        layout = BucketLayout(shapes, [np.float32] * len(shapes),
                              bucket_bytes or DEFAULT_BUCKET_BYTES)
        masks = [magnitude_mask(params, weights, d) for d in densities]
        del weights  # VGG19's are 575 MB per rank
        yield model, layout, masks
        return
    for size in sizes:
        count = size // 4
        layout = BucketLayout([(count,)], [np.float32], bucket_bytes or max(size, 1 << 20))
        yield None, layout, [np.random.default_rng(seed).random(count) < d for d in densities]


def _peer_knobs(topk_ratio, dgc_ratio, powersgd_rank):
    """The peers' knobs, named as :data:`PEER_DEFAULTS` names them; ValueError names a bad one."""
    for name, ratio in (("topk_ratio", topk_ratio), ("dgc_ratio", dgc_ratio)):
        if not 0 < ratio <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {ratio!r}")
    return {"topk_ratio": topk_ratio, "dgc_ratio": dgc_ratio,
            "powersgd_rank": check_int("powersgd_rank", powersgd_rank)}


def run(sizes, densities, methods, *, iters=None, warmup=2, bucket_bytes=None, seed=0,
        collectives=None, xp=np, model=None, topk_ratio=PEER_DEFAULTS["topk_ratio"],
        dgc_ratio=PEER_DEFAULTS["dgc_ratio"], powersgd_rank=PEER_DEFAULTS["powersgd_rank"]):
    """Benchmark every (size, density, method); returns the rows (identical on all ranks).

    ``xp`` is ``numpy`` (host buffers) or ``cupy`` (device buffers, CUDA-aware MPI or host
    staging as the transport decides). ``model`` (a name from :data:`MODELS`) replaces the
    sizes by that architecture's tensors and masks by global magnitude ones; ``powersgd``
    needs one. ``topk_ratio``, ``dgc_ratio``: the share of values ``topk`` sends, and ``dgc``
    of each tensor; ``powersgd_rank``: the rank of PowerSGD's approximations.
    """
    methods = [lookup_method(m, BENCH_METHODS).name for m in methods]
    knobs = _peer_knobs(topk_ratio, dgc_ratio, powersgd_rank)
    if "powersgd" in methods and model is None:
        raise ValueError("powersgd compresses matrices: give a model (--model NAME); a --sizes "
                         "buffer is one vector, which powerSGD_hook sends uncompressed")
    for density in densities:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
    if model is not None and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    collectives = collectives or default_collectives()
    rows = []
    for label, layout, masks in _cases(sizes, densities, model, bucket_bytes, seed):
        size = masks[0].size * 4
        n_iters = iters or int(max(3, min(20, (256 << 20) // size)))
        for density, mask in zip(densities, masks):
            for method in methods:
                if not METHODS[method].packed and density != densities[0]:
                    continue  # the dense baselines and the peers do not depend on the density
                row = _bench_one(collectives, method, layout, mask, density, n_iters, warmup,
                                 seed, xp, knobs)
                rows.append(dict(row, device="cuda" if xp is not np else "cpu", model=label,
                                 cuda_aware=getattr(collectives, "cuda_aware", None),
                                 nodes=getattr(collectives, "nodes", None)))
    return rows


_COLUMNS = (("size(B)", "size_bytes", ">11"), ("count", "count", ">10"),
            ("dens", "density", ">5.2f"), ("method", "method", ">17"),
            ("avg(us)", "time_avg_us", ">11.1f"), ("min(us)", "time_min_us", ">11.1f"),
            ("max(us)", "time_max_us", ">11.1f"), ("algbw", "algbw_GBps", ">7.3f"),
            ("busbw", "busbw_GBps", ">7.3f"), ("wire(B)", "wire_bytes_per_rank", ">11"),
            ("pack(us)", "pack_unpack_us", ">9.1f"), ("verif(us)", "verify_us", ">9.1f"),
            ("#wrong", "wrong", ">6"))


def format_table(rows):
    """The rows as nccl-tests lays them out: one line per (size, density, method)."""
    return harness.format_table(rows, _COLUMNS)


def build_parser(parser=None):
    parser = parser or command_parser("pacmpi bench allreduce", __doc__)
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M", metavar="SIZE,SIZE",
                        help="dense-equivalent float32 bytes per all-reduce, comma-separated, "
                             "K/M/G binary")
    add_densities(parser, "1.0,0.5,0.2,0.1")
    parser.add_argument("--methods", default=",".join(ALLREDUCE_METHODS),
                        help="comma-separated subset of " + ", ".join(BENCH_METHODS)
                        + " (default: the all-reduce methods, not the peers; powersgd needs "
                        "--model)")
    add_peer_options(parser)
    add_iters(parser, None, "timed all-reduces per row (default: 3..20, fewer for large sizes)")
    add_warmup(parser, 2, "untimed all-reduces before each row's timed ones")
    parser.add_argument("--bucket-bytes", type=parse_size, default=None, metavar="SIZE",
                        help="fusion bucket size, K/M/G binary (default: the message size)")
    add_device(parser, "NumPy host buffers (cpu) or CuPy device buffers (cuda)")
    parser.add_argument("--cuda-aware", choices=("auto", "yes", "no"), default="auto",
                        help="hand device buffers to MPI (yes), stage them through host memory "
                             "(no), or ask the MPI library (auto, the default)")
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="benchmark this architecture's parameter tensors instead of --sizes "
                             "(global magnitude masks, 25 MiB fusion buckets by default)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="the link rate this job runs on (e.g. 100mbit), only recorded in "
                             "the JSON for `pacmpi model calibrate`, with the all-reduce "
                             "algorithm MPI ran; pacmpi-run does the shaping and pins the ring")
    parser.add_argument("--topology", choices=("shared", "star"), default="shared",
                        help="the test bed's topology, recorded with --link (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=None, metavar="K",
                        help="simulated nodes, recorded with --link (default: one per rank)")
    parser.add_argument("--hierarchical", action="store_true",
                        help="reduce in two levels: within each node, then across one leader "
                             "per node (ternary codes then count nodes, not ranks)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                        help="with --hierarchical: simulate nodes of N consecutive ranks "
                             "(default: the real nodes, by host and network namespace)")
    add_json_file(parser, "the rows")
    return parser


def _simulated_node(ranks_per_node):
    """COMM_WORLD split into nodes of ``ranks_per_node`` consecutive ranks (None: None)."""
    if ranks_per_node is None:
        return None
    if ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be positive, got {ranks_per_node}")
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    return MPI.COMM_WORLD.Split(rank // ranks_per_node, key=rank)


def local_rank():
    """This process's rank among the ranks on its node, to give each rank its own GPU."""
    from mpi4py import MPI
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def _algorithm():
    """The all-reduce algorithm the MPI library ran (``pacmpi-run --link/--nodes`` pins the
    ring the cost model describes), read back from the library: "unknown" when it cannot say."""
    from mpi4py import MPI
    return allreduce_algorithm(MPI) or "unknown"


def main(argv=None):
    args = build_parser().parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    xp = np
    if args.device == "cuda":
        import cupy as xp
        xp.cuda.Device(local_rank() % xp.cuda.runtime.getDeviceCount()).use()
    cuda_aware = {"auto": "auto", "yes": True, "no": False}[args.cuda_aware]
    collectives = (HierarchicalCollectives(cuda_aware=cuda_aware,
                                           node_comm=_simulated_node(args.ranks_per_node))
                   if args.hierarchical else default_collectives(cuda_aware=cuda_aware))
    knobs = {name: getattr(args, name) for name in PEER_DEFAULTS}
    rows = run(sizes, densities, methods, iters=args.iters, warmup=args.warmup,
               bucket_bytes=args.bucket_bytes, collectives=collectives, xp=xp, model=args.model,
               **knobs)
    wrong = sum(r["wrong"] for r in rows)
    if collectives.rank == 0:
        print(format_table(rows))
        print("\nternary bits/value on the wire (digits per word), by word type:")
        print(format_wire_bits())
        if args.json:
            link = {"link": args.link, "topology": args.topology,
                    "nodes": args.nodes or collectives.size,
                    "allreduce_algorithm": _algorithm()} if args.link else {}
            harness.write_report(args.json, {
                "ranks": collectives.size, "model": args.model, **link, **knobs, "rows": rows,
                "ternary_bits": wire_bits_table(word_dtype=("int64", "uint64"))},
                "pacmpi bench allreduce")
        if wrong:
            print(f"VALIDATION FAILED: {wrong} wrong elements")
    return 1 if wrong else 0
