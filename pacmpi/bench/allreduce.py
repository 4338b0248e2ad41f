"""``pacmpi bench allreduce``: dense vs packed vs ternary all-reduce, like nccl-tests.

Columns: time per all-reduce (slowest rank), algbw = dense-equivalent bytes / time, busbw =
algbw * 2(n-1)/n, bytes each rank puts into the all-reduce, pacmpi's pack+unpack (including
quantization) and verification time, and #wrong elements from a validation pass.

Every method reduces the same integer-valued gradients under the same mask, so a validation
pass can count wrong elements exactly; sizes are dense-equivalent float32 bytes.
"""
import argparse
import json
import time

import numpy as np

from ..arrays import to_host
from ..collectives import default_collectives
from ..reducer import PacTrainReducer
from ..ternary import format_wire_bits, wire_bits_table

__all__ = ["METHODS", "parse_size", "run", "format_table", "main"]

METHODS = ("dense-fp32", "dense-fp16", "pactrain", "pactrain-ternary")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """``"64M"`` -> 67108864; raises ValueError naming the bad value."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        value = int(float(text[:-1] if unit else text) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"bad size {text!r}: use e.g. 1M, 64M, 1G") from None
    if value < 4:
        raise ValueError(f"bad size {text!r}: at least 4 bytes")
    return value


def _dense(collectives, wire_dtype):
    def reduce(grads):
        wire = grads[0].astype(wire_dtype, copy=wire_dtype != grads[0].dtype)
        collectives.allreduce(wire, "sum")
        grads[0][...] = wire
        return wire.nbytes, 0.0, 0.0
    return reduce


def _packed(collectives, mask, quantize, bucket_bytes):
    reducer = PacTrainReducer([mask], collectives=collectives, quantize=quantize, average=False,
                              stable_steps=0, error_feedback=False, bucket_bytes=bucket_bytes)
    keys = ("bytes_sent", "pack_seconds", "unpack_seconds", "verify_seconds")

    def reduce(grads):
        before = [reducer.stats[k] for k in keys]
        reducer.reduce(grads)
        sent, pack, unpack, verify = (reducer.stats[k] - b for k, b in zip(keys, before))
        return sent, pack + unpack, verify
    return reduce


def _make_reduce(method, collectives, mask, bucket_bytes):
    if method == "dense-fp32":
        return _dense(collectives, np.float32)
    if method == "dense-fp16":
        return _dense(collectives, np.float16)
    return _packed(collectives, mask, "ternary" if method.endswith("ternary") else None,
                   bucket_bytes)


def _count_wrong(method, result, reference, mask, scale, world):
    if method != "pactrain-ternary":
        return int(np.count_nonzero(result != reference))
    lattice = result / scale if scale > 0 else result
    off_lattice = np.abs(lattice - np.rint(lattice)) > 1e-3 * world
    out_of_range = np.abs(np.rint(lattice)) > world
    pruned_nonzero = (~mask) & (result != 0)
    return int(np.count_nonzero(off_lattice | out_of_range | pruned_nonzero))


def _bench_one(collectives, method, count, density, iters, warmup, bucket_bytes, seed, xp):
    world, rank = collectives.size, collectives.rank
    mask = np.random.default_rng(seed).random(count) < density
    grads = (np.random.default_rng(seed + 1 + rank).integers(-8, 9, size=count)
             .astype(np.float32) * mask)
    reduce = _make_reduce(method, collectives, xp.asarray(mask), bucket_bytes)
    device_grads = xp.asarray(grads)
    work = [xp.empty_like(device_grads)]
    times, wire, overhead, verify = [], 0, 0.0, 0.0
    for i in range(warmup + iters):
        work[0][...] = device_grads
        sync = np.zeros(1)
        collectives.allreduce(sync, "max")  # a barrier over the same transport
        started = time.perf_counter()
        wire_bytes, pack_unpack, verify_seconds = reduce(work)
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
            wire += wire_bytes
            overhead += pack_unpack
            verify += verify_seconds
    slowest = np.array(times)
    collectives.allreduce(slowest, "max")
    reference = grads.astype(np.float64)
    collectives.allreduce(reference, "sum")
    scale = np.array([np.abs(grads).max() if count else 0.0])
    collectives.allreduce(scale, "max")
    wrong = np.array([_count_wrong(method, to_host(work[0]), reference, mask, scale[0], world)],
                     dtype=np.int64)
    collectives.allreduce(wrong, "sum")
    dense_bytes = count * 4
    avg = float(slowest.mean())
    algbw = dense_bytes / avg / 1e9
    return {
        "size_bytes": dense_bytes, "count": count, "density": density, "method": method,
        "ranks": world, "time_avg_us": avg * 1e6, "time_min_us": float(slowest.min()) * 1e6,
        "time_max_us": float(slowest.max()) * 1e6, "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
        "wire_bytes_per_rank": wire // max(iters, 1),
        "pack_unpack_us": overhead / max(iters, 1) * 1e6,
        "verify_us": verify / max(iters, 1) * 1e6, "wrong": int(wrong[0]),
    }


def run(sizes, densities, methods, *, iters=None, warmup=2, bucket_bytes=None, seed=0,
        collectives=None, xp=np):
    """Benchmark every (size, density, method); returns the rows (identical on all ranks).

    ``xp`` is ``numpy`` (host buffers) or ``cupy`` (device buffers, CUDA-aware MPI or host
    staging as the transport decides).
    """
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    for density in densities:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
    collectives = collectives or default_collectives()
    rows = []
    for size in sizes:
        count = size // 4
        n_iters = iters or int(max(3, min(20, (256 << 20) // size)))
        for density in densities:
            for method in methods:
                if method.startswith("dense") and density != densities[0]:
                    continue  # the dense baselines do not depend on the density
                row = _bench_one(collectives, method, count, density, n_iters, warmup,
                                 bucket_bytes or max(size, 1 << 20), seed, xp)
                rows.append(dict(row, device="cuda" if xp is not np else "cpu",
                                 cuda_aware=getattr(collectives, "cuda_aware", None)))
    return rows


def format_table(rows):
    header = (f"{'size(B)':>11} {'count':>10} {'dens':>5} {'method':>17} {'avg(us)':>11} "
              f"{'min(us)':>11} {'max(us)':>11} {'algbw':>7} {'busbw':>7} {'wire(B)':>11} "
              f"{'pack(us)':>9} {'verif(us)':>9} {'#wrong':>6}")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['size_bytes']:>11} {r['count']:>10} {r['density']:>5.2f} {r['method']:>17} "
            f"{r['time_avg_us']:>11.1f} {r['time_min_us']:>11.1f} {r['time_max_us']:>11.1f} "
            f"{r['algbw_GBps']:>7.3f} {r['busbw_GBps']:>7.3f} {r['wire_bytes_per_rank']:>11} "
            f"{r['pack_unpack_us']:>9.1f} {r['verify_us']:>9.1f} {r['wrong']:>6}")
    return "\n".join(lines)


def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="pacmpi bench allreduce",
                                               description=__doc__)
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M",
                        help="comma-separated dense-equivalent float32 sizes (default %(default)s)")
    parser.add_argument("--densities", default="1.0,0.5,0.2,0.1",
                        help="comma-separated mask densities (default %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of " + ", ".join(METHODS))
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
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    return parser


def local_rank():
    """This process's rank among the ranks on its node, to give each rank its own GPU."""
    from mpi4py import MPI
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def main(argv=None):
    args = build_parser().parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    densities = [float(d) for d in args.densities.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    xp = np
    if args.device == "cuda":
        import cupy as xp
        xp.cuda.Device(local_rank() % xp.cuda.runtime.getDeviceCount()).use()
    collectives = default_collectives(
        cuda_aware={"auto": "auto", "yes": True, "no": False}[args.cuda_aware])
    rows = run(sizes, densities, methods, iters=args.iters, warmup=args.warmup,
               bucket_bytes=args.bucket_bytes, collectives=collectives, xp=xp)
    wrong = sum(r["wrong"] for r in rows)
    if collectives.rank == 0:
        print(format_table(rows))
        print("\nternary bits/value on the wire (digits per word), by word type:")
        print(format_wire_bits())
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"ranks": collectives.size, "rows": rows,
                           "ternary_bits": wire_bits_table(word_dtype=("int64", "uint64"))},
                          fh, indent=2)
        if wrong:
            print(f"VALIDATION FAILED: {wrong} wrong elements")
    return 1 if wrong else 0
