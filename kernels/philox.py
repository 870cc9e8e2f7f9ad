"""Triton's Philox4x32-10 in torch: the random numbers of `tl.randint` / `tl.rand`, bit for bit.

The Triton kernels draw their noise with ``tl.rand(seed, offset)`` / ``tl.randint(seed, offset)``
(`triton/language/random.py`); the torch references draw from here, at the same offsets, so a
seeded sample is the same numbers on any device and through either path.

What Triton computes, for a scalar integer ``seed`` and int64 ``offset`` (the kernels' offsets are
int64: ``row * width + col`` with an int64 row):

* the key: ``seed`` cast to uint64 (sign-extended, so it is ``seed mod 2**64``), split into
  ``k0 = low 32 bits`` and ``k1 = high 32 bits``;
* the counter: ``c0 = offset mod 2**32``, ``c1 = (offset >> 32) mod 2**32``, ``c2 = c3 = 0``;
* ten rounds of ``c0, c2 = mulhi(B, c2) ^ c1 ^ k0, mulhi(A, c0) ^ c3 ^ k1;
  c1, c3 = B·c2 mod 2**32, A·c0 mod 2**32`` (old c0, c2), the key raised by the Weyl constants
  after each round; `randint` is the final c0 (`randint4x` all four words);
* `rand`: the uint32 bit-cast to int32, negatives flipped (``~x``), converted to float32 and
  multiplied in float32 by the float32 ``4.6566127342e-10`` (the largest scale keeping the result
  below 1), so u ∈ [0, 1) on a grid of 2**-31.

uint32 arithmetic is emulated in int64 tensors: a product of two uint32 values is formed in int64
(torch's int64 multiply wraps modulo 2**64 in two's complement, on CPU and CUDA, so the 64 bits
are the exact product's), then its low and high 32 bits are taken with shifts and masks. `gumbel_from_uniform` is the kernels' Gumbel transform, in
float32 with correctly rounded logs, the one formula of every torch path (see its docstring for the
last bit of the kernels' own logs).
"""
from __future__ import annotations

import torch

N_ROUNDS = 10
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
UINT32_MASK = 0xFFFFFFFF
# `uint_to_uniform_float`'s scale for 32-bit draws, ((2**23 − 1) / 2**23) · 2**−31, as the float32
# constant Triton compiles it to.
UNIFORM_SCALE = 4.6566127342e-10
# The same float32 value as a Python float (exactly representable), so the product needs no tensor
# made on the device per call (a host-to-device copy that synchronises the stream).
UNIFORM_SCALE_F32 = torch.tensor(UNIFORM_SCALE, dtype=torch.float32).item()


def split_seed(seed: int) -> tuple[int, int]:
    """(k0, k1): the low and high 32 bits of `seed` as Triton's uint64 cast sees it.

    Triton passes an int seed as int32, uint32, int64 or uint64 by its value and sign-extends it to
    uint64, so any seed in [-2**63, 2**64) is taken modulo 2**64; others cannot be launched.
    """
    seed = int(seed)
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must lie in [-2**63, 2**64) (a Triton integer argument), got {seed}")
    seed &= (1 << 64) - 1
    return seed & UINT32_MASK, seed >> 32


