#!/usr/bin/env python3
"""Checks that every repository path the Markdown files name in backticks exists, so that the
docs cannot drift from the tree. A path counts when its first part is a top-level entry of
the repository (`engine/src/lib.rs`, `deploy/k8s/base/`); the dated histories
(`HISTORY.md`) keep the names of their day. Prints each missing path; exits 1 if any.

  python3 scripts/check-doc-paths.py
"""

import os
import re
import subprocess
import sys

PATH = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+/?")


def main():
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True,
                             cwd=root).stdout.split()
    top = {p.split("/")[0] for p in tracked}
    missing = 0
    for md in (p for p in tracked if p.endswith(".md") and not p.endswith("HISTORY.md")):
        with open(os.path.join(root, md)) as f:
            lines = f.read().splitlines()
        for n, line in enumerate(lines, 1):
            for name in re.findall(r"`([^`\s]+)`", line):
                name = name.rstrip(".,:;")
                if PATH.fullmatch(name) and name.split("/")[0] in top \
                        and not os.path.exists(os.path.join(root, name)):
                    print(f"{md}:{n}: no {name}")
                    missing += 1
    print(f"doc paths: {missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
