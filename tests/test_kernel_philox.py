"""Device-independent seeds: `remask.kernels.philox` is Triton's Philox4x32-10 bit for bit, and a
seeded sample is the same through the torch references and the Triton kernels.

Under TRITON_INTERPRET=1 on CPU (conftest); shapes are small and odd. The dispatchers' switch
(``REMASK_TRITON`` 1 / 0) picks the path, so these compare exactly what callers get.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DEVICE
from remask.kernels.canvas import canvas_score, canvas_update
from remask.kernels.confidence import (combine_partials_triton, confidence, confidence_partials_triton,
                                       confidence_triton)
from remask.kernels.confidence_ref import combine_partials_torch, confidence_partials_torch
from remask.kernels.dispatch import HAS_TRITON
from remask.kernels.philox import (gumbel_from_uniform, philox4x32, philox_randint, philox_uniform,
                                   uint_to_uniform_float)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter on CPU)")

SEEDS = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 7, 2**40 + 3, 2**63 + 5, 2**64 - 1, -1, -2**31]
MODES = ("prob", "margin", "neg_entropy")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _philox_probe(seed, offsets_ptr, words_ptr, uniform_ptr, gumbel_ptr, n, BLOCK: tl.constexpr):
        """randint4x's four words (as int64), rand and the kernels' −log(−log u) at n offsets."""
        i = tl.arange(0, BLOCK)
        valid = i < n
        offs = tl.load(offsets_ptr + i, mask=valid, other=0)
        w0, w1, w2, w3 = tl.randint4x(seed, offs)
        tl.store(words_ptr + i, w0.to(tl.int64) & 0xFFFFFFFF, mask=valid)
        tl.store(words_ptr + n + i, w1.to(tl.int64) & 0xFFFFFFFF, mask=valid)
        tl.store(words_ptr + 2 * n + i, w2.to(tl.int64) & 0xFFFFFFFF, mask=valid)
        tl.store(words_ptr + 3 * n + i, w3.to(tl.int64) & 0xFFFFFFFF, mask=valid)
        tl.store(words_ptr + 4 * n + i, tl.randint(seed, offs).to(tl.int64) & 0xFFFFFFFF, mask=valid)
        u = tl.rand(seed, offs)
        tl.store(uniform_ptr + i, u, mask=valid)
        tl.store(gumbel_ptr + i, -tl.log(-tl.log(u)), mask=valid)


def _offsets() -> torch.Tensor:
    """An odd count of offsets: small ones, both sides of 2**31 and 2**32, large and negative int64."""
    special = [2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 999, 2**40 + 12345,
               2**62 + 7, 2**63 - 1, -1, -2**31, -2**63]
    rand = torch.randint(0, 2**62, (120,), generator=torch.Generator().manual_seed(3))
    return torch.cat([torch.arange(0, 37), torch.tensor(special), rand]).to(torch.int64)


def _probe(seed: int, offsets: torch.Tensor):
    """The probe kernel run on DEVICE at `offsets`; its words, uniforms and Gumbels back on CPU."""
    n = offsets.numel()
    words = torch.empty(5 * n, dtype=torch.int64, device=DEVICE)
    uniform = torch.empty(n, dtype=torch.float32, device=DEVICE)
    gumbel = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _philox_probe[(1,)](seed, offsets.to(DEVICE), words, uniform, gumbel, n, BLOCK=triton.next_power_of_2(n))
    return words.view(5, n).cpu(), uniform.cpu(), gumbel.cpu()


@pytest.mark.parametrize("seed", SEEDS)
def test_philox_is_triton_randint_and_rand_bit_for_bit(seed):
    """Every word of randint4x, randint and rand, for seeds of every integer kind Triton passes
    (int32, uint32, int64, uint64: the seed is taken modulo 2**64) and offsets across the 32-bit
    boundary (the high word is the counter's second word)."""
    offsets = _offsets()
    words, uniform, _ = _probe(seed, offsets)
    for k, word in enumerate(philox4x32(seed, offsets)):
        assert torch.equal(word, words[k]), (seed, k)
    assert torch.equal(philox_randint(seed, offsets), words[4])
    got = philox_uniform(seed, offsets)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), uniform.view(torch.int32))
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0


