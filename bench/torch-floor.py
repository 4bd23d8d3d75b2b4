"""The floor of the GPU figures (docs/gpu.md): PyTorch's own transformers on a model folder,
timed as engine-bench times the engine. Prefill: the best of three forward passes of a prompt
of PREFILL tokens. Decode at each batch: sequences of CONTEXT tokens (one prefill), then
STEPS greedy steps of `model(...)` with the KV cache, each step waited for
(`torch.cuda.synchronize`), tokens per second over the steps. Greedy steps through the
model's forward rather than `generate`, whose own bookkeeping (stopping criteria, logits
processors) is not the model's speed. Never run by CI.

Usage: python3 bench/torch-floor.py FOLDER [--device cuda] [--dtype bfloat16]
           [--batches 1,16,64] [--json OUT]
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

PREFILL = 512
CONTEXT = 128
STEPS = 32


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompt(vocab: int, batch: int, length: int, device: str) -> torch.Tensor:
    # Fixed ids spread over the vocabulary, as engine-bench's synthetic prompts are.
    g = torch.Generator().manual_seed(7)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).to(device)


@torch.inference_mode()
def prefill_tokens_per_s(model, vocab: int, device: str) -> float:
    ids = prompt(vocab, 1, PREFILL, device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        model(ids, use_cache=False)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return PREFILL / best


@torch.inference_mode()
def decode_tokens_per_s(model, vocab: int, batch: int, device: str) -> float:
    ids = prompt(vocab, batch, CONTEXT, device)
    out = model(ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(STEPS):
        out = model(nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return batch * STEPS / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).to(args.device)
    model.eval()
    vocab = model.config.vocab_size
    result = {
        "folder": args.folder,
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "prefill_tokens": PREFILL,
        "prefill_tokens_per_s": prefill_tokens_per_s(model, vocab, args.device),
        "context": CONTEXT,
        "steps": STEPS,
        "decode": [
            {"batch": b, "tokens_per_s": decode_tokens_per_s(model, vocab, b, args.device)}
            for b in map(int, args.batches.split(","))
        ],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
