"""llama.cpp's own next-token choices on SmolLM2, teacher-forced: the reference our kernels
are held to once they no longer match candle's bit for bit (issue 32).

For each of a fixed set of chat prompts, llama.cpp (through llama-cpp-python, which builds
it from source) first writes a greedy continuation, then evaluates prompt + continuation
in one pass with logits for every position. For each position of the continuation it
records llama.cpp's five best next tokens with their log-probabilities. A test feeds the
same tokens through our decode path, batched, and checks that our best next token agrees
with llama.cpp's at 95% of positions or more, every disagreement a near-tie.

Writes engine/tests/fixtures/llama_cpp_smollm2.json; with `--kv-q8-0`, llama.cpp's K and V
caches hold Q8_0 blocks (`-ctk q8_0 -ctv q8_0`) and it writes
llama_cpp_smollm2_kv_q8_0.json, the reference for the engine's own Q8_0 caches.

Rerun (from the repo root; llama.cpp builds in about 5 minutes on two cores):
  bash scripts/fetch-smollm2.sh
  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "llama-cpp-python==0.3.36" numpy
  python3 scripts/oracle_llama_cpp.py
  python3 scripts/oracle_llama_cpp.py --kv-q8-0
"""

import importlib.metadata as md
import sys

from oracle_common import FIXTURES, MODELS, dump, llama_cpp_case, llama_cpp_model

GGUF_NAME = "smollm2-135m-instruct-q4_1.gguf"
CONTINUATION = 32
TOP = 5

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short recipe for pancakes.",
    "What does a CPU cache do?",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name four planets of the solar system.",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of regular exercise?",
    "Write a JSON object describing a book.",
    "How does a rainbow form?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small coffee shop.",
    "How many minutes are there in a day?",
]


def chat(question: str) -> str:
    """SmolLM2's chat template for one user turn, with its default system turn."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\n"
        f"{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def main() -> None:
    kv_q8_0 = "--kv-q8-0" in sys.argv[1:]
    path = MODELS / GGUF_NAME
    llm = llama_cpp_model(path, kv_q8_0)
    cases = []
    for q in QUESTIONS:
        prompt = llm.tokenize(chat(q).encode(), add_bos=False, special=True)
        cases.append({"question": q, **llama_cpp_case(llm, prompt, CONTINUATION, TOP)})
    dump(
        {
            "note": "written by scripts/oracle_llama_cpp.py; do not edit",
            "model": GGUF_NAME,
            "kv_cache": "q8_0" if kv_q8_0 else "f16",
            "versions": {"llama-cpp-python": md.version("llama-cpp-python")},
            "cases": cases,
        },
        FIXTURES / ("llama_cpp_smollm2_kv_q8_0.json" if kv_q8_0 else "llama_cpp_smollm2.json"),
    )


if __name__ == "__main__":
    main()
