"""`import remask` stays light (no torch, no transformers), with no import hooks: remask's families
are registered with transformers' Auto classes by plain `register` calls when `remask.models` is
imported, which the first use of any public name of `remask` does. In a fresh process official-format
checkpoints load through the Auto classes without remote code, whatever the order of the imports,
and every public name resolves. The layers' import contracts (pyproject.toml) hold."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib

import pytest

from remask.models import tiny


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def one_fresh_process() -> dict:
    """One fresh interpreter that imports in the order a user does, recording at each stage what the tests
    below check (one process instead of one each: every start pays torch's and transformers' import)."""
    return json.loads(_run("""
        import importlib.util, json, sys
        hooks_before = list(sys.meta_path)
        import remask
        light = [m for m in ("torch", "transformers", "transformers.modeling_utils", "remask.models",
                             "remask.diffusion", "remask.engine") if m in sys.modules]
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        registered = ["llada" in CONFIG_MAPPING, "remask.models" in sys.modules]
        remask.GenerationStats
        registered += ["llada" in CONFIG_MAPPING, "Dream" in CONFIG_MAPPING]
        from remask.models import family_of
        loaded = "remask.models.sdar" in sys.modules
        family = family_of("SDAR_MOE")
        families = [loaded, family.model_type, family.model_class.__name__, family_of("diffusion_gemma").load_class,
                    family_of("llama")]
        import remask.models, remask.diffusion, remask.engine
        added = [type(f).__module__ for f in sys.meta_path
                 if f not in hooks_before and type(f).__module__.startswith("remask")]
        flat = [n for n in ("remask.diffusion.llada", "remask.diffusion.stepper", "remask.diffusion.dinfer")
                if n in sys.modules or importlib.util.find_spec(n) is not None]
        aliases = [n for n, m in sys.modules.items() if n.startswith("remask.") and getattr(m, "__name__", n) != n]
        missing = [n for n in remask.__all__ if getattr(remask, n, None) is None]
        missing += [n for n in remask.models.__all__ if getattr(remask.models, n, None) is None]
        assert set(remask.__all__) <= set(dir(remask)) and set(remask.models.__all__) <= set(dir(remask.models))
        print(json.dumps(dict(light=light, registered=registered, families=families, hooks=[added, flat, aliases],
                              missing=missing, llada=remask.diffusion.families.llada.__name__,
                              family_names=sorted(remask.models.FAMILIES))))
    """))


def test_import_remask_imports_neither_torch_nor_transformers(one_fresh_process):
    assert one_fresh_process["light"] == []


def test_import_hooks_and_flat_names_are_gone(one_fresh_process):
    assert one_fresh_process["hooks"] == [[], [], []]


def test_import_remask_registers_nothing_until_a_name_is_used(one_fresh_process):
    """Bare `import remask` does not register (it imports no transformers); the first public name
    used imports `remask.models`, which does."""
    assert one_fresh_process["registered"] == [False, False, True, True]


def test_remask_help_imports_no_heavy_module():
    """`remask --help` stays fast (issue 44: under 0.5 s) because it imports neither torch, transformers,
    triton nor the decoding core; that is what is asserted here (a timed assert would fail on a loaded
    machine). The time itself: `python bench/cli_startup.py`."""
    out = json.loads(_run("""
        import contextlib, io, json, sys
        from remask.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):
            main(["--help"])
        heavy = ("torch", "transformers", "triton", "remask.diffusion", "remask.engine")
        print(json.dumps([[m for m in heavy if m in sys.modules], "usage" in shown.getvalue()]))
    """))
    assert out == [[], True]
    exe = os.path.join(os.path.dirname(sys.executable), "remask")
    _timed([exe, "--help"])   # the installed console script runs


def _timed(argv: list) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - start


def test_import_contracts_hold(tmp_path):
    """pyproject.toml's [tool.importlinter] contracts: the layers import only downwards, no cycles
    between a package's modules. grimp finds a package's modules by walking its folder, and
    `remask.diffusion`, `remask.models` and `remask.kernels` live outside remask/ (package-dir), so
    `lint-imports` runs over a view: a remask/ folder of links to the installed layout."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    view = tmp_path / "remask"
    view.mkdir()
    for name in os.listdir(os.path.join(root, package_dir["remask"])):
        if name != "__pycache__":
            os.symlink(os.path.join(root, package_dir["remask"], name), view / name)
    for package, folder in package_dir.items():
        parts = package.split(".")
        if len(parts) == 2 and not (view / parts[1]).exists():
            os.symlink(os.path.join(root, folder), view / parts[1])
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([exe, os.path.join(root, "pyproject.toml"), "--no-cache"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Analyzed" in done.stdout and " 0 broken" in done.stdout


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
    through `AutoModelForCausalLM`, no `trust_remote_code`, once `remask.models` is imported; remask
    imported before transformers, after it, or after its Auto classes. `remask.models` registers every
    family's config class and imports no model class (not even `transformers.modeling_utils`): a family's
    module comes with the first config of it, and only that family's."""
    head = {"remask first": "import remask\nimport transformers",
            "transformers first": "import transformers\nimport remask",
            "auto classes first": "from transformers import AutoModel\nimport remask"}[order]
    out = json.loads(_run(head + f"""
import json, sys
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
import remask.models
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
assert "remask.models.llada" not in sys.modules
registered = ["transformers.modeling_utils" in sys.modules,
              all(t in CONFIG_MAPPING for t in ("llada", "Dream", "sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"))]
llada = AutoModel.from_pretrained({str(checkpoints / "llada")!r})
fast = AutoModelForCausalLM.from_pretrained({str(checkpoints / "fast_dllm_v2")!r})
print(json.dumps([type(AutoConfig.from_pretrained({str(checkpoints / "llada")!r})).__name__,
                  isinstance(llada, remask.models.LLaDAModelLM), type(fast).__name__,
                  remask.get_spec(llada).kind, remask.get_spec(fast).attention,
                  registered, "remask.models.dream" in sys.modules]))
"""))
    assert out == ["LLaDAConfig", True, "FastDLLMV2ForCausalLM", "llada", "block-causal", [False, True], False]


def test_public_names_and_families_resolve_on_demand(one_fresh_process):
    assert one_fresh_process["missing"] == [] and one_fresh_process["llada"] == "remask.diffusion.families.llada"
    assert one_fresh_process["family_names"] == ["diffusion_gemma", "dream", "fast_dllm_qwen", "llada", "llada2_moe",
                                                 "sdar", "sdar_moe"]


def test_family_of_imports_a_family_module_on_demand(one_fresh_process):
    assert one_fresh_process["families"] == [False, "sdar_moe", "SDARMoeForCausalLM", "AutoModelForImageTextToText",
                                             None]
