"""Codec kernels: gather, scatter, in-place compact/expand, absmax and ternary encode/decode,
one fused pass per call.

Three routes compute the same bits (see :func:`backend`):

- ``"numba"``: NumPy arrays, compiled by Numba on first use and cached on disk
  (:mod:`pacmpi.kernels.cpu`);
- ``"cupy"``: CuPy arrays, CUDA kernels compiled by CuPy on first use (:mod:`pacmpi.kernels.gpu`);
- ``"numpy"``: the reference, on either array module (:mod:`pacmpi.kernels.reference`).

``PACMPI_KERNELS=auto|numba|numpy`` or :func:`set_backend` chooses: ``numpy`` always runs the
reference; ``numba`` insists on the compiled kernels (an error when Numba cannot be imported);
``auto`` (the default) compiles where it can and falls back to the reference, saying so once.
Arrays the fused kernels do not take (not C-contiguous, or a conversion they do not round
exactly as NumPy) go to the reference too. Nothing here imports Numba or CuPy until a kernel
runs on their arrays.
"""
import itertools
import os
import warnings

import numpy as np

from . import reference
from .reference import compute_dtype

__all__ = ["gather", "scatter", "compact", "expand", "absmax", "absmax_bits", "ternary_encode",
           "ternary_encode_kept", "ternary_decode", "segments_module", "backend", "set_backend",
           "warm_up", "compute_dtype", "BACKENDS"]

BACKENDS = ("auto", "numba", "numpy")

_forced = None        # set_backend()'s choice; None: the environment's
_cpu_module = None    # pacmpi.kernels.cpu once imported
_cpu_error = None     # why it could not be imported
_warned = False


def set_backend(name):
    """Route later calls through ``name`` (one of :data:`BACKENDS`); None returns the choice
    to ``PACMPI_KERNELS``."""
    global _forced
    _forced = None if name is None else _checked(name, "set_backend()")


def _checked(name, source):
    if name not in BACKENDS:
        raise ValueError(f"{source}: kernel backend must be one of {BACKENDS}, got {name!r}")
    return name


def _choice():
    if _forced is not None:
        return _forced
    return _checked(os.environ.get("PACMPI_KERNELS", "").strip().lower() or "auto",
                    "PACMPI_KERNELS")


def _cpu():
    global _cpu_module, _cpu_error
    if _cpu_module is None and _cpu_error is None:
        try:
            from . import cpu
        except ImportError as exc:  # numba (or its llvmlite) missing or broken
            _cpu_error = exc
        else:
            _cpu_module = cpu
            _share_cores()
    return _cpu_module


# Where launchers say how many ranks share this node (Open MPI, torchrun, MPICH/Hydra, Slurm).
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS",
                    "SLURM_NTASKS_PER_NODE")


