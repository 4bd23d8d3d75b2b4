"""RoPE scaling oracle: the generated tiny model under each rotary scaling the engine reads.

Usage (from the repo root):
  python3 scripts/oracle_rope.py TINY_MODEL_DIR OUT_JSON

TINY_MODEL_DIR is the tiny model the Rust side generates (`tandem-model --size tiny`). For
each variant in VARIANTS, the folder is copied with its config.json changed as the variant
says (both layouts: transformers 4's top-level `rope_theta` and `rope_scaling`, and
transformers 5's `rope_parameters`), loaded in float32 with eager attention on CPU, and,
for a fixed prompt of PROMPT_LEN token ids (longer than every variant's
`original_max_position_embeddings`, so that the scaled frequencies matter), records:

  config          = the whole config.json the variant was run with
  prompt_ids      = the prompt
  generated_ids   = NEW_TOKENS greedy tokens (model.generate, EOS never stops it)
  first_step_top5 = top-5 (id, logit) of the logits for the first new token

Loading must report no missing, unexpected or mismatched weights, so the variant runs the
weights the engine runs. `engine/tests/engine/rope.rs` reads the output.

It also records `config_fields`: every field transformers writes into a config.json for the
configuration classes of the architectures the engine runs (Gemma2Config, Gemma3TextConfig,
LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig,
Qwen3Config, Qwen3MoeConfig), so that a test can check the engine
knows what to do with each.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from oracle_common import dump, greedy_run, top5, versions

NEW_TOKENS = 16
CONFIG_CLASSES = (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
PROMPT_LEN = 200
ORIGINAL = 64

# (name, keys set in config.json, keys removed from it)
VARIANTS = [
    ("linear_v4", {"rope_scaling": {"type": "linear", "factor": 4.0}}, []),
    (
        "llama3_v4",
        {
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            },
        },
        [],
    ),
    (
        "yarn_v4",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
        [],
    ),
    (
        "yarn_v5",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 20000.0,
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            }
        },
        ["rope_theta", "rope_scaling"],
    ),
    ("default_v5", {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, ["rope_theta", "rope_scaling"]),
]


def prompt(vocab: int) -> list[int]:
    return [(i * 7919 + 13) % vocab for i in range(PROMPT_LEN)]


def run(model_dir: Path, vocab: int) -> dict:
    model, info = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt(vocab)
    logits, out_ids = greedy_run(model, ids, NEW_TOKENS, 0)
    return {
        "prompt_ids": ids,
        "generated_ids": out_ids,
        "first_step_top5": top5(logits),
    }


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    base = json.loads((model_dir / "config.json").read_text())
    results = []
    for name, set_keys, removed in VARIANTS:
        config = {k: v for k, v in base.items() if k not in removed}
        config.update(set_keys)
        with tempfile.TemporaryDirectory() as tmp:
            variant = Path(tmp) / name
            shutil.copytree(model_dir, variant)
            (variant / "config.json").write_text(json.dumps(config, indent=2))
            entry = {"name": name, "config": config, **run(variant, base["vocab_size"])}
        results.append(entry)
        print(f"{name}: -> {entry['generated_ids'][:8]}...")
    dump(
        {
            "model_dir": model_dir.name,
            "versions": versions(),
            "dtype": "float32",
            "attn_implementation": "eager",
            "variants": results,
            "config_fields": {c.__name__: sorted(c().to_dict()) for c in CONFIG_CLASSES},
        },
        out,
    )


if __name__ == "__main__":
    main()
