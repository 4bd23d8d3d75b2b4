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
// `q` `(n, heads, head_dim)` f32 into `out` of the same shape. Grid (heads, n), WARPS
// warps a block and `WARPS * head_dim` floats of dynamic shared memory.
//
// Each warp walks its keys with an online softmax (its running max, the sum of its
// weights and their weighted values, each lane holding the dimensions lane + 32 i); the
// warps' partial sums are then merged under their common max. `softcap` > 0 caps the
// scaled scores as Gemma 2 does; `window` > 0 keeps only the last `window` keys.
extern "C" __global__ void step_attention(const float* __restrict__ q,
                                          const Slot* __restrict__ slots,
                                          float* __restrict__ out, int heads, int kv_heads,
                                          int head_dim, float scale, float softcap,
                                          int window) {
    extern __shared__ float merged[];
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Slot s = slots[b];
    const size_t head = (size_t)(h / (heads / kv_heads)) * s.head_stride;
    const __half* keys = s.k + head;
    const __half* values = s.v + head;
    const long long last = (long long)s.pos;
    const long long first = (window > 0 && last + 1 > window) ? last + 1 - window : 0;
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
    float total = 0.0f;
    for (int w = 0; w < WARPS; w++) total += warp_sum[w] * expf(warp_max[w] - top);
    float* dst = out + ((size_t)b * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float x = 0.0f;
        for (int w = 0; w < WARPS; w++) x += merged[w * head_dim + d] * expf(warp_max[w] - top);
        dst[d] = x / total;
    }
}
