// kvq: projections of a few rows (a decode step of up to 8 sequences) as one kernel each, with
// what surrounds them in a decoder layer fused in (src/model/small.rs says why and when).
//
// gemv_T_R: for rows r < rows (rows <= R), outputs o:
//   prologue (optional): s = a + res_in (rounded to T; block 0 writes s to s_out), then
//     x = round_T(rsqrt(mean(s^2) + eps) * s * norm_w) — candle's add and rms_norm arithmetic;
//   y0[o] = round_T(x . W[o] + bias[o]) (f32 accumulation, fixed order per row);
//   epilogue by mode: 0 store y0; 1 store round_T(y0 + res); 2 (gated unit, W = [gate; up],
//     outputs F = N / 2) store round_T(act(y0[o]) * y0[F + o]) with SiLU or GELU-tanh (gelu);
//     3 store y0 widened to f32 (logits).
// gemv_rope_T_R: the same prologue and products for a stacked q|k|v projection, with RoPE and
//   the K/V writes of kernels/fused.cu's rope_qkv as its epilogue.
// The rows' inputs sit in shared memory as f32 (rows * K * 4 <= 48 KiB, checked by the host);
// each warp computes two weight rows for every input row, reading each weight once with
// 16-byte loads, several in flight per lane. Launched as programmatic dependents
// (src/device/kernels/pdl.rs), they fetch their first weights while the kernel before them
// finishes, then wait for it before reading its outputs.
#include "common.cuh"

constexpr int GEMV_WARPS = 4;
constexpr int GEMV_UNROLL = 6;

// Chunks of 8 inputs per thread the prologue keeps in flight (K up to 8 * 128 * 4 = 4096 in one
// round trip to L2: the prologue is latency-bound, one dependent load per loop step made it half
// of a small projection's time).
constexpr int GEMV_PU = 4;

// Stores 8 values of T (16 bytes).
template <typename T>
__device__ __forceinline__ void store8(T* p, const T* v) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}

// The 16-byte chunks c0 + u * nt (u < GEMV_PU, those below K8) of p, all loads issued at once.
template <typename T>
__device__ __forceinline__ void load_chunks(const T* __restrict__ p, int c0, int nt, int K8,
                                            uint4 (&v)[GEMV_PU]) {
#pragma unroll
    for (int u = 0; u < GEMV_PU; u++) {
        const int c = c0 + u * nt;
        if (c < K8) v[u] = __ldg(reinterpret_cast<const uint4*>(p) + c);
    }
}

// The rows' inputs into shared memory, added to res_in and RMS-normalized where asked, read in
// 16-byte chunks, GEMV_PU in flight per thread (the host passes 16-byte aligned rows).
template <typename T, int R>
__device__ __forceinline__ void gemv_prologue(float* xs, const T* __restrict__ a,
                                              const T* __restrict__ res_in,
                                              const T* __restrict__ norm_w, float eps,
                                              T* __restrict__ s_out, int rows, int K) {
    __shared__ float part[R][GEMV_WARPS];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int nt = blockDim.x, K8 = K / 8;
    float ss[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        ss[r] = 0.f;
        if (r >= rows) continue;
        for (int c0 = tid; c0 < K8; c0 += nt * GEMV_PU) {
            uint4 va[GEMV_PU], vr[GEMV_PU];
            load_chunks(a + (size_t)r * K, c0, nt, K8, va);
            if (res_in != nullptr) load_chunks(res_in + (size_t)r * K, c0, nt, K8, vr);
#pragma unroll
            for (int u = 0; u < GEMV_PU; u++) {
                const int c = c0 + u * nt;
                if (c >= K8) break;
                float f[8];
                widen8(va[u], a, f);
                if (res_in != nullptr) {
                    float g[8];
                    widen8(vr[u], a, g);
                    T s8[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        s8[i] = from_f<T>(f[i] + g[i]);
                        f[i] = to_f(s8[i]);
                    }
                    if (s_out != nullptr && blockIdx.x == 0) store8(s_out + (size_t)r * K + c * 8, s8);
                }
                float4* x4 = reinterpret_cast<float4*>(xs + r * K + c * 8);
                x4[0] = make_float4(f[0], f[1], f[2], f[3]);
                x4[1] = make_float4(f[4], f[5], f[6], f[7]);
#pragma unroll
                for (int i = 0; i < 8; i++) ss[r] += f[i] * f[i];
            }
        }
    }
    if (norm_w == nullptr) {
        __syncthreads();
        return;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float t = warp_sum(ss[r]);
        if (lane == 0) part[r][warp] = t;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= rows) continue;
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) t += part[r][w];
        const float scale = rsqrtf(t / K + eps);
        for (int c0 = tid; c0 < K8; c0 += nt * GEMV_PU) {
            uint4 vw[GEMV_PU];
            load_chunks(norm_w, c0, nt, K8, vw);
#pragma unroll
            for (int u = 0; u < GEMV_PU; u++) {
                const int c = c0 + u * nt;
                if (c >= K8) break;
                float wf[8];
                widen8(vw[u], a, wf);
                float* x = xs + r * K + c * 8;
#pragma unroll
                for (int i = 0; i < 8; i++) x[i] = to_f(from_f<T>(scale * x[i] * wf[i]));
            }
        }
    }
    __syncthreads();
}

