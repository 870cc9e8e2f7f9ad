"""Normal draws that are bit-identical on every CPU: torch's AVX2 Box-Muller, recomputed portably.

`torch.randn` / `Tensor.normal_` on a contiguous float32 tensor of 16 or more elements take a
vectorised path on x86 with AVX2 (also used under AVX512): the uniforms are drawn as usual, then
each block of 16 is turned into normals by a Box-Muller over the pairs (j, j + 8) whose logarithm,
sine and cosine are Cephes-style float32 polynomials (`ATen/native/cpu/avx_mathfun.h`), compiled
with fused multiply-adds. Under `ATEN_CPU_CAPABILITY=default`, on ARM, or on a CPU without AVX2,
torch computes the same transform with libm instead, so the same seed gives other tensors.

This module recomputes the AVX2 path's arithmetic operation by operation: uniforms from
`torch.rand` (the same generator stream on every CPU), float32 operations in numpy float32 (IEEE
correctly rounded), and each fused multiply-add exactly (the product is exact in float64; the one
case where rounding the float64 sum to float32 can differ from rounding the exact sum, a float64
sum lying on a float32 halfway point, is redone with TwoSum and round-to-odd). Which operations
are fused was read from the compiled kernel (`NormalFill16<float>` in torch 2.13's libtorch_cpu:
every multiply-add of the polynomials and of the argument reduction, and the final
`n * std + mean`); tests/test_portable_random.py checks the result bit for bit against
`torch.randn` / `normal_` wherever torch runs that kernel.

Tensors of fewer than 16 elements (and non-contiguous or non-float32 ones) take torch's scalar
path, which does not depend on the vector capability: they are left to torch.

`uniform_` over [a, b) (`kaiming_uniform_`, `nn.Linear`'s own init) differs between torch builds
too (`x * (b - a) + a`, fused in the AVX2 build only); `uniform_` here gives the fused result.
`portable_init()` routes `Tensor.normal_`, `Tensor.uniform_` and `torch.randn` through this
module while a model is constructed from a seed.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import numpy as np
import torch

__all__ = ["normal", "normal_", "randn", "uniform_", "portable_init", "VECTOR_MIN_NUMEL"]

# torch's vectorised normal path handles contiguous float32 tensors of at least this many elements
VECTOR_MIN_NUMEL = 16

# torch's own functions, kept before `portable_init` may replace them
_TORCH_NORMAL_ = torch.Tensor.normal_
_TORCH_UNIFORM_ = torch.Tensor.uniform_
_TORCH_RANDN = torch.randn


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


# The kernel's constants, as the float32 bit patterns it loads.
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_TWO_PI = _f32(0x40C90FDB)          # float(2 * pi)
_MIN_NORM = _f32(0x00800000)
_SQRTHF = _f32(0x3F3504F3)          # sqrt(1/2)
_LOG_P = [_f32(b) for b in (0x3D9021BB, 0xBDEBD1B8, 0x3DEF251A, 0xBDFE5D4F, 0x3E11E9BF, 0xBE2AAE50,
                            0x3E4CCEAC, 0xBE7FFFFC, 0x3EAAAAAA)]   # Cephes logf p0..p8
_LOG_Q1 = _f32(0xB95E8083)          # -2.12194440e-4
_LOG_Q2 = _f32(0x3F318000)          # 0.693359375
_FOPI = _f32(0x3FA2F983)            # 4 / pi
_DP1 = _f32(0xBF490000)             # -0.78515625
_DP2 = _f32(0xB97DA000)             # -2.4187564849853515625e-4
_DP3 = _f32(0xB3222169)             # -3.77489497744594108e-8
_COS_P = [_f32(b) for b in (0x37CCF5CE, 0xBAB6061A, 0x3D2AAAA5)]   # Cephes cosf
_SIN_P = [_f32(b) for b in (0xB94CA1F9, 0x3C08839E, 0xBE2AAAA3)]   # Cephes sinf

# float64 bit masks: the 29 bits below a float32 significand's last bit, and a float32 halfway point
_TAIL = np.uint64((1 << 29) - 1)
_HALFWAY = np.uint64(1 << 28)
_TINY = 2.0 ** -125                 # below this a float32 result may be subnormal (fewer bits)


def _f64(x):
    """float64 of float32 values (exact); float64 arrays as they are."""
    return x.astype(np.float64, copy=False) if isinstance(x, np.ndarray) else np.float64(x)


def _fma(a, b, c, tiny: bool = False) -> np.ndarray:
    """float32 fused multiply-add `a * b + c`, rounded once (float32 array out; a or b an array,
    a may be float64 holding float32 values; a is not modified).

    `tiny`: the result may be a float32 subnormal (not so for the kernel's internal values, which
    are zero or far above 2**-125)."""
    s = np.multiply(_f64(a), _f64(b))           # exact: 24 + 24 bits
    s += _f64(c)
    r = s.astype(np.float32)
    # Rounding the float64 sum to float32 equals rounding the exact sum unless the sum was inexact
    # and landed exactly on a float32 halfway point: then the bits it lost must break the tie.
    suspect = (s.view(np.uint64) & _TAIL) == _HALFWAY
    if tiny:
        suspect |= np.abs(s) < _TINY          # a subnormal result has its halfway points higher up
    if suspect.any():
        idx = np.nonzero(suspect)
        def pick(v):
            return np.broadcast_to(_f64(v), s.shape)[idx]

        pi, ci, si = pick(a) * pick(b), pick(c), s[idx]
        bb = si - pi
        err = (pi - (si - bb)) + (ci - bb)    # TwoSum: the exact sum is si + err
        bits = si.view(np.int64).copy()
        # round to odd: an inexact sum with an even last bit moves one step towards the exact sum
        step = np.where(np.signbit(err) == np.signbit(si), 1, -1)
        bits += np.where((err != 0) & ((bits & 1) == 0), step, 0)
        r[idx] = bits.view(np.float64).astype(np.float32)
    return r


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def _box_muller16(u: np.ndarray, mean: np.float32, std: np.float32) -> np.ndarray:
    """The kernel's transform of blocks of 16 uniforms `u` (shape (n, 16), float32) to normals.

    Selections and sign changes are done on the bits, as the kernel does them (masks of all ones)."""
    a, b = u[:, :8], u[:, 8:]
    with np.errstate(all="ignore"):
        # -- log(1 - a): Cephes logf --------------------------------------------------------
        u1 = _ONE - a                                   # in (0, 1]
        invalid = u1 <= 0
        u1 = np.maximum(u1, _MIN_NORM)
        bits = _bits(u1)
        e = ((bits >> np.uint32(23)).astype(np.int32) - 127).astype(np.float32) + _ONE
        m = ((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000)).view(np.float32)   # [0.5, 1)
        low = (m < _SQRTHF).view(np.uint8).astype(np.uint32)                            # 1 / 0
        x = (m - _ONE) + (_bits(m) & -low).view(np.float32)
        e = e - low.astype(np.float32)
        z = x * x
        x64 = x.astype(np.float64)                      # reused by each step of the polynomial
        y = _fma(x64, _LOG_P[0], _LOG_P[1])
        for coeff in _LOG_P[2:]:
            y = _fma(x64, y, coeff)
        y = x * y
        y = _fma(y, z, e * _LOG_Q1)
        y = y - z * _HALF                               # fused or not: z * 0.5 is exact
        x = x + y
        # fused in the kernel too, but e (an integer, |e| < 2**7) * Q2 (9 significant bits) is exact
        log = e * _LOG_Q2 + x
        if invalid.any():
            log[invalid] = np.nan
        radius = np.sqrt(log * np.float32(-2))
        # -- sin and cos of 2 pi b: Cephes sincosf ------------------------------------------
        theta = _TWO_PI * b
        tbits = _bits(theta)
        x = (tbits & np.uint32(0x7FFFFFFF)).view(np.float32)
        j = (x * _FOPI).astype(np.int32)
        j = ((j + 1) & ~np.int32(1)).view(np.uint32)
        yj = j.view(np.int32).astype(np.float32)
        sign_sin = (tbits & np.uint32(0x80000000)) ^ ((j & np.uint32(4)) << np.uint32(29))
        sign_cos = (~(j - np.uint32(2)) & np.uint32(4)) << np.uint32(29)
        poly = -((j & np.uint32(2)) == 0).view(np.uint8).astype(np.uint32)            # all ones / 0
        # j <= 8 and DP1, DP2 have short significands: these two products are exact in float32
        x = x + yj * _DP1
        x = x + yj * _DP2
        x = _fma(yj, _DP3, x)
        z = x * x
        z64 = z.astype(np.float64)
        half_z = z * _HALF
        yc = _fma(z64, _COS_P[0], _COS_P[1])
        yc = _fma(z64, yc, _COS_P[2])
        yc = z * yc
        yc = _fma(z64, yc, -half_z)
        yc = yc + _ONE
        ys = _fma(z64, _SIN_P[0], _SIN_P[1])
        ys = _fma(z64, ys, _SIN_P[2])
        ys = z * ys
        ys = _fma(x, ys, x)
        ysin2 = (_bits(ys) & poly).view(np.float32)
        ysin1 = (_bits(yc) & ~poly).view(np.float32)
        sin = ((_bits(ysin1 + ysin2)) ^ sign_sin).view(np.float32)
        cos = ((_bits((ys - ysin2) + (yc - ysin1))) ^ sign_cos).view(np.float32)
        n = np.empty_like(u)
        np.multiply(radius, cos, out=n[:, :8])
        np.multiply(radius, sin, out=n[:, 8:])
        if mean == 0:
            # fma(n, std, ±0): the product rounded once, then ±0 added (with the same signed-zero rule)
            if std != 1:
                n *= std
            n += mean
            return n
        return _fma(n, std, mean, tiny=True)


_BLOCK = 4096   # blocks of 16 processed at once (keeps the temporaries in cache)


def _transform(u: np.ndarray, mean: np.float32, std: np.float32) -> np.ndarray:
    u = u.reshape(-1, 16)
    out = np.empty_like(u)
    for i in range(0, u.shape[0], _BLOCK):
        out[i:i + _BLOCK] = _box_muller16(u[i:i + _BLOCK], mean, std)
    return out.reshape(-1)


def _normal_flat(numel: int, mean: float, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """`numel` (>= 16) float32 normals as torch's AVX2 path draws them; advances the generator alike."""
    tail = numel % 16
    # torch draws one uniform per element, then 16 more when numel is not a multiple of 16
    u = torch.rand(numel + (16 if tail else 0), generator=generator, dtype=torch.float32).numpy()
    mean32, std32 = np.float32(mean), np.float32(std)   # the kernel's float(mean), float(std)
    full = numel - tail
    out = np.empty(numel, dtype=np.float32)
    out[:full] = _transform(u[:full], mean32, std32)
    if tail:
        # the last 16 outputs (overlapping the last full block) come from the 16 fresh uniforms
        out[numel - 16:] = _transform(u[numel:], mean32, std32)
    return torch.from_numpy(out)


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _portable(tensor: torch.Tensor, min_numel: int = 0) -> bool:
    """Whether `tensor` is one this module fills itself (contiguous float32 on the CPU)."""
    return (tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
            and tensor.numel() >= min_numel)


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """`tensor.normal_(mean, std, generator=generator)` with the same result on every CPU.

    Contiguous float32 CPU tensors of >= 16 elements get the portable draw; all others are left to
    torch (its scalar path, which does not depend on the CPU's vector capability)."""
    if not _portable(tensor, VECTOR_MIN_NUMEL):
        return _TORCH_NORMAL_(tensor, mean, std, generator=generator)
    if not std >= 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    values = _normal_flat(tensor.numel(), float(mean), float(std), generator)
    return tensor.copy_(values.view(tensor.shape))


