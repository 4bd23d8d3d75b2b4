"""The generated tiny models as llama.cpp's own tools make and run them in GGUF.

Usage (from the scripts/ directory):
  LLAMA_CPP=DIR python3 oracle_gguf.py TINY_QWEN3 TINY_LLAMA3 TINY_QWEN3_MOE TINY_MIXTRAL \
      TINY_QWEN2_MOE TINY_QWEN2 TINY_GEMMA2 TINY_GEMMA3 TINY_PHI3 WIDE_QWEN3
  LLAMA_CPP=DIR python3 oracle_gguf.py --only MODEL:QUANT FOLDER   # one file, as qwen3_wide:q5_k_m

Each folder is `tandem-model --family
qwen3|llama3|qwen3-moe|mixtral|qwen2-moe|qwen2|gemma2|gemma3|phi3`'s, and WIDE_QWEN3
`tandem-model --family qwen3 --size wide`'s (every matrix 256 wide, so that Q4_K_M's
K-quants apply: a narrower one falls back to other types). The
plain Qwen2 one is converted with Qwen2.5's long-context setting added to a copy of its
config.json (YaRN, factor 4, past an original context of 64: YARN), as `qwen2_yarn`. DIR is a llama.cpp source tree at the
version llama-cpp-python vendors (its sdist's vendor/llama.cpp), for its converter
`convert_hf_to_gguf.py` and the `gguf-py` beside it.

1. convert_hf_to_gguf.py writes the folder as an f32 GGUF (its sha256 is recorded). The
   tiny model's tokenizer is trained here, so the converter cannot recognise its
   pre-tokenizer by the hash of its ids; it is told "qwen2", Qwen3's own, and the Gemma 2
   and Phi-3 converters, which read SentencePiece vocabularies, are given the byte-level
   one as Gemma 3's converter reads it without a tokenizer.model. The tests feed token ids, so
   llama.cpp's tokenizer never decides anything they check.
2. llama.cpp's quantizer (`llama_model_quantize`, what `llama-quantize` runs) makes the
   files MODELS names from it: engine/tests/fixtures/gguf/tiny-{model}-{quant}.gguf.
3. For each, llama.cpp (through llama-cpp-python) continues PROMPTS fixed random prompts
   greedily and records, teacher-forced, its five best next tokens at every position:
   engine/tests/fixtures/llama_cpp_tiny_{model}_{quant}.json, the schema of
   llama_cpp_smollm2.json. engine/tests/engine/llama_cpp.rs holds our decode path to them.
"""

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from oracle_common import (
    FIXTURES,
    dump,
    llama_cpp_case,
    llama_cpp_model,
    quantize,
    run_converter,
)

PROMPTS = 16
CONTINUATION = 32
TOP = 5
SEED = 20261128
# (name, llama_ftype): LLAMA_FTYPE_MOSTLY_Q8_0, _Q4_1, _Q5_0, _Q4_K_M and _Q5_K_M.
Q8_0, Q4_1, Q5_0 = ("q8_0", 7), ("q4_1", 3), ("q5_0", 8)
Q4_K_M, Q5_K_M = ("q4_k_m", 15), ("q5_k_m", 17)
# (model, quantizations), in the order of the command's folders.
MODELS = [
    ("qwen3", [Q8_0, Q4_1]),
    ("llama3", [Q8_0]),
    ("qwen3_moe", [Q8_0]),
    ("mixtral", [Q4_1]),
    ("qwen2_moe", [Q8_0]),
    ("qwen2_yarn", [Q8_0]),
    ("gemma2", [Q4_1]),
    ("gemma3", [Q8_0]),
    ("phi3", [Q8_0]),
    ("qwen3_wide", [Q8_0, Q4_K_M, Q5_K_M, Q5_0]),
]
# The config.json fields each model's folder is converted with, over its own.
CONFIG_EDITS = {
    "qwen2_yarn": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    },
}


# Names the converter writes as general.name where the folder's own would not do:
# llama.cpp's vocabulary loader looks up "</s>" for a model named like Phi-3, which the
# tiny tokenizer does not have.
MODEL_NAMES = {"phi3": "tiny"}


def convert(llama_cpp: Path, model_dir: Path, out: Path, name: str | None) -> None:
    """Runs llama.cpp's converter on `model_dir`, writing an f32 GGUF to `out`."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    import conversion.gemma as gemma

    import conversion.phi as phi

    gemma.Gemma2Model.set_vocab = base.TextModel._set_vocab_gpt2
    phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2
    args = [str(model_dir), "--outfile", str(out), "--outtype", "f32"]
    if name is not None:
        args += ["--model-name", name]
    run_converter(llama_cpp, args)


def prompts() -> list:
    """Random prompts of 8 to 200 ordinary ids: the tiny tokenizer's specials are 0 to 2
    and the tokens added after its 512 trained ones."""
    rng = np.random.default_rng(SEED)
    lengths = np.linspace(8, 200, PROMPTS).astype(int)
    return [[int(t) for t in rng.integers(3, 512, size=n)] for n in lengths]


def main() -> None:
    llama_cpp_dir = Path(os.environ["LLAMA_CPP"])
    jobs = list(zip(MODELS, sys.argv[1:], strict=True)) if sys.argv[1] != "--only" else only()
    for (model, quants), model_dir in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / f"tiny-{model}-f32.gguf"
            source = edited(Path(model_dir), Path(tmp) / model, CONFIG_EDITS.get(model))
            convert(llama_cpp_dir, source, f32, MODEL_NAMES.get(model))
            for quant in quants:
                record(model, f32, quant)


def only() -> list:
    """The one file `--only MODEL:QUANT FOLDER` names, so that adding a file leaves the
    others as they are."""
    _, spec, folder = sys.argv[1:]
    model, name = spec.split(":")
    quants = dict(MODELS)[model]
    return [((model, [q for q in quants if q[0] == name]), folder)]


def edited(model_dir: Path, copy: Path, edit: dict | None) -> Path:
    """`model_dir`, or a copy of it at `copy` with `edit`'s fields set in its config.json."""
    if edit is None:
        return model_dir
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(edit)
    (copy / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copy


def record(model: str, f32: Path, quant: tuple) -> None:
    """Quantizes `f32` and writes llama.cpp's teacher-forced reference for the file."""
    name, ftype = quant
    path = FIXTURES / "gguf" / f"tiny-{model}-{name}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    quantize(f32, path, ftype)
    llm = llama_cpp_model(path)
    cases = [llama_cpp_case(llm, p, CONTINUATION, TOP) for p in prompts()]
    dump(
        {
            "note": "written by scripts/oracle_gguf.py; do not edit",
            "model": path.name,
            "converted_f32_sha256": hashlib.sha256(f32.read_bytes()).hexdigest(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "versions": {"llama-cpp-python": md.version("llama-cpp-python")},
            "cases": cases,
        },
        FIXTURES / f"llama_cpp_tiny_{model}_{name}.json",
    )


if __name__ == "__main__":
    main()
