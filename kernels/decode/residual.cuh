// kvq: the dense part of --kv-residual on the GPU (src/kv/attend/residual/gpu.rs): the rows'
// layout and, after the block-wide quantized kernel (the warp kernel attends them itself as one
// more split, window.cuh), their merge with its output. One block per (query row, KV head): the query heads of that KV
// head attend the row's dense positions — its sinks [st, hs) and its window [lo, len) — whose f16
// copies sit in the layer's rings (positions before this step's write: the sequence's sink rows,
// or ring row p mod R) or among the rows this step writes (`new_k`, `new_v`), as one online
// softmax over tiles of rows (residual_tile); then the two parts are merged by their log-sum-exp, as two
// position splits are (merge.cuh), and written over the quantized part's output.
#pragma once
#include "codes.cuh"

// The dense rows of a step's queries: the layer's rings (`[slots · (S + R), width]` f16: a
// sequence's S sink rows, then its ring, position p at row S + p mod R), this step's new rows
// (`[T, width]`) and per query row eight words of `info` (below). Null `info`: no window. The
// warp kernel attends them in `splits` blocks per head chunk (window.cuh).
struct WinRows {
    const __half* ring_k;
    const __half* ring_v;
    const __half* new_k;
    const __half* new_v;
    const uint32_t* info;
    int S, R, width, splits;
};

// Row jj of a query's dense rows (its nsink sinks, then its window) in `in` (its info words):
// its row among this step's new rows (`fresh`) or in the rings.
__device__ __forceinline__ size_t window_row(const uint32_t* in, uint32_t jj, uint32_t nsink,
                                             uint32_t S, uint32_t R, bool& fresh) {
    const bool sink = jj < nsink;
    const uint32_t p = sink ? in[0] + jj : in[2] + (jj - nsink);
    fresh = p >= in[5];
    return fresh ? (size_t)in[6] + (p - in[5]) : (size_t)in[4] + (sink ? p : S + p % R);
}

// Rows per tile: one per thread, as many as keep the tile's V rows in 16 KB of shared memory.
__device__ __host__ __forceinline__ int residual_tile(int D, int threads) {
    return min(threads, 8192 / D);
}

