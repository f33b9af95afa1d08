#!/usr/bin/env python3
"""Runs infkv-stream over a grid and writes one CSV of the results with a JSON record of where
they came from, for scripts/eval_report.py. Two kinds of sweep:

  scripts/eval_sweep.py needles --out docs/evaluation/needles_v2_policies [--seeds 1-4]
      [--distance 2048] [--people 3] ...      the needle test, models x seeds x policies
  scripts/eval_sweep.py ppl --out docs/evaluation/ppl_slices [--skips 0,200000,...]
      [--tokens 10000] ...                    perplexity, models x disjoint slices x policies
  scripts/eval_sweep.py video --out docs/multimodal/video_facts [--seeds 1-3] [--frames 212]
      ...                                     infkv-video: a video and text facts, models x seeds
                                              x policies (a random projector per model)

common: [--models smollm2,gemma3] [--policies full,streaming_llm,...] [--budget 1024] [--jobs 2]
[-- MORE INFKV-STREAM ARGUMENTS]

A policy may carry settings of its own, for a tuning grid in one sweep:
`saddle_union:recent-share=0.5:union-share=0.25` runs `--policy saddle_union --recent-share 0.5
--union-share 0.25` and is named so in OUT.csv's policy column and in the record; a bare setting
is a flag (`snapkv:question-known` runs `--policy snapkv --question-known`).

Each run (model, seed or slice, policy) is one infkv-stream process with one thread; --jobs run at
once. Runs already in the work folder (--work, default ~/.cache/infkv/eval/NAME) are not repeated,
so a sweep resumes where it stopped and grows by seeds or slices; a run made by another program
build or other settings is refused rather than mixed in. OUT.csv: the columns model, then people
and seed (needles), skip (ppl) or seed (video), then the program's --csv columns (video: every
5th frame and the frames where facts are asked). Video also writes OUT_answers.csv, one row per
fact asked. OUT.json: the commit the program was built from, its version line, each model's and
the text's (video: the media's and projectors') SHA-256, the settings, the command and one record
per run (its seconds and the machine's load average)."""
import argparse
import concurrent.futures
import csv
import datetime
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("full,streaming_llm,window,context_shift,h2o,tova,snapkv,keydiff,recent_keydiff,inf_mllm,inf_mllm_bias,"
            "inf_mllm_v,expected_attention")
