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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:      # every other argument is lm-eval's own
        return _eval(argv[1:])
    parser = argparse.ArgumentParser(prog="remask", description="remask: fast, exact diffusion LLM decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("eval", help="lm-evaluation-harness with the remask model and the shipped tasks (needs the eval "
                                "extra); takes exactly lm_eval's flags, e.g. remask eval --model remask --model_args "
                                "pretrained=tiny-llada,steps=16 --tasks remask_tiny --apply_chat_template")
    serve_parser = sub.add_parser("serve", help="an OpenAI-compatible server (needs the serve extra)")
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
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
