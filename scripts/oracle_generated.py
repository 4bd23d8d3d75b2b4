"""Greedy-decoding oracle for a (small, generated) Hugging Face model directory.

Usage (from the repo root):
  python3 scripts/oracle_generated.py MODEL_DIR OUT_JSON

MODEL_DIR is a transformers checkpoint (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json), e.g. the tiny random model the Rust side generates. Loads it in
float32 (dtype=torch.float32, eager attention, CPU) and, for each prompt in PROMPTS, records:

  prompt (text), rendered-chat inputs (messages/tools/kwargs) for chat prompts,
  prompt_ids      = tok.encode(prompt, add_special_tokens=False)
  generated_ids   = 32 greedy new tokens from model.generate(do_sample=False), EOS disabled
  generated_text  = tok.decode(generated_ids)
  first_step_top5 = top-5 (id, logit) of the logits for the first new token

plus the transformers/torch versions and the sha256 of the weight files. The chat prompts use
the tokenizer's own chat_template (FALLBACK_CHATML if it has none; recorded as "chat_template").
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from oracle_common import TOOLS, dump, greedy_run, top5, versions

NEW_TOKENS = 32


# (name, plain text) or (name, messages, tools, template kwargs)
PROMPTS = [
    ("english", "The quick brown fox jumps over the lazy dog. Once upon a time"),
    ("chinese", "你好，世界！今天天气很好，我们去公园散步吧。"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ("chat", [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi! Who are you?"}], None, {}),
    ("chat_tools", [{"role": "user", "content": "What's the weather in Paris?"}], TOOLS, {}),
    ("chat_no_thinking", [{"role": "user", "content": "What is 2+2?"}], None, {"enable_thinking": False}),
    (
        "chat_tool_history",
        [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two cities, two calls.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"Rome\"}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "{\"temperature\": 25}"},
        ],
        TOOLS,
        {"enable_thinking": True},
    ),
]

FALLBACK_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # Plain argmax steps: drop the checkpoint's generation_config (which could carry a
    # repetition penalty etc.) and never stop on or suppress EOS.
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad)
    template = tok.chat_template or FALLBACK_CHATML

    results = []
    for name, *spec in PROMPTS:
        entry = {"name": name}
        if isinstance(spec[0], str):
            prompt = spec[0]
        else:
            messages, tools, kwargs = spec
            prompt = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, chat_template=template, **kwargs
            )
            entry.update(messages=messages, tools=tools, kwargs=kwargs)
        ids = tok.encode(prompt, add_special_tokens=False)
        logits, out_ids = greedy_run(model, ids, NEW_TOKENS, pad)
        with torch.no_grad():
            # Cross-check: teacher-forced argmax over the whole sequence gives the same tokens.
            full = model(torch.tensor([ids + out_ids])).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
        assert len(out_ids) == NEW_TOKENS, (name, len(out_ids))
        entry.update(
            prompt=prompt,
            prompt_ids=ids,
            generated_ids=out_ids,
            generated_text=tok.decode(out_ids),
            teacher_forced_argmax_matches=full == out_ids,
            first_step_top5=top5(logits),
        )
        results.append(entry)
        print(f"{name}: {len(ids)} prompt ids -> {out_ids[:8]}...")

    dump(
        {
            "model_dir": model_dir.name,
            "model_type": model.config.model_type,
            "weights_sha256": {p.name: sha256(p) for p in sorted(model_dir.glob("*.safetensors"))},
            "versions": versions(),
            "dtype": "float32",
            "attn_implementation": "eager",
            "max_new_tokens": NEW_TOKENS,
            "chat_template": template,
            "prompts": results,
        },
        out,
    )


if __name__ == "__main__":
    main()
