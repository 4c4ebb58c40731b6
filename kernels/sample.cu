// kvq: token picks on the device, so a decode step sends back token ids, not logits rows.
//
// argmax_rows_f32: per row of f32 logits [rows, vocab], the index of the largest value, the
// lowest index among equal maxima (the host sampler's greedy rule), and a flag for a row that
// holds a NaN. One block per row; each thread scans a strided slice (indices increasing, so its
// own first maximum wins), then the block reduces (value, index) pairs.
#include <stdint.h>
#include <math.h>

#define ARGMAX_THREADS 256
#define NONE 0xffffffffu

// The better of two candidates: the larger value, the lower index on a tie; NONE loses.
__device__ __forceinline__ void better(float& v, uint32_t& i, float ov, uint32_t oi) {
    if (oi == NONE) return;
    if (i == NONE || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

extern "C" __global__ void argmax_rows_f32(const float* __restrict__ x, int vocab,
                                           uint32_t* __restrict__ ids,
                                           uint32_t* __restrict__ nan_flags) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ uint32_t si[ARGMAX_THREADS / 32];
    __shared__ int snan;
    const float* r = x + (size_t)blockIdx.x * vocab;
    if (threadIdx.x == 0) snan = 0;
    __syncthreads();
    float v = -INFINITY;
    uint32_t i = NONE;
    int nan = 0;
    for (int k = threadIdx.x; k < vocab; k += blockDim.x) {
        float y = r[k];
        if (y != y) {
            nan = 1;
        } else if (i == NONE || y > v) {
            v = y;
            i = (uint32_t)k;
        }
    }
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
