"""An agent framework from PyPI, pydantic-ai, against `remask serve` on the shipped chat model `tiny-ar-chat`,
offline on 127.0.0.1 (issue 46, item 4): its structured output (`NativeOutput`: OpenAI's json_schema response
format, enforced by the server) and its tool loop (the model calls a Python function, reads its result and
answers in text), the answers checked against the held-out problems."""
from __future__ import annotations

import threading
import time

import pytest
from pydantic import BaseModel

import remask
from remask.serve import AsyncEngine, build_app
from remask.zoo import tasks

MODEL = "tiny-ar-chat"


@pytest.fixture(scope="module")
def agent_model():
    import uvicorn
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    engines = {MODEL: AsyncEngine(remask.LLM(MODEL))}
    server = uvicorn.Server(uvicorn.Config(build_app(engines), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    yield OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url, api_key="unused"))
    server.should_exit = True
    thread.join(10)
    engines[MODEL].shutdown()


class Answer(BaseModel):
    answer: str


def test_structured_output_of_an_agent_is_the_answer(agent_model):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.settings import ModelSettings

    agent = Agent(agent_model, output_type=NativeOutput(Answer),
                  model_settings=ModelSettings(max_tokens=64, temperature=0.0))
    problems = [p for p in tasks.problems(60, tasks.EVAL_SEED) if p.task in ("sort", "reverse", "add", "capital")][:12]
    answers = [agent.run_sync(p.prompt).output.answer for p in problems]
    right = sum(p.is_correct(a) for p, a in zip(problems, answers))
    assert right >= 11, list(zip([p.prompt for p in problems], answers))


def test_an_agent_calls_the_tool_and_answers_from_its_result(agent_model):
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    calls = []
    agent = Agent(agent_model, model_settings=ModelSettings(max_tokens=128, temperature=0.0))

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers"""
        calls.append((a, b))
        return a + b

    problems = [p for p in tasks.problems(200, tasks.EVAL_SEED) if p.task == "add"][:10]
    outcomes = []
    for p in problems:
        calls.clear()
        output = agent.run_sync(p.prompt).output
        a, b = (int(x) for x in p.prompt.split("+"))
        outcomes.append((p.prompt, list(calls), output, calls == [(a, b)], p.is_correct(output)))
    assert sum(called for *_, called, _ in outcomes) >= 9, outcomes        # the right call, the right arguments
    assert sum(right for *_, right in outcomes) >= 9, outcomes             # the answer from the tool's result
