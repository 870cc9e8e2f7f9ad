"""`import remask` stays light (no torch, no transformers: remask/_registration.py registers the
families when transformers' Auto classes are imported), and what it used to do eagerly still holds
in a fresh process: official-format checkpoints load through the Auto classes without remote code,
whatever the order of the imports, and every public name resolves."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from remask.models import tiny


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_remask_imports_neither_torch_nor_transformers():
    out = json.loads(_run("""
        import json, sys
        import remask
        print(json.dumps([m for m in ("torch", "transformers", "transformers.modeling_utils", "remask.models",
                                      "remask.diffusion", "remask.engine") if m in sys.modules]))
    """))
    assert out == []


def test_remask_models_registers_configs_without_the_model_classes():
    """`remask.models` imports the config classes only; a family module (its model classes, which
    import `transformers.modeling_utils`) comes with the first config of it."""
    out = json.loads(_run("""
        import json, sys
        import remask.models
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        before = "transformers.modeling_utils" in sys.modules
        registered = all(t in CONFIG_MAPPING for t in ("llada", "Dream", "sdar", "sdar_moe", "llada2_moe",
                                                       "Fast_dLLM_Qwen"))
        remask.models.LLaDAConfig(d_model=32, n_heads=2, n_layers=1)
        print(json.dumps([before, registered, "remask.models.llada" in sys.modules,
                          "remask.models.dream" in sys.modules]))
    """))
    assert out == [False, True, True, False]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("imports")
    tiny.write_tiny_llada(str(root / "llada"), vocab_size=1000, embedding_size=1000, mask_token_id=999,
                          eos_token_id=998, pad_token_id=997)
    tiny.write_tiny_fast_dllm_v2(str(root / "fast_dllm_v2"))
    return root


@pytest.mark.parametrize("order", ["remask first", "transformers first", "auto classes first"])
def test_auto_classes_load_official_checkpoints_after_import_remask(checkpoints, order):
    """A fresh process: LLaDA through `AutoModel`, Fast-dLLM v2 (a Qwen2 configuration subclass)
    through `AutoModelForCausalLM`, no `trust_remote_code`; remask imported before transformers,
    after it, or after its Auto classes."""
    head = {"remask first": "import remask\nimport transformers",
            "transformers first": "import transformers\nimport remask",
            "auto classes first": "from transformers import AutoModel\nimport remask"}[order]
    out = json.loads(_run(head + f"""
import json, sys
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
import remask.models
assert "remask.models.llada" not in sys.modules
llada = AutoModel.from_pretrained({str(checkpoints / "llada")!r})
fast = AutoModelForCausalLM.from_pretrained({str(checkpoints / "fast_dllm_v2")!r})
print(json.dumps([type(AutoConfig.from_pretrained({str(checkpoints / "llada")!r})).__name__,
                  isinstance(llada, remask.models.LLaDAModelLM), type(fast).__name__,
                  remask.get_spec(llada).kind, remask.get_spec(fast).attention]))
"""))
    assert out == ["LLaDAConfig", True, "FastDLLMV2ForCausalLM", "llada", "block-causal"]


def test_public_names_and_families_resolve_on_demand():
    out = json.loads(_run("""
        import json, sys
        import remask, remask.models
        missing = [n for n in remask.__all__ if getattr(remask, n, None) is None]
        missing += [n for n in remask.models.__all__ if getattr(remask.models, n, None) is None]
        assert set(remask.__all__) <= set(dir(remask)) and set(remask.models.__all__) <= set(dir(remask.models))
        print(json.dumps([missing, remask.diffusion.llada.__name__, sorted(remask.models.FAMILIES)]))
    """))
    assert out[0] == [] and out[1] == "remask.diffusion.families.llada"   # the flat name, its room's module
    assert out[2] == ["diffusion_gemma", "dream", "fast_dllm_qwen", "llada", "llada2_moe", "sdar", "sdar_moe"]


def test_family_of_imports_a_family_module_on_demand():
    out = json.loads(_run("""
        import json, sys
        from remask.models import family_of
        loaded = "remask.models.sdar" in sys.modules
        family = family_of("SDAR_MOE")
        print(json.dumps([loaded, family.model_type, family.model_class.__name__,
                          family_of("diffusion_gemma").load_class, family_of("llama")]))
    """))
    assert out == [False, "sdar_moe", "SDARMoeForCausalLM", "AutoModelForImageTextToText", None]
