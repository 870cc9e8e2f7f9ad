"""`models/portable_random.py`: torch's AVX2 normal (and uniform) draws recomputed on any CPU.

Where this CPU runs torch's AVX2/AVX512 kernels, the portable draws must equal torch's bit for bit
(values and the generator's state after). Under `ATEN_CPU_CAPABILITY=default` (torch's libm path,
as on ARM) every tiny writer must give the digests it gives here, which the fixtures were made on.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from remask.models import portable_random, tiny

VECTOR_CPU = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
pytestmark = pytest.mark.portable   # make test-portable runs it under each capability
needs_avx2 = pytest.mark.skipif(not VECTOR_CPU, reason="torch's vectorised normal path needs an AVX2/AVX512 CPU")

# Each tiny family; small where a size override keeps it fast, and the default (126 464-token) LLaDA.
WRITERS = [
    ("llada", dict(seed=0)),
    ("llada", dict(seed=1, n_kv_heads=2, weight_tying=True, include_bias=True, vocab_size=1000,
                   embedding_size=1000, mask_token_id=999, eos_token_id=998, pad_token_id=998)),
    ("dream", dict(seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298, pad_token_id=298,
                   bos_token_id=298)),
    ("sdar", dict(seed=0)),
    ("sdar_moe", dict(seed=0)),
    ("llada2", dict(seed=0)),
    ("fast_dllm_v2", dict(seed=0)),
    ("diffusion_gemma", dict(seed=0)),
]

_WRITE_ALL = """
import json, sys, tempfile, torch
from remask.models import tiny
specs = json.loads(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    digests = [getattr(tiny, "write_tiny_" + f)(f"{d}/{i}", **kw) for i, (f, kw) in enumerate(specs)]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "digests": digests}))
"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same_stream(g1: torch.Generator, g2: torch.Generator) -> bool:
    return torch.equal(torch.rand(7, generator=g1), torch.rand(7, generator=g2))


@needs_avx2
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_normal_equals_torch_vectorised_path(seed):
    # every tail (numel % 16) incl. none, a few larger odd sizes; torch.randn and normal_(mean, std)
    sizes = list(range(16, 48)) + [1000, 4099, 65537]
    for n in sizes:
        for mean, std in ((0.0, 1.0), (0.3, 0.02), (-1.7, 3.3)):
            g1, g2 = torch.Generator().manual_seed(seed + n), torch.Generator().manual_seed(seed + n)
            ref = torch.empty(n).normal_(mean, std, generator=g1)
            got = portable_random.normal((n,), mean, std, generator=g2)
            assert torch.equal(_bits(ref), _bits(got)), (n, mean, std)
            assert _same_stream(g1, g2), (n, mean, std)
    # a 2-D draw through randn, from the global generator (what torch.manual_seed seeds)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ref = torch.randn(333, 17)
        after_ref = torch.rand(5)
        torch.manual_seed(seed)
        got = portable_random.randn(333, 17)
        after_got = torch.rand(5)
    assert torch.equal(_bits(ref), _bits(got)) and torch.equal(after_ref, after_got)


@needs_avx2
def test_uniform_and_model_init_equal_torch():
    for seed, (a, b) in enumerate(((-0.0123, 0.0123), (2.0, 5.0), (-0.3, 7.5), (0.0, 1.0))):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        ref = torch.empty(20011).uniform_(a, b, generator=g1)
        got = portable_random.uniform_(torch.empty(20011), a, b, generator=g2)
        assert torch.equal(_bits(ref), _bits(got)) and _same_stream(g1, g2), (a, b)
    # inside portable_init, nn.Linear's own init and nn.init.normal_ give torch's tensors
    with torch.random.fork_rng():
        torch.manual_seed(7)
        ref = torch.nn.Linear(48, 37)
        torch.nn.init.normal_(ref.weight, std=0.02)
        torch.manual_seed(7)
        with portable_random.portable_init():
            got = torch.nn.Linear(48, 37)
            torch.nn.init.normal_(got.weight, std=0.02)
    for name, p in ref.named_parameters():
        assert torch.equal(_bits(p.detach()), _bits(dict(got.named_parameters())[name].detach())), name


def test_small_and_other_tensors_are_torchs_and_init_restores():
    # < 16 elements, float64, non-contiguous: torch's scalar path (already portable), untouched
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(torch.randn(15, generator=g1), portable_random.randn(15, generator=g2))
    a, b = torch.empty(40, 3, dtype=torch.float64), torch.empty(40, 3, dtype=torch.float64)
    assert torch.equal(a.normal_(generator=g1), portable_random.normal_(b, generator=g2))
    a, b = torch.empty(40, 3).t(), torch.empty(40, 3).t()
    assert torch.equal(a.normal_(0.5, 2, generator=g1), portable_random.normal_(b, 0.5, 2, generator=g2))
    saved = torch.Tensor.normal_, torch.Tensor.uniform_, torch.randn
    with pytest.raises(ValueError), portable_random.portable_init():
        assert torch.randn is not saved[2]
        raise ValueError
    assert (torch.Tensor.normal_, torch.Tensor.uniform_, torch.randn) == saved
    # the draw is a normal one (a sanity check that holds on any CPU)
    x = portable_random.randn(100_000, generator=torch.Generator().manual_seed(0))
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02
    assert math.isclose(portable_random.normal((64, 64), 5.0, 0.001).mean().item(), 5.0, abs_tol=1e-3)


def test_tiny_digests_do_not_depend_on_cpu_capability(tmp_path):
    here = [getattr(tiny, f"write_tiny_{family}")(str(tmp_path / str(i)), **kw)
            for i, (family, kw) in enumerate(WRITERS)]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-c", _WRITE_ALL, json.dumps(WRITERS)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["capability"] == "DEFAULT"
    assert dict(zip([f"{f}{kw}" for f, kw in WRITERS], there["digests"])) == \
        dict(zip([f"{f}{kw}" for f, kw in WRITERS], here))
    assert here[0] == "4da4f463ceed642a"   # LLaDA seed 0: the digest the reference fixtures were made on
