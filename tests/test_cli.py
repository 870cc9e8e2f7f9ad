"""The `remask` command: --help lists the subcommands; `models` and `generate` on the shipped models;
errors are one line naming the flag."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import remask
from remask.cli import main


def test_help_lists_the_subcommands():
    done = subprocess.run([sys.executable, "-m", "remask", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("eval", "serve", "models", "generate"):
        assert command in done.stdout


def test_models_describes_the_zoo_and_folders(capsys, tmp_path):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tiny-llada"]["kind"] == "llada" and rows["tiny-llada"]["mask_id"] == 4
    assert rows["tiny-ar"]["kind"] == "ar" and rows["tiny-ar"]["chat_template"]
    model, _ = remask.load("tiny-llada")
    assert rows["tiny-llada"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert main(["models"]) == 0 and "tiny-ar" in capsys.readouterr().out
    assert main(["models", str(tmp_path)]) == 2 and "config.json" in capsys.readouterr().err


def test_generate_prompts_and_jsonl_equal_the_llm(capsys, monkeypatch, tmp_path):
    assert main(["generate", "tiny-llada", "--prompt", "sort 52814", "--chat", "--steps", "16", "--block-length", "8",
                 "--threshold", "0.9", "--quiet"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = remask.LLM("tiny-llada")
    want = llm.generate("sort 52814", remask.SamplingParams(steps=16, block_length=8, threshold=0.9), use_tqdm=False,
                        chat=True)[0].outputs[0]
    assert row["text"] == want.text == "12458" and row["token_ids"] == want.token_ids and row["nfe"] == want.nfe

    lines = [{"id": "x", "prompt": "reverse abcd"},
             {"messages": [{"role": "user", "content": "sort 97531"}], "temperature": 0.7, "seed": 4, "n": 2}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["generate", "tiny-ar", "--input", str(source), "--output", str(out), "--chat", "--quiet",
                 "--max-tokens", "12"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("id") for r in rows] == ["x", None, None] and [r["index"] for r in rows] == [0, 0, 1]
    ar = remask.LLM("tiny-ar")
    sampled = ar.chat(lines[1]["messages"], remask.SamplingParams(max_tokens=12, temperature=0.7, seed=4, n=2),
                      use_tqdm=False)[0]
    assert [r["text"] for r in rows[1:]] == [o.text for o in sampled.outputs]

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt": "a", "messages": []}\n'))
    assert main(["generate", "tiny-ar", "--input", "-"]) == 2
    assert "line 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "tiny-llada", "--prompt", "x", "--steps", "0"], "steps"),
    (["generate", "tiny-llada", "--prompt", "x", "--use-cache", "sometimes"], "use_cache"),
    (["generate", "no-such-model", "--prompt", "x"], "no-such-model"),
    (["generate", "tiny-llada"], "--prompt"),
])
def test_bad_flags_are_one_line_naming_them(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_generate_data_parallel_under_torchrun_equals_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m remask generate`: each rank decodes its share, rank 0 writes
    every answer in input order — byte for byte what one process writes."""
    import shutil

    torchrun = shutil.which("torchrun", path=str(__import__("pathlib").Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    lines = [{"id": "a", "prompt": "sort 97531"}, {"prompt": "reverse wxyz", "temperature": 0.5, "seed": 2},
             {"prompt": "add 12 30"}, {"prompt": "capital of Peru", "n": 2, "temperature": 0.9}, {"prompt": "greet Ada"}]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    common = ["-m", "remask", "generate", "tiny-llada", "--input", str(source), "--chat", "--quiet", "--steps", "16",
              "--block-length", "8"]
    one = subprocess.run([sys.executable, *common, "--output", str(tmp_path / "one.jsonl")], capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([torchrun, "--nproc_per_node", "2", *common, "--output", str(tmp_path / "two.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()
    assert len((tmp_path / "two.jsonl").read_text().splitlines()) == 6


def test_importing_remask_prints_nothing():
    """Not even the messages torchao's import would print on a CPU machine (remask/_noise.py)."""
    done = subprocess.run([sys.executable, "-c", "import remask, remask.zoo; remask.load('tiny-ar')"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and "Failed to load" not in done.stderr
    assert "register_constant" not in done.stderr


def test_bench_dispatches_to_the_checkout_scripts(capsys):
    assert main(["bench", "no-such"]) == 2 and "unknown benchmark" in capsys.readouterr().err
    assert main(["bench", "quantized", "--problems", "2"]) == 0
    assert "| tiny-ar | greedy |" in capsys.readouterr().out
