// What the decode step's kernels (engine/src/attention/step.cu) use of CUDA, on the CPU:
// each block's threads are OS threads, `__syncthreads` a barrier over them and a warp
// shuffle an exchange through memory between two barriers over the warp's threads.
// Blocks run one after another, so a block's `__shared__` arrays can be `static`.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

// f16 as the GPU rounds it: to nearest, ties to even (the compiler's _Float16).
struct __half {
    uint16_t bits;
};
inline __half __float2half_rn(float f) {
    _Float16 h = (_Float16)f;
    __half r;
    std::memcpy(&r, &h, 2);
    return r;
}
inline float __half2float(__half h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim;

std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float warp_lanes[32][32];
// A block's dynamic shared memory (the kernels' `extern __shared__` array).
float dynamic_shared[1 << 14];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_lanes[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    const float other = warp_lanes[warp][lane ^ lane_mask];
    warp_barriers[warp]->arrive_and_wait();
    return other;
}

#define __global__
#define __shared__ static

// Runs one block of `kernel`: its threads, each with its indices.
template <class Kernel>
void run_block(unsigned bx, unsigned by, unsigned bz, unsigned threads, Kernel kernel) {
    std::barrier<> block(threads);
    block_barrier = &block;
    warp_barriers.clear();
    for (unsigned first = 0; first < threads; first += 32) {
        const unsigned lanes = threads - first < 32 ? threads - first : 32;
        warp_barriers.push_back(std::make_unique<std::barrier<>>(lanes));
    }
    std::vector<std::thread> running;
    for (unsigned t = 0; t < threads; t++) {
        running.emplace_back([=] {
            threadIdx.x = t;
            blockIdx.x = bx;
            blockIdx.y = by;
            blockIdx.z = bz;
            kernel();
        });
    }
    for (auto& t : running) t.join();
}

// Runs `kernel` over `grid` blocks of `threads` threads, one block after another.
template <class Kernel>
void launch(dim3 grid, unsigned threads, Kernel kernel) {
    blockDim.x = threads;
    for (unsigned bz = 0; bz < grid.z; bz++) {
        for (unsigned by = 0; by < grid.y; by++) {
            for (unsigned bx = 0; bx < grid.x; bx++) {
                run_block(bx, by, bz, threads, kernel);
            }
        }
    }
}
