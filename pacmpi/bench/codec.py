"""``python -m pacmpi.bench.codec``: the codec kernels of one bucket, fused vs the reference.

For a float32 gradient of ``--size`` values at each ``--density``, times absmax,
ternary_encode (quantize + pack), ternary_decode (unpack + scatter), gather and scatter through
:mod:`pacmpi.kernels` on the fused route and on the NumPy reference, next to a plain
``np.copyto`` of the same buffer in the same run. GB/s is of the dense float32 gradient
(``size * 4`` bytes) per call, so densities compare directly. The first fused call of each
kernel is timed on its own: Numba compiling it, or loading it from its on-disk cache.
"""
import argparse
import os
import time

import numpy as np

from .. import kernels
from ..arrays import synchronize
from ..ternary import TernaryCodec, ternary_key
from . import harness

__all__ = ["run", "format_table", "build_parser", "main"]

OPS = ("copyto", "absmax", "ternary_encode", "ternary_decode", "gather", "scatter")


def _parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


class _Bucket:
    """One bucket's buffers at one density, and each op as a call on them."""

    def __init__(self, size, density, codec, xp=np, seed=0):
        rng = np.random.default_rng(seed)
        self.xp = xp
        self.flat = xp.asarray(rng.standard_normal(size).astype(np.float32))
        indices = None if density >= 1 else np.flatnonzero(rng.random(size) < density)
        self.indices = None if indices is None else xp.asarray(indices)
        self.count = size if indices is None else indices.size
        self.residual = xp.asarray((rng.standard_normal(self.count) * 0.1).astype(np.float32))
        self.codec = codec
        self.scale = kernels.reference.absmax(xp, self.flat, self.indices, self.residual)
        self.key = ternary_key(seed, 0, 0, 0)
        self.words = xp.empty(codec.words_for(self.count), codec.word_dtype)
        kernels.reference.ternary_encode(xp, self.flat, self.indices, None, None, self.scale,
                                         self.key, codec, self.words)
        self.summed = self.words * codec.word_dtype.type(codec.world_size)
        self.packed = xp.empty(self.count, np.float32)
        self.out = xp.empty(size, np.float32)

    def call(self, op):
        """A no-argument callable running ``op`` (None where it does not apply: no gather and
        an in-place scatter when dense)."""
        n, c, xp = self.codec.world_size, self.codec, self.xp
        calls = {
            "copyto": lambda: xp.copyto(self.out, self.flat),
            "absmax": lambda: kernels.absmax(xp, self.flat, self.indices, self.residual),
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
        }
        return calls[op]


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
        reference=True, xp=np):
    """Time every op on ``xp``'s arrays (NumPy, or CuPy for the GPU kernels); returns
    ``{"config", "first_calls", "rows"}`` (JSON-able)."""
    codec = TernaryCodec(ranks, word)
    buckets = [_Bucket(size, d, codec, xp) for d in densities]
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
        copy_seconds = None
        for op in OPS:
            call = bucket.call(op)
            for route in ([] if call is None else ["numpy"] if op == "copyto" else routes):
                kernels.set_backend("numpy" if route == "numpy" else "auto")
                try:
                    timing = harness.time_op(call, repeat, sync=lambda: synchronize(xp))
                finally:
                    kernels.set_backend(None)
                copy_seconds = timing.min if op == "copyto" else copy_seconds
                rows.append({"op": op, "density": density, "values": bucket.count,
                             "route": route, "best_s": timing.min, "median_s": timing.median,
                             "GBps": size * 4 / timing.min / 1e9,
                             "vs_copyto": timing.min / copy_seconds})
    config = {"size": size, "densities": list(densities), "threads": threads, "ranks": ranks,
              "device": "cpu" if xp is np else "cuda",
              "word_dtype": word, "digits_per_word": codec.digits_per_word, "repeat": repeat,
              "fused_route": fused, "dense_bytes": size * 4}
    if fused == "numba":
        import numba
        config.update(numba=numba.__version__, threading_layer=numba.threading_layer())
    return {"config": config, "first_calls": first_calls, "rows": rows}


_COLUMNS = (("op", "op", ">15"), ("dens", "density", ">5.2f"), ("route", "route", ">6"),
            ("best(ms)", lambda r: r["best_s"] * 1e3, ">9.2f"),
            ("median(ms)", lambda r: r["median_s"] * 1e3, ">10.2f"), ("GB/s", "GBps", ">7.2f"),
            ("x copyto", "vs_copyto", ">8.2f"))


def format_table(result):
    config = result["config"]
    lines = [f"{config['size']} float32 values ({config['dense_bytes'] / 2 ** 20:.0f} MiB), "
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
                        help="float32 values per bucket, e.g. 16M (default 16M)")
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
                 args.repeat, args.ranks, args.word, reference=not args.no_reference, xp=xp)
    print(format_table(result))
    if args.json:
        harness.write_report(args.json, result, "python -m pacmpi.bench.codec")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
