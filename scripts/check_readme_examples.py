#!/usr/bin/env python3
"""Checks that every README code block marked `<!-- example: NAME -->` equals the region between
`// example-begin NAME` and `// example-end` in the test sources (both dedented), so the README's
code is the code the tests compile and run. Usage: check_readme_examples.py README TEST_FILE..."""
import re
import sys
import textwrap


def regions(paths):
    out = {}
    for path in paths:
        lines = open(path, encoding="utf-8").read().splitlines()
        name = None
        for line in lines:
            m = re.match(r"\s*// example-begin (\S+)", line)
            if m:
                name, out[m.group(1)] = m.group(1), []
            elif re.match(r"\s*// example-end", line):
                name = None
            elif name:
                out[name].append(line)
    return {k: textwrap.dedent("\n".join(v)).strip() for k, v in out.items()}


def main():
    readme, tests = sys.argv[1], sys.argv[2:]
    code = regions(tests)
    text = open(readme, encoding="utf-8").read()
    blocks = re.findall(r"<!-- example: (\S+) -->\s*```\w*\n(.*?)```", text, re.S)
    errors = []
    if not blocks:
        errors.append(f"{readme}: no <!-- example: NAME --> blocks")
    for name, block in blocks:
        if name not in code:
            errors.append(f"{readme}: example {name}: no 'example-begin {name}' region in the tests")
        elif textwrap.dedent(block).strip() != code[name]:
            errors.append(f"{readme}: example {name} differs from the test's region:\n--- README\n"
                          f"{textwrap.dedent(block).strip()}\n--- test\n{code[name]}")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"readme examples: {len(blocks) - len(errors)} of {len(blocks)} match the tests")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
