"""The `remask` command: --help lists the subcommands, gives every flag a line and imports no torch;
`models` and `generate` on the shipped models; errors are one line naming the flag."""
from __future__ import annotations

import argparse
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
    every answer in input order — byte for byte what one process writes; and the ranks print nothing."""
    import shutil

    torchrun = shutil.which("torchrun", path=str(__import__("pathlib").Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    lines = [{"id": "a", "prompt": "sort 97531"}, {"prompt": "reverse wxyz", "temperature": 0.5, "seed": 2},
             {"prompt": "add 12 30"}, {"prompt": "capital of Peru", "n": 2, "temperature": 0.9}, {"prompt": "greet Ada"}]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    common = ["generate", "tiny-llada", "--input", str(source), "--chat", "--quiet", "--steps", "16", "--block-length", "8"]
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0     # one process: this one
    two = subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "remask", *common, "--output",
                          str(tmp_path / "two.jsonl")], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert (tmp_path / "one.jsonl").read_bytes() == (tmp_path / "two.jsonl").read_bytes()
    assert len((tmp_path / "two.jsonl").read_text().splitlines()) == 6
    # Fresh processes that import remask and load a model print nothing: not even the messages torchao's
    # import would print on a CPU machine (remask/_noise.py). (Checked on these ranks: one launch fewer.)
    assert two.stdout == "" and "Failed to load" not in two.stderr and "register_constant" not in two.stderr


def test_bench_dispatches_to_the_checkout_scripts(capsys):
    assert main(["bench", "no-such"]) == 2 and "unknown benchmark" in capsys.readouterr().err
    assert main(["bench", "quantized", "--problems", "2"]) == 0
    assert "| tiny-ar | greedy |" in capsys.readouterr().out


# What `--help` may not import: `python -c` with the package `remask` stood in by a bare module on its
# path, so that cli.py's own imports are measured whatever remask/__init__.py imports.
HEAVY = ("torch", "transformers", "remask.engine", "remask.diffusion", "remask.models", "remask.integrations")
HELP_ARGVS = (["--help"], ["generate", "--help"], ["serve", "--help"], ["models", "--help"], ["eval", "--help"],
              ["bench", "--help"])


def test_help_imports_neither_torch_nor_remask_submodules():
    code = ("import contextlib, importlib.util, io, json, sys, types\n"
            "spec = importlib.util.find_spec('remask')\n"
            "package = types.ModuleType('remask')\n"
            "package.__path__ = list(spec.submodule_search_locations)\n"
            "sys.modules['remask'] = package\n"
            "from remask.cli import main\n"
            "out = {}\n"
            f"for argv in {list(HELP_ARGVS)!r}:\n"
            "    text = io.StringIO()\n"
            "    with contextlib.redirect_stdout(text):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "    out[' '.join(argv)] = text.getvalue()\n"
            f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], 'out': out}}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["heavy"] == []
    out = result["out"]
    assert "--ignore-eos" in out["generate --help"] and "lm-eval run" in out["eval --help"]
    assert all(name in out["bench --help"] for name in ("kernels", "engine", "serve", "quantized", "ablate"))


def test_help_through_the_entry_point_imports_no_torch():
    """`python -m remask --help` end to end: the package `remask` is imported first (the entry point
    `remask.cli:main` does the same)."""
    package = subprocess.run([sys.executable, "-c", "import sys, remask; print('torch' in sys.modules)"],
                             capture_output=True, text=True, timeout=120)
    assert package.returncode == 0, package.stderr[-2000:]
    assert package.stdout.strip() == "False", "`import remask` imports torch"
    code = ("import runpy, sys\n"
            "sys.argv = ['remask', '--help']\n"
            "try:\n"
            "    runpy.run_module('remask', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generate" in done.stdout


def test_every_flag_has_help_and_the_batch_example_uses_chat():
    from remask.cli import build_parser

    parser, _ = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"remask {name} {'/'.join(action.option_strings) or action.dest} has no help"
    generate = commands.choices["generate"].format_help()
    [batch] = [line for line in generate.splitlines() if "--input requests.jsonl" in line and "tiny-ar" in line]
    assert "--chat" in batch


def test_the_flags_are_the_sampling_params_fields():
    """cli.SAMPLING_FLAGS is written out (the dataclass sits behind torch): the same fields, each
    with the kind of flag its type asks for."""
    import dataclasses
    import typing

    from remask.cli import SAMPLING_FLAGS

    hints = typing.get_type_hints(remask.SamplingParams)
    expected = {}
    for field in dataclasses.fields(remask.SamplingParams):
        hint = str(hints[field.name])
        if field.name == "sparse":        # an object holding a config: no flag
            continue
        if field.name == "output_kind":   # how the engine reports a request; the CLI's LLM.generate sets it
            continue
        if field.name in ("decoder", "structured_outputs"):
            expected[field.name] = "json"
        elif field.name == "use_cache":
            expected[field.name] = "cache"
        elif "tuple" in hint:
            expected[field.name] = "ints" if "int" in hint else "strs"
        elif hints[field.name] is bool:
            expected[field.name] = "bool"
        elif "bool" in hint and "str" in hint:
            expected[field.name] = "bool_or_str"
        else:
            expected[field.name] = "int" if "int" in hint else "float" if "float" in hint else "str"
    assert {name: kind for name, kind, _ in SAMPLING_FLAGS} == expected
    assert all(text for _, _, text in SAMPLING_FLAGS)


def test_the_choice_lists_equal_the_library_s():
    from remask import cli
    from remask.diffusion.parts.cache import CACHE_MODES
    from remask.diffusion.methods import registry
    from remask.diffusion.families.dream import ALGORITHMS
    from remask.diffusion.families.llada import REMASKING

    assert cli.REMASKING == REMASKING and cli.ALGORITHMS == ALGORITHMS
    assert cli.CACHE_NAMES == tuple(m for m in CACHE_MODES if m is not None)
    assert cli.DECODERS == tuple(registry.names("decoder")) and cli.CACHE_CONFIGS == tuple(registry.names("use_cache"))


def test_serve_limits_are_the_app_s_and_reach_it(monkeypatch):
    """`remask serve --max-n / --body-timeout / --max-body-bytes`: defaults equal build_app's, and
    given values are passed to it."""
    import inspect

    from remask import cli
    from remask.serve import app

    from remask.serve import server

    signature = inspect.signature(app.build_app).parameters
    assert {name: signature[name].default for name in cli.SERVE_DEFAULTS} == cli.SERVE_DEFAULTS
    assert cli.SHUTDOWN_GRACE == server.SHUTDOWN_GRACE
    seen = {}
    monkeypatch.setattr(app, "build_app", lambda engines, **kw: seen.update(kw) or "app")
    import remask.serve

    monkeypatch.setattr(remask.serve, "build_app", app.build_app)
    monkeypatch.setattr(remask.serve, "serve", lambda *a, **kw: seen.update(kw) or 0)
    monkeypatch.setattr(remask.serve, "AsyncEngine", lambda llm, **kw: llm)
    import remask as package

    monkeypatch.setattr(package, "LLM", lambda *a, **kw: "llm", raising=False)
    assert cli.main(["serve", "tiny-llada", "--max-n", "4", "--body-timeout", "2.5", "--max-body-bytes", "4096",
                     "--shutdown-grace", "7"]) == 0
    assert (seen["max_n"], seen["body_timeout"], seen["max_body_bytes"], seen["shutdown_grace"]) == (4, 2.5, 4096, 7)
    assert seen["api_key"] is None


def test_serve_takes_several_api_keys(monkeypatch, tmp_path):
    """`--api-key` repeats and `--api-key-file` holds one key per line: build_app gets them all."""
    from remask import cli
    import remask as package
    import remask.serve

    seen = {}
    monkeypatch.setattr(remask.serve, "build_app", lambda engines, **kw: seen.update(kw) or "app")
    monkeypatch.setattr(remask.serve, "serve", lambda *a, **kw: 0)
    monkeypatch.setattr(remask.serve, "AsyncEngine", lambda llm, **kw: llm)
    monkeypatch.setattr(package, "LLM", lambda *a, **kw: "llm", raising=False)
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nkey-c\n\nkey-d\n")
    assert cli.main(["serve", "tiny-llada", "--api-key", "key-a", "--api-key", "key-b",
                     "--api-key-file", str(keys)]) == 0
    assert seen["api_key"] == ["key-a", "key-b", "key-c", "key-d"]


def test_generate_ignore_eos_and_min_tokens(capsys):
    """--ignore-eos and --min-tokens reach SamplingParams: the command's answers are the LLM's."""
    llm = remask.LLM("tiny-ar")
    for flags, settings in ((["--ignore-eos"], dict(ignore_eos=True)), (["--min-tokens", "10"], dict(min_tokens=10))):
        assert main(["generate", "tiny-ar", "--prompt", "sort 52814", "--chat", "--max-tokens", "24", "--quiet",
                     *flags]) == 0
        [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        want = llm.generate("sort 52814", remask.SamplingParams(max_tokens=24, **settings), use_tqdm=False,
                            chat=True)[0].outputs[0]
        assert row["token_ids"] == want.token_ids and row["finish_reason"] == want.finish_reason
        assert len(row["token_ids"]) == 24 if "ignore_eos" in settings else len(row["token_ids"]) >= 10


def test_apd_names_its_verifier_on_the_flag_and_on_input_lines(capsys, tmp_path):
    """`--decoder` and a `--input` line's `decoder` name APD's verifier by shipped name (or folder); both
    decode what the library does with the loaded verifier; a bad name is one line naming decoder.verifier."""
    apd = {"name": "apd", "verifier": "tiny-ar", "kv_window": 4, "max_lookahead": 8}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "sort 52814", "decoder": apd}) + "\n")
    assert main(["generate", "tiny-llada", "--input", str(source), "--chat", "--quiet", "--max-tokens", "12"]) == 0
    assert main(["generate", "tiny-llada", "--prompt", "sort 52814", "--chat", "--quiet", "--max-tokens", "12",
                 "--decoder", json.dumps(apd)]) == 0
    line_row, flag_row = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    config = remask.APDConfig(remask.load("tiny-ar")[0], kv_window=4, max_lookahead=8)
    want = remask.LLM("tiny-llada").generate("sort 52814", remask.SamplingParams(max_tokens=12, decoder=config),
                                             use_tqdm=False, chat=True)[0].outputs[0]
    assert line_row["token_ids"] == flag_row["token_ids"] == want.token_ids
    source.write_text(json.dumps({"prompt": "x", "decoder": {**apd, "verifier": "no-such-model"}}) + "\n")
    assert main(["generate", "tiny-llada", "--input", str(source), "--quiet"]) == 2
    assert "line 1: decoder.verifier" in capsys.readouterr().err
