"""The chat models' code (tiny-llada-chat / tiny-ar-chat): their data in every format, the chat
template (plain chats unchanged; tools, schemas, calls and tool results rendered), a smoke
training that resumes, every metric of the final report, and the server showing the template
the requested format. The models' weights are trained separately (`python -m remask.zoo.train
--model chat`): nothing here needs them."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from remask.zoo import CHAT_MODELS, CHECKPOINTS, charset, formats, train
from remask.zoo.evaluate import CHAT_GEN_LENGTHS, chat_prompt_ids, structure_of
from remask.zoo.tasks import EVAL_SEED, TASKS, TRAIN_SEED

LLADA_DIR = os.path.join(CHECKPOINTS, "tiny-llada")


@pytest.fixture(scope="module")
def tok():
    return charset.build_tokenizer(formats=True)


# --- data --------------------------------------------------------------------------------------

def test_examples_are_seeded_and_cover_every_kind_and_task():
    a, b = formats.examples(60, seed=3), formats.examples(60, seed=3)
    assert a == b and a != formats.examples(60, seed=4)
    assert [e.kind for e in a[:6]] == list(formats.KINDS)
    held_out = formats.examples(7 * 6 * 6, EVAL_SEED)
    for kind in formats.KINDS:
        tasks = {e.task.split("+")[0] for e in held_out if e.kind == kind}
        assert tasks == (set(formats.TOOL_TASKS) if kind in ("tool_call", "tool_answer") else set(TASKS)), kind
    for e in held_out + formats.examples(600, TRAIN_SEED):
        assert e.is_correct(e.target) and e.right_tool(e.target) and e.target in e.answers
        assert len(e.target) < CHAT_GEN_LENGTHS[e.kind] <= train.CHAT_GEN_LENGTH   # at least one EOS
        offered = [t["function"]["name"] for t in e.tools or ()]
        if e.kind in ("tool_call", "tool_answer"):
            assert set(e.task.split("+")) <= set(offered)
        elif e.kind == "tool_text":
            assert offered and e.task not in offered and not e.needs_tool
        else:
            assert not offered
    shapes = {e.response_format["json_schema"]["name"] for e in held_out if e.kind == "json"}
    assert shapes == set(formats.SHAPES)
    assert any(e.task.count("+") == 1 for e in held_out if e.kind == "tool_call")   # two calls in one answer


def test_scoring_reads_json_and_calls_as_values():
    e = formats.examples(1, EVAL_SEED, kinds=("json",), tasks=("sort",))[0]
    value = json.loads(e.target)
    assert e.is_correct(json.dumps(value, indent=2)) and not e.is_correct(e.target[:-1])
    colour = formats.examples(1, EVAL_SEED, kinds=("json_object",), tasks=("colour",))[0]
    assert colour.is_correct('{"answer": "blue"}') and colour.is_correct('{"answer":"grey"}')
    assert not colour.is_correct('{"answer":"bluwn"}')
    two = next(e for e in formats.examples(80, EVAL_SEED, kinds=("tool_call",)) if "+" in e.task)
    first, second = two.target.split(formats.CALL_TAG)[1:]
    swapped = formats.CALL_TAG + second + formats.CALL_TAG + first
    assert two.is_correct(swapped) and two.right_tool(swapped)
    assert not two.is_correct(formats.CALL_TAG + first) and not two.right_tool(formats.CALL_TAG + first)
    assert not two.right_tool("8") and formats.parse_calls("<tool_call>{") is None
    text = formats.examples(1, EVAL_SEED, kinds=("tool_text",))[0]
    assert text.right_tool(text.target) and not text.right_tool(formats.CALL_TAG + '{"name":"add","arguments":{}}')


def test_targets_are_what_the_server_enforces(tok):
    """Every training answer is one the server's structure accepts (the schema's compact JSON,
    the `auto` tool grammar's calls or text), and the server reads the calls back as trained."""
    from remask.structured import TOOL_CALL_TAG, compile_structure, tool_call_spec

    assert formats.CALL_TAG == TOOL_CALL_TAG
    for e in formats.examples(48, EVAL_SEED, kinds=("json", "json_object", "tool_call", "tool_answer", "tool_text",
                                                    "plain")):
        structure = structure_of(e)
        if e.kind == "plain":
            assert structure is None
            continue
        matcher = compile_structure(structure, tok, charset.VOCAB_SIZE, (charset.MASK_ID,)).matcher([charset.EOS_ID])
        assert matcher.valid(charset.encode_text(e.target) + [charset.EOS_ID]), (e.kind, e.target)
        if e.kind == "tool_call":
            calls = tool_call_spec(list(e.tools), "auto").calls_of(e.target)
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
                   [(c["name"], c["arguments"]) for c in formats.parse_calls(e.target)]


