"""Parts of a decode step from `perf script -F tid,ip,sym` lines on stdin: each sample put in
a part by its leaf symbol, printed as each part's share of all samples and of each thread's.
bench/step-profile.sh runs it."""

import collections
import sys

# First match wins, in this order.
PARTS = [
    # A product's own parts: its kernels, its drivers (`split::by_runs`' items, which call
    # the kernels and wait there on the stores of the last pair's outputs), the stores of
    # its outputs (`Columns::put*`) and the addresses its kernels ask for ahead
    # (`::ahead`), as every `kquant::` symbol already counted for the K-quants.
    ("quantized products", ["dot_group", "dot_tile", "dot_pair", "pair_tile",
                            "by_groups", "by_padded_groups", "by_runs_of_groups",
                            "split::by_runs",
                            "kquant::", "Q41Matrix::", "Q80Matrix::", "Columns::put"]),
    ("attention", ["attention::", "softmax", "exp_minus"]),
    ("pool: waits, spins, hand-offs", ["BarrierGuard", "begin_short_backtrace", "park",
                                       "futex", "spin_unlock", "finish_task_switch",
                                       "schedule", "execute_chunked", "call_trampoline"]),
    ("quantizing activations", ["quantize"]),
    ("allocator, memset, memmove, page clearing", ["malloc", "free", "memset", "memmove",
                                                   "memcpy", "page", "_int_", "calloc"]),
]
REST = "the rest (norms, RoPE, SwiGLU, argmax, candle's ops)"


def part(symbol):
    for name, marks in PARTS:
        if any(m in symbol for m in marks):
            return name
    return REST


def main():
    threads = collections.defaultdict(collections.Counter)
    for line in sys.stdin:
        fields = line.split(None, 2)
        if len(fields) < 2:
            continue
        symbol = fields[2].strip() if len(fields) > 2 else "[unknown]"
        threads[fields[0]][part(symbol)] += 1
    # The two busiest threads: the caller and candle's pool worker.
    busy = sorted(threads, key=lambda t: -sum(threads[t].values()))[:2]
    total = collections.Counter()
    for t in busy:
        total.update(threads[t])
    n = sum(total.values())
    if n == 0:
        sys.exit("no samples")
    names = [p for p, _ in PARTS] + [REST]
    print("| part | both threads | " + " | ".join(f"thread {t}" for t in busy) + " |")
    print("| --- | ---: |" + " ---: |" * len(busy))
    for name in names:
        cells = [f"{100 * threads[t][name] / sum(threads[t].values()):.1f}%" for t in busy]
        print(f"| {name} | {100 * total[name] / n:.1f}% | " + " | ".join(cells) + " |")
    outside = 100 * (n - total[PARTS[0][0]]) / n
    print(f"\noutside the products: {outside:.1f}% of {n} samples")


main()
