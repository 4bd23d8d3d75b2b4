// The decode step's kernels on the emulated GPU of shim.h against attention in f64: three
// sequences at positions 0, 21 and 40 in caches of different capacities, heads of 64, 96
// (not a multiple of a warp) and 128 dimensions, two query heads a K/V head, plain, with a
// window of 16 and with a soft cap, each sequence's keys attended whole or in 3 or 8 runs
// merged after (8: more runs than the first sequence has keys). Prints each case's largest
// difference; exits 1 when a written row is not the f16 of its input or an output is more
// than 1e-5 off.
#include <cstdio>
#include <random>

#include "shim.h"
#include "step.cpp"

namespace {

struct Case {
    int head_dim;
    int window;
    float softcap;
    // Runs of keys attended apart and merged (`merge_splits`); 1: none.
    int splits;
};

// Attention of one query head over keys `first ..= pos` of its K/V head, in f64.
double reference(const std::vector<float>& q, const std::vector<__half>& keys,
                 const std::vector<__half>& values, size_t head, int first, int pos, int hd,
                 float scale, float softcap, int d) {
    std::vector<double> w;
    double max = -INFINITY, sum = 0;
    for (int j = first; j <= pos; j++) {
        double dot = 0;
        for (int i = 0; i < hd; i++) dot += (double)q[i] * __half2float(keys[head + j * hd + i]);
        dot *= scale;
        if (softcap > 0) dot = softcap * std::tanh(dot / softcap);
        w.push_back(dot);
        max = std::max(max, dot);
    }
    for (double& x : w) sum += (x = std::exp(x - max));
    double out = 0;
    for (int j = first; j <= pos; j++)
        out += w[j - first] / sum * __half2float(values[head + j * hd + d]);
    return out;
}

}  // namespace

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 1);
    const int n = 3, heads = 4, kv_heads = 2;
    const int positions[n] = {0, 21, 40}, capacities[n] = {64, 64, 128};
    int failures = 0;
    for (Case c : {Case{64, 0, 0, 1}, Case{96, 16, 0, 1}, Case{128, 0, 5, 1}, Case{64, 16, 5, 1},
                   Case{64, 0, 0, 3}, Case{96, 16, 5, 3}, Case{128, 0, 0, 8}}) {
        const int hd = c.head_dim;
        const float scale = 1.0f / std::sqrt((float)hd);
        std::vector<std::vector<__half>> keys(n), values(n);
        std::vector<Slot> slots(n);
        for (int b = 0; b < n; b++) {
            keys[b].resize((size_t)kv_heads * capacities[b] * hd);
            values[b].resize(keys[b].size());
            for (auto& x : keys[b]) x = __float2half_rn(normal(rng));
            for (auto& x : values[b]) x = __float2half_rn(normal(rng));
            slots[b] = Slot{keys[b].data(), values[b].data(),
                            (unsigned long long)capacities[b] * hd,
                            (unsigned long long)positions[b]};
        }
        std::vector<float> q(n * heads * hd), k(n * kv_heads * hd), v(k.size());
        std::vector<float> out(q.size());
        for (auto* xs : {&q, &k, &v})
            for (float& x : *xs) x = normal(rng);
        launch(dim3{(unsigned)kv_heads, (unsigned)n, 1}, hd,
               [&] { kv_append(k.data(), v.data(), slots.data(), kv_heads, hd); });
        const unsigned splits = (unsigned)c.splits;
        std::vector<float> partial(splits > 1 ? out.size() / hd * splits * (hd + 2) : 0);
        launch(dim3{(unsigned)heads, (unsigned)n, splits}, 128, [&] {
            step_attention(q.data(), slots.data(), out.data(), partial.data(), heads, kv_heads,
                           hd, scale, c.softcap, c.window, c.splits);
        });
        if (splits > 1)
            launch(dim3{(unsigned)heads, (unsigned)n, 1}, 64, [&] {
                merge_splits(partial.data(), out.data(), heads, hd, c.splits);
            });
        double worst = 0;
        for (int b = 0; b < n; b++) {
            const int pos = positions[b];
            const int first = (c.window > 0 && pos + 1 > c.window) ? pos + 1 - c.window : 0;
            for (int h = 0; h < heads; h++) {
                const int g = h / (heads / kv_heads);
                const size_t head = (size_t)g * capacities[b] * hd;
                for (int d = 0; d < hd; d++) {
                    const size_t at = head + pos * hd + d, from = (b * kv_heads + g) * hd + d;
                    const float want_k = __half2float(__float2half_rn(k[from]));
                    const float want_v = __half2float(__float2half_rn(v[from]));
                    if (__half2float(keys[b][at]) != want_k ||
                        __half2float(values[b][at]) != want_v)
                        failures++;
                }
                std::vector<float> row(q.begin() + (b * heads + h) * hd,
                                       q.begin() + (b * heads + h + 1) * hd);
                for (int d = 0; d < hd; d++) {
                    const double want = reference(row, keys[b], values[b], head, first, pos, hd,
                                                  scale, c.softcap, d);
                    const double diff = std::abs(want - out[(b * heads + h) * hd + d]);
                    // A NaN is the worst of all (std::max would pass over it).
                    if (!(diff <= worst)) worst = diff;
                }
            }
        }
        std::printf("head_dim %d, window %d, soft cap %g, %d splits: largest difference %.3g\n",
                    hd, c.window, c.softcap, c.splits, worst);
        if (!(worst <= 1e-5)) failures++;
    }
    std::printf("%d failures\n", failures);
    return failures == 0 ? 0 : 1;
}