// The first GEMV_UNROLL chunks per lane of weight rows o0 and o1 (the whole row when
// K <= 8 * 32 * GEMV_UNROLL): fetched before pdl_wait, since weights never change.
struct WeightBatch {
    uint4 v0[GEMV_UNROLL], v1[GEMV_UNROLL];
};

template <typename T>
__device__ __forceinline__ void load_batch(const T* __restrict__ w, int o0, int o1, int K, int c0,
                                           WeightBatch& wb) {
    const int K8 = K / 8;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)o0 * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)o1 * K);
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; u++) {
        const int c = c0 + 32 * u;
        if (c < K8) {
            wb.v0[u] = __ldg(w0 + c);
            wb.v1[u] = __ldg(w1 + c);
        }
    }
}

// Both weight rows o0 and o1 times every staged input row, the first batch already in wb;
// sums in every lane of the warp.
template <typename T, int R>
__device__ __forceinline__ void dot_pair(const float* xs, const T* __restrict__ w, int o0, int o1,
                                         int rows, int K, WeightBatch& wb, float* acc0,
                                         float* acc1) {
    const int lane = threadIdx.x % 32;
    const int K8 = K / 8;
#pragma unroll
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = 0.f;
    for (int c0 = lane; c0 < K8; c0 += 32 * GEMV_UNROLL) {
        if (c0 != lane) load_batch<T>(w, o0, o1, K, c0, wb);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int c = c0 + 32 * u;
            if (c >= K8) break;
            float f0[8], f1[8];
            widen8(wb.v0[u], w, f0);
            widen8(wb.v1[u], w, f1);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= rows) break;
                const float4* xr = reinterpret_cast<const float4*>(xs + r * K + c * 8);
                const float4 xa = xr[0], xb = xr[1];
                const float x8[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc0[r] = fmaf(f0[i], x8[i], acc0[r]);
                    acc1[r] = fmaf(f1[i], x8[i], acc1[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        acc0[r] = warp_sum(acc0[r]);
        acc1[r] = warp_sum(acc1[r]);
    }
}

// A row's two sums plus the outputs' biases, rounded to T as the unfused matmul's output is.
template <typename T>
__device__ __forceinline__ void pair_out(float s0, float s1, const T* __restrict__ bias, int o0,
                                         int o1, T& t0, T& t1) {
    if (bias != nullptr) {
        s0 += to_f(bias[o0]);
        s1 += to_f(bias[o1]);
    }
    t0 = from_f<T>(s0);
    t1 = from_f<T>(s1);
}

template <typename T, int R>
__device__ __forceinline__ void gemv(const T* __restrict__ a, const T* __restrict__ res_in,
                                     const T* __restrict__ norm_w, float eps, T* __restrict__ s_out,
                                     const T* __restrict__ w, const T* __restrict__ bias,
                                     const T* __restrict__ res, void* __restrict__ y, int rows,
                                     int K, int N, int mode, int gelu) {
    extern __shared__ float xs[];
    pdl_trigger();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int unit = blockIdx.x * GEMV_WARPS + warp;
    // Two weight rows per warp: a gate row and its up row, or two neighbouring outputs.
    const int outs = mode == 2 ? N / 2 : N;
    int o0 = -1, o1 = -1;
    if (mode == 2) {
        if (unit < outs) {
            o0 = unit;
            o1 = unit + outs;
        }
    } else if (2 * unit < N) {
        o0 = 2 * unit;
        o1 = o0 + 1 < N ? o0 + 1 : o0;
    }
    WeightBatch wb;
    if (o0 >= 0) load_batch<T>(w, o0, o1, K, lane, wb);
    pdl_wait();
    gemv_prologue<T, R>(xs, a, res_in, norm_w, eps, s_out, rows, K);
    if (o0 < 0) return;
    float acc0[R], acc1[R];
    dot_pair<T, R>(xs, w, o0, o1, rows, K, wb, acc0, acc1);
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= rows) break;
        if (lane != r % 32) continue;
        T t0, t1;
        pair_out<T>(acc0[r], acc1[r], bias, o0, o1, t0, t1);
        const size_t at = (size_t)r * outs;
        if (mode == 2) {
            static_cast<T*>(y)[at + o0] = from_f<T>(gate_act(to_f(t0), gelu) * to_f(t1));
        } else if (mode == 3) {
            static_cast<float*>(y)[at + o0] = to_f(t0);
            if (o1 != o0) static_cast<float*>(y)[at + o1] = to_f(t1);
        } else {
            T* out = static_cast<T*>(y);
            if (mode == 1) {
                out[at + o0] = from_f<T>(to_f(t0) + to_f(res[at + o0]));
                if (o1 != o0) out[at + o1] = from_f<T>(to_f(t1) + to_f(res[at + o1]));
            } else {
                out[at + o0] = t0;
                if (o1 != o0) out[at + o1] = t1;
            }
        }
    }
}