def _share_cores():
    """Give each rank of a node its share of the cores: Numba's default of one thread per core
    on every rank oversubscribes the node (``NUMBA_NUM_THREADS`` set by the user wins)."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return
    local = next((int(v) for v in map(os.environ.get, _LOCAL_SIZE_VARS)
                  if v and v.isdigit() and int(v) > 0), 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import numba
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, cores // local)))


def _gpu():
    from . import gpu
    return gpu


def backend(xp):
    """The route that kernels on ``xp``'s arrays take now: ``"numba"``, ``"cupy"`` or
    ``"numpy"`` (the reference)."""
    global _warned
    choice = _choice()
    if choice == "numpy":
        return "numpy"
    if xp is not np:
        return "cupy"
    if _cpu() is not None:
        return "numba"
    if choice == "numba":
        raise ImportError(f"PACMPI_KERNELS=numba, but Numba cannot be imported: {_cpu_error}")
    if not _warned:
        _warned = True
        warnings.warn(f"pacmpi: Numba is not available ({_cpu_error}); codec kernels run the "
                      "slower NumPy reference (pip install numba)", RuntimeWarning, stacklevel=3)
    return "numpy"


def warm_up(dtypes=None):
    """Compile (or load from the cache) every NumPy kernel for ``dtypes`` (default: all the
    supported gradient dtypes) and both word widths, so a training step never waits for Numba.
    Returns the route that ran."""
    from ..arrays import supported_float_dtypes
    from ..segments import SegmentTable
    from ..ternary import TernaryCodec
    # Small calls run serial twins of the parallel kernels: compile both.
    counts = (2, _cpu().SERIAL_BELOW) if backend(np) == "numba" else (2,)
    for dtype, count in itertools.product(dtypes or supported_float_dtypes(), counts):
        flat = np.ones(2 * count, dtype)
        indices = np.arange(count, dtype=np.int32)  # the engine's positions (index_dtype)
        residual = np.zeros(count, compute_dtype(dtype))
        gather(np, flat, indices, np.empty(count, dtype))
        scatter(np, np.ones(count, dtype), indices, flat, 2)
        bits = np.packbits(np.arange(flat.size) % 2 == 0)
        compact(np, flat, bits, count)
        expand(np, flat, bits, count, 2)
        absmax(np, flat, indices, residual)
        absmax_bits(np, flat, bits, residual, [0, flat.size], [0, count], [0], np.zeros(1))
        for word in ("int32", "int64"):  # the kernels see unsigned views: one of each width
            codec = TernaryCodec(2, word)
            words = ternary_encode(np, flat, indices, residual, residual, 1.0, 0, codec,
                                   np.empty(codec.words_for(count), codec.word_dtype))
            ternary_decode(np, words, count, codec, 2, 1.0, 2, indices, flat)
            table = SegmentTable((count, count), indices, codec.digits_per_word)  # fused
            scales = table.absmax(np, flat, residual)
            words = table.encode(np, flat, residual, residual, scales, 0, codec,
                                 np.empty(table.words, codec.word_dtype))
            table.decode(np, words, codec, 2, scales, 2, flat)
            # The in-place route: survivors already at the front, no positions.
            words = table.encode(np, flat, residual, residual, scales, 0, codec,
                                 np.empty(table.words, codec.word_dtype), compact=True)
            table.decode(np, words, codec, 2, scales, 2, flat, compact=True)
            ternary_encode_kept(np, flat, bits, residual, residual, [0, flat.size],
                                [0, count], [0, codec.words_for(flat.size)], [0], scales[:1], [0],
                                codec,
                                np.empty(codec.words_for(flat.size), codec.word_dtype))
    return backend(np)


def _fused(xp, *arrays):
    """The fused kernels' module for these arrays, or None for the reference."""
    route = backend(xp)
    if route == "numpy" or not all(a.flags.c_contiguous for a in arrays if a is not None):
        return None
    return _cpu() if route == "numba" else _gpu()


def segments_module(xp, *arrays):
    """The compiled module whose ``*_segments`` kernels do many segments of a bucket in one
    serial call, when these arrays take the Numba route (contiguous NumPy arrays); None
    elsewhere: the reference and CuPy are called segment by segment
    (:class:`pacmpi.segments.SegmentTable`), the reference staying the oracle."""
    fused = _fused(xp, *arrays)
    return fused if fused is not None and backend(xp) == "numba" else None


def _count(flat, indices):
    return flat.size if indices is None else indices.size


def _positions(indices):
    """Survivor positions as the kernels take them: int32 (what the engine keeps for buckets
    under 2**31 elements: half the bytes) or int64 as given, any other integer type as int64."""
    if indices is None or indices.dtype in (np.int32, np.int64):
        return indices
    return indices.astype(np.int64)


def _check_float(name, array, dtype, size):
    if array is not None and (array.dtype != dtype or array.size != size):
        raise ValueError(f"{name} must be {size} {dtype} values (the compute dtype), "
                         f"got {array.size} {array.dtype}")


def _check_count(name, count, indices, flat):
    """The compiled kernels do not check bounds: wrong sizes must not reach them."""
    if indices is None:
        if count > flat.size:
            raise ValueError(f"{name}: {count} values do not fit {flat.size} elements")
    elif indices.size != count:
        raise ValueError(f"{name}: {count} values but {indices.size} indices")


# ---------------------------------------------------------------- public kernels
def gather(xp, flat, indices, out):
    """``out[j] = flat[indices[j]]`` (``flat[j]`` when indices is None), cast to out's dtype;
    returns ``out``."""
    indices = _positions(indices)
    _check_count("gather", out.size, indices, flat)
    fused = _fused(xp, flat, indices, out)
    if fused is None or not fused.converts(flat.dtype, out.dtype):
        return reference.gather(xp, flat, indices, out)
    return fused.gather(flat, indices, out)


def scatter(xp, payload, indices, flat, divisor=None):
    """``flat[:] = 0; flat[indices[j]] = payload[j] / divisor`` in one pass, payload cast to
    flat's dtype first and the division in flat's dtype as ``flat.dtype.type(divisor)`` (none
    when divisor is None).
    ``indices=None`` is dense: ``flat[:] = payload [/ divisor]``, and payload may be flat
    itself. Returns ``flat``."""
    indices = _positions(indices)
    _check_count("scatter", payload.size, indices, flat)
    fused = _fused(xp, payload, indices, flat)
    if fused is None or not fused.converts(payload.dtype, flat.dtype):
        return reference.scatter(xp, payload, indices, flat, divisor)
    return fused.scatter(payload, indices, flat, divisor)