def test_seed_modulo_2_64_and_out_of_range():
    offsets = torch.arange(0, 11, dtype=torch.int64)
    assert torch.equal(philox_randint(-1, offsets), philox_randint(2**64 - 1, offsets))
    with pytest.raises(ValueError, match="seed"):
        philox_randint(2**64, offsets)
    with pytest.raises(TypeError, match="int64"):
        philox_randint(0, offsets.to(torch.int32))


def test_uniform_conversion_edges():
    """0 and the largest draws map as Triton's conversion does: [0, 1), symmetric in the sign bit."""
    x = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    u = uint_to_uniform_float(x)
    assert u[0] == 0 and u[-1] == 0 and u[1] == u[-2] and u[2] == u[3] and float(u[2]) < 1.0


def test_gumbel_is_the_kernels_up_to_their_last_bit_and_library_independent():
    """The shared Gumbel transform: float32 logs rounded correctly (numpy's float64 log rounded
    gives the same bits: no dependence on the library's float32 log), and within a few float32
    ulps of the kernel's own float32 `tl.log` (numpy's float32 log under the interpreter)."""
    offsets = torch.arange(0, 4001, dtype=torch.int64) * 7919 + 2**31 - 50
    _, uniform, kernel_gumbel = _probe(7, offsets)
    g = gumbel_from_uniform(uniform)
    u64 = uniform.numpy().astype(np.float64)
    with np.errstate(divide="ignore"):
        first = np.log(u64).astype(np.float32)
        want = -np.log(-first.astype(np.float64)).astype(np.float32)
    assert torch.equal(g, torch.from_numpy(want))
    finite = torch.isfinite(g)
    assert torch.equal(finite, torch.isfinite(kernel_gumbel))
    ulp = torch.finfo(torch.float32).eps * g[finite].abs().clamp_min(1.0)
    assert ((g[finite] - kernel_gumbel[finite]).abs() <= 8 * ulp).all()


def _paths(monkeypatch, fn):
    """fn() through the torch reference and through the Triton kernel (the dispatchers' switch)."""
    monkeypatch.setenv("REMASK_TRITON", "0")
    torch_out = fn()
    monkeypatch.setenv("REMASK_TRITON", "1")
    triton_out = fn()
    return torch_out, triton_out


def _logits(rows: int, V: int, dtype: torch.dtype, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V + 3, generator=g) * scale).to(dtype).to(DEVICE)[:, :V]   # strided rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_confidence_seeded_sample_is_the_kernels(monkeypatch, temperature, dtype):
    """Every mode: the same x0 through torch and Triton, for selected rows (offsets use the logits
    row), excluded / zero-probability ids, a large seed; and a sample that is not the argmax."""
    V = 999
    logits = _logits(9, V, dtype, 11)
    rows = torch.tensor([8, 0, 3, 5, 6, 1], device=DEVICE)
    for mode in MODES:
        for seed in (17, 2**40 + 1):
            kw = dict(temperature=temperature, mode=mode, rows=rows, seed=seed, suppress_ids=[4],
                      exclude_ids=[998, 12], zero_prob_ids=[500])
            (x_t, c_t), (x_k, c_k) = _paths(monkeypatch, lambda: confidence(logits, **kw))
            assert torch.equal(x_t.cpu(), x_k.cpu()), (mode, seed, x_t, x_k)
            torch.testing.assert_close(c_t.double().cpu(), c_k.double().cpu(), atol=4e-5, rtol=1e-5)
    monkeypatch.setenv("REMASK_TRITON", "0")
    sampled = confidence(logits, temperature=temperature, seed=17)[0]
    assert not torch.equal(sampled, logits.float().argmax(1))   # the draws decide, not the logits alone
    assert not torch.equal(sampled, confidence(logits, temperature=temperature, seed=18)[0])


