"""The `remask` command (also `python -m remask`).

    remask serve tiny-llada                       # the shipped model on 127.0.0.1:8000
    remask serve --model fast=./my-llada --model ar=tiny-ar --api-key-file key.txt --port 9000
    remask eval --model remask --model_args pretrained=tiny-llada,steps=16,block_length=8 \
        --tasks remask_tiny --apply_chat_template          # lm-eval's flags, offline
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


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
    api_key = args.api_key
    if args.api_key_file:
        with open(args.api_key_file) as f:
            api_key = f.read().strip()
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
                    cors_origins=[o for o in (args.cors_origins or "").split(",") if o] or None)
    print(json.dumps({"serving": {name: path for name, path in models}, "host": args.host, "port": args.port}),
          flush=True)
    serve(app, engines, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _eval(rest: list[str]) -> int:
    """lm-eval's own command line, with the `remask` model registered and the shipped tasks on the
    task path (`--include_path` added; a user's own is kept too)."""
    try:
        from lm_eval.__main__ import cli_evaluate

        from remask.integrations import lmeval
    except ImportError as err:
        print(f"remask eval needs the eval extra: pip install 'remask[eval]' ({err})", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")     # the shipped task needs no download
    argv = list(rest)
    if "--include_path" in argv:
        i = argv.index("--include_path")
        argv[i + 1] = f"{argv[i + 1]},{lmeval.task_dir()}" if i + 1 < len(argv) else lmeval.task_dir()
    else:
        argv += ["--include_path", lmeval.task_dir()]
    saved = sys.argv
    sys.argv = ["remask eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv = saved
    return 0


def describe_checkpoint(name: str) -> dict:
    """What a checkpoint folder (or shipped name) holds, without loading its weights: model type,
    remask's kind, special ids, vocabulary, context, parameters (from the safetensors headers)."""
    import glob
    import os
    import types

    from safetensors import safe_open
    from transformers import AutoConfig

    import remask  # noqa: F401  (registers LLaDA and Dream with transformers)
    from remask.models.spec import get_spec
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
    """One flag per plain `SamplingParams` field (--max-tokens, --steps, ...); returns the names."""
    import dataclasses
    import typing

    from remask.engine import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    names = []
    for field in dataclasses.fields(SamplingParams):
        hint = str(hints[field.name])
        if field.name in ("apd", "sparse"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.name in ("canvas", "canvas_sampler", "sdar", "llada2", "fast_dllm_v2", "decoder"):   # JSON objects
            parser.add_argument(flag, dest=field.name, type=_json_object(flag), default=None,
                                help=f"a JSON object: SamplingParams.{field.name}")
        elif field.name == "use_cache":   # a cache name, or a cache config as a JSON object
            parser.add_argument(flag, dest=field.name, default=None,
                                type=lambda v, f=flag: _json_object(f)(v) if v.lstrip().startswith("{") else v,
                                help="a cache name (prefix, dual, paged) or a JSON object {\"name\": \"dkv\", ...}")
        elif "tuple" in hint:
            kind = int if "int" in hint else str
            parser.add_argument(flag, dest=field.name, type=kind, action="append", default=None,
                                help=f"(repeatable) SamplingParams.{field.name}")
        elif hint in ("bool",):
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        elif "bool" in hint and "str" in hint:      # confidence_eos_eot_inf: False / True / "corrected"
            parser.add_argument(flag, dest=field.name, default=None,
                                type=lambda v: {"false": False, "true": True}.get(v.lower(), v))
        else:
            kind = int if "int" in hint else float if "float" in hint else str
            parser.add_argument(flag, dest=field.name, type=kind, default=None)
        names.append(field.name)
    return names


def _json_object(flag: str):
    def parse(value: str) -> dict:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object: {err}") from None
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, got {value!r}")
        return parsed
    return parse


def _objects(settings: dict) -> dict:
    """JSON settings as SamplingParams takes them (`canvas_sampler` → a `CanvasSampler`)."""
    import remask

    if isinstance(settings.get("canvas_sampler"), dict):
        settings = dict(settings, canvas_sampler=remask.CanvasSampler(**settings["canvas_sampler"]))
    return settings


def _generate(args: argparse.Namespace, sampling_names: list[str]) -> int:
    import remask

    settings = {name: getattr(args, name) for name in sampling_names if getattr(args, name) is not None}
    try:
        params = remask.SamplingParams(**_objects(settings))
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
                    own = {k: v for k, v in row.items() if k not in ("prompt", "messages", "id")}
                    if ("prompt" in row) == ("messages" in row):
                        raise ValueError("each line needs exactly one of prompt / messages")
                    requests.append((row, params.replace(**_objects(own)) if own else params))
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
    for row, _ in requests:
        if "messages" in row:
            prompts.append(llm.chat_ids(row["messages"]))
        elif args.chat:
            prompts.append(llm.chat_ids([{"role": "user", "content": row["prompt"]}]))
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
                                                  "finish_reason": o.finish_reason, "nfe": o.nfe})))
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