def _check_bits(name, bits, flat, count=None):
    """The compiled kernels do not check bounds: ``bits`` must be one mask of ``flat.size``
    coordinates (``count`` of them set, when given), its padding bits 0."""
    pad = -flat.size % 8
    if (bits.dtype != np.uint8 or bits.ndim != 1 or bits.size != (flat.size + 7) // 8
            or (pad and int(bits[-1]) & ((1 << pad) - 1))):
        raise ValueError(f"{name}: bits must be packbits of a mask of {flat.size} coordinates, "
                         f"got {bits.size} {bits.dtype} bytes")
    if count is not None and not 0 <= count <= flat.size:
        raise ValueError(f"{name}: {count} survivors do not fit {flat.size} elements")


def compact(xp, flat, bits, count):
    """``flat[:count] = flat[mask]`` in place for the ``count`` coordinates set in ``bits``
    (``packbits`` of the mask, 1 bit per coordinate: no position array): the lossless payload
    written over the bucket's own front, no buffer; the rest of ``flat`` as it was. Returns
    ``flat[:count]``. Compiled for NumPy arrays (one thread: moving forward in place does not
    split into chunks); on CuPy arrays a CUDA kernel gathers the survivors into a buffer of
    their size first (a GPU's threads cannot move them within one array). A ``count`` other
    than the bits' raises ValueError before anything moves."""
    _check_bits("compact", bits, flat, count)
    fused = _fused(xp, flat, bits)
    if fused is None:
        return reference.compact(xp, flat, bits, count)
    return fused.compact(flat, bits, count)


def expand(xp, flat, bits, count, divisor=None):
    """The inverse of :func:`compact`, in place: :func:`scatter` of ``flat[:count]`` (the
    reduced payload of the ``count`` coordinates set in ``bits``) into ``flat``. Returns
    ``flat``."""
    _check_bits("expand", bits, flat, count)
    fused = _fused(xp, flat, bits)
    if fused is None:
        return reference.expand(xp, flat, bits, count, divisor)
    return fused.expand(flat, bits, count, divisor)


def absmax(xp, flat, indices, residual):
    """``max_j |compute(flat[indices[j]]) + residual[j]|`` as a Python float: NaN or Inf when
    any value is not finite, 0.0 for no values. ``indices=None``: all of flat;
    ``residual=None``: no residual."""
    indices = _positions(indices)
    _check_float("residual", residual, compute_dtype(flat.dtype), _count(flat, indices))
    fused = _fused(xp, flat, indices, residual)
    if fused is None:
        return reference.absmax(xp, flat, indices, residual)
    return fused.absmax(flat, indices, residual)


def absmax_bits(xp, flat, bits, residual, offsets, starts, which, out):
    """Per segment ``s`` in ``which``: ``out[s]`` = :func:`absmax` of the coordinates of
    ``flat[offsets[s]:offsets[s + 1]]`` set in ``bits`` (``packbits`` of a mask of flat: no
    position array) plus ``residual[starts[s]:starts[s + 1]]`` (``starts[s]``: the survivors
    before ``offsets[s]``; ``residual=None``: none). Reads flat without changing it. Compiled
    for NumPy arrays (one serial call for every segment) and CuPy arrays (one launch; segments
    from coordinate 0). Returns ``out`` (a host float64 array)."""
    _check_bits("absmax_bits", bits, flat)
    offsets, starts = np.asarray(offsets, np.int64), np.asarray(starts, np.int64)
    if offsets.size != starts.size or offsets[-1] > flat.size or \
            np.any(np.diff(offsets) < 0) or np.any(np.diff(starts) < 0):
        raise ValueError(f"absmax_bits: offsets {offsets} and starts {starts} must be ascending, "
                         f"as many, within {flat.size} elements")
    _check_float("residual", residual, compute_dtype(flat.dtype), int(starts[-1]))
    which = np.asarray(which, np.int64)
    fused = _fused(xp, flat, bits, residual)
    if fused is None or (backend(xp) == "cupy" and (offsets[0] != 0 or starts[0] != 0)):
        return reference.absmax_bits(xp, flat, bits, residual, offsets, starts, which, out)
    return fused.absmax_bits(flat, bits, residual, offsets, starts, which, out)


