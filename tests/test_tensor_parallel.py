"""Tensor parallel on CPU (gloo, 2 processes under torchrun): LLaDA and Dream load sharded the
transformers way (`DistributedConfig(tp_plan="auto")`: q/k/v and MLP inputs by columns, outputs by
rows, the LM head by vocabulary) and decode the same tokens as one process."""
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
    import remask
    from transformers import AutoModel
    from transformers.distributed import DistributedConfig
    path, prompts, kw = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = AutoModel.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
    q = next(m.weight for n, m in model.named_modules() if n.endswith("q_proj"))
    local = tuple(getattr(q, "to_local", lambda: q)().shape)
    outs = [remask.generate(model, torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
    if dist.get_rank() == 0:
        print("RESULT" + json.dumps({"outs": outs, "q_local": local, "q_full": tuple(q.shape),
                                     "dtensor": type(q).__name__}))
''')


def prompts_and_model(kind: str, folder: pathlib.Path):
    if kind == "tiny-llada":
        from remask.zoo import charset, checkpoint_path, tasks

        return checkpoint_path("tiny-llada"), [charset.encode_chat(p.prompt) for p in tasks.problems(6, tasks.EVAL_SEED)]
    tiny.write_tiny_dream(str(folder), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298, pad_token_id=298,
                          bos_token_id=298)
    g = torch.Generator().manual_seed(0)
    return str(folder), [torch.randint(0, 290, (5 + i,), generator=g).tolist() for i in range(4)]


@pytest.mark.parametrize("kind", ["tiny-llada", "dream"])
def test_two_ranks_decode_the_tokens_of_one_process(kind, tmp_path):
    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed beside this python")
    path, prompts = prompts_and_model(kind, tmp_path / "dream")
    kw = dict(steps=16, gen_length=16, block_length=8)
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    done = subprocess.run([torchrun, "--nproc_per_node", "2", str(script), path, json.dumps(prompts), json.dumps(kw)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[6:])
    assert result["dtensor"] == "DTensor" and result["q_local"][0] * 2 == result["q_full"][0]   # really sharded
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path).eval()
    alone = [remask.generate(model, torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
    assert result["outs"] == alone
