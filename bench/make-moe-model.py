"""A Qwen3-30B-A3B-shaped mixture of experts in GGUF Q4_K_M, for the mixture's speed
against llama.cpp (bench/README.md, "A mixture of experts"). Never run by CI.

Usage:
  LLAMA_CPP=DIR LLAMA_BIN=BIN python3 bench/make-moe-model.py OUT [EXPERTS]

DIR is the llama.cpp tree bench/install-peers.sh keeps (its gguf-py writes the file), BIN
the folder of its native build (`llama-quantize`). The model is Qwen3-30B-A3B's config.json
(`CONFIG`) but with EXPERTS experts a layer (default 64 of its 128): the same attention, the
same 8 experts of 768 run per token, so the same 3.3B parameters a token reads, in 16B
rather than 30.5B. The 128-expert Q4_K_M is 18.6 GB, and the engine and llama.cpp each
holding it leave this machine's 24 GiB no room (the issue allows a smaller total).

1. The f16 GGUF is written directly with llama.cpp's own gguf-py, not through
   convert_hf_to_gguf.py: that converter needs torch, and the f16 safetensors folder it
   reads would be another 32 GB. The metadata and tensor names are the converter's for
   `Qwen3MoeForCausalLM` (`tokenizer_metadata` is its `get_vocab_base` and `SpecialVocab`
   over the real Qwen3 tokenizer that scripts/fetch-npm-tokenizers.sh fetches); the
   matrices are normal with transformers' initializer_range of 0.02, norms 1, and the router
   in f32 as the converter keeps it.
2. `llama-quantize` writes OUT/qwen3-moe-a3b-e{EXPERTS}-q4_k_m.gguf with its own choice of
   types per tensor (Q4_K, Q6_K for the head and some of v and down_exps).
The f16 file is deleted after; a file that exists is skipped.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# Qwen3-30B-A3B's config.json, less the expert count.
CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
}
LLAMA_FTYPE_MOSTLY_F16 = 1


def tokenizer_metadata(gguf, writer, folder: Path) -> None:
    """The converter's `_set_vocab_gpt2` for a Qwen tokenizer (its pre-tokenizer `qwen2`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    reverse = {i: t for t, i in tok.vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(CONFIG["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token not in added:
            types.append(gguf.TokenType.NORMAL)
        elif decoder[i].special or (token.startswith("<|") and token.endswith("|>")):
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.USER_DEFINED)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)


def tensors(experts: int):
    """Every tensor's GGUF name, numpy shape (rows last) and dtype."""
    c = CONFIG
    h, vocab, inter = c["hidden_size"], c["vocab_size"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    yield "token_embd.weight", (vocab, h), np.float16
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), np.float32
        yield b + "attn_q.weight", (q, h), np.float16
        yield b + "attn_k.weight", (kv, h), np.float16
        yield b + "attn_v.weight", (kv, h), np.float16
        yield b + "attn_q_norm.weight", (c["head_dim"],), np.float32
        yield b + "attn_k_norm.weight", (c["head_dim"],), np.float32
        yield b + "attn_output.weight", (h, q), np.float16
        yield b + "ffn_norm.weight", (h,), np.float32
        yield b + "ffn_gate_inp.weight", (experts, h), np.float32
        yield b + "ffn_gate_exps.weight", (experts, inter, h), np.float16
        yield b + "ffn_up_exps.weight", (experts, inter, h), np.float16
        yield b + "ffn_down_exps.weight", (experts, h, inter), np.float16
    yield "output_norm.weight", (h,), np.float32
    yield "output.weight", (vocab, h), np.float16


def write_f16(gguf, path: Path, experts: int) -> None:
    c = CONFIG
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_type("model")
    writer.add_name(f"Qwen3-MoE-A3B-E{experts} random")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_F16)
    tokenizer_metadata(gguf, writer, REPO / "models" / "qwen3")
    for name, shape, dtype in tensors(experts):
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(20261202)
    for name, shape, dtype in tensors(experts):
        if dtype == np.float16:
            t = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        elif name.endswith("ffn_gate_inp.weight"):
            t = rng.standard_normal(shape, dtype=np.float32) * 0.02
        else:
            t = np.ones(shape, dtype=np.float32)
        writer.write_tensor_data(t)
    writer.close()


def main() -> None:
    llama_cpp, llama_bin = Path(os.environ["LLAMA_CPP"]), Path(os.environ["LLAMA_BIN"])
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    out = Path(sys.argv[1])
    experts = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"qwen3-moe-a3b-e{experts}-q4_k_m.gguf"
    if target.exists():
        print(f"{target} exists")
        return
    f16 = out / f"qwen3-moe-a3b-e{experts}-f16.gguf"
    write_f16(gguf, f16, experts)
    subprocess.run([str(llama_bin / "llama-quantize"), str(f16), str(target), "Q4_K_M"], check=True)
    f16.unlink()
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
