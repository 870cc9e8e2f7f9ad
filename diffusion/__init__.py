"""Decoding, in three rooms (docs/architecture.md):

* `parts/` — the protocol and the parts every method is made of: `stepper` (a decoder describes each forward as a
  `ForwardRequest`; `drive` / the engine's runner answer it), `step`, `scoring` and `selection` (the only copy of
  filtering, sampling and choosing), `rules`, `cache`, `varlen`, `checks` (the one validation layer), `stats`;
* `families/` — each model family's loop as a state + a step (`llada`, `dream`, `sdar`, ...);
* `methods/` — the published methods as step generators over those parts (`freedave`, `dinfer`, `wino`, ...),
  `decoders` (configs → method) and `presets` (engine settings → decoder).

A step: a `ForwardRequest` → one model call (alone, or packed in an engine step) → logits → `scoring.score_rows`
→ a rule's commit. Modules keep their flat paths (`remask.diffusion.llada`).
"""
import importlib
import importlib.abc
import importlib.util
import sys

ROOMS = {
    "parts": ("step", "stepper", "scoring", "selection", "rules", "cache", "varlen", "stats", "checks", "constrain",
              "constrain_loops"),
    "families": ("llada", "dream", "sdar", "llada2", "fast_dllm_v2", "canvas", "ar", "apd"),
    "methods": ("freedave", "freedave_blocks", "dinfer", "wino", "dkv", "dkv_dream", "d2cache", "elastic", "sparse",
                "presets", "decoders"),
}
_FLAT = {f"{__name__}.{module}": f"{__name__}.{room}.{module}" for room, modules in ROOMS.items() for module in modules}


class _FlatNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `remask.diffusion.<module>` as the module in its room."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in _FLAT else None

    def create_module(self, spec):
        return importlib.import_module(_FLAT[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _FlatNames) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FlatNames())

from .families.apd import APDConfig, apd_generate  # noqa: E402
from .families.ar import ARDecoder, ar_generate  # noqa: E402
from .families.canvas import CanvasSampler, canvas_generate  # noqa: E402
from .families.dream import DreamDecoder, DreamGenerationConfig, DreamModelOutput, diffusion_generate  # noqa: E402
from .families.llada import BlockDecoder, block_diffusion_generate, generate  # noqa: E402
from .methods import registry  # noqa: E402,F401  (every method defined: the registry, rule_types)
from .methods.sparse import SparseConfig  # noqa: E402
from .parts.scoring import score_rows, score_tokens  # noqa: E402
from .parts.selection import schedule_counts  # noqa: E402
from .parts.stats import GenerationStats  # noqa: E402


def __getattr__(name: str):
    """`remask.diffusion.llada` as an attribute: the module in its room."""
    if f"{__name__}.{name}" in _FLAT:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _flat in _FLAT:   # the flat names of the modules imported above
    if _FLAT[_flat] in sys.modules:
        sys.modules.setdefault(_flat, sys.modules[_FLAT[_flat]])

__all__ = [
    "APDConfig", "ARDecoder", "BlockDecoder", "CanvasSampler", "DreamDecoder", "DreamGenerationConfig",
    "DreamModelOutput", "GenerationStats", "SparseConfig", "apd_generate", "ar_generate", "block_diffusion_generate",
    "canvas_generate", "diffusion_generate", "generate", "schedule_counts", "score_rows", "score_tokens",
]