def test_confidence_split_vocabulary_keeps_the_draws(monkeypatch):
    """Several chunks and splits per row (block 128): the same offsets, the same x0 as torch."""
    logits = _logits(5, 1001, torch.float32, 12)
    monkeypatch.setenv("REMASK_TRITON", "0")
    want = confidence(logits, temperature=1.3, seed=99)[0]
    got = confidence_triton(logits, temperature=1.3, seed=99, num_splits=3, block=128)[0]
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_vocab_shards_draw_the_unsharded_calls_noise(monkeypatch, world, temperature):
    """Tensor parallel: shards draw at global offsets, so torch shards, Triton shards, and the
    unsharded torch and Triton calls all pick the same tokens."""
    V = 1001
    logits = _logits(7, V, torch.float32, 20 + world)
    rows = torch.tensor([6, 1, 2, 4], device=DEVICE)
    kw = dict(temperature=temperature, mode="margin", rows=rows, seed=2**31 - 1, argmax_ids=[7, 600],
              softmax_ids=[3])
    bounds = [round(V * r / world) for r in range(world + 1)]
    shards = list(zip(bounds[:-1], bounds[1:]))
    monkeypatch.setenv("REMASK_TRITON", "0")
    want = confidence(logits, temperature=temperature, mode="margin", rows=rows, seed=2**31 - 1,
                      suppress_ids=[], exclude_ids=[7, 600], zero_prob_ids=[3])[0]
    for partials, combine, extra in ((confidence_partials_torch, combine_partials_torch, {}),
                                     (confidence_partials_triton, combine_partials_triton, dict(num_splits=2))):
        parts = [partials(logits[:, a:b], vocab_start=a, vocab_size=V, **kw, **extra) for a, b in shards]
        got = combine(torch.cat([p for p, _ in parts], 2), torch.cat([i for _, i in parts], 1), "margin")[0]
        assert torch.equal(got.cpu(), want.cpu()), (partials.__name__, got, want)
    assert torch.equal(confidence_triton(logits, **kw)[0].cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_canvas_score_seeded_sample_is_the_kernels(monkeypatch, temperature, dtype):
    logits = _logits(7, 999, dtype, 30, scale=2.0)
    T = torch.tensor(temperature)
    for seed in (5, 2**33 + 9):
        got_t, got_k = _paths(monkeypatch, lambda: canvas_score(logits, T, seed=seed))
        assert torch.equal(got_t[0].cpu(), got_k[0].cpu()), (seed, got_t[0], got_k[0])
        assert torch.equal(got_t[1].cpu(), got_k[1].cpu())
    assert not torch.equal(got_t[0], got_t[1])   # some sample is not the argmax: the draws decide


def test_canvas_update_renoise_tokens_are_the_kernels(monkeypatch):
    B, L, V = 3, 29, 1001
    g = torch.Generator().manual_seed(4)
    entropy = (torch.rand(B, L, generator=g) * 0.5).to(DEVICE)
    sample = torch.randint(0, V, (B, L), generator=g).to(DEVICE)
    for seed in (0, 77, 2**32 + 3):
        (c_t, a_t), (c_k, a_k) = _paths(monkeypatch, lambda: canvas_update(sample, entropy, 1.0, vocab_size=V,
                                                                           seed=seed))
        assert torch.equal(a_t.cpu(), a_k.cpu()) and torch.equal(c_t.cpu(), c_k.cpu()), seed
        assert 0 < int(a_t.sum()) < B * L   # some positions renoised, some accepted
        offsets = torch.arange(B, device=DEVICE)[:, None] * L + torch.arange(L, device=DEVICE)
        assert torch.equal(c_t[~a_t], (philox_randint(seed, offsets) % V)[~a_t])
