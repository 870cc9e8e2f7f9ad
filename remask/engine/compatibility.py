"""The compatibility matrix of methods × model families, generated from the code (docs/compatibility.md).

    python -m remask.engine.compatibility --out docs/compatibility.md

Each cell is what `LLMEngine.add_request` says about a request of that method on a tiny checkpoint
of that family (`remask.models.tiny`): "yes" when accepted (the engine then decodes it step by step),
or the refusal's own message, naming the conflicting parts. A second table asks the same with a JSON
schema (`structured_outputs`, compiled against the zoo's character tokenizer). Nothing is written by hand;
`tests/test_compatibility.py` checks that the committed file is what the code says.
"""
from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from typing import Any

import torch

# The table's families (`config.model_type`) and their tiny checkpoints' writers (`remask.models.tiny`).
FAMILIES = {"llada": "write_tiny_llada", "Dream": "write_tiny_dream", "sdar": "write_tiny_sdar",
            "llada2_moe": "write_tiny_llada2", "fast_dllm_v2": "write_tiny_fast_dllm_v2",
            "diffusion_gemma": "write_tiny_diffusion_gemma"}


def methods() -> dict[str, dict[str, Any]]:
    """Method name → the `SamplingParams` keywords that ask for it (besides `max_tokens` and the
    layout keywords of `layout`)."""
    import remask
    from remask.diffusion.methods import registry

    listed = {
        "the family's own rule (LLaDA: low-confidence blocks)": {},
        "threshold (Fast-dLLM)": dict(threshold=0.9),
        "threshold + dual cache (Fast-dLLM)": dict(threshold=0.9, use_cache="dual"),
        "Dream's sampler (alg=entropy)": dict(alg="entropy"),
        "FreeDave": dict(decoder=remask.FreeDave()),
        "FreeDave + dual cache": dict(decoder=remask.FreeDave(), use_cache="dual"),
        "dInfer ThresholdDecoding": dict(decoder=remask.ThresholdDecoding()),
        "dInfer CreditDecoding": dict(decoder=remask.CreditDecoding()),
        "dInfer HierarchicalDecoding": dict(decoder=remask.HierarchicalDecoding()),
        "dInfer VicinityCache": dict(use_cache=remask.VicinityCache()),
        "WINO": dict(decoder=remask.WINO()),
        "Prophet": dict(decoder=remask.Prophet()),
        "dKV-Cache": dict(use_cache=remask.DKVCache()),
        "d2Cache": dict(use_cache=remask.D2Cache()),
        "Elastic-Cache": dict(use_cache=remask.ElasticCache()),
        "Elastic-Cache + dInfer HierarchicalDecoding": dict(use_cache=remask.ElasticCache(),
                                                           decoder=remask.HierarchicalDecoding()),
        "dKV-Cache + dInfer ThresholdDecoding": dict(use_cache=remask.DKVCache(), decoder=remask.ThresholdDecoding()),
    }
    named = {type(config) for kwargs in listed.values() for config in kwargs.values()}
    # Every other registered commit rule (diffusion/methods/registry.py), with its defaults.
    extra = {f"rule {rule.name} ({rule.__name__})": dict(decoder=rule()) for rule in registry.rules()
             if rule not in named}
    # Every other registered method with a loop of its own (DAEDAL, ...), by its config's name, with its defaults;
    # APD with a tiny random causal LM as its verifier (its config has no default verifier).
    own_loops = {m.config.__name__: {m.field: m.config()} for m in registry.METHODS.values()
                 if not m.is_rule and m.config not in named and m.way != "apd"}
    cached = {"MultiBlock + its KV cache (cache_delay_iter)": dict(decoder=remask.MultiBlock(cache_delay_iter=1))}
    return {**listed, **extra, **own_loops, **cached, "APD": dict(decoder=remask.APDConfig(_verifier()))}


