"""Sparse-dLLM retention (`sparse=SparseConfig(...)`): the selection rule against a brute-force
reading of upstream's, what keeping everything means, padded batches, the kernel in the loop, and
argument errors. The token-for-token reproduction of upstream is in test_sparse_reference.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remask
from helpers import left_pad, random_prompt
from remask.caches.sparse import RetentionKVCache, retained_positions
from remask.zoo import charset, tasks


@pytest.fixture(scope="module")
def tiny_llada():
    return remask.load("tiny-llada")[0]


def _brute_force(q, k, start, end, ratio, pool, row, topk_ties=True):
    """Upstream's CustomCache.filter_cache for one row, spelled out position by position
    (`topk_ties=False`: remask's default order among equal scores, the earlier position first)."""
    T = k.shape[2]
    outside = [p for p in range(T) if not start <= p < end]
    group = q.shape[1] // k.shape[1]
    mean_q = q[row, :, start:end].mean(dim=-2)                                   # [Hq, D]
    keys = k[row].repeat_interleave(group, dim=0)[:, outside]                    # [Hq, N, D]
    importance = torch.stack([(keys[h] @ mean_q[h]) for h in range(q.shape[1])]).mean(0)
    if pool is not None:
        importance = F.max_pool1d(importance[None, None], pool, 1, pool // 2)[0, 0]
    n = int(len(outside) * ratio)
    if topk_ties:
        keep = torch.topk(importance, n).indices.tolist()
    else:
        keep = sorted(range(len(outside)), key=lambda i: (-float(importance[i]), i))[:n]
    return sorted(outside[i] for i in keep)


@pytest.mark.parametrize("topk_ties", [True, False])
@pytest.mark.parametrize("ratio,pool", [(0.5, 3), (0.3, None), (0.9, 5), (0.1, 3)])
def test_selection_matches_upstreams_rule(ratio, pool, topk_ties):
    g = torch.Generator().manual_seed(int(ratio * 10))
    q = torch.randn(2, 4, 29, 8, generator=g)
    k = torch.randn(2, 2, 29, 8, generator=g)
    positions, counts = retained_positions(q, k, 10, 16, ratio, pool, False, None, topk_ties=topk_ties)
    for row in range(2):
        got = sorted(positions[row, 0, :counts[row]].tolist())
        assert got == _brute_force(q, k, 10, 16, ratio, pool, row, topk_ties)
        assert not any(10 <= p < 16 for p in got)


def test_head_select_keeps_an_equal_budget_per_kv_head():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 30, 8, generator=g), torch.randn(1, 3, 30, 8, generator=g)
    positions, counts = retained_positions(q, k, 20, 26, 0.5, 3, True, None)
    assert positions.shape == (1, 3, 12) and int(counts[0]) == 12
    sets = [set(positions[0, h].tolist()) for h in range(3)]
    assert all(len(s) == 12 for s in sets) and len(set.union(*sets)) > 12   # heads choose differently


def test_pads_are_never_kept_and_rows_keep_what_they_keep_alone():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    alone, n_alone = retained_positions(q, k, 12, 16, 0.5, 3, False, None)
    # the same row behind 5 left pads (garbage K/Q there)
    pad = 5
    qp = torch.cat([torch.randn(1, 2, pad, 8, generator=g) * 50, q], dim=2)
    kp = torch.cat([torch.randn(1, 2, pad, 8, generator=g) * 50, k], dim=2)
    valid = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 20, dtype=torch.bool)], dim=1)
    padded, n_padded = retained_positions(qp, kp, 12 + pad, 16 + pad, 0.5, 3, False, valid)
    assert int(n_padded[0]) == int(n_alone[0])
    # the same positions in the same order: ties (pooled neighbours) go to the earlier position
    assert padded[0, 0, :n_padded[0]].tolist() == (alone[0, 0, :n_alone[0]] + pad).tolist()


