"""The fused confidence kernel against its float64 torch reference, and that reference against the
definitions (whole-tensor float64 softmax; LLaDA's formulation).

On machines without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (set in conftest), so
shapes stay small and odd. Outputs and workspaces are NaN-poisoned (`poisoned_outputs`).
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels import confidence
from remask.kernels.confidence import confidence_config, confidence_triton
from remask.kernels.confidence_ref import confidence_reference_formulation, confidence_torch

# Confidence tolerance per logits dtype: the kernel accumulates in float32 either way (the inputs
# are upcast exactly), so the error is float32 summation error over V terms.
ATOL = {torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6}
MODES = ("prob", "margin", "neg_entropy")


def _logits(rows, V, dtype, seed, *, row_pad=0, scale=3.0):
    """`[rows, V]` logits, optionally a strided view (row stride V + row_pad) into a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, V + row_pad, generator=g) * scale
    return base.to(dtype).to(DEVICE)[:, :V]


def _check_pair(got, want, dtype, mode):
    x0, conf = got
    x0_ref, conf_ref = want
    assert torch.equal(x0.cpu(), x0_ref.cpu()), (x0, x0_ref)
    assert not torch.isnan(conf).any()
    tol = ATOL[dtype] * (20 if mode == "neg_entropy" else 1)  # |Σ p log p| grows like log V
    torch.testing.assert_close(conf.double().cpu(), conf_ref.double().cpu(), atol=tol, rtol=1e-5)


# every dtype at V = 1000; the larger block of V > 2048 once (the interpreter's cost grows with V)
@pytest.mark.parametrize("V, dtype", [(1000, torch.float32), (1000, torch.float16), (1000, torch.bfloat16),
                                      (4099, torch.float32)], ids=["1000-f32", "1000-f16", "1000-bf16", "4099-f32"])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_matches_reference(poisoned_outputs, mode, V, dtype):
    seed = V + MODES.index(mode)
    n = int(torch.randint(1, 38, (), generator=torch.Generator().manual_seed(seed)))
    logits = _logits(n, V, dtype, seed, row_pad=13)
    assert logits.stride(0) == V + 13  # strided rows, read in place
    suppress = [0, V - 1, 17]
    want = confidence_torch(logits, mode=mode, argmax_ids=suppress, softmax_ids=suppress)
    # several chunks per program and several programs per row (vocabulary split + combine kernel)
    small = 256 if V < 2048 else 1024
    for block, splits in ((None, None), (small, 1), (small, 3)):
        got = confidence_triton(logits, mode=mode, argmax_ids=suppress, softmax_ids=suppress, block=block,
                                num_splits=splits)
        _check_pair(got, want, dtype, mode)
        assert not bool(torch.isin(got[0].cpu(), torch.tensor(suppress)).any())


@pytest.mark.parametrize("mode", MODES)
def test_row_selection_reads_only_the_named_rows(poisoned_outputs, mode):
    logits = _logits(37, 1000, torch.float32, 11)
    rows = torch.tensor([36, 0, 5, 5, 20], device=DEVICE)
    want = confidence_torch(logits[rows.cpu().tolist()], mode=mode)
    for splits in (1, 3):
        _check_pair(confidence_triton(logits, mode=mode, rows=rows, block=256, num_splits=splits), want,
                    torch.float32, mode)
    _check_pair(confidence_torch(logits, mode=mode, rows=rows), want, torch.float32, mode)


@pytest.mark.parametrize("temperature, dtype", [(0.3, torch.float32), (2.5, torch.float32), (1.0, torch.bfloat16)],
                         ids=["0.3-f32", "2.5-f32", "1.0-bf16"])
