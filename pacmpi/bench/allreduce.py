"""``pacmpi bench allreduce``: dense vs packed vs ternary all-reduce, like nccl-tests.

Columns: time per all-reduce (slowest rank), algbw = dense-equivalent bytes / time, busbw =
algbw * 2(n-1)/n, bytes each rank puts into the all-reduce, pacmpi's pack+unpack (including
quantization) and verification time, and #wrong elements from a validation pass.

Every method reduces the same integer-valued gradients under the same mask, so a validation
pass can count wrong elements exactly; sizes are dense-equivalent float32 bytes.

``--model NAME`` replaces the sizes by a published architecture's parameter tensors
(:mod:`pacmpi.bench.models`): a global magnitude mask at each density, and fusion buckets of
the reducer's ``bucket_bytes`` (25 MiB, like DDP) filled in gradient-ready (reverse) order; the
dense baselines all-reduce the same buckets, and fp16's "codec" is its two casts.

``topk`` is the all-gather peer as ``TopKSync`` runs it: one top-k of the whole gradient
(``--topk-ratio`` of its values), whose float32 values and int64 positions every rank
all-gathers and adds up (its "codec": the selection and the scatter-add); its row's density is
the ratio. It runs once per size, like the dense baselines.
"""
import argparse
import time

import numpy as np

from .. import kernels
from ..arrays import to_host
from ..buckets import DEFAULT_BUCKET_BYTES, BucketLayout
from ..collectives import allreduce_algorithm, default_collectives
from ..costmodel import PEER_DEFAULTS, topk_count
from ..hierarchy import HierarchicalCollectives
from ..methods import ALLREDUCE_METHODS, METHODS, lookup_method
from ..reducer import PacTrainReducer
from ..ternary import format_wire_bits, wire_bits_table
from ..units import parse_size
from . import harness
from .models import MODELS, magnitude_mask, model_params, random_weights

__all__ = ["BENCH_METHODS", "run", "format_table", "main"]

BENCH_METHODS = ALLREDUCE_METHODS + ("topk",)
"""What this benchmark runs: the engine's all-reduce methods and TopK's all-gather."""


def _views(flat, shapes):
    bounds = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in shapes])
    return [flat[a:b].reshape(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes)]


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
    shapes = [m.shape for bucket in layout.buckets for m in bucket.members]
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


def _topk_select(xp, flat, k):
    """Positions (int64) and values of ``flat``'s ``k`` largest magnitudes."""
    positions = xp.argpartition(xp.abs(flat), flat.size - k)[flat.size - k:].astype(np.int64)
    return positions, flat[positions]


def _topk(collectives, ratio, count, xp):
    world, k = collectives.size, topk_count(ratio, count)
    # Every rank's block, gathered in place: made once, not in the timed calls.
    all_values = xp.empty(k * world, dtype=np.float32)
    all_positions = xp.empty(k * world, dtype=np.int64)
    mine = slice(collectives.rank * k, (collectives.rank + 1) * k)

    def reduce(flat):
        started = time.perf_counter()
        positions, values = _topk_select(xp, flat, k)
        all_values[mine], all_positions[mine] = values, positions
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


def _make_reduce(method, collectives, mask, layout, xp, topk_ratio=PEER_DEFAULTS["topk_ratio"]):
    if method == "topk":
        return _topk(collectives, topk_ratio, mask.size, xp)
    spec = METHODS[method]
    if not spec.packed:
        return _dense(collectives, np.float16 if spec.quantize == "fp16" else np.float32,
                      layout, xp)
    return _packed(collectives, mask, spec.quantize, layout)


def _count_wrong(method, result, reference, mask, scale, world):
    if method == "topk" or METHODS[method].quantize != "ternary":
        return int(np.count_nonzero(result != reference))
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