def test_keeping_everything_from_the_block_start_is_the_dual_cache(tiny_llada):
    # retention 1.0 selected at step 0 keeps every K/V of the block-start forward: the dual cache.
    sparse = remask.SparseConfig(retention_ratio=1.0, delay_step=0)
    for problem in tasks.problems(14, tasks.EVAL_SEED):
        prompt = torch.tensor([charset.encode_chat(problem.prompt)])
        kw = dict(steps=16, gen_length=16, block_length=8)
        assert torch.equal(remask.generate(tiny_llada, prompt, sparse=sparse, **kw),
                           remask.generate(tiny_llada, prompt, use_cache="dual", **kw)), problem.prompt


def test_compacted_and_in_place_sparse_steps_agree(load_model, monkeypatch):
    # The torch path copies the kept K/V out once; the Triton path reads them in place through
    # token-level index lists. The block step's logits must agree (float tolerance: different
    # summation order), and both attend over exactly the kept positions and the block.
    model = load_model("llada_gqa_tied")
    x = torch.cat([random_prompt(1, 19, 0, high=990), torch.full((1, 12), 999)], dim=1)
    start, end = 19, 23
    x2 = x.clone()
    x2[0, start] = 5   # a token committed at the selection step

    def block_step():
        cache = RetentionKVCache(0.5, 3, False)
        cache.begin_select(start, end)
        model(x, past_key_values=cache, cache_position=torch.arange(x.shape[1]))
        cache.end_select()
        logits = model(x2[:, start:end], past_key_values=cache, cache_position=torch.arange(start, end)).logits
        return cache, logits

    compact, compact_logits = block_step()
    assert compact.kept_fraction < 0.75 and len(compact.compact) == len(compact.kept)
    for layer, (kept_k, _, mask) in compact.compact.items():
        assert kept_k.shape[2] == int(compact.kept_counts[layer][0]) and mask is None
    monkeypatch.setenv("REMASK_TRITON", "1")
    in_place, in_place_logits = block_step()
    assert not in_place.compact
    for layer in range(len(in_place.kept)):
        num, idx = in_place.lists[layer]
        listed = idx[0, 0, 0, :num[0, 0, 0]].tolist()
        assert listed[-(end - start):] == list(range(start, end))
        assert listed[:-(end - start)] == in_place.kept[layer][0, 0, :in_place.kept_counts[layer][0]].tolist()
    torch.testing.assert_close(in_place_logits, compact_logits, rtol=1e-5, atol=1e-5)


def test_padded_batch_rows_equal_solo_rows(load_model):
    model = load_model("llada_gqa_tied")
    rows = [random_prompt(1, n, n, high=990)[0] for n in (9, 14, 6)]
    ids, mask = left_pad(rows, 998)
    sparse = remask.SparseConfig(retention_ratio=0.4)
    kw = dict(steps=12, gen_length=12, block_length=4, sparse=sparse)
    batch = remask.generate(model, ids, mask, **kw)
    for i, row in enumerate(rows):
        solo = remask.generate(model, row[None], **kw)
        assert torch.equal(batch[i, -12:], solo[0, -12:]), i