def test_injected_noise_gives_the_reference_sample(poisoned_outputs, temperature, dtype):
    logits = _logits(9, 1021, dtype, 7, scale=1.0)   # 9 rows: one program per row (and split) is slow interpreted
    noise = torch.rand(9, 1021, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    for mode in MODES:
        want = confidence_torch(logits, temperature=temperature, mode=mode, noise=noise)
        for splits in (1, 4):
            got = confidence_triton(logits, temperature=temperature, mode=mode, noise=noise, block=256,
                                    num_splits=splits)
            _check_pair(got, want, dtype, mode)
    # sampling really happened: not every row kept its argmax
    assert not torch.equal(want[0], logits.float().argmax(-1))


def test_ties_go_to_the_lowest_index_across_chunks_and_splits(poisoned_outputs):
    V = 1000
    logits = torch.zeros(4, V)
    logits[0, [700, 3, 999]] = 5.0   # the max at 3 (first chunk) and in later splits
    logits[1, [999, 600]] = 5.0      # both in late chunks
    logits[2] = torch.arange(V) % 7  # many ties, integer valued
    logits[3, 0] = 1.0
    logits = logits.to(DEVICE)
    for mode in MODES:
        want = confidence_torch(logits, mode=mode)
        assert want[0].tolist()[:2] == [3, 600]
        for splits in (1, 2, 8):
            _check_pair(confidence_triton(logits, mode=mode, block=128, num_splits=splits), want, torch.float32, mode)
    _, margin = confidence_triton(logits, mode="margin", block=128, num_splits=8)
    assert margin[0].item() == 0.0 and margin[1].item() == 0.0  # two equal maxima: p1 − p2 = 0


def test_exclude_and_zero_prob_ids(poisoned_outputs):
    logits = _logits(9, 1000, torch.float32, 3)
    top = logits.argmax(-1)
    exclude = [int(top[0])]
    zero = [int(top[1])]
    for splits in (1, 3):
        x0, conf = confidence_triton(logits, argmax_ids=exclude, softmax_ids=zero, block=256, num_splits=splits)
        want = confidence_torch(logits, argmax_ids=exclude, softmax_ids=zero)
        _check_pair((x0, conf), want, torch.float32, "prob")
    assert int(x0[0]) != exclude[0] and int(x0[1]) == zero[0] and conf[1].item() == 0.0
    # an excluded token keeps its probability mass (the zero-probability token does not)
    p = torch.softmax(logits[0].double().index_fill(0, torch.tensor(zero, device=DEVICE), -torch.inf), -1)
    assert conf[0].item() == pytest.approx(p[x0[0]].item(), rel=1e-5)


def test_philox_noise_is_deterministic_and_indexed_by_logits_row(poisoned_outputs):
    logits = _logits(16, 1000, torch.float32, 5, scale=0.5)
    a = confidence_triton(logits, temperature=1.0, seed=123, num_splits=2)
    b = confidence_triton(logits, temperature=1.0, seed=123)
    assert torch.equal(a[0], b[0])  # offsets are row·V + col, whatever the split
    rows = torch.tensor([15, 2, 9], device=DEVICE)
    c = confidence_triton(logits, temperature=1.0, seed=123, rows=rows)
    assert torch.equal(c[0], a[0][rows])
    d = confidence_triton(logits, temperature=1.0, seed=124)
    assert not torch.equal(d[0], a[0])


def test_philox_sampling_follows_the_tempered_softmax():
    """Gumbel-max with the kernel's stream samples softmax(l / T) (frequency test): the kernel draws what the torch
    path draws from the same seed (on the first rows: one program per row is slow under the interpreter), and the
    torch path's draws over many rows follow the tempered softmax."""
    V, n, T, kernel_rows = 7, 500, 0.8, 40
    row = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -3.0, 1.5])
    logits = row.expand(n, V).contiguous().to(DEVICE)
    x0, _ = confidence_torch(logits, temperature=T, seed=2024)
    freq = torch.bincount(x0.cpu(), minlength=V).double() / n
    expect = torch.softmax(row.double() / T, -1)
    assert torch.nn.functional.cosine_similarity(freq, expect, dim=0) > 0.99
    torch.testing.assert_close(freq, expect, atol=0.05, rtol=0)
    kernel = confidence_triton(logits[:kernel_rows], temperature=T, seed=2024)
    assert torch.equal(kernel[0].cpu(), x0[:kernel_rows].cpu())


def test_dispatch_forced_triton_and_forced_torch(monkeypatch):
    logits = _logits(5, 1000, torch.float16, 9)
    monkeypatch.setenv("REMASK_TRITON", "1")
    x_t, c_t = confidence(logits, mode="margin", suppress_ids=[4], exclude_ids=[5])
    monkeypatch.setenv("REMASK_TRITON", "0")
    x_r, c_r = confidence(logits, mode="margin", suppress_ids=[4], exclude_ids=[5])
    assert c_r.dtype == torch.float32 and c_t.dtype == torch.float32
    _check_pair((x_t, c_t), (x_r, c_r.double()), torch.float16, "margin")
    monkeypatch.setenv("REMASK_TRITON", "2")
    with pytest.raises(ValueError, match="REMASK_TRITON"):
        confidence(logits)


