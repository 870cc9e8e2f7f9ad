"""The `remask` command (also `python -m remask`).

    remask serve tiny-llada                       # the shipped model on 127.0.0.1:8000
    remask serve --model fast=./my-llada --model ar=tiny-ar --api-key-file key.txt --port 9000
    remask eval --model remask --model_args pretrained=tiny-llada,steps=16,block_length=8 \
        --tasks remask_tiny --apply_chat_template          # lm-eval's flags, offline

The parsers are built from the constants below and import nothing heavy: `--help` runs without
torch, transformers or remask's own submodules, which the subcommands import when they run.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any, Callable, Sequence

# Written out rather than imported from remask.diffusion so that building the parser imports nothing;
# tests/test_cli.py checks each against the library's own list.
REMASKING = ("low_confidence", "random")                                      # remask.diffusion.families.llada.REMASKING
ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold")   # ...dream.ALGORITHMS
CACHE_NAMES = ("prefix", "dual", "paged")                      # remask.diffusion.parts.cache.CACHE_MODES, less None
CACHE_CONFIGS = ("vicinity", "dkv", "d2cache", "elastic")      # remask.diffusion.methods.registry.names("use_cache")
DECODERS = ("freedave", "threshold", "credit", "hierarchical", "margin", "eb_sampler", "frechet", "klass", "wino",
            "prophet", "daedal", "multiblock", "sdar", "llada2", "fast_dllm_v2", "canvas",
            "apd")   # remask.diffusion.methods.registry.names("decoder")

# One `remask generate` flag per plain `SamplingParams` field: (field, kind, help). Written out for
# the same reason (the dataclass lives behind torch); tests/test_cli.py checks the names and kinds
# against `SamplingParams`. `sparse` takes a config object and has no flag; `output_kind` is how the engine
# reports a request, and the CLI reads finished outputs only (LLM.generate sets it).
# Kinds: int, float, str; bool (--x / --no-x); ints / strs (repeatable); json (a JSON object);
# cache (a name or a JSON object); bool_or_str (false / true / a word).
SAMPLING_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("max_tokens", "int", "answer length in tokens (default 16): diffusion models decode exactly this many "
                          "positions, AR ones stop at EOS; all models"),
    ("n", "int", "samples per prompt (default 1; sample i draws from seed + i); all models"),
    ("seed", "int", "seed of the request's draws (default: the engine's seed plus the request's index); all models"),
    ("temperature", "float", "sampling temperature (default 0: greedy); all models"),
    ("top_p", "float", "nucleus sampling: keep the smallest set of tokens holding this probability, in (0, 1] "
                       "(default off); AR, Dream (--alg), APD, SDAR, LLaDA2.x, Fast-dLLM v2"),
    ("top_k", "int", "sample among the k most probable tokens (default off); AR, Dream (--alg), APD, SDAR, LLaDA2.x"),
    ("stop", "strs", "(repeatable) a string that ends the answer's text, not included (default none); all models"),
    ("stop_token_ids", "ints", "(repeatable) a token id that ends the answer, besides the model's EOS/EOT "
                               "(default none); all models"),
    ("ignore_eos", "bool", "the model's EOS/EOT are ordinary tokens: the answer runs to --max-tokens unless --stop / "
                           "--stop-token-ids end it (vLLM's; default off; not with --early-stop); the decoders "
                           "docs/engine.md lists"),
    ("min_tokens", "int", "no EOS/EOT, --stop-token-ids id or --stop string ends the answer before this many tokens "
                          "(vLLM's; default 0); the decoders docs/engine.md lists"),
    ("steps", "int", "denoising steps over the whole answer, divisible by its blocks (default: --max-tokens, one "
                     "token per step); LLaDA's block rule, Dream (--alg)"),
    ("block_length", "int", "semi-autoregressive block size, dividing --max-tokens (default: --max-tokens, one "
                            "block); LLaDA's block rule, Dream's block decoder (--alg with --use-cache)"),
    ("remasking", "str", f"which masked positions each step commits: {' or '.join(REMASKING)} (default "
                         f"{REMASKING[0]}); LLaDA's block rule"),
    ("threshold", "float", "Fast-dLLM parallel decoding: commit every masked position of the block with confidence "
                           ">= this, at least one per step (default off); LLaDA, Dream (--alg "
                           "confidence_threshold), SDAR, LLaDA2.x, Fast-dLLM v2"),
    ("factor", "float", "Fast-dLLM's factor rule instead of --threshold (default off); LLaDA's block rule"),
    ("frechet_margin", "float", "Fast-dLLM++'s Frechet profile rule instead of --threshold / --factor: commit the "
                                "largest confidence prefix whose profile score exceeds this margin (default off; "
                                "the paper uses 0.25); LLaDA's block rule"),
    ("cfg_scale", "float", "unsupervised classifier-free guidance scale (default 0: off; not with --use-cache); "
                           "LLaDA's block rule"),
    ("use_cache", "cache", f"KV cache: {', '.join(CACHE_NAMES)} (Fast-dLLM's), or a JSON cache config "
                           f"{{\"name\": \"dkv\", ...}} ({', '.join(CACHE_CONFIGS)}; docs/decoders.md) (default none: "
                           "a full forward every step); LLaDA's block rule, Dream's block decoder"),
    ("early_stop", "bool", "stop a row after a fully decoded block holding EOS/EOT (default off); LLaDA's block rule"),
    ("logits_eos_inf", "bool", "set the EOS logit to -inf, so EOS is never chosen (default off); LLaDA's block rule"),
    ("confidence_eos_eot_inf", "bool_or_str", "false (default), true (upstream LLaDA's behaviour) or corrected "
                                              "(EOS/EOT predictions committed last; docs/quirks.md); LLaDA's block "
                                              "rule"),
    ("reference_rng", "bool", "draw the sampling noise as the reference code does, replaying its seeded runs token "
                              "for token (default off); LLaDA at --temperature > 0, DiffusionGemma"),
    ("reference_ties", "bool", "commit through torch.topk as the references do, keeping their order among exactly "
                               "equal confidences (default off: the lower index first); LLaDA's fixed schedule, "
                               "Dream's own sampler"),
    ("alg", "str", f"use Dream's sampler with this rule: {', '.join(ALGORITHMS)} (default none: LLaDA's block "
                   "rule); diffusion models"),
    ("alg_temp", "float", "randomness of Dream's choice of positions to commit (default none: the most "
                          "confident); Dream (--alg)"),
    ("eps", "float", "smallest noise level of Dream's time schedule, in [0, 1) (default 0.001); Dream (--alg)"),
    ("decoder", "json", f"a JSON decoder config {{\"name\": \"freedave\", ...}} ({', '.join(DECODERS)}) that "
                        "replaces the block rule, or the settings of the model family's own loop, e.g. "
                        "{\"name\": \"sdar\", \"denoising_steps\": 4} or {\"name\": \"canvas\", \"sampler\": "
                        "{\"rule\": \"top_k\", \"top_k\": 2}}, or APD's {\"name\": \"apd\", \"verifier\": "
                        "\"tiny-ar\"} (the verifier: a shipped model's name or a checkpoint folder) (default none; "
                        "docs/decoders.md says which models each runs on)"),
    ("structured_outputs", "json", "the answer's structure, vLLM's StructuredOutputsParams as a JSON object: "
                                   "{\"json\": schema}, {\"regex\": ...}, {\"choice\": [...]}, {\"grammar\": ...} or "
                                   "{\"json_object\": true} (default none; see also --json-schema); AR models, "
                                   "LLaDA's block rule"),
    ("logprobs", "int", "also write each generated token's log-probability under the raw model distribution and "
                        "its N most likely alternatives, 0 to 20 (vLLM's; default off); AR models"),
)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps help text without breaking a flag's name at its hyphens (`--max-` / `tokens`)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


SERVE_DEFAULTS = {"max_n": 128, "body_timeout": 10.0, "max_body_bytes": 1 << 20}
SHUTDOWN_GRACE = 30.0   # remask.serve.server.SHUTDOWN_GRACE (tests/test_cli.py checks)

BENCHES = {"engine": "engine.py", "serve": "serve_load.py", "quantized": "quantized.py", "ablate": "ablate.py"}

BENCH_HELP = """\
usage: remask bench {kernels,engine,serve,quantized,ablate} [the benchmark's own flags]

The benchmarks of a source checkout (bench/ is not installed: run from a clone). Each prints a
report (--out FILE also writes it); `remask bench NAME --help` lists that benchmark's flags.

  kernels     pytest-benchmark microbenchmarks of the kernels against their reference
              formulations (Triton on a GPU, the torch paths on CPU), then bench/report.py's
              report of bench/results/latest.json; extra flags go to pytest (e.g. -k unmask)
  engine      remask.LLMEngine against sequential generate calls on the tiny models: tokens/s,
              requests/s, NFE per token, p50/p99 latency, identical tokens
              (--requests 1,8,32,64,256  --max-tokens 16  --threads 1  --repeats 2  --out FILE.md)
  serve       load test of `remask serve` on 127.0.0.1 with the openai client: requests/s,
              tokens/s, latency, time to first text, then an overload phase
              (--requests 128  --concurrency 1,8,32,64  --max-tokens 16  --max-queue 16  --out FILE.md)
  quantized   the tiny models with int8 weights against float32: accuracy and speed
              (--problems 140  --threads 1  --out FILE.md)
  ablate      accuracy against NFE for every decoding strategy on the tiny models: CSV and plot
              (--sweep full|quick  --problems 140  --seed 0  --out FILE.csv  --plot FILE.png  --only ...)
"""


def _model_arg(value: str) -> tuple[str, str]:
    name, _, path = value.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--model takes NAME=PATH (a shipped name or a checkpoint folder), "
                                         f"got {value!r}")
    return name, path


def _defaults_arg(value: str) -> tuple[str, dict]:
    name, _, text = value.partition("=")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--defaults takes NAME=JSON, e.g. tiny-llada='{{\"steps\": 16}}': {err}") \
            from None
    if not name or not isinstance(values, dict):
        raise argparse.ArgumentTypeError(f"--defaults takes NAME=JSON object, got {value!r}")
    return name, values


def _cache_arg(value: str) -> tuple[int, float]:
    size, _, ttl = value.partition(",")
    try:
        return int(size), float(ttl)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--response-cache takes SIZE,TTL_SECONDS (e.g. 1024,600), got {value!r}") \
            from None


def _serve(args: argparse.Namespace) -> int:
    try:
        from remask.serve import AsyncEngine, build_app, serve
    except ImportError as err:
        print(f"remask serve needs the serve extra: pip install 'remask[serve]' ({err})", file=sys.stderr)
        return 2
    import remask

    models = list(args.model or [])
    if args.name:
        models.insert(0, (args.name, args.name))
    if not models:
        print("remask serve: give a model (e.g. `remask serve tiny-llada`) or --model NAME=PATH", file=sys.stderr)
        return 2
    if len({name for name, _ in models}) != len(models):
        print("remask serve: each --model NAME must be unique", file=sys.stderr)
        return 2
    api_keys = list(args.api_key or [])
    if args.api_key_file:
        with open(args.api_key_file) as f:   # one key per line (blank lines and # comments skipped)
            api_keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    api_key = api_keys or None
    engines = {name: AsyncEngine(remask.LLM(path, max_num_seqs=args.max_num_seqs, seed=args.seed),
                                 max_queue=args.max_queue)
               for name, path in models}
    admin_key = args.admin_key
    if args.admin_key_file:
        with open(args.admin_key_file) as f:
            admin_key = f.read().strip()
    app = build_app(engines, api_key=api_key, rate_limit=args.rate_limit, request_timeout=args.request_timeout,
                    response_cache=args.response_cache, admin_key=admin_key, defaults=dict(args.defaults or []),
                    load_model=lambda path: remask.LLM(path, max_num_seqs=args.max_num_seqs, seed=args.seed),
                    cors_origins=[o for o in (args.cors_origins or "").split(",") if o] or None,
                    max_n=args.max_n, body_timeout=args.body_timeout, max_body_bytes=args.max_body_bytes)
    print(json.dumps({"serving": {name: path for name, path in models}, "host": args.host, "port": args.port}),
          flush=True)
    return serve(app, engines, host=args.host, port=args.port, log_level=args.log_level,
                 shutdown_grace=args.shutdown_grace)


EVAL_HELP = """\
remask eval: lm-evaluation-harness's own command line (the eval extra), with
  * the model `remask` registered: --model remask --model_args pretrained=tiny-llada,steps=16,...
    (every other key a remask.SamplingParams field; docs/evaluation.md);
  * the shipped task remask_tiny on the task path, beside every --include_path folder (repeatable
    here; a folder's task overrides a shipped one of the same name);
  * --device cpu where there is no CUDA and no --device is given (lm-eval's default is cuda:0).
lm-eval's flags (`run`; `remask eval ls tasks` and `remask eval validate` work too):

"""


def _eval(rest: list[str]) -> int:
    """lm-eval's own command line, with the `remask` model registered, the shipped tasks beside every
    `--include_path` given, and the CPU as the device where there is no CUDA and none was asked for."""
    try:
        # lm-eval's `cli_evaluate` is these three lines; they are run here so that the parsed
        # arguments can be completed (a list of task folders, the device) before they execute.
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError as err:
        print(f"remask eval needs the eval extra: pip install 'remask[eval]' ({err})", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")     # the shipped task needs no download
    argv = list(rest)
    if argv in (["-h"], ["--help"]):     # lm-eval's top-level help lists its subcommands; the flags are run's
        print(EVAL_HELP, end="")
        argv = ["run", "--help"]
    saved = sys.argv
    sys.argv = ["remask eval", *argv]
    try:
        setup_logging()
        cli = HarnessCLI()
        args = cli.parse_args()          # --help exits here, before torch and the adapter are imported
        try:
            from remask.integrations import lmeval     # registers the model `remask`
        except ImportError as err:
            print(f"remask eval needs the eval extra: pip install 'remask[eval]' ({err})", file=sys.stderr)
            return 2
        config = _eval_config(args)
        if hasattr(args, "include_path"):            # run, ls and validate
            args.include_path = _include_paths(argv, config, lmeval.task_dir())
        if getattr(args, "command", None) == "run" and args.device is None and "device" not in config:
            import torch

            # lm-eval's default, cuda:0, where it exists; otherwise the CPU rather than a warning
            if not torch.cuda.is_available():
                args.device = "cpu"
        cli.execute(args)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    finally:
        sys.argv = saved
    return 0


def _eval_config(args: argparse.Namespace) -> dict:
    """The settings of lm-eval's `--config` YAML, if one is given (its values yield to the flags)."""
    if not getattr(args, "config", None):
        return {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    return EvaluatorConfig.load_yaml_config(args.config)


def _include_paths(argv: list[str], config: dict, shipped: str) -> list[str]:
    """Every task folder for lm-eval's `TaskManager(include_path=[...])`: the shipped tasks first, then
    the `--config` YAML's `include_path`, then each `--include_path` in order (lm-eval's own parser
    keeps only the last; a later folder's task overrides an earlier one's of the same name)."""
    given = argparse.ArgumentParser(add_help=False)      # lm-eval has validated argv already
    given.add_argument("--include_path", action="append", default=[])
    from_config = config.get("include_path") or []
    paths = [shipped, *([from_config] if isinstance(from_config, str) else from_config),
             *given.parse_known_args(argv)[0].include_path]
    return list(dict.fromkeys(str(p) for p in paths))


def describe_checkpoint(name: str) -> dict:
    """What a checkpoint folder (or shipped name) holds, without loading its weights: model type,
    remask's kind, special ids, vocabulary, context, parameters (from the safetensors headers)."""
    import glob
    import os
    import types

    from safetensors import safe_open
    from transformers import AutoConfig

    from remask.models.spec import get_spec   # importing remask.models registers LLaDA, Dream, ... with transformers
    from remask.zoo import checkpoint_path

    path = checkpoint_path(name)
    config = AutoConfig.from_pretrained(path)
    spec = get_spec(types.SimpleNamespace(config=config))
    parameters, dtypes = 0, set()
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                count = 1
                for size in piece.get_shape():
                    count *= size
                parameters += count
                dtypes.add(piece.get_dtype())
    return {"name": name, "path": os.path.abspath(path), "model_type": config.model_type, "kind": spec.kind,
            "mask_id": spec.mask_id, "eos_id": spec.eos_id, "eot_id": spec.eot_id, "vocab_size": spec.vocab_size,
            "max_length": spec.max_length, "parameters": parameters, "dtypes": sorted(dtypes),
            "tokenizer": os.path.exists(os.path.join(path, "tokenizer.json")),
            "chat_template": os.path.exists(os.path.join(path, "chat_template.jinja"))}


def _models(args: argparse.Namespace) -> int:
    from remask.zoo import SHIPPED

    rows = []
    for name in args.paths or SHIPPED:
        try:
            rows.append(describe_checkpoint(name))
        except (ValueError, OSError) as err:
            print(f"remask models: {name}: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':24s} {'kind':6s} {'type':8s} {'parameters':>11s} {'vocab':>7s} {'context':>8s} {'mask id':>8s} "
          f"{'eos id':>7s}  chat")
    for r in rows:
        print(f"{r['name']:24s} {r['kind']:6s} {r['model_type']:8s} {r['parameters']:>11,d} "
              f"{r['vocab_size'] or '-':>7} "
              f"{r['max_length'] or '-':>8} {'-' if r['mask_id'] is None else r['mask_id']:>8} "
              f"{'-' if r['eos_id'] is None else r['eos_id']:>7}  {'yes' if r['chat_template'] else 'no'}")
    return 0


def _sampling_flags(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per `SAMPLING_FLAGS` field (--max-tokens, --steps, ...), each None unless given, so
    that an unset field keeps `SamplingParams`' default; returns the field names."""
    group = parser.add_argument_group("decoding settings (remask.SamplingParams fields; a JSONL line's own win)")
    for name, kind, text in SAMPLING_FLAGS:
        flag = "--" + name.replace("_", "-")
        options: dict[str, Any] = dict(dest=name, default=None, help=text)
        if kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        elif kind in ("ints", "strs"):
            options.update(action="append", type=int if kind == "ints" else str)
        elif kind == "json":
            options.update(type=_json_object(flag), metavar="JSON")
        elif kind == "cache":        # a cache name, or a cache config as a JSON object
            options.update(type=_cache_or_json(flag), metavar="NAME|JSON")
        elif kind == "bool_or_str":  # confidence_eos_eot_inf: False / True / "corrected"
            options["type"] = _bool_or_word
        else:
            options["type"] = {"int": int, "float": float, "str": str}[kind]
        group.add_argument(flag, **options)
    return [name for name, _, _ in SAMPLING_FLAGS]


def _json_object(flag: str) -> Callable[[str], dict]:
    def parse(value: str) -> dict:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object: {err}") from None
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {value!r}")
        return parsed
    return parse


def _cache_or_json(flag: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        return _json_object(flag)(value) if value.lstrip().startswith("{") else value
    return parse


def _bool_or_word(value: str) -> bool | str:
    return {"false": False, "true": True}.get(value.lower(), value)


def _generate(args: argparse.Namespace, sampling_names: list[str]) -> int:
    import remask

    settings = {name: getattr(args, name) for name in sampling_names if getattr(args, name) is not None}
    if args.json_schema is not None:
        if "structured_outputs" in settings:
            print("remask generate: --json-schema and --structured-outputs: give one", file=sys.stderr)
            return 2
        try:
            with open(args.json_schema) as f:
                settings["structured_outputs"] = {"json": json.load(f)}
        except (OSError, ValueError) as err:
            print(f"remask generate: --json-schema {args.json_schema}: {err}", file=sys.stderr)
            return 2
    verifiers: dict = {}   # APD's verifiers by name or folder, each loaded once (--decoder and --input lines)

    def with_verifier(given: dict) -> dict:
        decoder = given.get("decoder")
        if not (isinstance(decoder, dict) and decoder.get("name") == "apd" and isinstance(decoder.get("verifier"), str)):
            return given
        try:
            if decoder["verifier"] not in verifiers:
                verifiers[decoder["verifier"]] = remask.load(decoder["verifier"])[0]
        except (OSError, ValueError) as err:
            raise ValueError(f"decoder.verifier: {err}") from None
        return {**given, "decoder": {**decoder, "verifier": verifiers[decoder["verifier"]]}}

    try:
        params = remask.SamplingParams(**with_verifier(settings))
    except (TypeError, ValueError) as err:
        print(f"remask generate: {err}", file=sys.stderr)
        return 2
    requests = []      # (prompt or messages, params)
    for text in args.prompt or []:
        requests.append(({"prompt": text}, params))
    if args.input:
        with (sys.stdin if args.input == "-" else open(args.input)) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    own = with_verifier({k: v for k, v in row.items() if k not in ("prompt", "messages", "id")})
                    if ("prompt" in row) == ("messages" in row):
                        raise ValueError("each line needs exactly one of prompt / messages")
                    requests.append((row, params.replace(**own) if own else params))
                except (ValueError, TypeError) as err:
                    print(f"remask generate: --input line {number}: {err}", file=sys.stderr)
                    return 2
    if not requests:
        print("remask generate: give --prompt TEXT (repeatable) or --input FILE.jsonl ('-' for stdin)", file=sys.stderr)
        return 2
    try:
        llm = remask.LLM(args.model, max_num_seqs=args.max_num_seqs)   # --seed is the requests' (SamplingParams)
    except (ValueError, OSError) as err:
        print(f"remask generate: {err}", file=sys.stderr)
        return 2
    prompts = []
    for row, row_params in requests:
        # a JSON schema asked for is shown to a chat template that reads it (the zoo's chat models), as the server does
        structure = row_params.structured_outputs
        shown = None if structure is None else structure.template_format()
        if "messages" in row:
            prompts.append(llm.chat_ids(row["messages"], response_format=shown))
        elif args.chat:
            prompts.append(llm.chat_ids([{"role": "user", "content": row["prompt"]}], response_format=shown))
        else:
            prompts.append(row["prompt"])
    # Data parallel under torchrun / accelerate launch: rank r decodes requests r, r + world, ...;
    # rank 0 writes all of them in input order. A request's tokens do not depend on its batch, so
    # the output equals one process's.
    rank, world = _distributed()
    mine = list(range(rank, len(requests), world))
    try:
        outs = llm.generate([prompts[i] for i in mine], [requests[i][1] for i in mine],
                            use_tqdm=not args.quiet and rank == 0)
    except ValueError as err:
        print(f"remask generate: {err}", file=sys.stderr)
        return 2
    lines = []
    for i, out in zip(mine, outs):
        row = requests[i][0]
        for o in out.outputs:
            lines.append((i, o.index, json.dumps({**({"id": row["id"]} if "id" in row else {}),
                                                  **({"messages": row["messages"]} if "messages" in row
                                                     else {"prompt": row["prompt"]}),
                                                  "index": o.index, "text": o.text, "token_ids": o.token_ids,
                                                  "finish_reason": o.finish_reason, "nfe": o.nfe,
                                                  **({} if o.logprobs is None else {"logprobs": [
                                                      {str(t): lp.logprob for t, lp in entry.items()}
                                                      for entry in o.logprobs]})})))
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, lines)
        lines = sorted(line for part in gathered for line in part)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    sink = sys.stdout if args.output in (None, "-") else open(args.output, "w")
    try:
        for _, _, line in lines:
            sink.write(line + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0


def _distributed() -> tuple[int, int]:
    """(rank, world size) under torchrun / accelerate launch (a gloo group is started), else (0, 1)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _bench(rest: list[str]) -> int:
    """The benchmarks of a source checkout (bench/ is not installed): `remask bench kernels` runs the
    kernel microbenchmarks and their report, `remask bench engine|serve|quantized|ablate [flags]` the
    script of that name with its own flags."""
    import os
    import runpy
    import subprocess

    usage = f"remask bench {{kernels,{','.join(BENCHES)}}} [the benchmark's flags; --help for them]"
    if not rest or rest[0] in ("-h", "--help"):
        print(BENCH_HELP, end="", file=sys.stdout if rest else sys.stderr)
        return 0 if rest else 2
    candidates = [os.path.join(os.getcwd(), "bench"),
                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")]
    folder = next((c for c in candidates if os.path.isfile(os.path.join(c, "engine.py"))), None)
    if folder is None:
        print("remask bench: the benchmarks live in the source checkout's bench/ folder; run it from a clone "
              "(git clone ... && cd remask)", file=sys.stderr)
        return 2
    which, args = rest[0], rest[1:]
    if which == "kernels":
        out = os.path.join(folder, "results", "latest.json")
        done = subprocess.run([sys.executable, "-m", "pytest", folder, "-q", "-p", "no:cacheprovider",
                               f"--benchmark-json={out}", *args])
        if done.returncode:
            return done.returncode
        return subprocess.run([sys.executable, os.path.join(folder, "report.py"), out]).returncode
    if which not in BENCHES:
        print(f"remask bench: unknown benchmark {which!r}; {usage}", file=sys.stderr)
        return 2
    script = os.path.join(folder, BENCHES[which])
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv = saved
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    """The `remask` parser (`eval` and `bench` pass their arguments on: `main` routes them first) and the
    `SamplingParams` fields that `generate` has flags for. Imports nothing beyond the standard library."""
    parser = argparse.ArgumentParser(prog="remask", description="remask: fast, exact diffusion LLM decoding",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="the benchmarks of a source checkout: kernels, engine, serve, quantized, ablate "
                                 "(each takes its script's flags; remask bench --help)")
    sub.add_parser("eval", help="lm-evaluation-harness with the remask model and the shipped tasks (needs the eval "
                                "extra); takes exactly lm_eval's flags, e.g. remask eval --model remask --model_args "
                                "pretrained=tiny-llada,steps=16 --tasks remask_tiny --apply_chat_template")
    serve_parser = sub.add_parser(
        "serve", help="an OpenAI-compatible server (needs the serve extra)",
        description="remask serve tiny-llada                      # 127.0.0.1:8000, playground at /\n"
                    "remask serve --model llada=tiny-llada --model ar=tiny-ar --api-key-file key.txt \\\n"
                    "    --defaults 'llada={\"steps\": 16, \"block_length\": 8}' --response-cache 1024,600\n"
                    "(docs/serving.md: routes, errors, metrics, drafts, hot swap)",
        formatter_class=_HelpFormatter)
    serve_parser.add_argument("name", nargs="?",
                              help="a shipped model name or checkpoint folder, served under that name")
    serve_parser.add_argument("--model", action="append", type=_model_arg, metavar="NAME=PATH",
                              help="serve PATH under NAME (repeatable)")
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve_parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                              help="require `Authorization: Bearer KEY` on the /v1 routes (repeatable: any of the "
                                   "keys; requests are scheduled fairly across keys) (default: no key)")
    serve_parser.add_argument("--api-key-file", default=None,
                              help="read API keys from this file, one per line (with any --api-key)")
    serve_parser.add_argument("--admin-key", default=None, help="enables POST /admin/models (load, swap, unload)")
    serve_parser.add_argument("--admin-key-file", default=None, help="read --admin-key from this file")
    serve_parser.add_argument("--max-queue", type=int, default=256,
                              help="requests held per model; more get 503 (default 256)")
    serve_parser.add_argument("--max-num-seqs", type=int, default=64,
                              help="sequences each engine decodes at once (default 64)")
    serve_parser.add_argument("--seed", type=int, default=0,
                              help="engine seed: an unseeded request draws from it plus its index (default 0)")
    serve_parser.add_argument("--defaults", action="append", type=_defaults_arg, metavar="NAME=JSON",
                              help="default sampling settings of a served model (SamplingParams fields)")
    serve_parser.add_argument("--rate-limit", type=int, default=None, help="requests per minute per API key")
    serve_parser.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests get 504")
    # defaults written out (remask.serve.app's MAX_N, BODY_TIMEOUT, MAX_BODY_BYTES) so --help imports nothing;
    # tests/test_cli.py checks they are the app's
    serve_parser.add_argument("--max-n", type=int, default=SERVE_DEFAULTS["max_n"],
                              help=f"most samples (n) one request may ask for (default {SERVE_DEFAULTS['max_n']}, "
                                   "OpenAI's cap); more get 400 naming n")
    serve_parser.add_argument("--body-timeout", type=float, default=SERVE_DEFAULTS["body_timeout"],
                              help=f"seconds a request body may take to arrive (default "
                                   f"{SERVE_DEFAULTS['body_timeout']:g}); slower ones get 408")
    serve_parser.add_argument("--max-body-bytes", type=int, default=SERVE_DEFAULTS["max_body_bytes"],
                              help=f"largest request body, chunked or not (default {SERVE_DEFAULTS['max_body_bytes']}); "
                                   "larger ones get 413 and are not read past the limit")
    serve_parser.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE,
                              help=f"seconds the requests in flight get to finish after SIGTERM (default "
                                   f"{SHUTDOWN_GRACE:g}); then they are aborted (503) and the server exits 1; a "
                                   "second SIGTERM exits at once")
    serve_parser.add_argument("--response-cache", type=_cache_arg, default=None, metavar="SIZE,TTL",
                              help="cache deterministic responses (LRU of SIZE, TTL seconds)")
    serve_parser.add_argument("--cors-origins", default=None, help="comma-separated origins allowed by CORS")
    serve_parser.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    models_parser = sub.add_parser("models", help="the shipped models, or what checkpoint folders hold",
                                   description="remask models              # the shipped ones\n"
                                               "remask models ./my-llada   # kind, ids, size of a folder",
                                   formatter_class=_HelpFormatter)
    models_parser.add_argument("paths", nargs="*", help="checkpoint folders or shipped names (default: the zoo)")
    models_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    gen_parser = sub.add_parser(
        "generate", help="decode prompts (text or JSONL) to JSONL",
        description="Decode prompts with a shipped model or a checkpoint folder and write one JSON line per "
                    "sample:\n{\"prompt\" or \"messages\", \"index\", \"text\", \"token_ids\", \"finish_reason\", "
                    "\"nfe\"}. Decoding flags are\nremask.SamplingParams fields; an unset one keeps the field's "
                    "default.",
        epilog="examples:\n"
               "  remask generate tiny-llada --prompt 'sort 52814' --chat --steps 16 --block-length 8\n"
               "  remask generate tiny-ar --input requests.jsonl --output answers.jsonl --chat --temperature 0.7 "
               "--seed 1\n"
               "    (a line: {\"prompt\": ...} or {\"messages\": [...]}, optional \"id\" and SamplingParams fields;\n"
               "     the shipped tiny models are chat-trained: give their prompts --chat)\n"
               "  torchrun --nproc_per_node 2 -m remask generate tiny-llada --input requests.jsonl --chat"
               "   # data parallel",
        formatter_class=_HelpFormatter)
    gen_parser.add_argument("model", help="a shipped name (remask models) or a checkpoint folder")
    gen_parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen_parser.add_argument("--input", help="JSONL requests ('-': stdin)")
    gen_parser.add_argument("--output", help="JSONL answers (default: stdout)")
    gen_parser.add_argument("--chat", action="store_true",
                            help="wrap each --prompt / prompt line in the tokenizer's chat template "
                                 "(\"messages\" lines always are)")
    gen_parser.add_argument("--max-num-seqs", type=int, default=64,
                            help="sequences the engine decodes at once (default 64; answers do not depend on it)")
    gen_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    gen_parser.add_argument("--json-schema", metavar="FILE", default=None,
                            help="a JSON Schema file: every answer is a JSON value it validates "
                                 "(structured_outputs={\"json\": schema}; AR models, LLaDA's block rule)")
    return parser, _sampling_flags(gen_parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:      # every other argument is lm-eval's own
        return _eval(argv[1:])
    if argv[:1] == ["bench"]:     # every other argument is the benchmark script's own
        return _bench(argv[1:])
    parser, sampling_names = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "models":
        return _models(args)
    if args.command == "generate":
        return _generate(args, sampling_names)
    return 2


if __name__ == "__main__":
    sys.exit(main())
