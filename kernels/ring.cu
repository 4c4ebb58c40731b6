// kvq: the residual window's rows of a captured decode step (src/kv/cache/ring_write.rs).
//
// ring_write_T: grid (rows), one block per new row. Row i of k — minus row i of `means` when
// given, in T arithmetic as candle's subtraction (the centred key the pool stores, then also
// written to `k_out`) — goes as f16 (rounded as candle's cast) to rows ring[i] and sink[i] of
// ring_k; row i of v the same to ring_v. sink[i] == ring[i] for a row that is no sink (one write).
// It replaces a subtraction and four scatters per layer in a replayed step.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void ring_write(const T* __restrict__ k, const T* __restrict__ v,
                                           const T* __restrict__ means, T* __restrict__ k_out,
                                           __half* __restrict__ ring_k, __half* __restrict__ ring_v,
                                           const uint32_t* __restrict__ ring,
                                           const uint32_t* __restrict__ sink, int width) {
    const size_t i = blockIdx.x;
    const size_t r = ring[i], s = sink[i];
    const T* kr = k + i * width;
    const T* vr = v + i * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        T kc = kr[c];
        if (means != nullptr) {
            kc = kc - means[i * width + c];
            k_out[i * width + c] = kc;
        }
        const __half hk = __float2half(to_f(kc)), hv = __float2half(to_f(vr[c]));
        ring_k[r * width + c] = hk;
        ring_v[r * width + c] = hv;
        if (s != r) {
            ring_k[s * width + c] = hk;
            ring_v[s * width + c] = hv;
        }
    }
}

#define KVQ_RING(TNAME, T)                                                                      \
    extern "C" __global__ void ring_write_##TNAME(const T* k, const T* v, const T* means,       \
                                                  T* k_out, __half* ring_k, __half* ring_v,     \
                                                  const uint32_t* ring, const uint32_t* sink,   \
                                                  int width) {                                  \
        ring_write<T>(k, v, means, k_out, ring_k, ring_v, ring, sink, width);                   \
    }

KVQ_RING(f32, float)
KVQ_RING(f16, __half)
KVQ_RING(bf16, __nv_bfloat16)
