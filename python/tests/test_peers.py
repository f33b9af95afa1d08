"""scripts/peers_single_turn.py, the single-turn side by side with OpenVINO GenAI and kvpress, on
one real question: infkv-stream exports it (--export-questions), each side answers it, and the
records say what the caches held. The OpenVINO side runs in its own environment
(scripts/openvino_env.sh, created on first use)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "peers_single_turn.py"
STREAM = ROOT / "build" / "release" / "tools" / "infkv-stream"
BUDGET = 1024


def peers_module():
    spec = importlib.util.spec_from_file_location("peers_single_turn", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_greedy_grade_is_infkv_streams():
    # the cases of tools/stream/needles.hpp's answer_matches
    grade = peers_module().answer_matches
    assert grade(" Volvo.", "Volvo") and grade(" volvo, a car", "Volvo") and grade("\n 27452.\n", "27452")
    assert not grade(" steal", "teal") and not grade(" a Volvo", "Volvo") and not grade(" Volvos", "Volvo")
    assert not grade(" 274521", "27452") and not grade("", "Volvo")


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    model, text = os.environ.get("INFKV_MODEL"), os.environ.get("INFKV_TEXT")
    missing = [w for w, ok in (("INFKV_MODEL", model and os.path.exists(model)),
                               ("INFKV_TEXT", text and os.path.exists(text)),
                               (str(STREAM), STREAM.exists())) if not ok]
    if missing:
        why = f"{', '.join(missing)} missing: run through scripts/test.sh (it builds infkv-stream first)"
        if os.environ.get("INFKV_REQUIRE_MODEL") == "1":
            pytest.fail(why)
        pytest.skip(why)
    out = tmp_path_factory.mktemp("peers") / "q.json"
    subprocess.run([str(STREAM), "--model", model, "--text", text, "--needle", "2048", "--trials", "1", "--seed", "1",
                    "--export-questions", str(out)], check=True, capture_output=True)
    return model, out


def run_side(question, tmp_path, python, *args):
    model, q = question
    out = tmp_path / "side.json"
    r = subprocess.run([python, str(SCRIPT), *args, "--questions", str(q), "--model", model, "--budget", str(BUDGET),
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    table = subprocess.run([sys.executable, str(SCRIPT), "table", str(out)], capture_output=True, text=True, check=True)
    return json.loads(out.read_text()), json.loads(q.read_text())["questions"][0], table.stdout


def test_the_export_holds_the_prompt_the_question_and_the_candidates(question):
    q = json.loads(question[1].read_text())["questions"][0]
    assert len(q["prompt"]) == q["at"] > 2048 and q["key_end"] <= q["at"] - 2048
    assert len(q["choices"]) == len(q["candidates"]) > 1 and q["candidates"][q["truth"]] == q["needle"]
    # the question ends with the statement's prefix, which the statement in the prompt begins with
    tail = q["question"][-4:]
    assert any(q["prompt"][i:i + 4] == tail for i in range(q["key_at"], q["key_end"]))


def test_kvpress_side_keeps_the_budget_and_grades_both_ways(question, tmp_path):
    got, q, table = run_side(question, tmp_path, sys.executable, "kvpress", "--presses", "full,snapkv")
    full, snap = got["records"]
    n = len(q["prompt"]) + len(q["question"])
    assert (full["setting"], full["after_tokens"], full["peak_tokens"]) == ("transformers full", n, n)
    assert (snap["setting"], snap["after_tokens"], snap["peak_tokens"]) == ("kvpress snapkv", BUDGET, n)
    grade = peers_module().answer_matches
    for r in (full, snap):
        assert r["rank"] >= 1 and r["forced_success"] == (r["rank"] == 1)
        assert r["success"] == grade(r["answer"], q["needle"])
    assert "| 1024 | kvpress snapkv | 1 |" in table


def test_kvpress_side_with_the_question_later_compresses_the_context_alone(question, tmp_path):
    got, q, _ = run_side(question, tmp_path, sys.executable, "kvpress", "--presses", "full,snapkv", "--question-later")
    full, snap = got["records"]
    n, nq = len(q["prompt"]), len(q["question"])
    assert (full["setting"], full["peak_tokens"], full["after_tokens"]) == ("transformers full, question later", n,
                                                                            n + nq)
    # the context alone compressed to the budget, the question decoded after it
    assert (snap["setting"], snap["peak_tokens"], snap["after_tokens"]) == ("kvpress snapkv, question later", n,
                                                                            BUDGET + nq)
    # without compression the question decoded after the context is the single-turn prefill
    single, _, _ = run_side(question, tmp_path, sys.executable, "kvpress", "--presses", "full")
    assert full["rank"] == single["records"][0]["rank"] and full["answer"] == single["records"][0]["answer"]


def test_openvino_side_reads_the_cache_it_held(question, tmp_path):
    env = subprocess.run([str(ROOT / "scripts" / "openvino_env.sh")], capture_output=True, text=True, check=True)
    python = os.path.join(env.stdout.strip().splitlines()[-1], "bin", "python")
    got, q, _ = run_side(question, tmp_path, python, "openvino", "--ov-modes", "SUM:w8")
    full, evicting = got["records"]
    n = len(q["prompt"]) + len(q["question"])
    assert full["setting"] == "openvino full" and evicting["setting"] == "openvino sum w8"
    # occupancy is read in blocks of 32 tokens: the prompt, then the answer's tokens
    assert n <= full["peak_tokens"] < n + got["gen"] + 64 and full["after_tokens"] == full["peak_tokens"]
    # its eviction runs once the prompt is in: the whole prompt is held first, the budget after
    assert evicting["peak_tokens"] >= n and BUDGET <= evicting["after_tokens"] <= BUDGET + 64
    assert all("forced_success" not in r for r in (full, evicting))
