"""The README's runnable example runs."""
from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_runnable_example(tmp_path, monkeypatch):
    text = open(README).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    runnable = [b for b in blocks if "tiny.write_tiny_llada" in b]
    assert runnable, "README lost its runnable example"
    code = runnable[0].replace("/tmp/tiny-llada", str(tmp_path / "tiny-llada"))
    exec(compile(code, "README.md", "exec"), {})


def test_kernel_docs_examples_run():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "kernels.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 9, "docs/kernels.md lost its examples"
    for block in blocks:
        exec(compile(block, "docs/kernels.md", "exec"), {})


@pytest.mark.parametrize("doc", ["models.md", "caching.md", "apd.md", "sparse.md", "engine.md", "serving.md",
                                 "evaluation.md", "diffusion-gemma.md", "block-diffusion.md", "decoders.md"])
def test_docs_examples_run(doc):
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", doc)).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"docs/{doc} lost its examples"
    for block in blocks:   # as a script runs it: not under this file's `from __future__ import annotations`
        exec(compile(block, f"docs/{doc}", "exec", dont_inherit=True), {"__name__": f"docs_{doc[:-3]}"})


def test_zoo_doctests():
    import doctest

    import remask.zoo
    import remask.zoo.evaluate
    import remask.caches.paged
    import remask.caches.page_manager
    import remask.text
    import remask.zoo.formats
    import remask.zoo.tasks

    for module in (remask.zoo, remask.zoo.tasks, remask.zoo.formats, remask.zoo.evaluate, remask.caches.paged,
                   remask.caches.page_manager, remask.text):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