def test_training_batches_are_seeded_and_fit_the_context():
    for ar in (False, True):
        ids, mask, P, whole = train.chat_batch_at(5, 0, 16, ar=ar)
        again = train.chat_batch_at(5, 0, 16, ar=ar)
        assert torch.equal(ids, again[0]) and torch.equal(mask, again[1]) and P == again[2]
        assert torch.equal(whole, again[3]) and whole.shape == (16,)
        assert ids.shape[1] <= charset.CHAT_CONTEXT and bool((ids[:, P:] == charset.EOS_ID).any(1).all())
    lengths = {train.chat_batch_at(step, 0, 4)[0].shape[1] - train.chat_batch_at(step, 0, 4)[2] for step in range(30)}
    assert lengths == set(train.CHAT_LENGTHS)


# --- chat template -----------------------------------------------------------------------------

PLAIN_CHATS = [
    [{"role": "user", "content": "sort 52814"}],
    [{"role": "user", "content": "greet Ada"}, {"role": "assistant", "content": "Hello, Ada!"},
     {"role": "user", "content": "3+4"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}],
    [{"role": "user", "content": "  a+b = {c}; x|y ~"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("messages", PLAIN_CHATS)
def test_plain_chats_render_as_the_shipped_template(tok, messages):
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(LLADA_DIR)
    for generation_prompt in (True, False):
        for extra in ({}, {"tools": None}, {"response_format": {"type": "text"}}):
            old = shipped.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            new = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)
            assert new == old
            new_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt, **extra)
            old_ids = shipped.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
            assert list(getattr(new_ids, "input_ids", new_ids)) == list(getattr(old_ids, "input_ids", old_ids))
    if len(messages) == 1 and messages[0]["role"] == "user":
        ids = chat_prompt_ids(formats.Example("plain", "sort", tuple(messages), None, None, "", ("",)), tok)
        assert ids == charset.encode_chat(messages[0]["content"])


def test_the_shipped_models_keep_their_tokenizer():
    shipped_vocab = {t: i for i, t in enumerate(charset.VOCAB)}
    assert charset.build_tokenizer().get_vocab() == shipped_vocab
    assert charset.build_tokenizer().chat_template == charset.CHAT_TEMPLATE
    chat = charset.build_tokenizer(formats=True)
    assert chat.get_vocab() == {**shipped_vocab, **{t: i for i, t in enumerate(charset.CHAT_VOCAB)}}
    assert [chat.convert_tokens_to_ids(t) for t in charset.FORMAT_TOKENS] == [
        charset.TOOLS_ID, charset.TOOL_ID, charset.FORMAT_ID] == [103, 104, 105]
    assert len(charset.CHAT_VOCAB) <= charset.VOCAB_SIZE


def test_tools_calls_and_tool_results_render_compactly(tok):
    e = next(e for e in formats.examples(40, EVAL_SEED, kinds=("tool_answer",), tasks=("add",)) if "+" not in e.task)
    tools = [formats.TOOLS["add"], formats.TOOLS["capital"], {"type": "function", "function": {"name": "now"}}]
    messages = [*e.messages[:1],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":3,"b":5}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "capital",
                                                                      "arguments": {"country": "Peru"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "8"},
                {"role": "tool", "tool_call_id": "call_2", "content": '{"result":"Lima"}'}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|tools|>add(a:int,b:int);capital(country:str);now()<|eot|>"
        f"<|user|>{e.messages[0]['content']}<|eot|>"
        '<|assistant|><tool_call>{"name":"add","arguments":{"a":3,"b":5}}'
        '<tool_call>{"name":"capital","arguments":{"country":"Peru"}}<|eos|>'
        '<|tool|>8<|eot|><|tool|>{"result":"Lima"}<|eot|><|assistant|>')
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))
    assert charset.UNK_ID not in ids and ids.count(charset.TOOL_ID) == 2 and ids.count(charset.TOOLS_ID) == 1
    # the server hands calls and tool messages to a template that reads them, as they are
    from remask.structured import messages_for_template, template_tool_support

    assert template_tool_support(tok) == (True, True)
    assert messages_for_template(tok, messages) == messages
    # a call in the history renders exactly as the model wrote it
    call = formats.examples(1, EVAL_SEED, kinds=("tool_answer",))[0]
    rendered = tok.apply_chat_template(list(call.messages[:2]), tokenize=False)
    assert formats.examples(1, EVAL_SEED, kinds=("tool_call",))[0].target  # the call kind exists
    assert rendered.endswith("<|assistant|>" + "".join(
        formats.CALL_TAG + formats.compact({"name": c["function"]["name"],
                                            "arguments": json.loads(c["function"]["arguments"])})
        for c in call.messages[1]["tool_calls"]) + "<|eos|>")


