#!/usr/bin/env python3
"""Writes every example request body in MindIE's API documents (a folder of them, outside
this repository: SEEDS_DIR, by default a `shared/seeds` folder beside the checkout) to
tests/fixtures/seed_requests.json, for the conformance test that sends each one as written.
The fixture is committed, so only refreshing it needs the documents.

    python3 scripts/extract-seed-requests.py [SEEDS_DIR]

A request body is a JSON object in a document with "model" and "messages" or "prompt".
"""

import glob
import json
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
seeds = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "..", "shared", "seeds")
out = []
for path in sorted(glob.glob(os.path.join(seeds, "0*.txt"))):
    text = open(path, encoding="utf-8").read()
    decoder = json.JSONDecoder()
    i = 0
    while (start := text.find("{", i)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(value, dict) and "model" in value and ("messages" in value or "prompt" in value):
            out.append({"document": os.path.basename(path), "body": value})
        i = end
dest = os.path.join(root, "tests", "fixtures", "seed_requests.json")
with open(dest, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(f"{len(out)} requests -> {dest}")