// The stacked q|k|v projection ([(H + 2 KVH) * D, K]) with RoPE (halves layout) at each row's
// position: a warp computes rows i and i + D/2 of one head, rotates q and k heads as
// kernels/fused.cu's rope_qkv does (its arithmetic in T), and writes q to q_out [rows, H, D],
// k and v to row r of k_out / v_out [rows, KVH * D], or to row slots[r] of a dense cache pool.
template <typename T, int R>
__device__ __forceinline__ void gemv_rope(const T* __restrict__ a, const T* __restrict__ res_in,
                                          const T* __restrict__ norm_w, float eps,
                                          T* __restrict__ s_out, const T* __restrict__ w,
                                          const T* __restrict__ bias, const uint32_t* __restrict__ pos,
                                          const float* __restrict__ cos, const float* __restrict__ sin,
                                          const uint32_t* __restrict__ slots, T* __restrict__ q_out,
                                          T* __restrict__ k_out, T* __restrict__ v_out, int rows,
                                          int K, int heads, int kv_heads, int d) {
    extern __shared__ float xs[];
    pdl_trigger();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int unit = blockIdx.x * GEMV_WARPS + warp;
    const int half = d / 2;
    const int h = unit / half, i = unit % half;
    const bool active = h < heads + 2 * kv_heads;
    const int o0 = h * d + i, o1 = o0 + half;
    WeightBatch wb;
    if (active) load_batch<T>(w, o0, o1, K, lane, wb);
    pdl_wait();
    gemv_prologue<T, R>(xs, a, res_in, norm_w, eps, s_out, rows, K);
    if (!active) return;
    float acc0[R], acc1[R];
    dot_pair<T, R>(xs, w, o0, o1, rows, K, wb, acc0, acc1);
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= rows) break;
        if (lane != r % 32) continue;
        T x1, x2;
        pair_out<T>(acc0[r], acc1[r], bias, o0, o1, x1, x2);
        const size_t row = slots != nullptr ? (size_t)slots[r] : (size_t)r;
        if (h >= heads + kv_heads) {
            T* dst = v_out + (row * kv_heads + (h - heads - kv_heads)) * d;
            dst[i] = x1;
            dst[i + half] = x2;
            continue;
        }
        T* dst = h < heads ? q_out + ((size_t)r * heads + h) * d
                           : k_out + (row * kv_heads + (h - heads)) * d;
        const size_t cs = (size_t)pos[r] * half + i;
        const T c = from_f<T>(cos[cs]), sn = from_f<T>(sin[cs]);
        dst[i] = x1 * c - x2 * sn;
        dst[i + half] = x1 * sn + x2 * c;
    }
}

#define KVQ_GEMV(TNAME, T, R)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                 \
        gemv_##TNAME##_##R(const T* a, const T* res_in, const T* norm_w, float eps, T* s_out,     \
                           const T* w, const T* bias, const T* res, void* y, int rows, int K,     \
                           int N, int mode, int gelu) {                                           \
        gemv<T, R>(a, res_in, norm_w, eps, s_out, w, bias, res, y, rows, K, N, mode, gelu);       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_rope_##TNAME##_##R(        \
        const T* a, const T* res_in, const T* norm_w, float eps, T* s_out, const T* w,            \
        const T* bias, const uint32_t* pos, const float* cos, const float* sin,                   \
        const uint32_t* slots, T* q_out, T* k_out, T* v_out, int rows, int K, int heads,          \
        int kv_heads, int d) {                                                                    \
        gemv_rope<T, R>(a, res_in, norm_w, eps, s_out, w, bias, pos, cos, sin, slots, q_out,      \
                        k_out, v_out, rows, K, heads, kv_heads, d);                               \
    }

KVQ_GEMV(f16, __half, 1)
KVQ_GEMV(f16, __half, 2)
KVQ_GEMV(f16, __half, 4)
KVQ_GEMV(f16, __half, 8)
KVQ_GEMV(bf16, __nv_bfloat16, 1)
KVQ_GEMV(bf16, __nv_bfloat16, 2)
KVQ_GEMV(bf16, __nv_bfloat16, 4)
KVQ_GEMV(bf16, __nv_bfloat16, 8)