BENCHES = {"engine": "engine.py", "serve": "serve_load.py", "quantized": "quantized.py", "ablate": "ablate.py"}


def _bench(rest: list[str]) -> int:
    """The benchmarks of a source checkout (bench/ is not installed): `remask bench kernels` runs the
    kernel microbenchmarks and their report, `remask bench engine|serve|quantized|ablate [flags]` the
    script of that name with its own flags."""
    import os
    import runpy
    import subprocess

    usage = f"remask bench {{kernels,{','.join(BENCHES)}}} [the script's flags; --help for them]"
    if not rest or rest[0] in ("-h", "--help"):
        print(usage)
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:      # every other argument is lm-eval's own
        return _eval(argv[1:])
    if argv[:1] == ["bench"]:     # every other argument is the benchmark script's own
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="remask", description="remask: fast, exact diffusion LLM decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="the benchmarks of a source checkout: kernels, engine, serve, quantized, ablate "
                                 "(each takes its script's flags)")
    sub.add_parser("eval", help="lm-evaluation-harness with the remask model and the shipped tasks (needs the eval "
                                "extra); takes exactly lm_eval's flags, e.g. remask eval --model remask --model_args "
                                "pretrained=tiny-llada,steps=16 --tasks remask_tiny --apply_chat_template")
    serve_parser = sub.add_parser(
        "serve", help="an OpenAI-compatible server (needs the serve extra)",
        description="remask serve tiny-llada                      # 127.0.0.1:8000, playground at /\n"
                    "remask serve --model llada=tiny-llada --model ar=tiny-ar --api-key-file key.txt \\\n"
                    "    --defaults 'llada={\"steps\": 16, \"block_length\": 8}' --response-cache 1024,600\n"
                    "(docs/serving.md: routes, errors, metrics, drafts, hot swap)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_parser.add_argument("name", nargs="?",
                              help="a shipped model name or checkpoint folder, served under that name")
    serve_parser.add_argument("--model", action="append", type=_model_arg, metavar="NAME=PATH",
                       help="serve PATH under NAME (repeatable)")
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8000)
    serve_parser.add_argument("--api-key", default=None)
    serve_parser.add_argument("--api-key-file", default=None)
    serve_parser.add_argument("--admin-key", default=None, help="enables POST /admin/models (load, swap, unload)")
    serve_parser.add_argument("--admin-key-file", default=None)
    serve_parser.add_argument("--max-queue", type=int, default=256, help="requests held per model; more get 503")
    serve_parser.add_argument("--max-num-seqs", type=int, default=64)
    serve_parser.add_argument("--seed", type=int, default=0)
    serve_parser.add_argument("--defaults", action="append", type=_defaults_arg, metavar="NAME=JSON",
                              help="default sampling settings of a served model (SamplingParams fields)")
    serve_parser.add_argument("--rate-limit", type=int, default=None, help="requests per minute per API key")
    serve_parser.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests get 504")
    serve_parser.add_argument("--response-cache", type=_cache_arg, default=None, metavar="SIZE,TTL",
                              help="cache deterministic responses (LRU of SIZE, TTL seconds)")
    serve_parser.add_argument("--cors-origins", default=None, help="comma-separated origins allowed by CORS")
    serve_parser.add_argument("--log-level", default="info")
    models_parser = sub.add_parser("models", help="the shipped models, or what checkpoint folders hold",
                                   description="remask models              # the shipped ones\n"
                                               "remask models ./my-llada   # kind, ids, size of a folder",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    models_parser.add_argument("paths", nargs="*", help="checkpoint folders or shipped names (default: the zoo)")
    models_parser.add_argument("--json", action="store_true")
    gen_parser = sub.add_parser(
        "generate", help="decode prompts (text or JSONL) to JSONL",
        description="remask generate tiny-llada --prompt 'sort 52814' --chat --steps 16 --block-length 8\n"
                    "remask generate tiny-ar --input requests.jsonl --output answers.jsonl --temperature 0.7\n"
                    "  (a line: {\"prompt\": ...} or {\"messages\": [...]}, optional \"id\" and SamplingParams fields)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    gen_parser.add_argument("model", help="a shipped name or a checkpoint folder")
    gen_parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen_parser.add_argument("--input", help="JSONL requests ('-': stdin)")
    gen_parser.add_argument("--output", help="JSONL answers (default: stdout)")
    gen_parser.add_argument("--chat", action="store_true", help="wrap each --prompt / prompt line in the chat template")
    gen_parser.add_argument("--max-num-seqs", type=int, default=64)
    gen_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    sampling_names = _sampling_flags(gen_parser)
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