def ternary_encode(xp, flat, indices, residual_in, residual_out, scale, key, codec, words_out):
    """Quantize ``v_j = compute(flat[indices[j]]) + residual_in[j]`` to ``q_j`` in {-1, 0, 1}
    with ``P(q_j = sign v_j) = float32(|v_j|) / float32(scale)`` (none when ``scale <= 0``),
    drawing :func:`pacmpi.hashing.uniform` number j of ``key``; store
    ``residual_out[j] = v_j - q_j * scale`` (may be residual_in itself; None: not kept) and pack
    ``q_j + 1`` into ``words_out`` exactly as :meth:`TernaryCodec.encode`. Returns words_out."""
    indices = _positions(indices)
    count = _count(flat, indices)
    compute = compute_dtype(flat.dtype)
    _check_float("residual_in", residual_in, compute, count)
    _check_float("residual_out", residual_out, compute, count)
    if words_out.dtype != codec.word_dtype or words_out.size != codec.words_for(count):
        raise ValueError(f"words_out must be {codec.words_for(count)} {codec.word_dtype} "
                         f"words, got {words_out.size} {words_out.dtype}")
    fused = _fused(xp, flat, indices, residual_in, residual_out, words_out)
    if fused is None:
        return reference.ternary_encode(xp, flat, indices, residual_in, residual_out, scale,
                                        key, codec, words_out)
    return fused.ternary_encode(flat, indices, residual_in, residual_out, scale, key, codec,
                                words_out)


def ternary_encode_kept(xp, flat, bits, residual_in, residual_out, offsets, starts,
                        word_starts, which, scales, keys, codec, words):
    """:func:`ternary_encode` of every coordinate of each segment ``s`` in ``which``
    (``flat[offsets[s]:offsets[s + 1]]``, sent dense) with ``scales[s]`` and ``keys[s]`` into
    ``words[word_starts[s]:word_starts[s + 1]]``, where the error-feedback residual is kept for
    the coordinates set in ``bits`` only (``packbits`` of a mask of flat; the segment's are
    ``residual_in[starts[s]:starts[s + 1]]``): the words and those residuals are the ones a
    full-length residual that is 0 elsewhere gives. ``residual_out`` (may be residual_in; None:
    not kept) gets theirs. Compiled for NumPy arrays (one serial call: it is the path of the
    few steps a mask is checked dense) and CuPy arrays (one launch for the segments with words,
    from coordinate 0). Returns ``words``."""
    _check_bits("ternary_encode_kept", bits, flat)
    if residual_in is None:
        raise ValueError("ternary_encode_kept: residual_in is required (the survivors' residual)")
    offsets, starts, word_starts = (np.asarray(a, np.int64) for a in (offsets, starts,
                                                                       word_starts))
    compute = compute_dtype(flat.dtype)
    if offsets.size != starts.size or offsets[-1] != flat.size or starts[-1] > flat.size:
        raise ValueError(f"ternary_encode_kept: offsets {offsets} and starts {starts} must "
                         f"cover {flat.size} elements")
    _check_float("residual_in", residual_in, compute, int(starts[-1]))
    _check_float("residual_out", residual_out, compute, int(starts[-1]))
    if words.dtype != codec.word_dtype or words.size < word_starts[-1]:
        raise ValueError(f"words must be at least {word_starts[-1]} {codec.word_dtype} words, "
                         f"got {words.size} {words.dtype}")
    which = np.asarray(which, np.int64)
    scales, keys = np.asarray(scales, np.float64), np.asarray(keys, np.uint64)
    fused = _fused(xp, flat, bits, residual_in, residual_out, words)
    every = np.array_equal(which, np.flatnonzero(np.diff(word_starts)))  # (the GPU's launch)
    if fused is None or (backend(xp) == "cupy" and (offsets[0] != 0 or not every)):
        return reference.ternary_encode_kept(xp, flat, bits, residual_in, residual_out,
                                             offsets, starts, word_starts, which, scales, keys,
                                             codec, words)
    return fused.ternary_encode_kept(flat, bits, residual_in, residual_out, offsets, starts,
                                     word_starts, which, scales, keys, codec, words)


def ternary_decode(xp, words, count, codec, ranks, scale, divisor, indices, flat):
    """From words summed over ``ranks`` ranks: ``s_j = digit_j - ranks``, value
    ``compute(s_j) * compute(scale) [/ compute(divisor)]`` cast once to flat's dtype;
    ``flat[:] = 0; flat[indices[j]] = value_j`` (``flat[j]`` when indices is None) for
    j < count. Returns ``flat``."""
    indices = _positions(indices)
    _check_count("ternary_decode", count, indices, flat)
    if words.dtype != codec.word_dtype or words.size < codec.words_for(count):
        raise ValueError(f"words must be at least {codec.words_for(count)} {codec.word_dtype} "
                         f"words, got {words.size} {words.dtype}")
    fused = _fused(xp, words, indices, flat)
    if fused is None:
        return reference.ternary_decode(xp, words, count, codec, ranks, scale, divisor,
                                        indices, flat)
    return fused.ternary_decode(words, count, codec, ranks, scale, divisor, indices, flat)