def _bench_one(collectives, method, layout, mask, density, iters, warmup, seed, xp,
               topk_ratio=PEER_DEFAULTS["topk_ratio"]):
    world, rank = collectives.size, collectives.rank
    count = mask.size
    grads = (np.random.default_rng(seed + 1 + rank).integers(-8, 9, size=count)
             .astype(np.float32) * mask)
    reduce = _make_reduce(method, collectives, xp.asarray(mask), layout, xp, topk_ratio)
    device_grads = xp.asarray(grads)
    work = xp.empty_like(device_grads)

    def refill():  # the reduction works in place
        work[...] = device_grads

    timing = harness.time_op(lambda: reduce(work), iters, warmup=warmup, setup=refill,
                     collectives=collectives)
    wire, overhead, verify = (sum(part) for part in zip(*timing.results))
    reference = grads.astype(np.float64)
    if method == "topk":  # the sum of every rank's top-k, nothing else
        k = topk_count(topk_ratio, count)
        positions, values = _topk_select(np, grads, k)
        reference = np.zeros(count)
        reference[positions] = values
        density = topk_ratio
    collectives.allreduce(reference, "sum")
    scale = np.array([np.abs(_quantized(collectives, grads)).max() if count else 0.0])
    collectives.allreduce(scale, "max")
    wrong = np.array([_count_wrong(method, to_host(work), reference, mask, scale[0], world)],
                     dtype=np.int64)
    collectives.allreduce(wrong, "sum")
    dense_bytes = count * 4
    algbw = dense_bytes / timing.mean / 1e9
    return {
        "size_bytes": dense_bytes, "count": count, "density": density, "method": method,
        "ranks": world, "time_avg_us": timing.mean * 1e6, "time_min_us": timing.min * 1e6,
        "time_max_us": timing.max * 1e6, "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
        "wire_bytes_per_rank": wire // iters, "pack_unpack_us": overhead / iters * 1e6,
        "verify_us": verify / iters * 1e6, "wrong": int(wrong[0]),
        "buckets": len(layout.buckets),
        "kept": k if method == "topk" else int(np.count_nonzero(mask)),
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


def run(sizes, densities, methods, *, iters=None, warmup=2, bucket_bytes=None, seed=0,
        collectives=None, xp=np, model=None, topk_ratio=PEER_DEFAULTS["topk_ratio"]):
    """Benchmark every (size, density, method); returns the rows (identical on all ranks).

    ``xp`` is ``numpy`` (host buffers) or ``cupy`` (device buffers, CUDA-aware MPI or host
    staging as the transport decides). ``model`` (a name from :data:`MODELS`) replaces the
    sizes by that architecture's tensors and masks by global magnitude ones. ``topk_ratio``:
    the share of values ``topk`` sends.
    """
    methods = [lookup_method(m, BENCH_METHODS).name for m in methods]
    if not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio!r}")
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
                    continue  # the dense baselines (and TopK) do not depend on the density
                row = _bench_one(collectives, method, layout, mask, density, n_iters, warmup,
                                 seed, xp, topk_ratio)
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
    parser = parser or argparse.ArgumentParser(prog="pacmpi bench allreduce",
                                               description=__doc__)
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M",
                        help="comma-separated dense-equivalent float32 sizes (default %(default)s)")
    parser.add_argument("--densities", default="1.0,0.5,0.2,0.1",
                        help="comma-separated mask densities (default %(default)s)")
    parser.add_argument("--methods", default=",".join(ALLREDUCE_METHODS),
                        help="comma-separated subset of " + ", ".join(BENCH_METHODS)
                        + " (default: all but topk)")
    parser.add_argument("--topk-ratio", type=float, default=PEER_DEFAULTS["topk_ratio"],
                        help="the share of values topk sends (default %(default)s)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations (default: 3..20, fewer for large sizes)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=parse_size, default=None,
                        help="fusion bucket size (default: the message size)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="NumPy host buffers or CuPy device buffers (default %(default)s)")
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
    parser.add_argument("--nodes", type=int, default=None,
                        help="simulated nodes, recorded with --link (default: one per rank)")
    parser.add_argument("--hierarchical", action="store_true",
                        help="reduce in two levels: within each node, then across one leader "
                             "per node (ternary codes then count nodes, not ranks)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                        help="with --hierarchical: simulate nodes of N consecutive ranks "
                             "(default: the real nodes, by host and network namespace)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
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
    rows = run(sizes, densities, methods, iters=args.iters, warmup=args.warmup,
               bucket_bytes=args.bucket_bytes, collectives=collectives, xp=xp, model=args.model,
               topk_ratio=args.topk_ratio)
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
                "ranks": collectives.size, "model": args.model, **link, "rows": rows,
                "ternary_bits": wire_bits_table(word_dtype=("int64", "uint64"))},
                "pacmpi bench allreduce")
        if wrong:
            print(f"VALIDATION FAILED: {wrong} wrong elements")
    return 1 if wrong else 0
