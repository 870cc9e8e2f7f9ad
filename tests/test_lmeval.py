"""The lm-evaluation-harness adapter: `remask eval` / `simple_evaluate` on the shipped offline task
give exactly `remask.zoo.evaluate`'s accuracy and answers; likelihoods are defined and seeded."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import remask  # noqa: E402
from remask.integrations.lmeval import RemaskLM, task_dir  # noqa: E402
from remask.zoo.evaluate import Strategy, evaluate  # noqa: E402
from remask.zoo.tasks import EVAL_SEED, problems  # noqa: E402

N = 40


@pytest.fixture(scope="module")
def task_manager():
    """The shipped task's index (lm-eval's own tasks left out: their index reads every one of its task files)."""
    return TaskManager(include_path=task_dir(), include_defaults=False)


@pytest.mark.parametrize("pretrained,model_args,strategy", [
    ("tiny-llada", dict(steps=16, block_length=8, max_tokens=16), Strategy.of("blocks of 8", steps=16, block_length=8)),
    ("tiny-llada", dict(steps=16, block_length=16, threshold=0.9, max_tokens=16),
     Strategy.of("threshold", steps=16, threshold=0.9)),
    ("tiny-ar", dict(max_tokens=16), Strategy.of("greedy", ar=True)),
])
def test_accuracy_and_answers_equal_the_zoo_evaluation(pretrained, model_args, strategy, task_manager):
    lm = RemaskLM(pretrained=pretrained, **model_args)
    results = lm_eval.simple_evaluate(model=lm, tasks=["remask_tiny"], limit=N, apply_chat_template=True,
                                      task_manager=task_manager, log_samples=True,
                                      random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    accuracy = results["results"]["remask_tiny"]["exact_match,none"]
    model, _ = remask.load(pretrained)
    expected = evaluate(model, problems(N, EVAL_SEED), strategy)
    assert accuracy == expected.accuracy
    answers = [s["resps"][0][0] for s in sorted(results["samples"]["remask_tiny"], key=lambda s: s["doc_id"])]
    assert answers == expected.outputs


# `remask eval` with lm-eval's own flags and seeded sampling, on a clean environment without network; beside the
# shipped task, two user task folders (--include_path given twice, both spellings). Where there is no CUDA the run
# gives no --device: lm-eval's default is cuda:0, and `remask eval` gives the CPU instead, without a warning.
EVAL_ARGS = ["-m", "remask", "eval", "--model", "remask", "--model_args",
             "pretrained=tiny-llada,steps=16,block_length=8,max_tokens=16,temperature=0.8,seed=5",
             "--tasks", "my_task,their_task,remask_tiny", "--apply_chat_template", "--limit", "16", "--log_samples",
             *(["--device", "cpu"] if torch.cuda.is_available() else [])]
OFFLINE = {"PATH": "/usr/bin:/bin", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}

USER_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _user_task(folder, name: str) -> None:
    """A task folder of the kind a user passes with --include_path: YAML over a local JSONL file."""
    folder.mkdir()
    data = folder / "data.jsonl"
    data.write_text(json.dumps({"prompt": "sort 52814", "answer": "12458"}) + "\n"
                    + json.dumps({"prompt": "reverse abcd", "answer": "dcba"}) + "\n")
    (folder / f"{name}.yaml").write_text(USER_TASK.format(name=name, data=data))


def _run_eval(launcher: list[str], out, home, tasks) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    """One `remask eval` run (EVAL_ARGS, the user tasks in `tasks`, a fresh HOME) under `launcher`: its results
    JSON, its sampled answers to remask_tiny by doc, and the finished process."""
    include = ["--include_path", str(tasks / "mine"), f"--include_path={tasks / 'theirs'}"]
    done = subprocess.run([*launcher, *EVAL_ARGS, *include, "--output_path", str(out)], capture_output=True, text=True,
                          timeout=600, env={**OFFLINE, "HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = list(out.rglob("results_*.json"))
    [samples] = list(out.rglob("samples_remask_tiny_*.jsonl"))
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    return json.loads(result.read_text()), [r["resps"][0][0] for r in rows], done


@pytest.fixture(scope="module")
def one_process_eval(tmp_path_factory):
    """The one-process run that the checks below read and the torchrun run is compared with (one launch:
    each pays the imports and lm-eval's task index)."""
    home = tmp_path_factory.mktemp("eval-home")
    _user_task(home / "mine", "my_task")
    _user_task(home / "theirs", "their_task")
    return home, _run_eval([sys.executable], home / "one", home, home)


def test_remask_eval_command_runs_offline_and_logs_its_settings(one_process_eval):
    """`python -m remask eval` without network: an accuracy and remask's settings in the results (a second launch
    giving the same sampled answers: the torchrun test below, whose two processes equal this one)."""
    _, (first, answers, _) = one_process_eval
    assert 0 < first["results"]["remask_tiny"]["exact_match,none"] <= 1 and len(answers) == 16
    assert "sampling_params" in json.dumps(first)       # remask's settings logged beside the numbers


def test_remask_eval_sees_every_include_path_and_the_shipped_task(one_process_eval):
    """Each --include_path (given twice, both spellings) and the shipped remask_tiny are all found
    (lm-eval's own flag keeps one path, and a comma-joined one is read as a single folder); the user
    tasks' `do_sample: false` decodes greedily whatever the model_args' temperature. Without CUDA no
    --device was given, and the CPU was used without a warning."""
    _, (first, _, done) = one_process_eval
    assert "remask_tiny" in done.stdout and "CUDA is not available" not in done.stderr
    results = first["results"]
    assert results["my_task"]["exact_match,none"] == results["their_task"]["exact_match,none"] == 1.0


def test_a_cuda_device_asked_for_by_name_falls_back_to_the_cpu_with_a_warning():
    """(`remask eval` without --device: the test above.)"""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the device exists")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        RemaskLM(pretrained="tiny-ar", device="cuda")


def test_loglikelihoods():
    def requests(pairs, kind="loglikelihood"):
        return [Instance(request_type=kind, doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]

    ar = RemaskLM(pretrained="tiny-ar")
    tok = ar.tokenizer
    chat = ar.apply_chat_template([{"role": "user", "content": "sort 52814"}])
    (right, greedy_right), (wrong, greedy_wrong) = ar.loglikelihood(requests([(chat, "12458"), (chat, "99999")]))
    assert right > wrong and greedy_right and not greedy_wrong
    # exact: the sum of the model's own log-probabilities
    ids = tok(chat + "12458", add_special_tokens=False)["input_ids"]
    context = len(tok(chat, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(ar.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    assert right == pytest.approx(float(sum(logprobs[i - 1, ids[i]] for i in range(context, len(ids)))), abs=1e-4)
    [rolling] = ar.loglikelihood_rolling(requests([("sort 52814",)], "loglikelihood_rolling"))
    assert rolling < 0

    llada = RemaskLM(pretrained="tiny-llada", mc_num=32, mc_batch_size=8, is_check_greedy=True)
    chat = llada.apply_chat_template([{"role": "user", "content": "sort 52814"}])
    first = llada.loglikelihood(requests([(chat, "12458"), (chat, "99999")]))
    again = llada.loglikelihood(requests([(chat, "12458"), (chat, "99999")]))
    assert first == again                                   # seeded Monte-Carlo draws
    assert first[0][0] > first[1][0] and first[0][1] and not first[1][1]
    with pytest.raises(NotImplementedError, match="diffusion"):
        llada.loglikelihood_rolling(requests([("x",)], "loglikelihood_rolling"))
    with pytest.raises(ValueError, match="mc_num"):
        RemaskLM(pretrained="tiny-llada", mc_num=10, mc_batch_size=4)
    with pytest.raises(ValueError, match="steps"):
        RemaskLM(pretrained="tiny-llada", steps=0)


def test_data_parallel_under_torchrun_equals_one_process(tmp_path, one_process_eval):
    """`torchrun --nproc_per_node 2 -m remask eval`: lm-eval shards the requests over two processes
    (gloo); every sampled answer and the accuracy equal one process's (so a second launch reproduces the first)."""
    import pathlib
    import shutil

    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    home, (one, one_answers, _) = one_process_eval
    two, two_answers, _ = _run_eval([torchrun, "--nproc_per_node", "2"], tmp_path / "two", tmp_path, home)
    assert len(one_answers) == 16 and two_answers == one_answers
    assert two["results"]["remask_tiny"]["exact_match,none"] == one["results"]["remask_tiny"]["exact_match,none"]


def test_mc_loglikelihood_replays_llada_eval_code_with_reference_rng():
    """16 cases (right and wrong continuations, CFG 0 and 0.5) from LLaDA's own `eval_llada.py`
    estimator run with `torch.manual_seed(seed)`: `reference_rng=True` gives the same values (the same
    draws; the sums to float32 rounding, docs/reference-fixtures.md)."""
    import pathlib

    data = json.loads((pathlib.Path(__file__).parent / "fixtures" / "llada_mc_loglikelihood.json").read_text())
    tok = None
    for case in data["cases"]:
        lm = RemaskLM(pretrained="tiny-llada", mc_num=case["mc_num"], mc_batch_size=case["mc_batch_size"],
                      cfg_scale=case["cfg"], reference_rng=True)
        tok = tok or lm.tokenizer
        context, continuation = tok.decode(case["context"]), tok.decode(case["continuation"])
        assert lm._encode_pair(context, continuation) == (case["context"], case["continuation"])
        torch.manual_seed(case["seed"])
        [(value, _)] = lm.loglikelihood([Instance(request_type="loglikelihood", doc={},
                                                  arguments=(context, continuation), idx=0)])
        # the draws are replayed exactly; the float32 sums inside the forward may round differently
        # on another CPU (its SIMD width changes the reduction order), hence a few float32 ulps
        assert value == pytest.approx(case["reference"], rel=1e-6, abs=1e-6), case
