// kvq: token picks on the device, so a decode step sends back token ids, not logits rows.
//
// argmax_rows_f32: per row of f32 logits [rows, vocab], the index of the largest value, the
// lowest index among equal maxima (the host sampler's greedy rule), and a flag for a row that
// holds a NaN. One block of 1024 threads per row (one block of 256 took 84 µs under ncu on a 49K vocabulary
// at batch 1, longer than a layer); each thread scans a strided slice, four values per 16-byte
// load where the row is aligned (indices increasing, so its own first maximum wins), then the
// block reduces (value, index) pairs.
#include <stdint.h>
#include <math.h>
#include "common.cuh"

#define ARGMAX_THREADS 1024
#define NONE 0xffffffffu

// The better of two candidates: the larger value, the lower index on a tie; NONE loses.
__device__ __forceinline__ void better(float& v, uint32_t& i, float ov, uint32_t oi) {
    if (oi == NONE) return;
    if (i == NONE || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// One value at index k of this thread's scan: a NaN flags the row, a larger value wins.
__device__ __forceinline__ void take(float y, uint32_t k, float& v, uint32_t& i, int& nan) {
    if (y != y) {
        nan = 1;
    } else if (i == NONE || y > v) {
        v = y;
        i = k;
    }
}

extern "C" __global__ void argmax_rows_f32(const float* __restrict__ x, int vocab,
                                           uint32_t* __restrict__ ids,
                                           uint32_t* __restrict__ nan_flags) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ uint32_t si[ARGMAX_THREADS / 32];
    __shared__ int snan;
    pdl_start();
    const float* r = x + (size_t)blockIdx.x * vocab;
    if (threadIdx.x == 0) snan = 0;
    __syncthreads();
    float v = -INFINITY;
    uint32_t i = NONE;
    int nan = 0;
    // Scalar steps until the row is 16-byte aligned, then quads, then the tail. Each thread's
    // indices still increase: its scalar head (if any) comes before its quads, its quads before
    // its tail.
    int head = (int)(((16 - ((uintptr_t)r & 15)) & 15) / 4);
    if (((uintptr_t)r & 3) != 0 || head > vocab) head = vocab;  // not even float-aligned: scalar
    const int quads = (vocab - head) / 4, tail = head + 4 * quads;
    for (int k = threadIdx.x; k < head; k += blockDim.x) take(r[k], (uint32_t)k, v, i, nan);
    const float4* r4 = reinterpret_cast<const float4*>(r + head);
#pragma unroll 4
    for (int q = threadIdx.x; q < quads; q += blockDim.x) {
        const float4 y = r4[q];
        const uint32_t k = (uint32_t)(head + 4 * q);
        take(y.x, k, v, i, nan);
        take(y.y, k + 1, v, i, nan);
        take(y.z, k + 2, v, i, nan);
        take(y.w, k + 3, v, i, nan);
    }
    for (int k = tail + threadIdx.x; k < vocab; k += blockDim.x) take(r[k], (uint32_t)k, v, i, nan);
    if (nan) snan = 1;
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, v, off);
        uint32_t oi = __shfl_down_sync(0xffffffffu, i, off);
        better(v, i, ov, oi);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x / 32); w++) better(v, i, sv[w], si[w]);
        ids[blockIdx.x] = i;
        nan_flags[blockIdx.x] = (uint32_t)snan;
    }
}
