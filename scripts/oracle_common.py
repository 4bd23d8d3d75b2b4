"""Shared helpers for the oracle scripts (paths, versions, JSON output).

Not a script by itself; imported by scripts/oracle_*.py.
"""

import json
import os
import re
import runpy
import sys
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

def greedy_run(model, ids: list, new_tokens: int, pad: int) -> tuple:
    """A reference's first-step logits after `ids` and its `new_tokens` greedy tokens
    (model.generate, EOS never stops it), as the engine tests compare them."""
    import torch

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids).logits[0, -1]
        out_ids = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )[0, len(ids) :].tolist()
    return logits, out_ids


def top5(logits) -> dict:
    """The five largest logits, as the fixtures record them."""
    import torch

    top = torch.topk(logits, 5)
    return {"ids": top.indices.tolist(), "logits": [float(v) for v in top.values]}


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


def llama_cpp_model(path: Path, kv_q8_0: bool = False):
    """llama.cpp (through llama-cpp-python) on the GGUF file `path`, with logits kept at
    every position for teacher forcing. With `kv_q8_0` its K and V caches hold Q8_0 blocks
    (`-ctk q8_0 -ctv q8_0`, which a quantized V needs flash attention for)."""
    from llama_cpp import GGML_TYPE_Q8_0, Llama

    kv = {"type_k": GGML_TYPE_Q8_0, "type_v": GGML_TYPE_Q8_0, "flash_attn": True}
    return Llama(
        model_path=str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        seed=0,
        verbose=False,
        **(kv if kv_q8_0 else {}),
    )


def llama_cpp_case(llm, prompt: list, continuation: int, top: int) -> dict:
    """llama.cpp's greedy continuation of `prompt` (at most `continuation` tokens, up to
    EOS), then one teacher-forced pass over prompt + continuation with logits at every
    position: for each continuation token, llama.cpp's `top` best next tokens before it,
    with their log-probabilities."""
    import numpy as np

    llm.reset()
    out = []
    for t in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if t == llm.token_eos() or len(out) == continuation:
            break
        out.append(t)
    llm.reset()
    llm.eval(prompt + out)
    positions = []
    for i in range(len(out)):
        # The logits after prompt + out[:i], which predict out[i].
        row = np.array(llm.scores[len(prompt) - 1 + i]).astype(np.float64)
        lp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        best = np.argsort(-lp, kind="stable")[:top]
        positions.append(
            {"top": [int(t) for t in best], "logprobs": [round(float(lp[t]), 5) for t in best]}
        )
    return {"prompt": prompt, "continuation": out, "positions": positions}


def run_converter(llama_cpp: Path, args: list) -> None:
    """Runs llama.cpp's convert_hf_to_gguf.py in this process with `args`, its gguf-py
    first on the path."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", *args]
    try:
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv


def quantize(src: Path, out: Path, ftype: int) -> None:
    """llama.cpp's quantizer (`llama_model_quantize`, what `llama-quantize` runs) on two
    threads, to the llama_ftype `ftype`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {out}")
