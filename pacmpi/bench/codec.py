"""``python -m pacmpi.bench.codec``: the codec kernels of one bucket, fused vs the reference.

For a gradient of ``--size`` values (``--dtype``, float32 by default; its pruned values 0, as
the engine sees them) at each ``--density``, times absmax (through positions, and absmax_bits:
through the mask's bits, reading every coordinate), ternary_encode (quantize + pack),
ternary_decode (unpack + scatter), gather, scatter and the in-place pair compact / expand
(survivors to the front and back, driven by the mask's bits) through :mod:`pacmpi.kernels` on
the fused route and on the NumPy reference, next to a plain ``copyto`` of the same buffer in
the same run. Two rates per call: GB/s of the dense gradient (``size * itemsize`` bytes), so
densities compare directly, and the share of copyto's memory bandwidth that the call's own
traffic reaches (:func:`bytes_moved`: what it must read and write at least), which says how
close a kernel runs to the memory's speed. The first fused call of each kernel is timed on its
own: Numba compiling it, or loading it from its on-disk cache.
"""
import argparse
import os
import time

import numpy as np

from .. import kernels
from ..arrays import check_float_dtype, synchronize
from ..ternary import TernaryCodec, ternary_key
from . import harness

__all__ = ["run", "bytes_moved", "format_table", "build_parser", "main"]

OPS = ("copyto", "absmax", "absmax_bits", "ternary_encode", "ternary_decode", "gather",
       "scatter", "compact", "expand")


def _parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


class _Bucket:
    """One bucket's buffers at one density, and each op as a call on them."""

    def __init__(self, size, density, codec, xp=np, seed=0, dtype=np.float32):
        rng = np.random.default_rng(seed)
        self.xp = xp
        flat = rng.standard_normal(size).astype(dtype)
        mask, indices = None if density >= 1 else rng.random(size) < density, None
        if mask is not None:
            indices = np.flatnonzero(mask)
            flat[~mask] = 0  # pruned gradients are 0 (G = mask * G), as the engine sees them
        self.flat = xp.asarray(flat)
        self.indices = None if indices is None else xp.asarray(indices)
        self.count = size if indices is None else indices.size
        compute = kernels.compute_dtype(dtype)
        self.residual = xp.asarray((rng.standard_normal(self.count) * 0.1).astype(compute))
        self.codec = codec
        self.scale = kernels.reference.absmax(xp, self.flat, self.indices, self.residual)
        self.key = ternary_key(seed, 0, 0, 0)
        self.words = xp.empty(codec.words_for(self.count), codec.word_dtype)
        kernels.reference.ternary_encode(xp, self.flat, self.indices, None, None, self.scale,
                                         self.key, codec, self.words)
        self.summed = self.words * codec.word_dtype.type(codec.world_size)
        self.packed = xp.empty(self.count, dtype)
        self.out = xp.empty(size, dtype)
        self.bits, self.top = None, np.zeros(1)
        if mask is not None:
            self.bits = xp.asarray(np.packbits(mask))

    def call(self, op):
        """A no-argument callable running ``op`` (None where it does not apply: no gather and
        an in-place scatter when dense)."""
        n, c, xp = self.codec.world_size, self.codec, self.xp
        calls = {
            "copyto": lambda: xp.copyto(self.out, self.flat),
            "absmax": lambda: kernels.absmax(xp, self.flat, self.indices, self.residual),
            "absmax_bits": None if self.bits is None else
            lambda: kernels.absmax_bits(xp, self.flat, self.bits, self.residual,
                                        [0, self.flat.size], [0, self.count], [0], self.top),
            "ternary_encode": lambda: kernels.ternary_encode(
                xp, self.flat, self.indices, self.residual, self.residual, self.scale, self.key,
                c, self.words),
            "ternary_decode": lambda: kernels.ternary_decode(
                xp, self.summed, self.count, c, n, self.scale, n, self.indices, self.out),
            "gather": None if self.indices is None else
            lambda: kernels.gather(xp, self.flat, self.indices, self.packed),
            "scatter": (lambda: kernels.scatter(xp, self.out, None, self.out, n))
            if self.indices is None else
            (lambda: kernels.scatter(xp, self.packed, self.indices, self.out, n)),
            # In place on out (its values do not change the work): no call when dense.
            "compact": None if self.bits is None else
            lambda: kernels.compact(xp, self.out, self.bits, self.count),
            "expand": None if self.bits is None else
            lambda: kernels.expand(xp, self.out, self.bits, self.count, n),
        }
        return calls[op]


