"""Reference codec kernels on any array module (``xp`` is NumPy or CuPy): the tested oracle.

Each function is written as plainly as the array module allows, with full-size temporaries;
the fused Numba and CuPy kernels must reproduce these results bit for bit. Values are computed
in :func:`compute_dtype` (float64 for float64 gradients, float32 otherwise) and cast to the
gradient dtype once, at the end. The integer tables the fused kernels share are here too.
"""
import functools

import numpy as np

from ..ternary import stochastic_ternary

__all__ = ["compute_dtype", "digit_powers", "division_tables", "gather", "scatter", "compact",
           "expand", "absmax", "absmax_bits", "ternary_encode", "ternary_encode_kept",
           "ternary_decode"]


def compute_dtype(dtype):
    """float64 for float64 gradients; float32 for float16, bfloat16 and float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.lru_cache(maxsize=None)
def digit_powers(base, digits):
    """``base**d`` for d < digits, uint64 (a word's digit d is worth ``base**d``)."""
    return np.array([base ** d for d in range(digits)], dtype=np.uint64)


@functools.lru_cache(maxsize=None)
def division_tables(base, digits):
    """``(magics, shifts)``, uint64 arrays whose entry d divides by ``D = base**(d+1)``:
    ``x // D == (t + ((x - t) >> 1)) >> shift`` with ``t`` the high 64 bits of ``magic * x``,
    for every uint64 ``x`` (Granlund and Montgomery, 1994, fig. 4.1), a multiply instead of a
    slow division. ``base`` is odd, so no divisor is a power of two, and ``base**digits`` fits
    a uint64 word."""
    magics, shifts = [], []
    for d in range(1, digits + 1):
        divisor = base ** d
        length = divisor.bit_length()  # ceil(log2(divisor))
        magics.append((1 << 64) * ((1 << length) - divisor) // divisor + 1)
        shifts.append(length - 1)
    return np.array(magics, dtype=np.uint64), np.array(shifts, dtype=np.uint64)


def _place(xp, values, indices, flat):
    """``flat[:] = 0; flat[indices] = values`` (``flat[:n] = values`` when indices is None)."""
    if indices is None:
        flat[:values.size] = values
        flat[values.size:] = 0
    else:
        flat[...] = 0
        flat[indices] = values
    return flat


def _values(xp, flat, indices, residual):
    """The survivors in the compute dtype, plus the residual when one is given."""
    values = (flat if indices is None else flat[indices]).astype(compute_dtype(flat.dtype))
    if residual is not None:
        values += residual
    return values


def gather(xp, flat, indices, out):
    """``out[j] = flat[indices[j]]`` (``flat[j]`` when indices is None)."""
    if indices is None:
        out[...] = flat[:out.size]
    elif out.dtype == flat.dtype:
        xp.take(flat, indices, out=out)
    else:
        out[...] = flat[indices]
    return out


def scatter(xp, payload, indices, flat, divisor=None):
    """``flat[:] = 0; flat[indices] = payload / divisor`` (payload cast to flat's dtype first,
    the division in flat's dtype)."""
    values = payload.astype(flat.dtype, copy=False)
    if divisor is not None:
        values = values / flat.dtype.type(divisor)
    return _place(xp, values, indices, flat)


def _kept(xp, bits, size):
    """Positions of the set bits among the first ``size`` of ``bits`` (``packbits`` order)."""
    return xp.flatnonzero(xp.unpackbits(bits)[:size])


def compact(xp, flat, bits, count):
    """``flat[:count] = flat[mask]`` for the ``count`` coordinates set in ``bits`` (``packbits``
    of the mask); returns ``flat[:count]``."""
    kept = _kept(xp, bits, flat.size)
    if kept.size != count:
        raise ValueError(f"compact: the bits hold {kept.size} survivors, not {count}")
    flat[:count] = flat[kept]
    return flat[:count]


def expand(xp, flat, bits, count, divisor=None):
    """The inverse of :func:`compact`, as :func:`scatter` of ``flat[:count]`` into ``flat``."""
    kept = _kept(xp, bits, flat.size)
    if kept.size != count:
        raise ValueError(f"expand: the bits hold {kept.size} survivors, not {count}")
    return scatter(xp, flat[:count].copy(), kept, flat, divisor)


def absmax(xp, flat, indices, residual):
    """``max |flat[indices] + residual|`` in the compute dtype, as a Python float (NaN or Inf
    when any value is not finite; 0.0 when there are none)."""
    values = _values(xp, flat, indices, residual)
    return float(xp.max(xp.abs(values))) if values.size else 0.0


def absmax_bits(xp, flat, bits, residual, offsets, starts, which, out):
    """``out[s]`` = :func:`absmax` of segment ``s`` for each ``s`` in ``which``: the
    coordinates of ``flat[offsets[s]:offsets[s + 1]]`` set in ``bits`` (``packbits`` of a mask
    of flat), plus ``residual[starts[s]:starts[s + 1]]``, its survivors' residual."""
    for s in which:
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        window = xp.unpackbits(bits[lo // 8:(hi + 7) // 8])[lo % 8:lo % 8 + hi - lo]
        part = None if residual is None else residual[starts[s]:starts[s + 1]]
        out[s] = absmax(xp, flat[lo:hi], xp.flatnonzero(window), part)
    return out


def ternary_encode(xp, flat, indices, residual_in, residual_out, scale, key, codec, words_out):
    """Quantize ``flat[indices] + residual_in`` to ternary codes, store the new error-feedback
    residual, and pack the codes into ``words_out``."""
    values = _values(xp, flat, indices, residual_in)
    codes = stochastic_ternary(xp, values, scale, key)
    if residual_out is not None:
        residual_out[...] = values - codes.astype(values.dtype) * values.dtype.type(scale)
    return codec.encode(xp, codes, out=words_out)


def ternary_encode_kept(xp, flat, bits, residual_in, residual_out, offsets, starts,
                        word_starts, which, scales, keys, codec, words):
    """:func:`ternary_encode` of every coordinate of each segment ``s`` in ``which``
    (``flat[offsets[s]:offsets[s + 1]]``, dense) with ``scales[s]`` and ``keys[s]`` into
    ``words[word_starts[s]:word_starts[s + 1]]``, where the residual is kept for the
    coordinates set in ``bits`` only (``residual_in[starts[s]:starts[s + 1]]``: as a full-length
    residual that is 0 elsewhere); ``residual_out`` (None: not kept) gets theirs."""
    kept = xp.unpackbits(bits)[:flat.size].view(xp.bool_)
    compute = compute_dtype(flat.dtype)
    for s in which:
        lo, hi, r0, r1 = (int(offsets[s]), int(offsets[s + 1]), int(starts[s]),
                          int(starts[s + 1]))
        mask = kept[lo:hi]
        full = xp.zeros(hi - lo, dtype=compute)
        full[mask] = residual_in[r0:r1]
        out = None if residual_out is None else xp.empty_like(full)
        ternary_encode(xp, flat[lo:hi], None, full, out, float(scales[s]), int(keys[s]), codec,
                       words[int(word_starts[s]):int(word_starts[s + 1])])
        if residual_out is not None:
            residual_out[r0:r1] = out[mask]
    return words


def ternary_decode(xp, words, count, codec, ranks, scale, divisor, indices, flat):
    """Unpack the code sums of ``ranks`` ranks, scale (and divide) them in the compute dtype and
    scatter them into a zeroed ``flat``."""
    compute = compute_dtype(flat.dtype).type
    values = codec.decode(xp, words, count, ranks).astype(compute)
    values *= compute(scale)
    if divisor is not None:
        values /= compute(divisor)
    return _place(xp, values, indices, flat)
