"""The tiny checkpoints carry the released `config.json` / `generation_config.json` key for key
(models/official/: only sizes, special ids and the values listed in models/tiny.py differ), and
every family loads from such a folder through transformers' Auto classes without remote code."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import transformers

from remask.models import tiny

# family -> (writer, official file stem, keys the tiny adds (ids the release keeps outside config.json))
FAMILIES = {
    "llada": (tiny.write_tiny_llada, "llada", set()),
    "dream": (tiny.write_tiny_dream, "dream", set()),
    "sdar": (tiny.write_tiny_sdar, "sdar", {"block_size", "mask_token_id"}),
    "sdar_moe": (tiny.write_tiny_sdar_moe, "sdar_moe", {"block_size", "mask_token_id"}),
    "llada2": (tiny.write_tiny_llada2, "llada2", {"eos_token_id", "mask_token_id"}),
    "fast_dllm_v2": (tiny.write_tiny_fast_dllm_v2, "fast_dllm_v2", {"mask_token_id"}),
}


def _official(stem: str, kind: str) -> dict | None:
    path = os.path.join(tiny.OFFICIAL_DIR, f"{stem}.{kind}.json")
    return json.load(open(path)) if os.path.exists(path) else None


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("official")
    folders = {}
    for family, (writer, _, _) in FAMILIES.items():
        folders[family] = str(root / family)
        writer(folders[family])
    return folders


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_keys_are_the_released_ones(written, family):
    _, stem, added = FAMILIES[family]
    for kind in ("config", "generation_config"):
        official = _official(stem, kind)
        path = os.path.join(written[family], f"{kind}.json")
        if official is None:   # the release ships none (LLaDA2): neither does the tiny
            assert not os.path.exists(path), f"{family}: the release has no {kind}.json"
            continue
        mine = json.load(open(path))
        assert set(mine) == set(official) | (added if kind == "config" else set()), (family, kind)
        # values: sizes, ids and dtype shrink; structure (auto_map, architectures, model_type) is the release's
        for key in ("architectures", "auto_map", "model_type", "attn_implementation"):
            if key in official:
                assert mine[key] == official[key], (family, key)


def test_sdar_release_config_names_flex_attention():
    # the released SDAR-4B config that broke loading: the tiny keeps that key and its value
    assert tiny.SDAR_DEFAULTS["attn_implementation"] == "flex_attention"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loads_through_auto_classes_without_remote_code(written, family):
    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        model = auto.from_pretrained(written[family])   # no trust_remote_code
        assert type(model).__module__.startswith("remask.models"), type(model)
        assert next(model.parameters()).dtype == torch.float32
    assert transformers.AutoConfig.from_pretrained(written[family]).model_type.lower() == \
        json.load(open(os.path.join(written[family], "config.json")))["model_type"].lower()


def test_diffusion_gemma_generation_config_is_the_released_one(tmp_path):
    pytest.importorskip("transformers.models.diffusion_gemma")
    tiny.write_tiny_diffusion_gemma(str(tmp_path))
    official = _official("diffusion_gemma", "generation_config")
    mine = json.load(open(tmp_path / "generation_config.json"))
    assert set(official) - {"transformers_version"} <= set(mine)
    for key in ("max_denoising_steps", "t_min", "t_max", "confidence_threshold", "stability_threshold",
                "sampler_config", "max_new_tokens"):
        assert mine[key] == official[key], key
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path))
    assert model.config.canvas_length == 8


def _without_attn_key(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    del config["attn_implementation"]
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=2)
    return str(dst)


def test_sdar_release_config_decodes_as_before(written, tmp_path, caplog):
    """An SDAR folder with the released keys (`attn_implementation: flex_attention`) loads with a
    one-line notice and decodes token for token as the same weights without that key."""
    from remask.compat.sdar import block_diffusion_generate
    from remask.models import registry

    registry._NOTIFIED.clear()
    with caplog.at_level(logging.WARNING, logger="remask.models"):
        released = transformers.AutoModelForCausalLM.from_pretrained(written["sdar"]).eval()
    notices = [r.getMessage() for r in caplog.records if r.name == "remask.models"]
    assert len(notices) == 1 and "flex_attention" in notices[0] and "sdpa" in notices[0]
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        _without_attn_key(written["sdar"], tmp_path / "plain")).eval()
    prompt = {"input_ids": torch.randint(0, 290, (1, 7), generator=torch.Generator().manual_seed(0))}
    for strategy in ("low_confidence_static", "low_confidence_dynamic"):
        kw = dict(mask_id=299, gen_length=12, block_length=4, denoising_steps=4, remasking_strategy=strategy,
                  confidence_threshold=0.5, temperature=1.0)
        a = block_diffusion_generate(released, prompt, **kw, generator=torch.Generator().manual_seed(1))
        b = block_diffusion_generate(plain, prompt, **kw, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a, b)
        a = block_diffusion_generate(released, prompt, **{**kw, "temperature": 0.0})
        b = block_diffusion_generate(plain, prompt, **{**kw, "temperature": 0.0})
        assert torch.equal(a, b)
        assert not (a[:, 7:] == 299).any()


@pytest.mark.parametrize("family", ["llada", "dream", "fast_dllm_v2", "llada2"])
def test_unoffered_attn_implementation_falls_back(written, tmp_path, family):
    """Any family's config.json naming an attention implementation remask does not offer loads (SDPA)."""
    import shutil

    dst = tmp_path / family
    shutil.copytree(written[family], dst)
    config = json.load(open(dst / "config.json"))
    config["attn_implementation"] = "flash_attention_2"
    json.dump(config, open(dst / "config.json", "w"), indent=2)
    model = transformers.AutoModel.from_pretrained(str(dst))
    assert model.config._attn_implementation in (None, "sdpa", "eager")
