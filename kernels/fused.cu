// kvq: fused decoder ops for CUDA — each replaces two to six of candle's one-op launches in
// every layer (src/model/fused.rs says which and why).
//
// add_rms_norm_T: per row, s = x + r (rounded to T, as candle's add) and
//   y = s * rsqrt(mean(s^2) + eps) * w (f32 inside, one rounding), as candle's rmsnorm kernel.
// rope_qkv_T: from the rows of a stacked q|k|v projection [T, (H + 2 KVH) * D], the rotated q
//   [T, H, D], rotated k and plain v [T, KVH * D] (or their rows written straight into a dense
//   cache pool at given slots), with RoPE (halves layout) at each row's own position; the
//   arithmetic is candle's rope_thd in T exactly (cos/sin rounded to T). With per-head norm
//   weights (Qwen3's q_norm / k_norm, [D]), each q and k head is first RMS-normalized as
//   candle's rms_norm does it (f32 inside, one rounding to T).
// glu_T: y = act(g) * u from the rows of a stacked gate|up projection [T, 2F] (act: SiLU, or
//   GELU tanh for Gemma), f32 inside, one rounding.
#include "common.cuh"

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? part[lane] : 0.f);
}

template <typename T>
__device__ __forceinline__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ r,
                                             const T* __restrict__ w, T* __restrict__ s,
                                             T* __restrict__ y, int cols, float eps) {
    const size_t row = blockIdx.x;
    x += row * cols;
    y += row * cols;
    if (r != nullptr) {
        r += row * cols;
        s += row * cols;
    }
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = to_f(x[c]);
        if (r != nullptr) {
            T sum = from_f<T>(v + to_f(r[c]));
            s[c] = sum;
            v = to_f(sum);
        }
        acc += v * v;
    }
    const float scale = rsqrtf(block_sum(acc) / cols + eps);
    const T* src = r != nullptr ? s : x;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        y[c] = from_f<T>(scale * to_f(src[c]) * to_f(w[c]));
    }
}

template <typename T>
__device__ __forceinline__ void rope_qkv(const T* __restrict__ qkv, const uint32_t* __restrict__ pos,
                                         const float* __restrict__ cos, const float* __restrict__ sin,
                                         T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                                         const uint32_t* __restrict__ slots, const T* __restrict__ qn,
                                         const T* __restrict__ kn, float eps, int heads,
                                         int kv_heads, int d) {
    // grid (T, H + 2 KVH), block D/2 rounded up to a warp: one thread per rotated pair. K and V
    // go to row t of k / v, or with `slots` straight into row slots[t] of a dense cache pool.
    const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half = d / 2;
    const bool on = i < half;
    const int width = (heads + 2 * kv_heads) * d;
    const size_t row = slots != nullptr ? (size_t)slots[t] : (size_t)t;
    const T* src = qkv + (size_t)t * width + (size_t)h * d;
    if (h >= heads + kv_heads) {
        if (!on) return;
        T* dst = v + (row * kv_heads + (h - heads - kv_heads)) * d;
        dst[i] = src[i];
        dst[i + half] = src[i + half];
        return;
    }
    T* dst = h < heads ? q + ((size_t)t * heads + h) * d : k + (row * kv_heads + (h - heads)) * d;
    T x1 = on ? src[i] : from_f<T>(0.f), x2 = on ? src[i + half] : from_f<T>(0.f);
    const T* nw = h < heads ? qn : kn;
    if (nw != nullptr) {  // block-uniform: every thread of the block takes this branch or none
        const float a = to_f(x1), b = to_f(x2);
        const float scale = rsqrtf(block_sum(a * a + b * b) / d + eps);
        if (on) {
            x1 = from_f<T>(scale * a * to_f(nw[i]));
            x2 = from_f<T>(scale * b * to_f(nw[i + half]));
        }
    }
    if (!on) return;
    const size_t cs = (size_t)pos[t] * half + i;
    const T c = from_f<T>(cos[cs]), s = from_f<T>(sin[cs]);
    dst[i] = x1 * c - x2 * s;
    dst[i + half] = x1 * s + x2 * c;
}

template <typename T>
__device__ __forceinline__ void glu(const T* __restrict__ gu, T* __restrict__ y, int ff, int gelu,
                                    size_t n) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const size_t t = idx / ff, j = idx % ff;
    const float g = to_f(gu[t * 2 * ff + j]), u = to_f(gu[t * 2 * ff + ff + j]);
    y[idx] = from_f<T>(gate_act(g, gelu) * u);
}

#define KVQ_FUSED(TNAME, T)                                                                         \
    extern "C" __global__ void add_rms_norm_##TNAME(const T* x, const T* r, const T* w, T* s, T* y, \
                                                    int cols, float eps) {                          \
        add_rms_norm<T>(x, r, w, s, y, cols, eps);                                                  \
    }                                                                                               \
    extern "C" __global__ void rope_qkv_##TNAME(const T* qkv, const uint32_t* pos, const float* cos, \
                                                const float* sin, T* q, T* k, T* v,                 \
                                                const uint32_t* slots, const T* qn, const T* kn,    \
                                                float eps, int heads, int kv_heads, int d) {        \
        rope_qkv<T>(qkv, pos, cos, sin, q, k, v, slots, qn, kn, eps, heads, kv_heads, d);           \
    }                                                                                               \
    extern "C" __global__ void glu_##TNAME(const T* gu, T* y, int ff, int gelu, size_t n) {         \
        glu<T>(gu, y, ff, gelu, n);                                                                 \
    }

KVQ_FUSED(f32, float)
KVQ_FUSED(f16, __half)
KVQ_FUSED(bf16, __nv_bfloat16)
