#!/usr/bin/env python3
"""Every option of infkv-compare, infkv-stream, infkv-capture, infkv-engine-bench and infkv-video given wrong values (negative,
zero, huge, wrong type, a missing or non-GGUF or empty or binary or non-UTF-8 file, an unwritable
output path): each run must exit non-zero, print a one-line error naming the option, and leave no
output file. Each bad value replaces the value of a base command line that must succeed (checked
first), so a case fails only because of its own option.

Usage: cli_sweep.py --compare EXE [--stream EXE --capture EXE --model GGUF --text TXT [--bench EXE
       [--video EXE --gemma GGUF --mmproj GGUF --image JPEG]]] [--list] (print the cases and exit).
Exit status 1 when a case misbehaves."""
import argparse
import os
import subprocess
import sys
import tempfile

HUGE = "99999999999999999999"


def with_opt(base, opt, value):
    """`base` with `opt` set to `value`: replaces the option's value where `base` has it."""
    if opt in base:
        i = base.index(opt)
        return base[:i + 1] + [value] + base[i + 2:]
    return base + [opt, value]


def cases(a, tmp):
    """Base command lines that must succeed, and the bad cases: (program, args, option named in
    the error, output file that must not appear)."""
    out, bases = [], []
    missing = os.path.join(tmp, "no_such_file")
    unwritable = "/nonexistent-dir/out"
    empty = os.path.join(tmp, "empty.txt")
    binary = os.path.join(tmp, "binary.txt")
    latin1 = os.path.join(tmp, "latin1.txt")
    nul = os.path.join(tmp, "nul.txt")
    truncated = os.path.join(tmp, "truncated.gguf")
    open(empty, "w").close()
    with open(binary, "wb") as f:
        f.write(bytes(range(256)) * 64)
    small = os.path.join(tmp, "small.txt")
    if a.model:
        with open(a.model, "rb") as f, open(truncated, "wb") as g:
            g.write(f.read(4096))
    if a.text:
        with open(a.text, "rb") as f:
            head = f.read(40000)
        with open(small, "wb") as g:
            g.write(head[:1000])  # about 250 tokens
        # Real prose, one accented letter in Latin-1 (not UTF-8) far into it; and a NUL byte.
        with open(latin1, "wb") as g:
            g.write(head[:20000] + "Caf\xe9 ".encode("latin-1") + head[20000:])
        with open(nul, "wb") as g:
            g.write(head[:20000] + b"\x00" + head[20000:])

    def ints(prog, base, opt, bad):
        for v in bad:
            out.append((prog, with_opt(base, opt, v), opt, None))

    def files(prog, base, opt, bad):
        for f in bad:
            out.append((prog, with_opt(base, opt, f), opt, None))

    cmp = [a.compare, "--tokens", "2048"]
    bases.append(cmp)
    ints(a.compare, cmp, "--policy", ["no_such_policy"])
    ints(a.compare, cmp, "--budget", ["-1", "0", "20", HUGE, "abc"])
    ints(a.compare, cmp, "--block", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--layer", ["-1", "99", "abc"])
    ints(a.compare, cmp, "--tokens", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--threads", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--sinks", ["-1", HUGE, "abc"])
    ints(a.compare, cmp, "--recent", ["-1", HUGE, "abc"])
    ints(a.compare, cmp, "--window", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--probes", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--beta", ["-1", "nan", "inf", "abc"])
    ints(a.compare, cmp, "--ea-window", ["-1", "0", HUGE, "abc"])
    ints(a.compare, cmp, "--recent-share", ["-0.1", "1.5", "nan", "abc"])
    ints(a.compare, cmp, "--union-share", ["-0.1", "1.5", "nan", "abc"])
    ints(a.compare, cmp, "--keydiff-kernel", ["-1", "0", "4", HUGE, "abc"])
    files(a.compare, cmp, "--trace", [missing, empty, binary])
    out.append((a.compare, cmp + ["--json", unwritable + ".json"], "--json", unwritable + ".json"))
    if not a.stream:
        return bases, out

    st = [a.stream, "--model", a.model, "--text", a.text, "--tokens", "600", "--budget", "256", "--block", "64",
          "--policy", "streaming_llm", "--threads", "1"]
    bases.append(st)
    files(a.stream, st, "--model", [missing, empty, binary, truncated])
    files(a.stream, st, "--text", [missing, empty, binary, latin1, nul])
    ints(a.stream, st, "--policy", ["no_such_policy"])
    ints(a.stream, st, "--budget", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--block", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--tokens", ["-1", HUGE, "abc"])
    out.append((a.stream, with_opt(st, "--text", small), "--tokens", None))  # 600 tokens: beyond the text
    ints(a.stream, st, "--skip", ["-1", HUGE, "abc"])
    ints(a.stream, st, "--threads", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--sinks", ["-1", HUGE, "abc"])
    ints(a.stream, st, "--recent", ["-1", HUGE, "abc"])
    ints(a.stream, st, "--window", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--beta", ["-1", "nan", "inf", "abc"])
    ints(a.stream, st, "--smooth", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--progress", ["-1", HUGE, "abc"])
    ints(a.stream, st, "--ea-window", ["-1", "0", HUGE, "abc"])
    ints(a.stream, st, "--recent-share", ["-0.1", "1.5", "nan", "abc"])
    ints(a.stream, st, "--union-share", ["-0.1", "1.5", "nan", "abc"])
    ints(a.stream, st, "--keydiff-kernel", ["-1", "0", "4", HUGE, "abc"])
    ints(a.stream, st, "--reduce", ["sum", "abc"])
    ints(a.stream, st, "--cache-type", ["q5_1", "f32", "abc"])
    out.append((a.stream, st + ["--cache-type", "q4_0", "--archive", "4"], "--cache-type", None))
    ints(a.stream, st, "--position-gap", ["-1", "abc"])
    out.append((a.stream, st + ["--position-gap", "4", "--keep-positions"], "--position-gap", None))
    out.append((a.stream, st + ["--position-gap", "4", "--archive", "4", "--compact-positions", "--recall", "8"],
                "--position-gap", None))
    out.append((a.stream, with_opt(st, "--policy", "recent_keydiff") + ["--recent-share", "1"], "--budget", None))
    ints(a.stream, st, "--passkey", ["-1", HUGE, "abc"])  # --tokens belongs to the text stream
    pk = [a.stream, "--model", a.model, "--passkey", "300", "--trials", "1", "--budget", "256", "--block", "64",
          "--policy", "streaming_llm", "--threads", "1"]
    bases.append(pk)
    ints(a.stream, pk, "--trials", ["-1", "0", HUGE, "abc"])
    ints(a.stream, pk, "--gen", ["-1", "0", HUGE, "abc"])
    out.append((a.stream, pk + ["--tokens", "100"], "--tokens", None))
    nd = [a.stream, "--model", a.model, "--text", a.text, "--needle", "300", "--trials", "1", "--budget", "256",
          "--block", "64", "--policy", "streaming_llm", "--threads", "1"]
    bases.append(nd)
    ints(a.stream, nd, "--needle", ["-1", "0", HUGE, "abc"])
    out.append((a.stream, with_opt(nd, "--text", small), "--needle", None))  # beyond the text
    out.append((a.stream, nd + ["--needle-kind", "color"], "--needle-kind", None))
    out.append((a.stream, st + ["--needle-kind", "word"], "--needle-kind", None))  # without --needle
    out.append((a.stream, pk + ["--needle", "300"], "--needle", None))  # not with --passkey
    out.append((a.stream, with_opt(nd, "--needle", "300,300"), "--needle", None))  # a distance twice
    ints(a.stream, nd, "--needles", ["-1", "0", "13", HUGE, "abc"])
    out.append((a.stream, nd + ["--needle-kind", "word,word"], "--needle-kind", None))  # a kind twice
    out.append((a.stream, nd + ["--needles", "3", "--needle-kind", "word,fact"], "--needles", None))  # more than kinds
    ints(a.stream, nd, "--needle-gap", ["-1", "0", HUGE, "abc"])
    out.append((a.stream, st + ["--needles", "3"], "--needles", None))  # without --needle
    ints(a.stream, nd, "--people", ["-1", "0", "9", HUGE, "abc"])  # a kind offers 8 values
    out.append((a.stream, st + ["--people", "2"], "--people", None))  # without --needle
    out.append((a.stream, nd + ["--needles", "7", "--people", "3", "--needle-kind", "word,fact"], "--needles",
                None))  # 7 needles of 3 people per kind take 3 kinds
    out.append((a.stream, nd + ["--needles", "3", "--needle-gap", "1000000"], "--needle", None))  # beyond the text
    for opt, ext in (("--json", ".json"), ("--csv", ".csv"), ("--plot", ".png")):
        out.append((a.stream, st + [opt, unwritable + ext], opt, unwritable + ext))

    cap = [a.capture, "--model", a.model, "--text", a.text, "--tokens", "64", "--layers", "0", "--threads", "1",
           "--out", os.path.join(tmp, "capture.safetensors")]
    bases.append(cap)
    files(a.capture, cap, "--model", [missing, empty, binary, truncated])
    files(a.capture, cap, "--text", [missing, empty, binary, latin1, nul])
    ints(a.capture, cap, "--tokens", ["-1", "0", "15", HUGE, "abc"])
    ints(a.capture, cap, "--layers", ["-1", "999", "abc"])
    ints(a.capture, cap, "--segment-tokens", ["-1", HUGE, "abc"])
    ints(a.capture, cap, "--threads", ["-1", "0", HUGE, "abc"])
    out.append((a.capture, with_opt(cap, "--out", unwritable + ".safetensors"), "--out", unwritable + ".safetensors"))
    if not a.bench:
        return bases, out

    dec = [a.bench, "decode", "--model", a.model, "--text", a.text, "--history", "256,512", "--gen", "2",
           "--bounded-gen", "4", "--warm", "128", "--budget", "128", "--block", "32", "--policy", "streaming_llm",
           "--threads", "1"]
    pre = [a.bench, "prefill", "--model", a.model, "--text", a.text, "--tokens", "300", "--budget", "128",
           "--block", "64", "--threads", "1"]
    pla = [a.bench, "placement", "--model", a.model, "--text", a.text, "--budget", "64", "--block", "16",
           "--rounds", "1", "--flash-attn", "on", "--threads", "1"]
    bases += [dec, pre, pla]
    for base in (dec, pre, pla):
        files(a.bench, base, "--model", [missing, empty, binary, truncated])
        files(a.bench, base, "--text", [missing, empty, binary, latin1, nul])
        ints(a.bench, base, "--budget", ["-1", "0", HUGE, "99999999999", "abc"])
        ints(a.bench, base, "--block", ["-1", "0", HUGE, "abc"])
        ints(a.bench, base, "--threads", ["-1", "0", HUGE, "abc"])
        out.append((a.bench, base + ["--json", unwritable + ".json"], "--json", unwritable + ".json"))
    ints(a.bench, dec, "--history", ["-1", "0", HUGE, "99999999999", "abc"])
    out.append((a.bench, with_opt(dec, "--text", small), "--history", None))  # beyond the text
    ints(a.bench, dec, "--gen", ["-1", "0", HUGE, "abc"])
    ints(a.bench, dec, "--bounded-gen", ["-1", "0", HUGE, "abc"])
    ints(a.bench, dec, "--warm", ["-1", HUGE, "abc"])
    ints(a.bench, dec, "--policy", ["no_such_policy", "full", "recompute"])
    ints(a.bench, pre, "--budget", ["20"])  # below snapkv's protected window
    ints(a.bench, pre, "--tokens", ["-1", "0", HUGE, "abc"])
    out.append((a.bench, with_opt(pre, "--text", small), "--tokens", None))  # beyond the text
    out.append((a.bench, pre + ["--mode", "plain", "--tokens", "99999999999"], "--tokens", None))
    ints(a.bench, pre, "--mode", ["fast", ""])
    ints(a.bench, pre, "--policy", ["no_such_policy", "context_shift", "full"])
    ints(a.bench, pla, "--budget", ["19"])  # below the sinks and a block
    ints(a.bench, pla, "--rounds", ["-1", "0", "99999999999", "abc"])  # 99999999999: beyond the text
    ints(a.bench, pla, "--flash-attn", ["auto", ""])
    ints(a.bench, pla, "--seed", ["-1", "abc"])
    if not a.video:
        return bases, out

    vid = [a.video, "--model", a.gemma, "--mmproj", a.mmproj, "--media", a.image, "--facts", "1", "--ask-after", "1",
           "--budget", "100", "--policy", "streaming_llm", "--threads", "1", "--progress", "0"]
    bases.append(vid)
    files(a.video, vid, "--model", [missing, empty, binary, truncated])
    files(a.video, vid, "--mmproj", [missing, empty, binary, truncated])
    files(a.video, vid, "--media", [missing, empty, binary])
    ints(a.video, vid, "--policy", ["no_such_policy", "recompute", "context_shift"])
    ints(a.video, vid, "--budget", ["-1", "0", HUGE, "99999999999", "abc"])
    ints(a.video, vid, "--block", ["-1", "10", HUGE, "abc"])  # 10: smaller than a frame
    ints(a.video, vid, "--frames", ["-1", "1", HUGE, "abc"])  # 1: fewer than --facts + --ask-after
    ints(a.video, vid, "--fps", ["-1", "0", "nan", "abc"])
    ints(a.video, vid, "--facts", ["-1", "17", "abc"])
    ints(a.video, vid, "--people", ["-1", "0", "9", "abc"])
    ints(a.video, vid, "--ask-after", ["-1", "0", "1,1", "abc"])
    ints(a.video, vid, "--gen", ["-1", "0", "abc"])
    ints(a.video, vid, "--threads", ["-1", "0", HUGE, "abc"])
    ints(a.video, vid, "--progress", ["-1", "abc"])
    for opt, ext in (("--json", ".json"), ("--csv", ".csv")):
        out.append((a.video, vid + [opt, unwritable + ext], opt, unwritable + ext))
    return bases, out


def main():
    p = argparse.ArgumentParser()
    for name in ("compare", "stream", "capture", "bench", "model", "text", "video", "gemma", "mmproj", "image"):
        p.add_argument("--" + name)
    p.add_argument("--list", action="store_true")
    a = p.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        bases, todo = cases(a, tmp)
        for args in bases if not a.list else []:
            r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp)
            if r.returncode != 0:
                print(f"FAIL base command {' '.join(args)}: exit {r.returncode} ({r.stderr.strip()[-300:]})")
                return 1
            if os.path.exists(os.path.join(tmp, "capture.safetensors")):
                os.remove(os.path.join(tmp, "capture.safetensors"))
        for prog, args, opt, product in todo:
            shown = " ".join(os.path.basename(x) if x == prog else x for x in args)
            if a.list:
                print(shown)
                continue
            try:
                r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp)
            except subprocess.TimeoutExpired:
                print(f"FAIL {shown}: still running after 120 s")
                bad += 1
                continue
            lines = [l for l in r.stderr.splitlines() if l.strip()]
            problems = []
            if r.returncode == 0:
                problems.append("exit status 0")
            if r.returncode < 0 or r.returncode >= 128:
                problems.append(f"killed by signal (status {r.returncode})")
            if not any(opt in l for l in lines):
                problems.append(f"no error line names {opt}")
            errors = [l for l in lines if "error" in l.lower()]
            if len(errors) > 1:
                problems.append(f"{len(errors)} error lines")
            for f in [product, os.path.join(tmp, "capture.safetensors")]:
                if f and os.path.exists(f):
                    problems.append(f"left {f} behind")
                    os.remove(f)
            if problems:
                bad += 1
                tail = " | ".join(lines[-3:])
                print(f"FAIL {shown}: {'; '.join(problems)} (stderr: {tail[:300]})")
        if not a.list:
            print(f"cli sweep: {len(todo) - bad} of {len(todo)} bad invocations refused cleanly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
