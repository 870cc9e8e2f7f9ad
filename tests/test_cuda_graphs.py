"""`LLMEngine(cuda_graphs=True)`: uncached full forwards replay a graph captured per (bucket, T).

Off CUDA the knob is refused. The graph logic (buckets, static buffers, padding, output slicing,
capture once, eviction) runs on CPU with a stand-in graph whose `replay()` runs the captured body
again into the same static output — as a CUDA graph rewrites its static output from its static
inputs. The real capture is checked against eager only where a GPU is present."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.engine import LLMEngine, SamplingParams
from remask.engine import cuda_graphs
from remask.kernels.batch_invariant import batch_invariant_linear
from remask.engine.cuda_graphs import GraphedForward, buckets_up_to
from remask.models.spec import get_spec
from remask.zoo import charset, tasks

PROMPT = charset.encode_chat(tasks.problems(1, tasks.EVAL_SEED)[0].prompt)


class FakeGraph:
    def __init__(self, body, out: torch.Tensor) -> None:
        self.body, self.out = body, out

    def replay(self) -> None:
        self.out.copy_(self.body())   # reads the static inputs now, rewrites the static output


class FakeBackend:
    def __init__(self) -> None:
        self.captured = 0

    def capture(self, body):
        self.captured += 1
        out = body()
        return FakeGraph(body, out), out


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


def invariant(rows: int):
    return batch_invariant_linear(rows > 1)


def canvases(rows: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 100, (rows, T), generator=torch.Generator().manual_seed(seed))


def test_refused_off_cuda_and_validated(llada):
    model, tokenizer = llada
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device; this model is on cpu"):
        LLMEngine(model, tokenizer, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        remask.LLM(model, tokenizer, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        LLMEngine(model, tokenizer, cuda_graphs=1)
    assert LLMEngine(model, tokenizer).runner.graphs is None   # the default: no graph path at all


def test_buckets():
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_up_to(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets_up_to(1) == [1]
    graphs = GraphedForward(FakeBackend(), 48)
    assert [graphs.bucket(g) for g in (1, 2, 3, 5, 33, 48, 49)] == [1, 2, 4, 8, 48, 48, None]


def test_replay_equals_eager_captures_once_and_returns_fresh_rows(llada):
    model, _ = llada
    spec = get_spec(model)
    forward = lambda x: spec.logits(model, x)   # noqa: E731
    backend = FakeBackend()
    graphs = GraphedForward(backend, 8)
    T = 24
    entered = []

    def recording(rows: int):
        entered.append(rows)
        return invariant(rows)

    with torch.no_grad():
        x1, x2 = canvases(3, T, 1), canvases(3, T, 2)
        with invariant(3):
            want1, want2 = spec.logits(model, x1), spec.logits(model, x2)
        got1 = graphs(x1, forward, context=recording)
        assert list(graphs.graphs) == [(4, T, ())]            # 3 rows ran in the 4-row bucket
        assert entered and set(entered) == {4}                # captured in the eager path's context, for 4 rows
        assert torch.equal(got1, want1)
        entry = graphs.graphs[4, T, ()]
        assert torch.equal(entry.static_in[3], x1[0])         # padding: a copy of row 0
        got2 = graphs(x2, forward, context=invariant)
        assert torch.equal(got2, want2)                       # this call's rows, not the captured ones
        assert torch.equal(got1, want1)                       # an earlier result is not overwritten
        assert backend.captured == graphs.captures == 1 and graphs.replays == 2
        x4 = canvases(4, T, 3)
        with invariant(4):
            want4 = spec.logits(model, x4)
        assert torch.equal(graphs(x4, forward, context=invariant), want4)
        assert backend.captured == 1                          # 4 rows: the same graph
        x_one = canvases(1, T, 4)
        assert torch.equal(graphs(x_one, forward, context=invariant), spec.logits(model, x_one))
        assert backend.captured == 2 and (1, T, ()) in graphs.graphs   # one row: bucket 1, never padded
        x9 = canvases(9, T, 5)                                # beyond the largest bucket: eager
        with invariant(9):
            want9 = spec.logits(model, x9)
        assert torch.equal(graphs(x9, forward, context=invariant), want9) and backend.captured == 2


def test_graphs_are_capped_least_recently_used_first():
    backend = FakeBackend()
    graphs = GraphedForward(backend, 4, max_graphs=2)
    forward = lambda x: x.float() * 2   # noqa: E731
    for T in (3, 4):
        graphs(torch.ones(1, T, dtype=torch.long), forward)
    graphs(torch.ones(1, 3, dtype=torch.long), forward)       # T=3 used last: T=4 is the oldest
    graphs(torch.ones(1, 5, dtype=torch.long), forward)
    assert list(graphs.graphs) == [(1, 3, ()), (1, 5, ())] and backend.captured == 3
    x = torch.arange(4).view(1, 4)
    assert torch.equal(graphs(x, forward), x.float() * 2) and backend.captured == 4   # recaptured


def test_a_forward_that_cannot_be_captured_runs_eagerly():
    class Refusing:
        calls = 0

        def capture(self, body):
            self.calls += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    backend = Refusing()
    graphs = GraphedForward(backend, 4)
    x = torch.arange(6).view(2, 3)
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        assert torch.equal(graphs(x, lambda t: t + 1, key="k"), x + 1)
    assert torch.equal(graphs(x, lambda t: t + 1, key="k"), x + 1) and backend.calls == 1   # not retried


def run(engine: LLMEngine, requests) -> dict[str, list[int]]:
    for rid, params in requests:
        engine.add_request(rid, PROMPT, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].all_token_ids
    return done


REQUESTS = [(f"low{i}", SamplingParams(max_tokens=16, steps=16, block_length=8, temperature=t, seed=i))
            for i, t in enumerate((0.0, 0.7, 1.0))] + [
    (f"dream{i}", SamplingParams(max_tokens=16, steps=8, alg="entropy", temperature=0.5, seed=10 + i)) for i in range(2)
] + [("prefix", SamplingParams(max_tokens=16, steps=16, block_length=8, use_cache="prefix", seed=20))]


def test_engine_graph_path_gives_the_eager_tokens(llada, monkeypatch):
    """The engine's own graph path on CPU (the stand-in graph): three LLaDA requests (bucket 4),
    two Dream-sampler ones (bucket 2) and a prefix-cache one (eager) give the tokens of
    cuda_graphs=False."""
    model, tokenizer = llada
    want = run(LLMEngine(model, tokenizer), REQUESTS)
    backend = FakeBackend()
    monkeypatch.setattr(cuda_graphs, "make_backend", lambda device: backend)
    engine = LLMEngine(model, tokenizer, cuda_graphs=True)
    got = run(engine, REQUESTS)
    assert got == want
    T = len(PROMPT) + 16
    assert {(bucket, t, key[0]) for bucket, t, key in engine.runner.graphs.graphs} == {
        (4, T, "BlockDecoder"), (2, T, "DreamDecoder")}
    assert backend.captured == len(engine.runner.graphs.graphs) and engine.runner.graphs.replays > 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_equal_eager_on_gpu():
    model, tokenizer = remask.load("tiny-llada", device="cuda")
    want = run(LLMEngine(model, tokenizer), REQUESTS)
    engine = LLMEngine(model, tokenizer, cuda_graphs=True)
    assert run(engine, REQUESTS) == want
    assert engine.runner.graphs.captures >= 2 and engine.runner.graphs.replays > 16
    spec = get_spec(model)
    graphs = GraphedForward(cuda_graphs.make_backend(torch.device("cuda")), 8)
    with torch.no_grad():
        for seed in (1, 2):   # the second replays the first's graph with new rows
            x = canvases(3, 40, seed).cuda()
            with invariant(3):
                want_logits = spec.logits(model, x)
            assert torch.equal(graphs(x, lambda t: spec.logits(model, t), context=invariant), want_logits)
    assert graphs.captures == 1
