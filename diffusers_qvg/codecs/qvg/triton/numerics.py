"""Exact float formats by integer arithmetic, shared by the QVG kernels.

Triton's own rounding conversions differ between backends (the CPU interpreter truncates to bfloat16 and
rounds e4m3 its own way; GPUs saturate), so the roundings the format contract names are spelled out here
with integer bit operations and power-of-two products: the results are the same on every backend and equal
to PyTorch's casts for the finite, in-range values the codec produces. The one exception is the scale
search's hot rounding (:func:`round_scale`), which takes the GPU's conversion instructions where their
rounding is the cast's. Widening conversions (e4m3, fp16, bf16 to float32) are exact everywhere and use
Triton's own.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2^e as float32, exactly, for integer ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exponent(v):
    """floor(log2|v|) of a normal float32 (the biased exponent field, unbiased)."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127


@triton.jit
def pow2_at_least(v):
    """2^ceil(log2 v) for v > 0 (exponent clamped to [-126, 127]), 1 for v == 0: the reference's rule."""
    mantissa = v.to(tl.int32, bitcast=True) & 0x7FFFFF
    e = exponent(v) + tl.where(mantissa != 0, 1, 0)
    return tl.where(v > 0, pow2(tl.minimum(tl.maximum(e, -126), 127)), 1.0)


@triton.jit
def quotient(a, b, inv):
    """``RN(a / b)`` for ``b > 0`` without a division, from ``inv`` within 2 ulps of ``1 / b`` (Markstein's
    correction: ``y = RN(a inv)``, the remainder ``b y - a``, exact in a fused multiply-add, and ``RN(y -
    inv (b y - a))``): three instructions where the IEEE division takes ~15. Exact where ``b``'s
    significand has at most 18 bits (the codes' steps: 11), ``b`` lies in [2^-61, 2^67] and the quotient's
    magnitude is at least 2^-26; smaller quotients are within a few ulps, and every use rounds them to 0.

    Why. With ``b = B 2^beta``, ``B`` odd of k bits: no normal quotient is a midpoint ``mu`` of two float32
    (``mu b`` would be an odd integer of at least 25 bits times a power of two, not a float32 ``a``), and
    ``|a - mu b|`` is a nonzero multiple of a power of two, so ``a / b`` lies at least ``ulp(a / b)
    2^-(k + 1)`` from every midpoint. The unrounded result is ``a / b + (y - a / b)(1 - inv b)``: with
    ``|1 - inv b| <= 2^-22``, so ``|y - a / b| < 4.5`` ulps, it is off by less than that, on the same side of
    every midpoint, and rounds to ``RN(a / b)``. The remainder, a few ulps of ``a`` and a multiple of
    ``ulp(b) ulp(y) / 2 >= 2^-134`` in that range, is exact. (Subnormal quotients can be midpoints: there the
    division is needed.) tests/test_triton_quantize.py checks every 11-bit significand at every level
    threshold, with ``inv`` exact and off by 2 ulps."""
    y = a * inv
    return tl.math.fma(-tl.math.fma(y, b, -a), inv, y)  # a zero keeps a's sign, as in the division


@triton.jit
def rint(v):
    """Round half to even, for |v| < 2^22 (the float32 magic-number trick; exact without fast-math)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def f32_to_e4m3(v):
    """Encode a float32 that is exactly representable in e4m3 (see :func:`round_to_format`) as its bits (int32).

    Only encoding needs this: decoding e4m3 with ``.to(tl.float32)`` is exact on every backend (the patterns
    0x7F/0xFF, NaN in PyTorch, which the encoder never writes, are the one exception in the interpreter).
    """
    sign = tl.where(v.to(tl.int32, bitcast=True) < 0, 128, 0)
    a = tl.abs(v)
    e = tl.maximum(exponent(a), -6)
    mantissa = (a * pow2(3 - e)).to(tl.int32)  # in [8, 16) for normals, [0, 8) for subnormals
    field = tl.where(mantissa >= 8, e + 7, 0)
    return sign | (field << 3) | (mantissa & 7)


@triton.jit
def round_to_format(v, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round float32 ``v`` to nearest-even in a format with ``MANTISSA`` bits and normals from 2^MIN_EXPONENT.

    e4m3 is (3, -6), float16 (10, -14). Values must lie below the format's maximum (no saturation here).
    """
    e = tl.maximum(exponent(v), MIN_EXPONENT)
    # Scaling by powers of two is exact; a `/` could compile to an approximate division.
    magnitude = rint(tl.abs(v) * pow2(MANTISSA - e)) * pow2(e - MANTISSA)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)  # -0.0 stays -0.0, as in a cast


@triton.jit
def round_nonnegative_to_format(v, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """:func:`round_to_format` for ``v >= 0`` (or NaN, kept), in half the instructions: the scale search rounds
    every candidate of every group. Normals round nearest-even in the bits (the carry of ``+ half - 1 + lsb``
    moves into the exponent exactly when the value rounds up to the next power of two); below the smallest
    normal the quantum is fixed, ``2^(MIN_EXPONENT - MANTISSA)``, and adding and subtracting ``1.5 * 2^23``
    quanta rounds to it (the float32 magic-number trick at that ulp)."""
    DROP: tl.constexpr = 23 - MANTISSA
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (MIN_EXPONENT - MANTISSA + 23)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (-(1 << DROP))).to(tl.float32, bitcast=True)
    return tl.where(v < 2.0**MIN_EXPONENT, (v + MAGIC) - MAGIC, normal)


@triton.jit
def round_scale(v, FMT_MAX: tl.constexpr, E4M3: tl.constexpr, SOFTWARE: tl.constexpr):
    """``fmt(min(v, fmt_max))`` for ``v >= 0`` (or NaN, kept) as float32: nearest-even in the scale format
    (e4m3 or float16), saturated at its maximum, by the conversion instructions (``cvt.rn``; for e4m3
    ``cvt.rn.satfinite``, one instruction per two values), which the PTX ISA defines as IEEE round-to-nearest-
    even with subnormals: the cast's rounding, in fewer instructions than the bit arithmetic. The
    interpreter rounds e4m3 ties its own way, so there (``SOFTWARE``) e4m3 is rounded by
    :func:`round_nonnegative_to_format`; its float16 cast is numpy's, nearest-even."""
    if E4M3 and not SOFTWARE:  # satfinite: above the maximum (Inf too) gives the maximum, NaN stays NaN
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    v = tl.where(v > FMT_MAX, FMT_MAX, v)
    if E4M3:
        return round_nonnegative_to_format(v, 3, -6)
    else:
        return v.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def clamp(v, lo, hi):
    """``torch.clamp``'s result bit for bit: a -0.0 inside the range stays -0.0 (min/max instructions may not)."""
    return tl.where(v < lo, lo, tl.where(v > hi, hi, v))


@triton.jit
def round_to_bf16(v):
    """float32 -> the nearest-even bfloat16 value, still as float32 (so any later cast is exact)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_tf32(v):
    """float32 -> the nearest-even TF32 value (10 explicit mantissa bits), still as float32: a tensor core's
    TF32 product of such values is exact, whatever rounding the hardware applies to its operands."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_exact(v, dtype: tl.constexpr, SOFTWARE_BF16: tl.constexpr):
    """float32 -> ``dtype`` with round-to-nearest-even: GPUs' ``cvt.rn`` does it; the interpreter truncates to
    bfloat16, so there (``SOFTWARE_BF16``) the rounding is done in integer arithmetic first."""
    if SOFTWARE_BF16 and dtype == tl.bfloat16:
        return round_to_bf16(v).to(dtype)
    else:
        return v.to(dtype)
