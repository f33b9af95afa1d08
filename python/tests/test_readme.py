"""The README's Python snippets (those marked `<!-- test: python -->`), run in order in one
namespace, with the project's model and text (INFKV_MODEL, INFKV_TEXT)."""
import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_python_snippets_run(smollm2, kjv_text):  # the fixtures check the model and text exist
    text = open(README, encoding="utf-8").read()
    blocks = re.findall(r"<!-- test: python -->\n```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    ns = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), ns)
    assert tuple(ns["kept_keys"].shape) == (8, 1024, 64)
    assert ns["stats"].kept == [512] * 30
    # SmolLM2-135M answers poorly either way; what must hold is that infkv's SnapKV press answers
    # exactly as kvpress's own SnapKV press at the same settings
    from kvpress import SnapKVPress
    theirs = ns["pipe"](ns["context"], question="What did God call the light?",
                        press=SnapKVPress(compression_ratio=0.5, window_size=64), max_new_tokens=12)["answer"]
    assert ns["answer"].strip() and ns["answer"] == theirs