def philox4x32(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = N_ROUNDS
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tl.randint4x(seed, offsets)`: four uint32 words (as int64 tensors of `offsets`' shape) per
    int64 offset. `seed`: an int, or an int64 tensor broadcast against `offsets` (a seed per row, as
    a kernel that loads its row's seed draws: each row's words are those of its seed alone)."""
    if offsets.dtype != torch.int64:
        raise TypeError(f"offsets must be int64 (the kernels' offsets are), got {offsets.dtype}")
    if torch.is_tensor(seed):
        if seed.dtype != torch.int64:
            raise TypeError(f"a seed tensor must be int64, got {seed.dtype}")
        # the low and high words of each seed's uint64 (an arithmetic shift, then masked: two's complement)
        k0, k1 = seed & UINT32_MASK, (seed >> 32) & UINT32_MASK
    else:
        k0, k1 = split_seed(seed)
    c0 = offsets & UINT32_MASK
    c1 = (offsets >> 32).bitwise_and_(UINT32_MASK)   # arithmetic shift, then the low 32 bits: Triton's truncation
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(n_rounds):
        # Products of two uint32 in int64 wrap modulo 2**64; the bit pattern is the exact 64-bit
        # product, so its high word is (p >> 32) masked (the shift is arithmetic) and its low word
        # p masked. In-place where a word is consumed: this runs over every logit of a chunk. c0 and
        # c2 are masked each round (they are multiplied); c1 and c3 only enter XORs whose result is
        # masked, so they keep the whole product until the end: each elementwise op is one kernel
        # launch on a GPU, and the loop's launches, not its bytes, are its time there.
        p_b = c2.mul_(PHILOX_ROUND_B)
        p_a = c0.mul_(PHILOX_ROUND_A)
        c0 = (p_b >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(UINT32_MASK)
        c2 = (p_a >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(UINT32_MASK)
        c1, c3 = p_b, p_a
        k0 = (k0 + PHILOX_KEY_A) & UINT32_MASK
        k1 = (k1 + PHILOX_KEY_B) & UINT32_MASK
    if n_rounds:
        c1, c3 = c1.bitwise_and_(UINT32_MASK), c3.bitwise_and_(UINT32_MASK)
    return c0, c1, c2, c3


def philox_randint(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = N_ROUNDS) -> torch.Tensor:
    """`tl.randint(seed, offsets)`: uint32 values in an int64 tensor of `offsets`' shape."""
    return philox4x32(seed, offsets, n_rounds)[0]


def uint_to_uniform_float(x: torch.Tensor) -> torch.Tensor:
    """Triton's `uint_to_uniform_float` for uint32 draws (held in int64): float32 in [0, 1)."""
    # bit-cast to int32 and flip the negatives: x ≥ 2**31 becomes ~(x − 2**32) = 2**32 − 1 − x
    x = torch.where(x >= 2**31, UINT32_MASK - x, x)
    # int32 → float32 (round to nearest even), then one float32 product: x < 2**31, so the int64
    # → float32 conversion rounds exactly as Triton's int32 → float32 one does. The scale is the
    # float32 constant as a Python float: both factors are float32 values, so their exact product
    # (48 significant bits) rounded once to float32 is the float32 product, however the scalar is
    # carried (float32 or float64 opmath).
    return x.to(torch.float32).mul_(UNIFORM_SCALE_F32)


def philox_uniform(seed: int | torch.Tensor, offsets: torch.Tensor, n_rounds: int = N_ROUNDS) -> torch.Tensor:
    """`tl.rand(seed, offsets)`: float32 uniforms in [0, 1) of `offsets`' shape."""
    return uint_to_uniform_float(philox_randint(seed, offsets, n_rounds))


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """The kernels' Gumbel noise ``g = −log(−log u)`` of float32 uniforms, in float32, each log
    correctly rounded to float32.

    The kernels form ``l − T·log(−log u)`` in float32; −(T·c) and l + (−d) are exact negations, so
    ``l + T·g`` (T and l float32, one rounding per operation) is their number whenever their two
    logs round as these do. Float32 logs are not reproducible across libraries (here numpy's, the
    interpreter's, and torch's CPU float32 log each miss the correctly rounded result for several
    percent of the Philox uniforms, differently), so each log is taken in float64 and rounded once:
    the same float32 whichever float64 log computes it (numpy's and torch's CPU one agreed on every
    uniform `tl.rand` can return, both logs). The kernels' own float32 `tl.log` (numpy's under the
    interpreter, libdevice on GPU) may differ in the last bits (a few 1e-7 absolute in g), which
    moves a sample only when two scores are that close. u = 0 gives g = −inf (never chosen), as in
    the kernels.
    """
    first = torch.log(u.to(torch.float64)).to(torch.float32)            # log u, rounded to float32
    return -torch.log(-first.to(torch.float64)).to(torch.float32)       # −log(−log u), rounded


def grid_offsets(rows: torch.Tensor, width: int, cols: torch.Tensor) -> torch.Tensor:
    """int64 offsets ``row · width + col`` `[len(rows), len(cols)]`, the kernels' Philox counters
    (`rows` the logits rows, `cols` global columns)."""
    return rows.to(torch.int64)[:, None] * int(width) + cols.to(torch.int64)[None, :]
