// kvq: --kv-residual's dense rows inside the warp kernel (warp.cuh), as more splits: the blocks
// at split indices nsplit, nsplit + 1, ... (WinRows::splits of them) attend a query row's sinks
// and window (residual.cuh's WinRows, f16 copies), WIN_ROWS rows each, while the other blocks
// attend its quantized positions, and the last block to finish merges all their partials in one
// pass (warp.cuh, warp_merge_last). One launch instead of the quantized kernel followed by residual_merge: the
// dense rows cost a few blocks beside the others, each as short as a quantized one (one round
// trip for its rows), not a second kernel's latency after them.
#pragma once
#include "warp_shape.cuh"
#include "residual.cuh"

// Rows a warp loads at once (their loads in flight together), and the rows of one window block
// (the host plans the splits from it: src/kv/attend/decode/cuda/residual.rs).
#define WIN_U 4
#define WIN_ROWS (QW * WIN_U)

// Window block wi of query row b, KV head kh, query heads [j0, j0 + gn): rows [wi·WIN_ROWS,
// (wi + 1)·WIN_ROWS), the last block all rows from there. Each warp takes WIN_U rows at a time,
// a lane owns D/32 consecutive dims (of q, of each row's K and V, of its V
// totals); scores are reduced across the warp, the softmax runs per warp in registers, and the
// warps' totals land where warp_combine reads them. Queries unrotated (the copies are). Not
// inlined: inlined, its registers made the tensor-core kernels spill in their main loop (ptxas,
// decode_qm_f16_b4_d128_g64: 28 bytes; H200, 4 × 8 KV heads at 16K: 0.055 → 0.060 ms).
template <typename T, int D, typename Wacc>
__device__ __noinline__ void window_split(const T* __restrict__ q, float scale,
                                             const WinRows& w, int wi, int b, int kh, int H, int G,
                                             int j0, int gn, float (*wm_s)[QG], float (*wl_s)[QG],
                                             Wacc wacc, int& bad_s) {
    constexpr int DL = D / 32;
    static_assert(DL == 2 || DL == 4, "head_dim 64 or 128");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t* in = w.info + (size_t)b * 8;
    const uint32_t st = in[0], hs = in[1], lo = in[2], len = in[3];
    const uint32_t nsink = hs > st ? hs - st : 0, all = nsink + (len > lo ? len - lo : 0);
    const uint32_t first = (uint32_t)wi * WIN_ROWS;
    const uint32_t n = wi + 1 == w.splits ? all : min(all, first + WIN_ROWS);
    const size_t h0 = (size_t)b * H + (size_t)kh * G + j0;
    float qr[QG][DL], m[QG], l[QG], acc[QG][DL];
#pragma unroll
    for (int j = 0; j < QG; j++) {
        m[j] = neg_inf();
        l[j] = 0.f;
#pragma unroll
        for (int e = 0; e < DL; e++) {
            qr[j][e] = j < gn ? to_f(q[(h0 + j) * D + lane * DL + e]) * scale : 0.f;
            acc[j][e] = 0.f;
        }
    }
    for (uint32_t r0 = first + (uint32_t)warp * WIN_U; r0 < n; r0 += WIN_ROWS) {
        __half2 kk[WIN_U][DL / 2], vv[WIN_U][DL / 2];
#pragma unroll
        for (int u = 0; u < WIN_U; u++) {
            const __half2 zero = __float2half2_rn(0.f);
#pragma unroll
            for (int e = 0; e < DL / 2; e++) kk[u][e] = vv[u][e] = zero;
            if (r0 + u >= n) continue;
            bool fresh;
            const size_t row = window_row(in, r0 + u, nsink, (uint32_t)w.S, (uint32_t)w.R, fresh);
            const size_t at = row * (size_t)w.width + (size_t)kh * D + lane * DL;
            const __half2* kp = reinterpret_cast<const __half2*>((fresh ? w.new_k : w.ring_k) + at);
            const __half2* vp = reinterpret_cast<const __half2*>((fresh ? w.new_v : w.ring_v) + at);
#pragma unroll
            for (int e = 0; e < DL / 2; e++) {
                kk[u][e] = kp[e];
                vv[u][e] = vp[e];
            }
        }
        float s[WIN_U][QG];
#pragma unroll
        for (int u = 0; u < WIN_U; u++) {
#pragma unroll
            for (int j = 0; j < QG; j++) {
                float a = 0.f;
#pragma unroll
                for (int e = 0; e < DL / 2; e++) {
                    const float2 k2 = __half22float2(kk[u][e]);
                    a += qr[j][2 * e] * k2.x + qr[j][2 * e + 1] * k2.y;
                }
                s[u][j] = a;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < WIN_U; u++) {
#pragma unroll
                for (int j = 0; j < QG; j++) s[u][j] += __shfl_xor_sync(0xffffffffu, s[u][j], o);
            }
        }
#pragma unroll
        for (int j = 0; j < QG; j++) {
            float mx = m[j];
#pragma unroll
            for (int u = 0; u < WIN_U; u++)
                if (r0 + u < n) mx = fmaxf(mx, s[u][j]);
            const float c = m[j] == neg_inf() ? 0.f : __expf(m[j] - mx);
            l[j] *= c;
#pragma unroll
            for (int e = 0; e < DL; e++) acc[j][e] *= c;
#pragma unroll
            for (int u = 0; u < WIN_U; u++) {
                if (r0 + u >= n) continue;
                const float p = __expf(s[u][j] - mx);
                l[j] += p;
#pragma unroll
                for (int e = 0; e < DL / 2; e++) {
                    const float2 v2 = __half22float2(vv[u][e]);
                    acc[j][2 * e] += p * v2.x;
                    acc[j][2 * e + 1] += p * v2.y;
                }
            }
            m[j] = mx;
        }
    }
#pragma unroll
    for (int j = 0; j < QG; j++) {
        if (lane == 0) {
            wm_s[warp][j] = m[j];
            wl_s[warp][j] = l[j];
        }
#pragma unroll
        for (int e = 0; e < DL; e++) wacc(warp)[j][lane * DL + e] = acc[j][e];
    }
    if (tid == 0) bad_s = 0;
}