// info, per query row: st, hs, lo, len, the sequence's first ring row, the first position of
// this step's write (0xffffffff: none) and its row among the new rows, whether the quantized
// part is empty (its output and log-sum-exp are then not read). Latency-bound (a few blocks
// at batch 1): each thread loads its row's K into registers and its V into shared memory at
// once, so a tile costs one round trip to memory.
template <typename T>
__device__ __forceinline__ void residual_merge_impl(
    const T* __restrict__ q, const T* __restrict__ oq, const float* __restrict__ lse,
    T* __restrict__ out, const __half* __restrict__ ring_k, const __half* __restrict__ ring_v,
    const __half* __restrict__ new_k, const __half* __restrict__ new_v,
    const uint32_t* __restrict__ info, int H, int kvh, int D, int S, int R, int width,
    float scale) {
    const int r = blockIdx.x, kh = blockIdx.y, G = H / kvh;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int TJ = residual_tile(D, blockDim.x);
    const uint32_t* in = info + (size_t)r * 8;
    const uint32_t st = in[0], hs = in[1], lo = in[2], len = in[3];
    const bool qempty = in[7] != 0;
    const uint32_t nsink = hs > st ? hs - st : 0, nwin = len > lo ? len - lo : 0;
    const uint32_t n = nsink + nwin;
    extern __shared__ __align__(16) unsigned char rsm[];
    __half* v_s = reinterpret_cast<__half*>(rsm);                // [TJ][D] the tile's V rows
    float* q_s = reinterpret_cast<float*>(v_s + (size_t)TJ * D);  // [G][D]
    float* acc_s = q_s + G * D;                                  // [G][D]
    float* s_s = acc_s + G * D;                                  // [G][TJ]
    float* m_s = s_s + G * TJ;                                   // [G] running max
    float* z_s = m_s + G;                                        // [G] running sum
    float* c_s = z_s + G;                                        // [G] this tile's rescale
    const size_t h0 = (size_t)r * H + (size_t)kh * G;            // the group's first head row
    for (int i = tid; i < G * D; i += blockDim.x) {
        q_s[i] = to_f(q[h0 * D + i]);
        acc_s[i] = 0.f;
    }
    for (int g = tid; g < G; g += blockDim.x) {
        m_s[g] = neg_inf();
        z_s[g] = 0.f;
    }
    __syncthreads();
    for (uint32_t t0 = 0; t0 < n; t0 += TJ) {
        const int tn = (int)min((uint32_t)TJ, n - t0);
        if (tid < tn) {
            // This thread's row: a sink, a ring row, or one of this step's new rows.
            bool fresh;
            const size_t row = window_row(in, t0 + tid, nsink, (uint32_t)S, (uint32_t)R, fresh);
            const size_t at = row * (size_t)width + (size_t)kh * D;
            const uint4* kr = reinterpret_cast<const uint4*>((fresh ? new_k : ring_k) + at);
            const uint4* vr = reinterpret_cast<const uint4*>((fresh ? new_v : ring_v) + at);
            uint4* vd = reinterpret_cast<uint4*>(v_s + (size_t)tid * D);
            for (int c = 0; c < D / 8; c++) vd[c] = vr[c];
            // Scores of up to 8 heads per pass over the row (eight values per load).
            for (int g0 = 0; g0 < G; g0 += 8) {
                float sc[8];
#pragma unroll
                for (int u = 0; u < 8; u++) sc[u] = 0.f;
                for (int c = 0; c < D / 8; c++) {
                    const uint4 raw = kr[c];
                    const __half* kh8 = reinterpret_cast<const __half*>(&raw);
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        const float kf = __half2float(kh8[e]);
#pragma unroll
                        for (int u = 0; u < 8; u++)
                            if (g0 + u < G) sc[u] += q_s[(g0 + u) * D + c * 8 + e] * kf;
                    }
                }
#pragma unroll
                for (int u = 0; u < 8; u++)
                    if (g0 + u < G) s_s[(g0 + u) * TJ + tid] = sc[u] * scale;
            }
        }
        __syncthreads();
        // Online softmax: a warp per head; scores become weights.
        for (int g = warp; g < G; g += nw) {
            float mx = neg_inf();
            for (int j = lane; j < tn; j += 32) mx = fmaxf(mx, s_s[g * TJ + j]);
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m_s[g], mx);
            float z = 0.f;
            for (int j = lane; j < tn; j += 32) {
                const float e = __expf(s_s[g * TJ + j] - mn);
                s_s[g * TJ + j] = e;
                z += e;
            }
            z = warp_sum(z);
            if (lane == 0) {
                const float c = m_s[g] == neg_inf() ? 0.f : __expf(m_s[g] - mn);
                c_s[g] = c;
                z_s[g] = z_s[g] * c + z;
                m_s[g] = mn;
            }
        }
        __syncthreads();
        // Values from shared memory: a thread per (head, dim).
        for (int i = tid; i < G * D; i += blockDim.x) {
            const int g = i / D, d = i % D;
            float a = acc_s[i] * c_s[g];
            for (int j = 0; j < tn; j++) a += s_s[g * TJ + j] * __half2float(v_s[(size_t)j * D + d]);
            acc_s[i] = a;
        }
        __syncthreads();
    }
    // Merge: weights e^(lse − top) for the quantized part (normalized), e^(m + ln z − top) for
    // the dense one.
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const size_t o = h0 * D + i;
        const float qo = qempty ? 0.f : to_f(oq[o]);
        float res = qo;
        if (n > 0) {
            const float ld = m_s[g] + __logf(z_s[g]);
            const float lq = qempty ? neg_inf() : lse[h0 + g];
            const float top = fmaxf(lq, ld);
            const float a = qempty ? 0.f : __expf(lq - top), b = __expf(ld - top);
            res = (a * qo + b * (acc_s[i] / z_s[g])) / (a + b);
        }
        out[o] = from_f<T>(res);
    }
}
