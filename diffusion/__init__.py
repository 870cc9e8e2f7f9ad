"""Decoding, in three rooms (docs/architecture.md):

* `parts/` — the protocol and the parts every method is made of: `stepper` (a decoder describes each forward as a
  `ForwardRequest`; `drive` / the engine's runner answer it), `step`, `scoring` and `selection` (the only copy of
  filtering, sampling and choosing), `rules`, `cache`, `varlen`, `checks` (the one validation layer), `stats`;
* `families/` — each model family's loop as a state + a step (`llada`, `dream`, `sdar`, ...);
* `methods/` — the published methods as step generators over those parts (`freedave`, `dinfer`, `wino`, ...)
  and `decoders` (configs → method); the engine's settings → decoder is `remask.engine.presets`;
* `drop_in` — the entry points above them: `generate` (LLaDA / Fast-dLLM) and `diffusion_generate` (Dream),
  which route `decoder=` / `use_cache=` to a registered method or run the family's own loop.

A step: a `ForwardRequest` → one model call (alone, or packed in an engine step) → logits → `scoring.score_rows`
→ a rule's commit. Each module is imported by its room's path (`remask.diffusion.families.llada`).
"""
from .families.apd import APDConfig, apd_generate
from .families.ar import ARDecoder, ar_generate
from .families.canvas import CanvasSampler, canvas_generate
from .drop_in import diffusion_generate, generate
from .families.dream import DreamDecoder, DreamGenerationConfig, DreamModelOutput
from .families.llada import BlockDecoder, block_diffusion_generate
from .methods import registry  # noqa: F401  (every method defined: the registry, rule_types)
from .parts.sparse import SparseConfig
from .parts.scoring import score_rows, score_tokens
from .parts.selection import schedule_counts
from .parts.stats import GenerationStats

__all__ = [
    "APDConfig", "ARDecoder", "BlockDecoder", "CanvasSampler", "DreamDecoder", "DreamGenerationConfig",
    "DreamModelOutput", "GenerationStats", "SparseConfig", "apd_generate", "ar_generate", "block_diffusion_generate",
    "canvas_generate", "diffusion_generate", "generate", "schedule_counts", "score_rows", "score_tokens",
]
