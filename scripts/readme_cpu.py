#!/usr/bin/env python3
"""Writes the README's CPU code as one C++ program: every code block marked `<!-- test: cpu -->`
in README.md, in order and as printed, in place of the `// @README_SNIPPETS@` line of the
template. Usage: readme_cpu.py README TEMPLATE OUT"""
import re
import sys


def main():
    readme, template, out = sys.argv[1:4]
    blocks = re.findall(r"<!-- test: cpu -->\s*```cpp\n(.*?)```", open(readme, encoding="utf-8").read(), re.S)
    if not blocks:
        sys.exit(f"{readme}: no <!-- test: cpu --> blocks")
    code = "\n".join(f"  // README.md, CPU block {i + 1}\n" + "".join("  " + line + "\n" for line in b.splitlines())
                     for i, b in enumerate(blocks))
    text = open(template, encoding="utf-8").read()
    if "  // @README_SNIPPETS@\n" not in text:
        sys.exit(f"{template}: no '// @README_SNIPPETS@' line")
    result = text.replace("  // @README_SNIPPETS@\n", code)
    try:
        if open(out, encoding="utf-8").read() == result:
            return
    except OSError:
        pass
    open(out, "w", encoding="utf-8").write(result)


if __name__ == "__main__":
    main()