def test_reference_matches_the_definitions():
    """The float64 torch path against whole-tensor float64 softmax and LLaDA's formulation."""
    logits = _logits(12, 1000, torch.bfloat16, 4).cpu()
    l64 = logits.double()
    p = torch.softmax(l64, -1)
    x0, conf = confidence_torch(logits)
    assert torch.equal(x0, l64.argmax(-1))
    torch.testing.assert_close(conf, p.gather(1, x0[:, None])[:, 0], rtol=1e-12, atol=0)
    top2 = p.topk(2).values
    torch.testing.assert_close(confidence_torch(logits, mode="margin")[1], top2[:, 0] - top2[:, 1], rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(confidence_torch(logits, mode="neg_entropy")[1], torch.special.xlogy(p, p).sum(-1),
                               rtol=1e-10, atol=1e-12)
    noise = torch.rand(12, 1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for T in (0.0, 0.5, 1.0):
        x_ref, c_ref = confidence_reference_formulation(logits, temperature=T, noise=noise)
        x0, conf = confidence_torch(logits, temperature=T, noise=noise)
        assert torch.equal(x0, x_ref)
        torch.testing.assert_close(conf, c_ref, rtol=1e-12, atol=0)


def test_torch_path_works_in_chunks(monkeypatch):
    import remask.kernels.confidence_ref as ref
    logits = _logits(10, 1000, torch.float32, 2).cpu()
    whole = confidence_torch(logits, mode="neg_entropy")
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 3000)  # 3 rows at a time
    chunked = confidence_torch(logits, mode="neg_entropy")
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_config_is_a_function_of_the_shape():
    block, split_blocks, splits, _ = confidence_config(32, 126464, 132)  # an H100's 132 SMs
    assert block == 4096 and splits * split_blocks * block >= 126464 and 32 * splits >= 132  # few rows: split V
    assert confidence_config(1024, 126464, 132)[2] == 1  # many rows fill the device on their own
    assert confidence_config(3, 1000, 132)[:3] == (1024, 1, 1)


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.zeros(3, 4, 5)), "2-D"),
    (dict(logits=torch.zeros(3, 5, dtype=torch.float64)), "dtype"),
    (dict(logits=torch.zeros(5, 3).t()), "contiguous"),
    (dict(mode="max"), "mode"),
    (dict(temperature=-1.0), "temperature"),
    (dict(rows=torch.tensor([0, 3])), "rows"),
    (dict(rows=torch.tensor([[0]])), "rows"),
    (dict(noise=torch.rand(2, 5), temperature=1.0), "noise"),
])
def test_bad_input_names_the_parameter(bad, match):
    kwargs = dict(logits=torch.zeros(3, 5))
    kwargs.update(bad)
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        confidence(kwargs.pop("logits"), **kwargs)


def _shards(V, world):
    chunk = -(-V // world)   # torch.chunk's split, as a Shard(-1) DTensor holds it
    return [(min(r * chunk, V), min((r + 1) * chunk, V)) for r in range(world)]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_vocab_shards_combine_to_the_unsharded_result(poisoned_outputs, world, mode, temperature):
    """Tensor parallel scoring: each rank's partial state over its columns, merged in rank order,
    is the unsharded call — same x0 (ties to the lowest id across shards, ids and noise global),
    same confidence — for the float64 torch path and for the kernel."""
    from remask.kernels.confidence import combine_partials_triton, confidence_partials_triton
    from remask.kernels.confidence_ref import combine_partials_torch, confidence_partials_torch

    V = 1001
    logits = _logits(9, V, torch.float32, 40 + world)
    logits[2, 5] = logits[2, 900] = 40.0   # an exact tie between the first and the last shard
    rows = torch.tensor([0, 2, 3, 8], device=DEVICE)
    ids = dict(argmax_ids=[7, 600], softmax_ids=[3, 999])
    kw = dict(temperature=temperature, mode=mode, rows=rows, seed=5, **ids)
    shards = _shards(V, world)
    for partials, combine, whole in ((confidence_partials_torch, combine_partials_torch, confidence_torch),
                                     (confidence_partials_triton, combine_partials_triton, confidence_triton)):
        extra = {} if partials is confidence_partials_torch else dict(num_splits=2, block=128)
        parts = [partials(logits[:, a:b], vocab_start=a, vocab_size=V, **kw, **extra) for a, b in shards]
        got = combine(torch.cat([p for p, _ in parts], 2), torch.cat([i for _, i in parts], 1), mode)
        want = whole(logits, **kw)
        assert torch.equal(got[0].cpu(), want[0].cpu()), (partials.__name__, got[0], want[0])
        torch.testing.assert_close(got[1].double().cpu(), want[1].double().cpu(), atol=1e-6, rtol=1e-6)
    if temperature == 0:
        assert int(want[0][1]) == 5


def test_an_empty_vocab_shard_takes_no_part():
    """More ranks than vocabulary chunks: the last rank holds no column and reports nothing."""
    from remask.kernels.confidence_ref import combine_partials_torch, confidence_partials_torch

    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    parts = [confidence_partials_torch(logits[:, a:b], vocab_start=a, vocab_size=4, mode="margin")
             for a, b in _shards(4, 3)]
    assert parts[-1][0].shape == (6, 3, 1) and int(parts[-1][1][0, 0]) == 2**31 - 1
    got = combine_partials_torch(torch.cat([p for p, _ in parts], 2), torch.cat([i for _, i in parts], 1), "margin")
    want = confidence_torch(logits, mode="margin")
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
