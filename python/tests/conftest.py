"""Shared fixtures: the real model and text come from scripts/model.sh and scripts/kjv.sh
(scripts/test.sh passes them as INFKV_MODEL and INFKV_TEXT). Without them the model tests skip,
unless INFKV_REQUIRE_MODEL=1 (scripts/test.sh), when they fail."""
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws a progress bar

import pytest


def _path(var):
    p = os.environ.get(var)
    if p and os.path.exists(p):
        return p
    if os.environ.get("INFKV_REQUIRE_MODEL") == "1":
        pytest.fail(f"{var} is not set to an existing file (scripts/model.sh, scripts/kjv.sh)")
    pytest.skip(f"{var} not set: run through scripts/test.sh or export it")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in transformers (f32, CPU, sdpa), loaded from the project's GGUF."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = _path("INFKV_MODEL")
    folder, name = os.path.split(os.path.abspath(path))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok


@pytest.fixture(scope="session")
def kjv_text():
    with open(_path("INFKV_TEXT"), encoding="utf-8") as f:
        return f.read()
