"""Load test of `remask serve`: the server on 127.0.0.1 (in this process, a uvicorn thread), a
bounded number of requests from the official `openai` async client at several concurrencies,
mixed streaming and not; it stops by itself.

    python bench/serve_load.py --out bench/results/serve-load-<machine>-<date>.md

Reports per concurrency: requests/s, generated tokens/s, p50/p99 latency, p50/p99 time to first
text (streaming: the first content delta; otherwise the whole answer), errors. Every response is
checked against the offline `remask.LLM.generate` result for the same settings and seed. A last
phase overloads a server whose queue holds `--max-queue` requests: only 503s may fail there.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Iterator

import openai
import torch
import uvicorn

import remask
from remask.serve import AsyncEngine, build_app
from remask.zoo import tasks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

SETTINGS = [dict(steps=16, block_length=8), dict(steps=16, block_length=8, threshold=0.9),
            dict(steps=16, block_length=8, threshold=0.9, use_cache="dual"), dict(steps=16, block_length=4)]


@contextlib.contextmanager
def serving(max_queue: int) -> Iterator[str]:
    """A tiny-llada server on 127.0.0.1 in a thread; yields its /v1 URL, stops it afterwards."""
    engine = AsyncEngine(remask.LLM("tiny-llada"), max_queue=max_queue)
    server = uvicorn.Server(uvicorn.Config(build_app({"tiny-llada": engine}), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def workload(n: int, max_tokens: int) -> list[dict[str, Any]]:
    problems = tasks.problems(n, tasks.EVAL_SEED)
    return [dict(prompt=p.prompt, seed=i, stream=i % 2 == 0, extra=SETTINGS[i % len(SETTINGS)], max_tokens=max_tokens)
            for i, p in enumerate(problems)]


async def one(client: openai.AsyncOpenAI, req: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    messages = [{"role": "user", "content": req["prompt"]}]
    first = None
    try:
        if req["stream"]:
            text = ""
            stream = await client.chat.completions.create(model="tiny-llada", messages=messages, seed=req["seed"],
                                                          max_tokens=req["max_tokens"], stream=True,
                                                          extra_body=req["extra"])
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        first = first or time.perf_counter()
                        text += choice.delta.content
        else:
            out = await client.chat.completions.create(model="tiny-llada", messages=messages, seed=req["seed"],
                                                       max_tokens=req["max_tokens"], extra_body=req["extra"])
            text = out.choices[0].message.content
    except openai.APIStatusError as err:
        return dict(error=err.status_code, latency=time.perf_counter() - start)
    end = time.perf_counter()
    return dict(text=text, latency=end - start, ttft=(first or end) - start, error=None)


async def run_level(url: str, reqs: list[dict[str, Any]], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(concurrency)

    async def limited(req):
        async with gate:
            return await one(client, req)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(r) for r in reqs))
    seconds = time.perf_counter() - start
    await client.close()
    return results, seconds


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_load.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=16, help="queue of the overload phase's server")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reqs = workload(args.requests, args.max_tokens)
    offline = remask.LLM("tiny-llada")
    expected = [offline.chat([{"role": "user", "content": r["prompt"]}],
                             remask.SamplingParams(max_tokens=r["max_tokens"], seed=r["seed"], **r["extra"]),
                             use_tqdm=False)[0].outputs[0].text for r in reqs]
    rows = []
    with serving(max(256, args.requests)) as url:
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            results, seconds = asyncio.run(run_level(url, reqs, concurrency))
            rows.append(summarize(f"{concurrency}", results, seconds, expected, reqs))
            print(rows[-1], flush=True)
    with serving(args.max_queue) as url:      # overload: only 503s may fail, and every answer is right
        results, seconds = asyncio.run(run_level(url, reqs, 64))
        rows.append(summarize(f"64, queue of {args.max_queue}", results, seconds, expected, reqs))
        print(rows[-1], flush=True)
    lines = [f"# Serving load test: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}, Python {sys.version.split()[0]}; tiny-llada, {args.requests} chat requests "
             f"per level ({args.max_tokens} tokens; half streaming; settings cycled: low-confidence, threshold 0.9, "
             f"dual cache + threshold, blocks of 4); command: `python bench/serve_load.py --requests {args.requests} "
             f"--concurrency {args.concurrency}`", "",
             "| concurrency | requests/s | generated tok/s | p50 latency (s) | p99 latency (s) | p50 TTFT (s) "
             "| p99 TTFT (s) | errors | 503s | answers equal offline `LLM` |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['p50']:.3f} | "
                     f"{r['p99']:.3f} | {r['ttft50']:.3f} | {r['ttft99']:.3f} | {r['errors']} | {r['busy']} | "
                     f"{'yes' if r['equal'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    write_markdown(text, args.out)
    ok = all(r["equal"] and r["errors"] == 0 for r in rows)
    return 0 if ok else 1


def summarize(label: str, results: list[dict[str, Any]], seconds: float, expected: list[str],
              reqs: list[dict[str, Any]]) -> dict[str, Any]:
    served = [(r, e) for r, e in zip(results, expected) if r["error"] is None]
    busy = sum(r["error"] == 503 for r in results)
    tokens = len(served) * reqs[0]["max_tokens"]
    lat = [r["latency"] for r, _ in served]
    ttft = [r["ttft"] for r, _ in served]
    return dict(concurrency=label, requests_per_s=len(served) / seconds, tokens_per_s=tokens / seconds,
                p50=statistics.median(lat) if lat else float("nan"), p99=pct(lat, 0.99),
                ttft50=statistics.median(ttft) if ttft else float("nan"), ttft99=pct(ttft, 0.99),
                errors=sum(r["error"] not in (None, 503) for r in results), busy=busy,
                equal=all(r["text"] == e for r, e in served))


if __name__ == "__main__":
    sys.exit(main())