def normal(shape: Sequence[int], mean: float = 0.0, std: float = 1.0, *,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """A new float32 tensor of `shape` filled as `torch.empty(shape).normal_(mean, std)` on AVX2."""
    return normal_(torch.empty(tuple(shape), dtype=torch.float32), mean, std, generator=generator)


def randn(*size, generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
          device=None, requires_grad: bool = False, **kwargs) -> torch.Tensor:
    """`torch.randn` with the AVX2 result on every CPU (float32 on the CPU; anything else is torch's)."""
    shape = _shape(size)
    if ((dtype or torch.get_default_dtype()) != torch.float32 or torch.device(device or "cpu").type != "cpu"
            or math.prod(shape) < VECTOR_MIN_NUMEL or kwargs):
        return _TORCH_RANDN(*size, generator=generator, dtype=dtype, device=device, requires_grad=requires_grad,
                            **kwargs)
    return normal(shape, generator=generator).requires_grad_(requires_grad)


def uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, *,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """`tensor.uniform_(a, b, generator=generator)` with the AVX2 build's result on every CPU.

    torch draws x = k / 2**24 per element (the same on every CPU) and returns `x * (b - a) + a` in
    float32, which its AVX2 build fuses into one multiply-add (the default build rounds twice), so
    uniform_ (and kaiming_uniform_, ...) over [a, b) other than [0, 1) differ between them. Here
    the fused form is computed exactly. Non-float32 or non-contiguous tensors are left to torch."""
    if not _portable(tensor) or tensor.numel() == 0:
        return _TORCH_UNIFORM_(tensor, a, b, generator=generator)
    if not a <= b:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={a} > to={b}")
    x = torch.rand(tensor.numel(), generator=generator, dtype=torch.float32).numpy()
    lo, hi = np.float32(a), np.float32(b)
    with np.errstate(all="ignore"):
        values = _fma(x, hi - lo, lo, tiny=True)
    return tensor.copy_(torch.from_numpy(values).view(tensor.shape))


def _tensor_normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    return normal_(self, mean, std, generator=generator)


def _tensor_uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0, *,
                     generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
    from_ = kwargs.pop("from", from_)     # torch spells the keyword `from`
    if kwargs:
        raise TypeError(f"uniform_() got unexpected keyword arguments {sorted(kwargs)}")
    return uniform_(self, from_, to, generator=generator)


@contextlib.contextmanager
def portable_init() -> Iterator[None]:
    """While active, `Tensor.normal_` and `Tensor.uniform_` (so `nn.init.normal_`, `kaiming_uniform_`
    of `nn.Linear`'s own init, transformers' `init.*`, ...) and `torch.randn` draw portably.

    For constructing models from a seed inside the tiny writers. Not thread-safe: it replaces the
    functions process-wide while active."""
    saved = torch.Tensor.normal_, torch.Tensor.uniform_, torch.randn
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.randn = _tensor_normal_, _tensor_uniform_, randn
    try:
        yield
    finally:
        torch.Tensor.normal_, torch.Tensor.uniform_, torch.randn = saved
