"""Tensor parallel on CPU (gloo, 2 processes under torchrun): LLaDA and Dream load sharded the
transformers way (`DistributedConfig(tp_plan="auto")`: q/k/v and MLP inputs by columns, outputs by
rows, the LM head by vocabulary with its logits left sharded) and decode the same tokens as one
process. The fused scoring works on each rank's vocabulary columns and combines a few numbers per
row: on those paths full logits are never gathered (the test counts `DTensor.full_tensor` calls);
the reference formulations (whole-row noise, Dream's top-p) gather, and still match."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import remask
from remask.models import tiny

SCRIPT = textwrap.dedent('''
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    import remask.models   # registers remask's families with transformers' Auto classes
    from transformers import AutoModel
    from transformers.distributed import DistributedConfig
    def run(path, prompts, settings):
        model = AutoModel.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
        q = next(m.weight for n, m in model.named_modules() if n.endswith("q_proj"))
        local = tuple(getattr(q, "to_local", lambda: q)().shape)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[0]])).logits
        gathers = []
        full_tensor = DTensor.full_tensor
        def counted(self, *a, **k):
            gathers.append(tuple(self.shape))
            return full_tensor(self, *a, **k)
        DTensor.full_tensor = counted
        runs = []
        for kw in settings:
            gathers.clear()
            seed, fn = kw.pop("seed", None), getattr(remask, kw.pop("fn", "generate"))
            outs = []
            for p in prompts:
                gen = torch.Generator().manual_seed(seed) if seed is not None else None
                outs.append(fn(model, torch.tensor([p]), generator=gen, **kw)[0, len(p):].tolist())
            runs.append({"outs": outs, "gathers": len(gathers)})
        DTensor.full_tensor = full_tensor
        return {"runs": runs, "q_local": local, "q_full": tuple(q.shape), "dtensor": type(q).__name__,
                "logits": type(logits).__name__, "logits_local": list(logits.to_local().shape),
                "logits_full": list(logits.shape)}
    results = [run(path, prompts, settings) for path, prompts, settings in json.loads(sys.argv[1])]
    if dist.get_rank() == 0:   # every model of the test in one launch
        print("RESULT" + json.dumps(results))
''')

BASE = dict(steps=16, gen_length=16, block_length=8)
# (settings, fused: scored on the shards without a gather)
SETTINGS = {
    "tiny-llada": [
        (BASE, True),
        (dict(BASE, threshold=0.5, use_cache="dual"), True),
        (dict(BASE, temperature=0.8, seed=3, use_cache="prefix"), True),
        (dict(BASE, cfg_scale=0.5), True),
        (dict(BASE, temperature=0.8, seed=5, reference_rng=True), False),
    ],
    "dream": [
        (BASE, True),
        (dict(BASE, threshold=0.3, temperature=0.8, seed=7), True),
        (dict(fn="diffusion_generate", max_new_tokens=16, steps=16, alg="entropy"), True),
        (dict(fn="diffusion_generate", max_new_tokens=16, steps=8, alg="topk_margin", use_cache="dual",
              block_length=8), True),
        (dict(fn="diffusion_generate", max_new_tokens=16, steps=16, alg="maskgit_plus", temperature=0.7, top_p=0.9,
              seed=11), False),
    ],
}


def prompts_and_model(kind: str, folder: pathlib.Path):
    if kind == "tiny-llada":
        from remask.zoo import charset, checkpoint_path, tasks

        return checkpoint_path("tiny-llada"), [charset.encode_chat(p.prompt) for p in tasks.problems(4, tasks.EVAL_SEED)]
    tiny.write_tiny_dream(str(folder), seed=4, vocab_size=301, mask_token_id=299, eos_token_id=298, pad_token_id=298,
                          bos_token_id=298)   # an odd vocabulary: the shards differ in width
    g = torch.Generator().manual_seed(0)
    return str(folder), [torch.randint(0, 290, (5 + i,), generator=g).tolist() for i in range(3)]


def test_two_ranks_decode_the_tokens_of_one_process(tmp_path):
    """LLaDA (the shipped tiny-llada) and Dream (an odd vocabulary), both in one torchrun launch."""
    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    jobs = {kind: prompts_and_model(kind, tmp_path / "dream") for kind in SETTINGS}
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    done = subprocess.run([torchrun, "--nproc_per_node", "2", str(script), json.dumps(
        [(path, prompts, [kw for kw, _ in SETTINGS[kind]]) for kind, (path, prompts) in jobs.items()])],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[6:])
    from transformers import AutoModel

    for (kind, (path, prompts)), result in zip(jobs.items(), results):
        assert result["dtensor"] == "DTensor" and result["q_local"][0] * 2 == result["q_full"][0], kind  # sharded
        vocab = result["logits_full"][-1]
        assert result["logits"] == "DTensor" and result["logits_local"][-1] == -(-vocab // 2), kind   # stays sharded
        model = AutoModel.from_pretrained(path).eval()
        for (kw, fused), run in zip(SETTINGS[kind], result["runs"]):
            kw = dict(kw)
            seed, fn = kw.pop("seed", None), getattr(remask, kw.pop("fn", "generate"))
            alone = [fn(model, torch.tensor([p]), **kw, generator=None if seed is None else
                        torch.Generator().manual_seed(seed))[0, len(p):].tolist() for p in prompts]
            assert run["outs"] == alone, (kind, kw)
            assert (run["gathers"] == 0) == fused, (kind, kw, run["gathers"])


KERNEL_SCRIPT = textwrap.dedent('''
    import json, importlib, os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    kernels = importlib.import_module("remask.kernels.confidence")
    rank, world = dist.get_rank(), dist.get_world_size()
    V = 1001
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(1)) * 3
    logits[2, 5] = logits[2, 900] = 40.0
    chunk = -(-V // world)
    a, b = rank * chunk, min((rank + 1) * chunk, V)
    rows = torch.tensor([0, 2, 3, 8])
    out = {}
    for path, mode, temperature in [(p, m, t) for p in ("torch", "triton") for m in ("prob", "margin", "neg_entropy")
                                    for t in (0.0, 0.7)]:
        os.environ["REMASK_TRITON"] = "1" if path == "triton" else "0"   # the dispatcher reads it at each call
        kw = dict(temperature=temperature, mode=mode, rows=rows, suppress_ids=[7], exclude_ids=[600],
                  zero_prob_ids=[999])
        x0, conf = kernels.confidence_vocab_parallel(logits[:, a:b], vocab_start=a, vocab_size=V, seed=5, **kw)
        want = kernels.confidence(logits, seed=5, **kw)
        unseeded = kernels.confidence_vocab_parallel(logits[:, a:b], vocab_start=a, vocab_size=V, **kw)[0]
        everyone = [torch.empty_like(unseeded) for _ in range(world)]
        dist.all_gather(everyone, unseeded)
        out[f"{path}-{mode}-{temperature}"] = dict(
            same_x0=torch.equal(x0, want[0]), conf_err=float((conf.double() - want[1].double()).abs().max()),
            ranks_agree=all(torch.equal(e, everyone[0]) for e in everyone))
    if rank == 0:
        print("RESULT" + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)   # the Triton interpreter's threads can abort a normal interpreter shutdown here
''')


def test_vocab_parallel_scoring_over_gloo(tmp_path):
    """`confidence_vocab_parallel` on 2 ranks (gloo): each rank scores its columns, the ranks
    all-gather 7 numbers per row and combine them; x0 equals the unsharded call's and the
    confidence agrees (the torch path and the kernel under the interpreter, both in one launch); without
    a seed the ranks share rank 0's, so they agree."""
    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    script = tmp_path / "vocab.py"
    script.write_text(KERNEL_SCRIPT)
    import os

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([torchrun, "--nproc_per_node", "2", str(script)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[6:])
    assert len(result) == 12
    for case, r in result.items():
        assert r["same_x0"] and r["ranks_agree"], case
        assert r["conf_err"] < 1e-5, case