@pytest.mark.parametrize("schema, shown", [
    ({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}, "{answer:str}"),
    ({"type": "object", "properties": {"task": {"type": "string"}, "result": {
        "type": "object", "properties": {"value": {"type": "string"}, "length": {"type": "integer"}},
        "required": ["value", "length"]}}, "required": ["task", "result"]}, "{task:str,result:{value:str,length:int}}"),
    # pydantic's shape: titles, $defs / $ref, Optional as anyOf with null, a default, an enum, an array
    ({"$defs": {"Center": {"properties": {"x": {"title": "X", "type": "integer"}, "y": {"type": "number"}},
                           "required": ["x", "y"], "title": "Center", "type": "object"}},
      "properties": {"kind": {"enum": ["circle", "square"], "title": "Kind"}, "center": {"$ref": "#/$defs/Center"},
                     "tags": {"items": {"type": "string"}, "type": "array"},
                     "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
      "required": ["kind", "center", "tags"], "title": "Shape", "type": "object"},
     '{kind:"circle"|"square",center:{x:int,y:num},tags:[str],note?:str|null}'),
    ({"$ref": "#/$defs/N", "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}}},
     "{next?:{next?:{next?:any}}}"),   # recursion stops
    ({"type": "object"}, "object"), ({}, "any"), ({"type": ["integer", "null"]}, "int|null"),
    ({"const": 3}, "3"), ({"type": "array"}, "[any]"),
])
def test_schemas_render_compactly(tok, schema, shown):
    messages = [{"role": "user", "content": "sort 52814"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert text == f"<|bos|><|format|>{shown}<|eot|><|user|>sort 52814<|eot|><|assistant|>"
    plain = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                    response_format={"type": "json_object"})
    assert plain == "<|bos|><|format|>json<|eot|><|user|>sort 52814<|eot|><|assistant|>"


# --- training and the final report -------------------------------------------------------------

METRIC_KEYS = {"plain": {"accuracy", "per_task"}, "json_enforced": {"valid_stop", "correct_stop"},
               "json_unenforced": {"valid_stop", "correct_stop"},
               "tool_auto": {"right_tool_or_text", "exact", "calls_when_needed", "text_when_not"},
               "tool_answer": {"accuracy"}}


def test_chat_training_smoke_resumes_and_reports_every_format(tmp_path):
    from remask.zoo import load
    from remask.zoo.train import main as train_main

    from safetensors.torch import load_file

    small = ["--sequential", "--batch-size", "4", "--width", "16", "--layers", "1", "--eval-problems", "1",
             "--log-every", "2"]
    # the models the chat models start from (`CHAT_BASE`): the first models (4 steps), then tiny-ar-chat from tiny-ar
    assert train_main(["--model", "both", "--out", str(tmp_path / "base"), "--llada-steps", "4", "--ar-steps", "4"]
                      + small) == 0
    assert train_main(["--model", "ar-chat", "--out", str(tmp_path / "base"), "--ar-chat-steps", "2",
                       "--init-from", str(tmp_path / "base")] + small) == 0
    common = ["--model", "chat", "--llada-chat-steps", "4", "--ar-chat-steps", "4",
              "--init-from", str(tmp_path / "base")] + small
    assert train_main(["--out", str(tmp_path / "a")] + common) == 0
    assert train_main(["--out", str(tmp_path / "b"), "--stop-after", "3"] + common) == 0
    assert not (tmp_path / "b" / "tiny-llada-chat" / "model.safetensors").exists()
    assert train_main(["--out", str(tmp_path / "b"), "--resume"] + common) == 0
    for name in ("tiny-llada-chat", "tiny-ar-chat"):
        a = (tmp_path / "a" / name / "model.safetensors").read_bytes()
        assert a == (tmp_path / "b" / name / "model.safetensors").read_bytes(), name
        metrics = json.loads((tmp_path / "a" / name / "metrics.json").read_text())
        strategies = metrics["held_out"]["strategies"]
        assert [s["strategy"] for s in strategies] == (
            ["1 token/step", "threshold 0.9 + dual cache"] if name == "tiny-llada-chat" else ["greedy AR"])
        for s in strategies:
            for key, fields in METRIC_KEYS.items():
                assert set(s[key]) == fields, (name, key)
                assert all(0.0 <= v <= 1.0 for k, v in s[key].items() if k != "per_task")
        model, tok = load(str(tmp_path / "a" / name))
        config = model.config
        context = config.max_sequence_length if name == "tiny-llada-chat" else config.max_position_embeddings
        assert context == charset.CHAT_CONTEXT == 512
        assert tok.chat_template == charset.CHAT_FORMATS_TEMPLATE and tok.convert_tokens_to_ids("<|tool|>") == 104
    config = json.loads((tmp_path / "a" / "tiny-llada-chat" / "config.json").read_text())
    assert config["trained_gen_length"] == train.CHAT_GEN_LENGTH
    # started from their base models' weights (tiny-llada-chat: tiny-ar-chat's, renamed): 0 steps give them back
    for name, base in train.CHAT_BASE.items():
        assert train_main(["--out", str(tmp_path / "zero"), "--model", which(name), "--llada-chat-steps", "0",
                           "--ar-chat-steps", "0", "--init-from", str(tmp_path / "base")] + small) == 0
        started = load_file(str(tmp_path / "zero" / name / "model.safetensors"))
        first = load_file(str(tmp_path / "base" / base / "model.safetensors"))
        if name == "tiny-llada-chat":
            first = train.llama_to_llada(first)
        assert started.keys() == first.keys() and all(torch.equal(started[k], first[k]) for k in first), name
        metrics = json.loads((tmp_path / "zero" / name / "metrics.json").read_text())
        assert metrics["init_from"] == base


def test_a_grown_model_starts_as_its_base():
    """`load_grown`: a model with a layer more than its start weights computes exactly what they did (the new
    layer's output projections are zero: the residual stream passes it unchanged); weights it cannot hold are
    refused."""
    base, _ = train.build_model("tiny-llada-chat", 0, width=16, layers=1)
    grown, _ = train.build_model("tiny-llada-chat", 1, width=16, layers=2)
    train.load_grown(grown, base.state_dict())
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(base(ids).logits, grown(ids).logits)
    with pytest.raises(ValueError, match="do not fit"):
        train.load_grown(base, grown.state_dict())


def which(name: str) -> str:
    return {"tiny-llada-chat": "llada-chat", "tiny-ar-chat": "ar-chat"}[name]


def test_chunked_losses_equal_the_whole_batch():
    for name in ("tiny-llada-chat", "tiny-ar-chat"):
        model, _ = train.build_model(name, 0, width=16, layers=1)
        ids, mask, P, _ = train.chat_batch_at(3, 0, 12, ar=name == "tiny-ar-chat")
        with torch.no_grad():
            if name == "tiny-llada-chat":
                whole = train.llada_sft_loss(model, ids, mask, P, torch.Generator().manual_seed(1))
                chunked = train.llada_sft_loss(model, ids, mask, P, torch.Generator().manual_seed(1), chunks=4)
                shares = [train.llada_sft_loss(model, ids, mask, P, torch.Generator().manual_seed(1), chunks=4,
                                               share=(rank, 2)) for rank in (0, 1)]
            else:
                whole, chunked = train.ar_loss(model, ids, mask, P), train.ar_loss(model, ids, mask, P, chunks=4)
                shares = [train.ar_loss(model, ids, mask, P, chunks=4, share=(rank, 2)) for rank in (0, 1)]
        assert torch.allclose(whole, chunked, rtol=1e-5), name
        # `--procs 2`: each rank's part of the chunks, the batch's normalisation: the parts add up to the batch
        assert 0 < shares[0] < chunked and torch.allclose(shares[0] + shares[1], chunked, rtol=1e-5), name


def test_rows_drawn_whole_are_trained_with_every_answer_position_masked(monkeypatch):
    """`CHAT_WHOLE_MASKED`: the tool conversations' share of rows at t = 1 (every answer position masked, the
    state decoding starts from); the other rows' noise is the noise without it."""
    model, _ = train.build_model("tiny-llada-chat", 0, width=16, layers=1)
    step = next(s for s in range(20) if train.chat_batch_at(s, 0, 12)[3].any())
    ids, mask, P, whole = train.chat_batch_at(step, 0, 12)
    assert set(whole.tolist()) <= set(torch.tensor([0.0, *train.CHAT_WHOLE_MASKED.values()]).tolist())
    fed = []
    monkeypatch.setattr(model, "forward", lambda x, attention_mask: fed.append(x) or
                        type("Out", (), {"logits": torch.zeros(*x.shape, charset.VOCAB_SIZE)})())
    shares = {"none": None, "all": torch.where(whole > 0, 1.0, 0.0), "never": torch.zeros(12)}
    for share in shares.values():
        train.llada_sft_loss(model, ids, mask, P, torch.Generator().manual_seed(1), whole=share)
    masked = {name: (x[:, P:] == charset.MASK_ID) for name, x in zip(shares, fed)}
    rows = whole > 0
    assert bool(masked["all"][rows].all()) and not bool(masked["none"][rows].all())
    assert torch.equal(masked["all"][~rows], masked["none"][~rows]) and torch.equal(masked["never"], masked["none"])


def test_data_parallel_training_is_the_single_process_run_and_resumes(tmp_path):
    """`--procs 2` (two processes on loopback, gradients summed) trains the weights one process trains (up to the
    order of the gradient sum), is seeded, and resumes to the bits of an uninterrupted run."""
    from safetensors.torch import load_file

    from remask.zoo.train import main as train_main

    common = ["--model", "llada-chat", "--from-scratch", "--llada-chat-steps", "4", "--batch-size", "8", "--width",
              "16", "--layers", "1", "--eval-problems", "1", "--log-every", "2"]
    assert train_main(["--out", str(tmp_path / "one")] + common) == 0
    assert train_main(["--out", str(tmp_path / "two"), "--procs", "2"] + common) == 0
    assert train_main(["--out", str(tmp_path / "cut"), "--procs", "2", "--stop-after", "3"] + common) == 0
    assert train_main(["--out", str(tmp_path / "cut"), "--procs", "2", "--resume"] + common) == 0
    one, two, cut = (load_file(str(tmp_path / run / "tiny-llada-chat" / "model.safetensors"))
                     for run in ("one", "two", "cut"))
    assert two.keys() == one.keys() and any(not torch.equal(two[k], one[k]) for k in one)   # two sums, not one
    assert all(torch.allclose(two[k], one[k], atol=1e-5) for k in one)
    assert all(torch.equal(two[k], cut[k]) for k in one)
    assert json.loads((tmp_path / "two" / "tiny-llada-chat" / "metrics.json").read_text())["processes"] == 2
    with pytest.raises(SystemExit):
        train_main(["--out", str(tmp_path / "bad"), "--procs", "0"] + common)


def test_chat_models_load_by_name_once_trained():
    from remask.zoo import checkpoint_path, load

    assert checkpoint_path("tiny-llada-chat") == os.path.join(CHECKPOINTS, "tiny-llada-chat")
    if not os.path.exists(os.path.join(CHECKPOINTS, "tiny-ar-chat", "config.json")):
        with pytest.raises(FileNotFoundError, match="--model chat"):
            load("tiny-ar-chat")


# The issue's targets (held-out, enforced where the server enforces): plain answers as the first
# models (100%), JSON valid and correct at `stop` ≥ 90%, the right tool (or text) with `auto` ≥ 90%,
# the answer after the tool results ≥ 90%.
CHAT_TARGETS = {("plain", "accuracy"): 1.0, ("json_enforced", "correct_stop"): 0.9,
                ("tool_auto", "right_tool_or_text"): 0.9, ("tool_answer", "accuracy"): 0.9}
# Not met: asserted to be short, so a model that meets it fails here until the entry is removed and
# the target holds like the others (model, rule, format, figure; docs/models.md: tiny-llada-chat's eleventh
# run is shipped short of enforced JSON's correct answers, 86% / 81%, under both rules; tiny-ar-chat meets every
# target).
LLADA_CHAT_RULES = ("1 token/step", "threshold 0.9 + dual cache")
SHORT_OF_TARGET: set[tuple[str, str, str, str]] = {
    ("tiny-llada-chat", rule, "json_enforced", "correct_stop") for rule in LLADA_CHAT_RULES}
SHIPPED_CHAT = [n for n in CHAT_MODELS if os.path.exists(os.path.join(CHECKPOINTS, n, "config.json"))]
RECHECKED = 8   # examples per format decoded again here (the first of the 56 the metrics counted)


@pytest.mark.parametrize("name", SHIPPED_CHAT)
def test_shipped_chat_models_meet_the_targets(name):
    """The committed metrics meet the targets under every rule, and the shipped weights give them
    again on the first examples of each format (at most one of 8 off, as 56 examples allow)."""
    from remask.models import get_spec
    from remask.zoo import load
    from remask.zoo.evaluate import chat_metrics, chat_strategies

    with open(os.path.join(CHECKPOINTS, name, "metrics.json")) as f:
        documented = json.load(f)["held_out"]["strategies"]
    for figures in documented:
        for (kind, key), target in CHAT_TARGETS.items():
            met = figures[kind][key] >= target
            assert met != ((name, figures["strategy"], kind, key) in SHORT_OF_TARGET), (
                name, figures["strategy"], kind, key, figures[kind][key])
    model, tok = load(name)
    strategies = chat_strategies(get_spec(model).kind == "ar")
    assert [s.name for s in strategies] == [f["strategy"] for f in documented]
    again = chat_metrics(model, tok, RECHECKED, strategies[-1])   # the fastest rule (threshold + cache, or AR)
    n = documented[-1]["n_per_format"]
    for (kind, key), _ in CHAT_TARGETS.items():
        # the first 8 of the 56 spread around the 56's share: up to 1.5 examples off, or three standard deviations
        # of a draw of 8 from the 56 where the share is far from 0 and 1 (tiny-llada-chat's figures near 60%)
        p = documented[-1][kind][key]
        slack = max(1.5, 3 * math.sqrt(RECHECKED * p * (1 - p) * (n - RECHECKED) / (n - 1))) / RECHECKED
        assert again[kind][key] >= p - slack, (name, kind, key, again[kind][key])


# --- the server shows the template the requested format ----------------------------------------

def test_the_server_renders_tools_and_response_format_through_the_template(tmp_path, tok):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import remask
    from remask.serve import AsyncEngine, build_app
    from helpers import Server

    model, config = train.build_model("tiny-ar-chat", 0, width=16, layers=1)
    train.save_checkpoint("tiny-ar-chat", model, config, str(tmp_path / "m"))
    engine = AsyncEngine(remask.LLM(str(tmp_path / "m")))
    server = Server(build_app({"m": engine}))
    try:
        def prompt_tokens(**body) -> int:
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                               json={"model": "m", "max_tokens": 64, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"]

        json_example = formats.examples(1, EVAL_SEED, kinds=("json",))[0]
        messages = list(json_example.messages)
        assert prompt_tokens(messages=messages, response_format=json_example.response_format) == \
            len(chat_prompt_ids(json_example, tok))
        schema = json_example.response_format["json_schema"]["schema"]
        assert prompt_tokens(messages=messages, structured_outputs={"json": json.dumps(schema)}) == \
            len(chat_prompt_ids(json_example, tok))
        assert prompt_tokens(messages=messages) == len(charset.encode_chat(messages[0]["content"]))
        answer = formats.examples(1, EVAL_SEED, kinds=("tool_answer",))[0]
        assert prompt_tokens(messages=list(answer.messages), tools=list(answer.tools)) == \
            len(chat_prompt_ids(answer, tok))
    finally:
        server.stop()
        engine.shutdown()


def test_template_response_format_reads_both_fields():
    from remask.serve.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    openai_form = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    cases = [({"response_format": openai_form}, openai_form),
             ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
             ({"structured_outputs": {"json": schema}}, {"type": "json_schema", "json_schema": {
                 "name": "structured_outputs", "schema": schema}}),
             ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
             ({"response_format": {"type": "text"}}, None), ({"structured_outputs": {"regex": "a+"}}, None), ({}, None)]
    for fields, want in cases:
        request = ChatCompletionRequest(model="m", messages=messages, **fields)
        request.structured()
        assert request.template_response_format() == want, fields
