"""Shared helpers for the oracle scripts (paths, versions, JSON output).

Not a script by itself; imported by scripts/oracle_*.py.
"""

import json
import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "engine" / "tests" / "fixtures"
MODELS = Path(os.environ.get("TANDEM_MODELS", REPO_ROOT / "models"))


def versions() -> dict:
    """Versions of the libraries that produced a fixture."""
    import importlib.metadata as md

    out = {}
    for name in ("transformers", "tokenizers", "jinja2", "gguf", "torch"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


# A JSON list of scalars (numbers, strings, ...) that json.dumps(indent=...) spread over
# several lines. Literal newlines never occur inside JSON strings, so joining the lines
# of such a list cannot change any text.
_ITEM = r'(?:-?[0-9][-+.0-9eE]*|"(?:[^"\\\n]|\\.)*"|null|true|false)'
_SCALAR_LIST = re.compile(r"\[\n\s*(" + _ITEM + r"(?:,\n\s*" + _ITEM + r")*)\n\s*\]")


def dump(obj, path: Path) -> None:
    """Write pretty, diff-friendly UTF-8 JSON (lists of scalars kept on one line)."""
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    text = _SCALAR_LIST.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    assert json.loads(text) == obj
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {path}")

# The one tool definition every oracle renders.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    }
]
