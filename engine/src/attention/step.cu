// A decode step's attention on a GPU, one launch each for the whole batch however long
// each sequence's cache is (attention/cuda.rs launches them). Each sequence's cache stays
// where it is, `(kv_heads, capacity, head_dim)` f16 per layer: the kernels find it by the
// pointers in its `Slot`, so no step gathers or pads the caches.
#include <cuda_fp16.h>

// One sequence's cache in this layer: K and V, the elements from one K/V head to the
// next (capacity * head_dim), and the new row's position (the positions stored before it).
// Four 64-bit words, as cuda.rs writes them.
struct Slot {
    __half* k;
    __half* v;
    unsigned long long head_stride;
    unsigned long long pos;
};

// Warps a block of `step_attention` runs: each takes every WARPS-th key.
#define WARPS 4
// Head dimensions a lane holds: head_dim up to 32 * MAX_DIMS (cuda.rs checks it).
#define MAX_DIMS 8

// Writes each sequence's new K and V row, `(n, kv_heads, head_dim)` f32, rounded to the
// nearest f16 (ties to even, as the CPU's conversion), at its position. Grid (kv_heads, n).
extern "C" __global__ void kv_append(const float* __restrict__ k, const float* __restrict__ v,
                                     const Slot* __restrict__ slots, int kv_heads, int head_dim) {
    const int h = blockIdx.x, b = blockIdx.y;
    const Slot s = slots[b];
    const size_t src = ((size_t)b * kv_heads + h) * head_dim;
    const size_t dst = h * s.head_stride + s.pos * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        s.k[dst + d] = __float2half_rn(k[src + d]);
        s.v[dst + d] = __float2half_rn(v[src + d]);
    }
}

// Attention of each sequence's new row over its keys up to and including that row's,
// `q` `(n, heads, head_dim)` f32. Grid (heads, n, splits), WARPS warps a block and
// `WARPS * head_dim` floats of dynamic shared memory.
//
// With one split, a block attends one (sequence, head) over all its keys and writes the
// result to `out` `(n, heads, head_dim)`. With more (a small batch over long caches, where
// one block a head would leave most of the GPU idle), split z of a sequence's keys, cut in
// `splits` runs of equal length, writes its partial result to `partial`
// `(n, heads, splits, head_dim + 2)`: its weighted values, unnormalized, then its max and
// its sum of weights; `merge_splits` then merges them.
//
// Each warp walks its keys with an online softmax (its running max, the sum of its
// weights and their weighted values, each lane holding the dimensions lane + 32 i); the
// warps' partial sums are then merged under their common max. `softcap` > 0 caps the
// scaled scores as Gemma 2 does; `window` > 0 keeps only the last `window` keys.
extern "C" __global__ void step_attention(const float* __restrict__ q,
                                          const Slot* __restrict__ slots,
                                          float* __restrict__ out, float* __restrict__ partial,
                                          int heads, int kv_heads, int head_dim, float scale,
                                          float softcap, int window, int splits) {
    extern __shared__ float merged[];
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    const int h = blockIdx.x, b = blockIdx.y, z = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Slot s = slots[b];
    const size_t head = (size_t)(h / (heads / kv_heads)) * s.head_stride;
    const __half* keys = s.k + head;
    const __half* values = s.v + head;
    const long long pos = (long long)s.pos;
    const long long start = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
    // This split's keys, `first ..= last`: none where the sequence has fewer keys than
    // there are splits.
    const long long run = (pos + 1 - start + splits - 1) / splits;
    const long long first = start + z * run;
    const long long last = first + run - 1 < pos ? first + run - 1 : pos;
    const float* row = q + ((size_t)b * heads + h) * head_dim;

    float qd[MAX_DIMS], acc[MAX_DIMS];
    for (int i = 0; i < MAX_DIMS; i++) {
        const int d = lane + 32 * i;
        qd[i] = d < head_dim ? row[d] : 0.0f;
        acc[i] = 0.0f;
    }
    // Before the first key the max is -inf: its correction exp(-inf) zeroes nothing yet
    // summed, and a warp without keys keeps weight 0 in the merge.
    float max = -INFINITY, sum = 0.0f;
    for (long long j = first + warp; j <= last; j += WARPS) {
        const __half* key = keys + j * head_dim;
        float dot = 0.0f;
        for (int i = 0; i < MAX_DIMS; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) dot += qd[i] * __half2float(key[d]);
        }
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        float score = dot * scale;
        if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
        const float next = fmaxf(max, score);
        const float correction = expf(max - next);
        const float weight = expf(score - next);
        sum = sum * correction + weight;
        const __half* value = values + j * head_dim;
        for (int i = 0; i < MAX_DIMS; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * correction + weight * __half2float(value[d]);
        }
        max = next;
    }
    if (lane == 0) {
        warp_max[warp] = max;
        warp_sum[warp] = sum;
    }
    for (int i = 0; i < MAX_DIMS; i++) {
        const int d = lane + 32 * i;
        if (d < head_dim) merged[warp * head_dim + d] = acc[i];
    }
    __syncthreads();

    float top = -INFINITY;
    for (int w = 0; w < WARPS; w++) top = fmaxf(top, warp_max[w]);
    // A split without keys keeps the max -inf (its sums are then not numbers), which
    // `merge_splits` passes over.
    float total = 0.0f;
    for (int w = 0; w < WARPS; w++) total += warp_sum[w] * expf(warp_max[w] - top);
    const size_t at = (size_t)b * heads + h;
    float* dst = splits == 1 ? out + at * head_dim : partial + (at * splits + z) * (head_dim + 2);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float x = 0.0f;
        for (int w = 0; w < WARPS; w++) x += merged[w * head_dim + d] * expf(warp_max[w] - top);
        dst[d] = splits == 1 ? x / total : x;
    }
    if (splits > 1 && threadIdx.x == 0) {
        dst[head_dim] = top;
        dst[head_dim + 1] = total;
    }
}

// Merges `step_attention`'s splits: `partial` `(n, heads, splits, head_dim + 2)` into `out`
// `(n, heads, head_dim)`, each split's values and sum weighted by exp(its max - the
// largest). Grid (heads, n).
extern "C" __global__ void merge_splits(const float* __restrict__ partial,
                                        float* __restrict__ out, int heads, int head_dim,
                                        int splits) {
    const size_t at = (size_t)blockIdx.y * heads + blockIdx.x;
    const float* parts = partial + at * splits * (head_dim + 2);
    const int width = head_dim + 2;
    float top = -INFINITY;
    for (int z = 0; z < splits; z++) top = fmaxf(top, parts[z * width + head_dim]);
    float total = 0.0f;
    for (int z = 0; z < splits; z++) {
        const float m = parts[z * width + head_dim];
        if (m > -INFINITY) total += parts[z * width + head_dim + 1] * expf(m - top);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float x = 0.0f;
        for (int z = 0; z < splits; z++) {
            const float m = parts[z * width + head_dim];
            if (m > -INFINITY) x += parts[z * width + d] * expf(m - top);
        }
        out[at * head_dim + d] = x / total;
    }
}