@functools.cache
def _verifier() -> torch.nn.Module:
    """APD's verifier in the table: a random one-layer Llama whose vocabulary covers every family's tiny checkpoint's
    (APD refuses a verifier that lacks the dLLM's EOS)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=160_000, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2)).eval()


# The settings each table adds to every request: plain, and a JSON schema the answer must follow.
SETTINGS = {"plain": {}, "structured_outputs": {"structured_outputs": {"json": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}}

# The methods that read `steps` (the rest pick their own number of steps).
READS_STEPS = ("the family's own rule (LLaDA: low-confidence blocks)", "Dream's sampler (alg=entropy)", "dKV-Cache",
               "d2Cache", "dKV-Cache + dInfer ThresholdDecoding", "Prophet")


def layout(name: str, spec: Any) -> dict[str, Any]:
    """The layout keywords of method `name` on a model of `spec`: blocks of 16 (not Elastic-Cache's
    sliding window, APD nor Dream's sampler) and 32 steps on the bidirectional mask models; none on the
    families that fix their own blocks (block-causal) or canvas (uniform noise)."""
    if spec.attention == "block-causal" or spec.noise == "uniform":
        return {}
    out = {} if name.startswith(("Elastic-Cache", "APD", "Dream's sampler")) else dict(block_length=16)
    if name in READS_STEPS:
        out["steps"] = 32
    return out


def cell(engine: Any, params: dict[str, Any], prompt: list[int]) -> str:
    """What `add_request` says of one request: "yes", or "no: " and its refusal."""
    from remask.engine import SamplingParams

    try:
        engine.add_request("probe", prompt, SamplingParams(max_tokens=32, **params))
    except (ValueError, TypeError) as err:
        return "no: " + " ".join(str(err).split()).replace("|", "/")
    engine.abort_request("probe")
    return "yes"


def matrix() -> dict[str, dict[str, dict[str, str]]]:
    """Setting (a key of `SETTINGS`) → method → family → "yes" or "no: <the refusal>"."""
    from remask.engine import LLMEngine
    from remask.models import tiny
    from remask.zoo import charset, load

    out = {setting: {name: {} for name in methods()} for setting in SETTINGS}
    tokenizer = charset.build_tokenizer()   # a structure is compiled against the engine's tokenizer
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            # the family's tiny checkpoint, written and loaded as `remask.LLM` loads a folder
            getattr(tiny, FAMILIES[family])(f"{root}/{family}")
            engine = LLMEngine(load(f"{root}/{family}")[0], tokenizer)
            spec = engine.spec
            prompt = [i for i in range(5, 13) if i not in (spec.mask_id, spec.eos_id, spec.pad_id)]
            for setting, extra in SETTINGS.items():
                for name, params in methods().items():
                    out[setting][name][family] = cell(engine, {**params, **layout(name, spec), **extra}, prompt)
    return out


def markdown(tables: dict[str, dict[str, dict[str, str]]]) -> str:
    lines = ["# Compatibility: methods × model families", "",
             "Generated by `python -m remask.engine.compatibility --out docs/compatibility.md` from what",
             "`LLMEngine.add_request` accepts on a tiny checkpoint of each family (max_tokens=32; on LLaDA / Dream",
             "blocks of 16, and 32 steps where the method reads steps); do not edit by",
             "hand (`tests/test_compatibility.py` checks it). \"yes\": the engine decodes it step by step, with the",
             "same tokens as the drop-in function; \"no\": the refusal, naming the parts that conflict. Footnotes",
             "hold the refusals.", ""]
    titles = {"plain": [], "structured_outputs": [
        "## With structured output", "", "The same requests with `structured_outputs={\"json\": {...}}` (a JSON schema;",
        "docs/serving.md, \"Structured output and tool calls\"), on an engine given the zoo's character tokenizer.", ""]}
    notes: dict[str, int] = {}
    for setting, table in tables.items():
        lines += titles[setting] + ["| method | " + " | ".join(FAMILIES) + " |",
                                    "| --- |" + " :---: |" * len(FAMILIES)]
        for name, row in table.items():
            cells = ["yes" if row[family] == "yes" else f"no [{notes.setdefault(row[family][4:], len(notes) + 1)}]"
                     for family in FAMILIES]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Refusals:", "", *(f"{index}. {message}" for message, index in notes.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remask.engine.compatibility", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="markdown file to write (default: print)")
    args = parser.parse_args(argv)
    text = markdown(matrix())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