# Files whose change changes the program (scripts and docs do not).
CODE = ["include", "backends", "adapters", "tools", "CMakeLists.txt", "cmake", "CMakePresets.json"]


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def last_line(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def seeds(spec):
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


ANSWER_COLUMNS = ["policy", "after", "fact", "kind", "person", "value", "statement_tokens", "statement_cached",
                  "forced_success", "greedy_success", "true_logprob", "best_other_logprob", "answer"]


def answer_rows(model, lead, j, name=None):
    """One row per fact asked in an infkv-video JSON (its policies' answers; `name`: a policy
    variant's name in place of the program's)."""
    out = []
    for r in j["runs"]:
        for q in r.get("answers", []):
            f = j["facts"][q["fact"]]
            truth = f["candidates"].index(f["value"])
            lp = q["logprobs"]
            other = max(x for i, x in enumerate(lp) if i != truth)
            out.append([model, *lead, name or r["policy"], q["after"], q["fact"], f["kind"], f["person"], f["value"],
                        f["statement_tokens"], q["statement_cached"], int(q["forced_success"]), int(q["greedy_success"]),
                        f"{lp[truth]:.4f}", f"{other:.4f}", q["answer"]])
    return out


def policy_args(spec):
    """`name:flag=value:flag:...` -> (name, [--flag, value, --flag, ...]); refuses a malformed
    setting."""
    name, *settings = spec.split(":")
    out = []
    for kv in settings:
        flag, eq, value = kv.partition("=")
        if not flag or (eq and not value):
            sys.exit(f"eval_sweep: --policies: {spec!r}: settings are flag=value or a bare flag "
                     "(e.g. recent-share=0.5, question-known)")
        out += [f"--{flag}", value] if eq else [f"--{flag}"]
    return name, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["needles", "ppl", "video"])
    ap.add_argument("--out", required=True, help="OUT.csv and OUT.json are written (no extension)")
    ap.add_argument("--work", help="per-run files (default ~/.cache/infkv/eval/<basename of --out>)")
    ap.add_argument("--program", help="default build/release/tools/infkv-stream (video: infkv-video)")
    ap.add_argument("--models", help="names scripts/model.sh takes (default smollm2,gemma3; video: gemma3)")
    ap.add_argument("--seeds", default="1-4", help="needles: streams, e.g. 1-4 or 1,3,5")
    ap.add_argument("--skips", default="0,200000,400000,600000",
                    help="ppl: where each slice starts, in tokens of the text (--skip)")
    ap.add_argument("--tokens", type=int, default=10000, help="ppl: tokens per slice")
    ap.add_argument("--text", choices=["kjv", "jargon"], default="kjv",
                    help="needles, ppl: the text (scripts/kjv.sh: the KJV; scripts/jargon.sh: the Jargon File)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--distance", default="2048", help="infkv-stream --needle (comma list)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--needles", type=int, default=12)
    ap.add_argument("--people", type=int, default=3)
    ap.add_argument("--gap", type=int, default=128, help="--needle-gap")
    ap.add_argument("--media", help="video: the video (default llama.cpp's tools/mtmd/test-3.mp4)")
    ap.add_argument("--fps", default="24", help="video: frames taken per second")
    ap.add_argument("--frames", default="212", help="video: frames streamed")
    ap.add_argument("--facts", default="12", help="video: facts stated between the first frames")
    ap.add_argument("--ask-after", default="10,50,200", help="video: further frames before the facts are asked")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report-only", action="store_true", help="write OUT from the runs already made")
    ap.add_argument("extra", nargs="*", help="more infkv-stream arguments, after --")
    a = ap.parse_args()
    for p in a.policies.split(","):
        policy_args(p)  # a malformed variant is refused before anything is made

    name = os.path.basename(a.out)
    work = a.work or os.path.join(os.environ.get("INFKV_CACHE", os.path.expanduser("~/.cache/infkv")), "eval", name)
    os.makedirs(work, exist_ok=True)
    video = a.mode == "video"
    a.program = a.program or os.path.join(ROOT, "build/release/tools", "infkv-video" if video else "infkv-stream")
    models = {m: last_line(["scripts/model.sh", m]) for m in (a.models or ("gemma3" if video else "smollm2,gemma3")).split(",")}
    per_model = {m: [] for m in models}  # arguments that differ by model (video: its projector)
    if video:
        llama_root = os.path.dirname(last_line(["scripts/llama_cpp.sh"]))
        text = a.media or os.path.join(llama_root, "src/tools/mtmd/test-3.mp4")
        env = dict(os.environ, PYTHONPATH=os.path.join(llama_root, "src/gguf-py"))
        for m, path in models.items():  # a random projector sized to the model's embeddings (seed 0)
            proj = os.path.join(work, f"mmproj_{m}.gguf")
            if not os.path.exists(proj):
                subprocess.run(["/usr/bin/python3", "scripts/mm_projector.py", proj + ".part", "--model", path],
                               cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
                os.replace(proj + ".part", proj)
            per_model[m] = ["--mmproj", proj]
        common = ["--media", text, "--fps", a.fps, "--frames", a.frames, "--facts", a.facts, "--people",
                  str(a.people), "--ask-after", a.ask_after, "--gen", "8"]
        cells = [(f"s{s}", ["--seed", str(s)], [str(s)]) for s in seeds(a.seeds)]
        lead = ["seed"]
    else:
        text = last_line([f"scripts/{a.text}.sh"])
    if a.mode == "needles":
        common = ["--text", text, "--needle", a.distance, "--needles", str(a.needles), "--people", str(a.people),
                  "--needle-gap", str(a.gap), "--trials", str(a.needles)]
        cells = [(f"s{s}", ["--seed", str(s)], [str(a.people), str(s)]) for s in seeds(a.seeds)]
        lead = ["people", "seed"]
    elif a.mode == "ppl":
        common = ["--text", text, "--tokens", str(a.tokens)]
        skips = [int(k) for k in a.skips.split(",")]
        if any(y - x < a.tokens for x, y in zip(sorted(skips), sorted(skips)[1:])):
            sys.exit(f"eval_sweep: --skips {a.skips}: slices of --tokens {a.tokens} overlap")
        cells = [(f"k{k}", ["--skip", str(k)], [str(k)]) for k in skips]
        lead = ["skip"]
    common += ["--budget", str(a.budget), "--threads", "1", "--progress", "0", *a.extra]

    # The sweep's program: a copy taken when the sweep starts (a rebuild during a sweep cannot
    # change it), with the commit it was built from; later invocations must match.
    manifest_path = os.path.join(work, "manifest.json")
    program = os.path.join(work, os.path.basename(a.program))
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest["common"] != common[2:]:
            sys.exit(f"eval_sweep: {work} holds runs with other settings ({manifest['common']}); "
                     f"use another --out or --work")
    else:
        if a.report_only:
            sys.exit(f"eval_sweep: --report-only: no runs in {work}")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
        if dirty:
            sys.exit(f"eval_sweep: the program's sources have uncommitted changes:\n{dirty}\n"
                     "commit them and rebuild, so the results can name their commit")
        # brought up to date with the committed sources (ninja: nothing to do when it is)
        build = os.path.dirname(os.path.dirname(a.program))
        target = "infkv_video" if video else "infkv_stream"
        if subprocess.run(["cmake", "--build", build, "--target", target], stdout=subprocess.DEVNULL).returncode:
            sys.exit(f"eval_sweep: --program {a.program}: cmake --build {build} --target {target} failed "
                     "(configure it first: . scripts/llama_env.sh)")
        shutil.copy2(a.program, program)
        manifest = {"commit": git("rev-parse", "HEAD"),
                    "version": last_line([program, "--version"]),
                    "common": common[2:]}
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=1)

    runs = [(m, c, p) for c in cells for m in models for p in a.policies.split(",")]

    def base_of(m, c, p):
        return os.path.join(work, f"{m}_{c[0]}_{p.replace(':', '_').replace('=', '')}")

    def run(m, c, p):
        base = base_of(m, c, p)
        if os.path.exists(base + ".json"):
            return base, None
        name, own = policy_args(p)
        cmd = [program, "--model", models[m], *per_model[m], *common, *c[1], "--policy", name, *own,
               "--csv", base + ".part.csv", "--json", base + ".part.json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return base, f"{shlex.join(cmd)}\nfailed ({r.returncode}):\n{r.stderr[-2000:]}"
        os.replace(base + ".part.csv", base + ".csv")
        os.replace(base + ".part.json", base + ".json")
        print(f"eval_sweep: {m} {c[0]} {p}: done", file=sys.stderr, flush=True)
        return base, None

    failed = []
    if not a.report_only:
        with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            for base, err in pool.map(lambda r: run(*r), runs):
                if err:
                    failed.append(err)
                    print(err, file=sys.stderr)

    # OUT.csv and OUT.json from the runs made so far (a grid cell not yet run is left out).
    out_rows, records, header, desc, answers, settings = [], [], None, {}, [], None
    asked_at = {int(a.facts) + int(n) for n in a.ask_after.split(",")} if video else set()
    for m, c, p in runs:
        base = base_of(m, c, p)
        if not os.path.exists(base + ".json"):
            continue
        with open(base + ".json") as f:
            j = json.load(f)
        desc.setdefault(m, j.get("model_desc"))  # the model as llama.cpp describes it
        if j.get("version") != manifest["version"]:
            sys.exit(f"eval_sweep: {base}.json: made by {j.get('version')}, not {manifest['version']}")
        with open(base + ".csv", newline="") as f:
            rd = csv.reader(f)
            h = next(rd)
            header = header or h
            named = h.index("policy") if ":" in p else None  # a variant: its own name, not the program's
            for row in rd:
                if named is not None:
                    row[named] = p
                # video: every 5th frame, the frames where facts are asked and the last
                if video and not (int(row[1]) % 5 == 0 or int(row[1]) in asked_at or int(row[1]) == int(a.frames)):
                    continue
                out_rows.append([m, *c[2], *row])
        if video:
            answers += answer_rows(m, c[2], j, p if ":" in p else None)
        records.append({"model": m, "run": c[0], "policy": p, "file": os.path.basename(base) + ".json",
                        "load_average": [j.get("load_average_start"), j.get("load_average_end")]})
        if ":" in p:
            records[-1]["settings"] = j["settings"]  # a variant's own; protocol.settings: the plain runs'
        elif settings is None:
            settings = j["settings"]
    if header is None:
        sys.exit("eval_sweep: no finished runs")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["model", *lead, *header])
    w.writerows(out_rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".csv", "w") as f:
        f.write(buf.getvalue())
    if video:
        with open(a.out + "_answers.csv", "w") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["model", "seed", *ANSWER_COLUMNS])
            w.writerows(answers)
        what = ("infkv-video: a video through mtmd (random-weight projector) and text facts between its first frames, "
                "one row per policy and frame (every 5th, the asked and the last); the answers in OUT_answers.csv")
        protocol = {"needle_protocol": j.get("needle_protocol"), "fps": float(a.fps), "frames": int(a.frames),
                    "facts": int(a.facts), "people": a.people, "ask_after": [int(n) for n in a.ask_after.split(",")],
                    "projectors": {m: {"file": os.path.basename(v[1]), "sha256": sha256(v[1])}
                                   for m, v in per_model.items()}}
    elif a.mode == "needles":
        what = "infkv-stream needle test (docs/evaluation.md, \"The needle protocol\"), one row per question"
        protocol = {"needle_protocol": j["needle"].get("protocol"), "distances": j["needle"]["distances"],
                    "needles_per_stream": a.needles, "people": a.people, "needle_gap": a.gap}
    else:
        what = "infkv-stream perplexity on disjoint slices of the text, one row per block of each run"
        protocol = {"skips": skips, "tokens": a.tokens}
    protocol["settings"] = settings or j["settings"]
    record = {
        "what": what,
        "commit": manifest["commit"],
        "program": manifest["version"],
        "protocol": protocol,
        "models": {m: {"file": os.path.basename(p), "sha256": sha256(p), "desc": desc.get(m)} for m, p in models.items()},
        ("media" if video else "text"): {"file": os.path.basename(text), "sha256": sha256(text)},
        # the sweep's command (a --report-only pass collects the same runs)
        "command": "scripts/eval_sweep.py " + shlex.join(x for x in sys.argv[1:] if x != "--report-only"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": records,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"eval_sweep: {len(records)} of {len(runs)} runs in {a.out}.csv / .json", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