def bytes_moved(op, bucket):
    """Bytes that ``op`` on ``bucket`` must read and write at least: the survivors' values,
    their int64 indices when packed (the mask's bits for compact / expand), the compute-dtype
    residual (read, and written back by the encoder), the packed words, and for the
    scattering ops the whole output (zeroed, then the survivors written)."""
    values = bucket.count * bucket.flat.itemsize
    index = 0 if bucket.indices is None else bucket.count * 8
    residual = bucket.residual.nbytes
    words = bucket.words.nbytes
    dense = bucket.out.nbytes
    zeroed = 0 if bucket.indices is None else dense  # a packed scatter clears flat first
    return {"copyto": 2 * dense,
            "absmax": values + index + residual,
            "absmax_bits": dense + residual + (bucket.out.size + 7) // 8,
            "ternary_encode": values + index + 2 * residual + words,
            "ternary_decode": words + index + zeroed + values,
            "gather": 2 * values + index,
            "scatter": 2 * values + index + zeroed,
            "compact": 2 * values + (bucket.out.size + 7) // 8,
            "expand": values + dense + (bucket.out.size + 7) // 8}[op]


def _first_calls(buckets, route, import_seconds):
    """Seconds of each kernel's first fused call (compile or cache load), and the cache's
    account of it."""
    rows = [{"op": "import", "seconds": import_seconds, "route": route}]
    for op in OPS[1:]:
        started = time.perf_counter()
        for bucket in buckets:  # each density's signature (packed or dense is one signature)
            call = bucket.call(op)
            if call is not None:
                call()
        rows.append({"op": op, "seconds": time.perf_counter() - started, "route": route})
    if route == "numba":
        from ..kernels import cpu
        stats = cpu.compile_stats()
        for row in rows[1:]:
            row.update(stats[row["op"]])
    return rows


def run(size=16 << 20, densities=(1.0, 0.5), threads=1, repeat=5, ranks=4, word="uint64",
        reference=True, xp=np, dtype="float32"):
    """Time every op on ``xp``'s arrays (NumPy, or CuPy for the GPU kernels) of ``dtype``
    (float16, bfloat16, float32 or float64); returns ``{"config", "first_calls", "rows"}``
    (JSON-able)."""
    dtype = check_float_dtype(dtype)
    codec = TernaryCodec(ranks, word)
    buckets = [_Bucket(size, d, codec, xp, dtype=dtype) for d in densities]
    started = time.perf_counter()
    fused = kernels.backend(xp)  # imports Numba
    import_seconds = time.perf_counter() - started
    if fused == "numba":
        import numba
        numba.set_num_threads(threads)
    first_calls = _first_calls(buckets, fused, import_seconds)
    routes = [fused] + (["numpy"] if reference and fused != "numpy" else [])
    rows = []
    for density, bucket in zip(densities, buckets):
        copy_rate = None
        for op in OPS:
            call = bucket.call(op)
            for route in ([] if call is None else ["numpy"] if op == "copyto" else routes):
                kernels.set_backend("numpy" if route == "numpy" else "auto")
                try:
                    timing = harness.time_op(call, repeat, sync=lambda: synchronize(xp))
                finally:
                    kernels.set_backend(None)
                moved = bytes_moved(op, bucket) / timing.min / 1e9
                copy_rate = moved if op == "copyto" else copy_rate
                rows.append({"op": op, "density": density, "values": bucket.count,
                             "route": route, "best_s": timing.min, "median_s": timing.median,
                             "GBps": size * dtype.itemsize / timing.min / 1e9,
                             "moved_GBps": moved, "of_copy_bandwidth": moved / copy_rate})
    config = {"size": size, "dtype": dtype.name, "densities": list(densities),
              "threads": threads, "ranks": ranks, "device": "cpu" if xp is np else "cuda",
              "word_dtype": word, "digits_per_word": codec.digits_per_word, "repeat": repeat,
              "fused_route": fused, "dense_bytes": size * dtype.itemsize}
    if fused == "numba":
        import numba
        config.update(numba=numba.__version__, threading_layer=numba.threading_layer())
    if xp is not np:
        config.update(_device_memory(xp))
    return {"config": config, "first_calls": first_calls, "rows": rows}


def _device_memory(cupy):
    """The GPU's name and its memory's nominal bandwidth (double data rate x bus width), for
    comparison with copyto's measured one; None where the runtime no longer reports it."""
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    clock_khz, bus_bits = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
    name = props["name"]
    return {"gpu": name.decode() if isinstance(name, bytes) else str(name),
            "nominal_GBps": 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz else None}


_COLUMNS = (("op", "op", ">15"), ("dens", "density", ">5.2f"), ("route", "route", ">6"),
            ("best(ms)", lambda r: r["best_s"] * 1e3, ">9.2f"),
            ("median(ms)", lambda r: r["median_s"] * 1e3, ">10.2f"), ("GB/s", "GBps", ">7.2f"),
            ("moved GB/s", "moved_GBps", ">10.2f"),
            ("% copy BW", lambda r: 100 * r["of_copy_bandwidth"], ">9.0f"))


def format_table(result):
    config = result["config"]
    lines = [f"{config['size']} {config['dtype']} values "
             f"({config['dense_bytes'] / 2 ** 20:.0f} MiB), "
             f"{config['threads']} thread(s), ternary on {config['ranks']} ranks in "
             f"{config['word_dtype']} words ({config['digits_per_word']} digits each), "
             f"fused route: {config['fused_route']}"
             + (f" ({config['threading_layer']} threads)" if "threading_layer" in config else ""),
             harness.format_table(result["rows"], _COLUMNS)]
    lines.append("first fused calls (compile, or load from the cache):")
    for r in result["first_calls"]:
        cache = (f", {r['compiled']} compiled, {r['cache_hits']} from the cache"
                 if "compiled" in r else "")
        lines.append(f"  {r['op']:>15}: {r['seconds']:.3f} s{cache}")
    cache_dir = next((r["cache_dir"] for r in result["first_calls"] if "cache_dir" in r), None)
    if cache_dir:
        lines.append(f"Numba cache: {cache_dir}")
    return "\n".join(lines)


def build_parser(parser=None):
    parser = parser or argparse.ArgumentParser(prog="python -m pacmpi.bench.codec",
                                               description=__doc__)
    parser.add_argument("--size", type=_parse_count, default=16 << 20,
                        help="gradient values per bucket, e.g. 16M (default 16M)")
    parser.add_argument("--dtype", default="float32",
                        help="gradient dtype: float16, bfloat16, float32 or float64 "
                             "(default %(default)s)")
    parser.add_argument("--densities", default="1.0,0.5",
                        help="comma-separated mask densities (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="Numba threads (default %(default)s: one core)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per op")
    parser.add_argument("--ranks", type=int, default=4, help="ranks the codec sums over")
    parser.add_argument("--word", choices=("int64", "int32", "uint64"), default="uint64")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the (slow) NumPy reference timings")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="NumPy arrays (Numba kernels) or CuPy arrays (CUDA kernels)")
    parser.add_argument("--json", default=None, help="write the result to this JSON file")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    # Numba's pool is sized once, from this variable, when it starts.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(args.threads, os.cpu_count() or 1)))
    xp = np
    if args.device == "cuda":
        import cupy as xp
    result = run(args.size, [float(d) for d in args.densities.split(",")], args.threads,
                 args.repeat, args.ranks, args.word, reference=not args.no_reference, xp=xp,
                 dtype=args.dtype)
    print(format_table(result))
    if args.json:
        harness.write_report(args.json, result, "python -m pacmpi.bench.codec")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
