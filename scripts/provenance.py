#!/usr/bin/env python3
"""Adds a "provenance" record to a JSON result: the commit of the tree it was made from, whether
that tree's code had uncommitted changes, the command, and the time. Usage: provenance.py FILE COMMAND"""
import datetime
import json
import subprocess
import sys


def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()


def main():
    path, command = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data["provenance"] = {
        "commit": git("rev-parse", "HEAD"),
        # uncommitted changes to the code (results and docs being regenerated do not count)
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!docs")),
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