def _same_tokens_with_the_kernel(model, prompt, kw, monkeypatch):
    """Decode with the torch path, then with the Triton kernel (interpreted on CPU): same tokens,
    and the kernel really ran. Returns the tokens."""
    import remask.kernels.sparse_attention as sparse_module

    want = remask.generate(model, prompt, **kw)
    calls = []
    real = sparse_module.block_sparse_attention_triton
    monkeypatch.setattr(sparse_module, "block_sparse_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("REMASK_TRITON", "1")
    assert torch.equal(remask.generate(model, prompt, **kw), want)
    assert calls
    return want


def test_triton_kernel_in_the_loop_gives_the_same_tokens(tiny_llada, monkeypatch):
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    kw = dict(steps=16, gen_length=16, block_length=8, sparse=remask.SparseConfig(retention_ratio=0.5))
    _same_tokens_with_the_kernel(tiny_llada, prompt, kw, monkeypatch)


def test_bad_sparse_arguments(tiny_llada):
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    kw = dict(steps=16, gen_length=16, block_length=8)
    for bad, match in [(dict(retention_ratio=0.0), "retention_ratio"), (dict(pool_kernel=4), "pool_kernel"),
                       (dict(delay_step=-1), "delay_step"), (dict(method="flex"), "method"),
                       (dict(block_len=16), "block_len"), (dict(kv_block_size=4), "kv_block_size")]:
        with pytest.raises(ValueError, match=match):
            remask.generate(tiny_llada, prompt, sparse=remask.SparseConfig(**bad), **kw)
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(tiny_llada, prompt, sparse=remask.SparseConfig(), use_cache="dual", **kw)
    with pytest.raises(TypeError, match="SparseConfig"):
        remask.generate(tiny_llada, prompt, sparse=dict(retention_ratio=0.5), **kw)


# --- SparseD block masks (method="block_mask") ---------------------------------------------------

def _block_mask(**kw):
    return remask.SparseConfig(method="block_mask", **{"retention_ratio": 0.3, "kv_block_size": 4, **kw})


def test_block_mask_before_its_selecting_step_is_dense(load_model):
    # skip_fraction 0.95 of 12 steps selects at step 12: never used, so dense decoding exactly.
    model = load_model("llada_small")
    for seed in range(3):
        prompt = random_prompt(1, 9 + 4 * seed, seed, high=290)
        kw = dict(steps=12, gen_length=12, block_length=4)
        assert torch.equal(remask.generate(model, prompt, sparse=_block_mask(skip_fraction=0.95), **kw),
                           remask.generate(model, prompt, **kw))


def test_keeping_every_block_is_dense_attention(load_model):
    # select 1.0 keeps int(n) + 1 ≥ n blocks: every key, so the tokens are dense decoding's.
    model = load_model("llada_small")
    for seed in range(3):
        prompt = random_prompt(1, 13 + seed, seed, high=290)
        kw = dict(steps=16, gen_length=16, block_length=8)
        assert torch.equal(remask.generate(model, prompt, sparse=_block_mask(retention_ratio=1.0), **kw),
                           remask.generate(model, prompt, **kw))


def test_corrected_scale_changes_the_selection():
    from remask.caches.sparse import sparsed_block_mask

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 40, 32, generator=g) * 2, torch.randn(1, 4, 40, 32, generator=g) * 2
    quirk = sparsed_block_mask(q, k, 4, 0.3, 16, 4 ** -0.5)        # 1/√n_heads, upstream
    corrected = sparsed_block_mask(q, k, 4, 0.3, 16, 32 ** -0.5)   # 1/√head_dim
    assert not torch.equal(quirk, corrected)
    for mask in (quirk, corrected):
        # every query block keeps int(n·0.3)+1 prompt-side picks (minus those cleared at `last`) and
        # int(n_gen·0.3)+1 generation blocks: at least one generation block per row
        assert bool(mask[..., 6:].any(dim=-1).all())


def test_block_mask_runs_gqa_and_the_kernel_in_the_loop(load_model, monkeypatch):
    # Upstream's mask construction needs MHA; remask repeats the KV heads for the selection.
    model = load_model("llada_gqa_tied")
    prompt = random_prompt(1, 11, 0, high=990)
    kw = dict(steps=8, gen_length=8, block_length=8, sparse=_block_mask(skip_fraction=0.0))
    want = _same_tokens_with_the_kernel(model, prompt, kw, monkeypatch)
    assert not (want == 999).any()


def test_block_mask_refuses_padded_batches(load_model):
    model = load_model("llada_small")
    ids, mask = left_pad([random_prompt(1, 5, 0, high=290)[0], random_prompt(1, 8, 1, high=290)[0]], 297)
    with pytest.raises(ValueError, match="block_mask"):
        remask.generate(model, ids, mask, steps=8, gen_length=8, block_length=8, sparse=_block_mask())
    with pytest.raises(ValueError, match="corrected_scale"):
        remask.generate(model, ids[:1], steps=8, gen_length=8, block_length=8, sparse=_block_mask(corrected_scale=1))
