// kvq: the last step of one tile of the warp-independent decode kernel (warp.cuh), V, and the
// warp's totals once its tiles are done.
#pragma once
#include "warp_shape.cuh"
#include "codes.cuh"
#include "async.cuh"

// 3. Tensor-core V (VMMA): two k-tiles of 16 positions: this lane's positions 2tq, 2tq+1,
// 2tq+8, 2tq+9 of each (weights from lanes 8tq + gq%4 and 8tq + 4 + gq%4), codes
// from the staged tile (sV, scales sVS, biases sVB). A masked position has weight 0, and its
// scale and bias are taken as 0 (its staged bytes are zeros), so nothing non-finite enters.
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_values_mma(
    const float (&pm)[2][2], int gq, int tq, unsigned vmask, const unsigned char* sV, const T* sVS,
    const T* sVB, float (&cv)[QShape<T, B, D, GS>::CR][4], float& accb_c) {
    using S = QShape<T, B, D, GS>;
    constexpr int HB = S::HB, NG = S::NG, MT = S::MT, BPL = S::BPL, VW = S::VW;
    const unsigned FULL = 0xffffffffu;
    // Codes as f16 (exact): ORed into 1024 (0x6400: low nibble or byte) or, for a high nibble
    // left in place, into 64 (0x5400, mantissa unit 1/16), then the offset subtracted.
    const uint32_t cmask = 0x000F000Fu * (B == 4) + 0x00FF00FFu * (B == 8);
    const uint32_t magic = 0x64006400u, hmask = 0x00F000F0u, hmagic = 0x54005400u;
    const __half2 k1024 = __floats2half2_rn(-1024.f, -1024.f);
    const __half2 k64 = __floats2half2_rn(-64.f, -64.f);
    const int gam = gq / 4;  // this lane's column's group
    const bool col_ok = gam < NG;
#pragma unroll
    for (int kt = 0; kt < 2; kt++) {
        // Position 16kt + g' + 8e of head h sits in lane 4g' + h (pm[kt][e]).
        const int src0 = 4 * (2 * tq) + gq % 4, src1 = src0 + 4;
        float pw[4];
        pw[0] = __shfl_sync(FULL, pm[kt][0], src0);
        pw[1] = __shfl_sync(FULL, pm[kt][0], src1);
        pw[2] = __shfl_sync(FULL, pm[kt][1], src0);
        pw[3] = __shfl_sync(FULL, pm[kt][1], src1);
        uint32_t x[4][VW];
        float pp[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int r = 16 * kt + 2 * tq + (k & 1) + 8 * (k >> 1);
            const unsigned char* src_b = sV + stage_off<HB>(r, gq * BPL);
            if (BPL == 4) {
                x[k][0] = *reinterpret_cast<const uint32_t*>(src_b);
            } else if (BPL == 8) {
                const uint2 v2 = *reinterpret_cast<const uint2*>(src_b);
                x[k][0] = v2.x; x[k][1] = v2.y;
            } else {
                const uint4 v4 = *reinterpret_cast<const uint4*>(src_b);
                x[k][0] = v4.x; x[k][1] = v4.y; x[k][2] = v4.z; x[k][3] = v4.w;
            }
            // A masked row's staged scale and bias are zeros already (no test of vmask).
            const int at = r * NG + (col_ok ? gam : 0);
            const float sc = col_ok ? to_f(sVS[at]) : 0.f;
            const float bi = col_ok ? to_f(sVB[at]) : 0.f;
            pp[k] = pw[k] * sc;
            accb_c = fmaf(pw[k], bi, accb_c);
        }
        // P' as hi + lo f16 pairs: b0 = positions (2tq, 2tq+1), b1 = (+8, +9).
        const __half2 h01 = __floats2half2_rn(pp[0], pp[1]);
        const __half2 h23 = __floats2half2_rn(pp[2], pp[3]);
        const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
        const __half2 l01 = __floats2half2_rn(pp[0] - f01.x, pp[1] - f01.y);
        const __half2 l23 = __floats2half2_rn(pp[2] - f23.x, pp[3] - f23.y);
        const uint32_t bh0 = *reinterpret_cast<const uint32_t*>(&h01);
        const uint32_t bh1 = *reinterpret_cast<const uint32_t*>(&h23);
        const uint32_t bl0 = *reinterpret_cast<const uint32_t*>(&l01);
        const uint32_t bl1 = *reinterpret_cast<const uint32_t*>(&l23);
#pragma unroll
        for (int i = 0; i < MT; i++) {
            // Rows gq / gq+8 of m-tile i: B = 4: low / high nibble of byte i;
            // B = 8: bytes 2i / 2i+1. Each pair: positions (2tq, 2tq+1) and (+8, +9).
            uint32_t r01, r23, s01, s23;
            if (B == 4) {
                const int w = i / 4, by = i % 4;
                const uint32_t sel = (uint32_t)by | ((uint32_t)(4 + by) << 8);
                r01 = __byte_perm(x[0][w], x[1][w], sel);
                r23 = __byte_perm(x[2][w], x[3][w], sel);
                s01 = r01;  // high nibbles: hmask / hmagic below
                s23 = r23;
            } else {
                const int w = (2 * i) / 4, by = (2 * i) % 4;
                const uint32_t sel0 = (uint32_t)by | ((uint32_t)(4 + by) << 8);
                const uint32_t sel1 = (uint32_t)(by + 1) | ((uint32_t)(5 + by) << 8);
                r01 = __byte_perm(x[0][w], x[1][w], sel0);
                r23 = __byte_perm(x[2][w], x[3][w], sel0);
                s01 = __byte_perm(x[0][w], x[1][w], sel1);
                s23 = __byte_perm(x[2][w], x[3][w], sel1);
            }
            uint32_t a[4];
            const uint32_t raw[4] = {r01, s01, r23, s23};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const bool hi = B == 4 && (k & 1);
                uint32_t h;
                asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
                    : "=r"(h) : "r"(raw[k]), "r"(hi ? hmask : cmask), "r"(hi ? hmagic : magic));
                const __half2 c = __hadd2(*reinterpret_cast<const __half2*>(&h), hi ? k64 : k1024);
                a[k] = *reinterpret_cast<const uint32_t*>(&c);
            }
            mma16816(cv[i], a[0], a[1], a[2], a[3], bh0, bh1);
            mma16816(cv[i], a[0], a[1], a[2], a[3], bl0, bl1);
        }
    }
}

// 3. V by lanes: D/8 lanes per position, 32·8/D positions per step; a lane takes the weights
// and the slot of its position by shuffle and accumulates 8 values for every head. Codes from
// the staged tile (tensor-core scores) or the pool (SIMT, vrow: the lane's head row or ~0).
// A masked position has weight 0, and its scale and bias are taken as 0 (the SIMT kernels read
// slot 0), so nothing non-finite enters.
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_values_lanes(
    const float (&pj)[QG], const float (&pm)[2][2], int rsub, int c8, unsigned vmask,
    const unsigned char* sV, const T* sVS, const T* sVB, uint32_t vrow, const unsigned char* vcb,
    const T* vs, const T* vb, uint32_t hg, int group, float (&acc)[QShape<T, B, D, GS>::AR][8],
    float (&accb)[QShape<T, B, D, GS>::AR]) {
    using S = QShape<T, B, D, GS>;
    constexpr bool MMA = S::MMA;
    constexpr int HB = S::HB, NG = S::NG, RPS = S::RPS;
    constexpr float TWO_B = S::TWO_B;
    const unsigned FULL = 0xffffffffu;
#pragma unroll
for (int st = 0; st < 32 / RPS; st++) {
    int r;
    float pr[QG];
    if constexpr (!MMA) {
        r = st * RPS + rsub;
#pragma unroll
        for (int j = 0; j < QG; j++) pr[j] = __shfl_sync(FULL, pj[j], r);
    } else {
        // Positions 16μ + 8e + g whose weights sit in the same register (pm[μ][e]) of lanes
        // 4g + j: g = g1 + rsub.
        constexpr int STEPS8 = 8 / RPS;  // steps per 8 rows (one e of one m-tile)
        const int g1 = (st % STEPS8) * RPS, e = (st / STEPS8) % 2, mu = st / (2 * STEPS8);
        const int g = g1 + rsub;
        r = 16 * mu + 8 * e + g;
#pragma unroll
        for (int j = 0; j < QG; j++) pr[j] = __shfl_sync(FULL, pm[mu][e], 4 * g + j);
    }
    if constexpr (S::DENSE) {  // 8 values of T straight from the pool; masked rows add 0
        const uint32_t sr = __shfl_sync(FULL, vrow, r);
        const bool ok = sr != 0xffffffffu;
        const uint4 raw = *reinterpret_cast<const uint4*>(vcb + (size_t)(ok ? sr : 0) * HB + c8 * 16);
        float x[8];
        widen8(raw, (const T*)nullptr, x);
#pragma unroll
        for (int k = 0; k < 8; k++) x[k] = ok ? x[k] : 0.f;
#pragma unroll
        for (int j = 0; j < QG; j++)
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] = fmaf(pr[j], x[k], acc[j][k]);
        continue;
    }
    bool ok;
    uint64_t win;
    float sc, bi;
    if constexpr (MMA) {  // from the staged tile
        ok = (vmask >> r) & 1;
        // A width without tensor-core V (3-bit values beside 4-bit keys) is staged in plain order.
        constexpr bool PLAIN = B != 4 && B != 8;
        win = load_codes8<B>(sV + (PLAIN ? r * HB + c8 * B : stage_off<HB>(r, c8 * B)));
        const int gidx = r * NG + (c8 * 8) / GS;
        sc = ok ? to_f(sVS[gidx]) * TWO_B : 0.f;
        bi = ok ? to_f(sVB[gidx]) : 0.f;
    } else {
        const uint32_t sr = __shfl_sync(FULL, vrow, r);
        ok = sr != 0xffffffffu;
        const uint32_t hr = ok ? sr : 0;
        win = load_codes8<B>(vcb + (size_t)hr * HB + c8 * B);
        const size_t gidx = (size_t)hr * hg + (c8 * 8) / group;
        sc = ok ? to_f(vs[gidx]) * TWO_B : 0.f;
        bi = ok ? to_f(vb[gidx]) : 0.f;
    }
    const uint32_t ww[3] = {(uint32_t)win, (uint32_t)(win >> 32), 0u};
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; k++) x[k] = frac_at<B>(ww, k);
#pragma unroll
    for (int j = 0; j < QG; j++) {
        const float ps = pr[j] * sc;
        accb[j] = fmaf(pr[j], bi - sc, accb[j]);
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = fmaf(ps, x[k], acc[j][k]);
    }
}
}

// The warp's totals once its tiles are done: l over the lanes holding a head's weights, V over
// the lanes that share a column slice, into wm_s / wl_s and the warp's wacc rows; a bad block id
// marks the block bad.
template <typename T, int B, int D, int GS, typename Wacc>
__device__ __forceinline__ void warp_totals(
    int lane, int warp, int gq, int tq, int c8, bool bad_row, float (&m_w)[QG], float (&l_w)[QG],
    float (&acc)[QShape<T, B, D, GS>::AR][8], float (&accb)[QShape<T, B, D, GS>::AR],
    float (&cv)[QShape<T, B, D, GS>::CR][4], float accb_c, float (*wm_s)[QG], float (*wl_s)[QG],
    int& bad_s, Wacc wacc) {
    using S = QShape<T, B, D, GS>;
    constexpr bool MMA = S::MMA, VMMA = S::VMMA;
    constexpr int MT = S::MT, BPL = S::BPL, LPR = S::LPR;
    const unsigned FULL = 0xffffffffu;
    if (MMA) {
        // Lane 4g + j holds head j's running max (the same in its 8 lanes) and a partial sum.
        l_w[0] += __shfl_xor_sync(FULL, l_w[0], 4);
        l_w[0] += __shfl_xor_sync(FULL, l_w[0], 8);
        l_w[0] += __shfl_xor_sync(FULL, l_w[0], 16);
#pragma unroll
        for (int j = 0; j < QG; j++) {
            const float mj = __shfl_sync(FULL, m_w[0], j), lj = __shfl_sync(FULL, l_w[0], j);
            if (lane == 0) {
                wm_s[warp][j] = mj;
                wl_s[warp][j] = lj;
            }
        }
    }
    if constexpr (VMMA) {
        // Column gq's bias over all positions (lanes 4gq'..: partial over tq), then each lane
        // writes the (dim, head) entries whose column is its dims' group.
        accb_c += __shfl_xor_sync(FULL, accb_c, 1);
        accb_c += __shfl_xor_sync(FULL, accb_c, 2);
        const float bc0 = __shfl_sync(FULL, accb_c, 4 * (2 * tq));
        const float bc1 = __shfl_sync(FULL, accb_c, 4 * (2 * tq + 1));
        const int h0 = (2 * tq) % 4;
        if (tq / 2 == (gq * (D / 8)) / GS) {
#pragma unroll
            for (int i = 0; i < MT; i++) {
                const int d0 = B == 4 ? 2 * (gq * BPL + i) : gq * BPL + 2 * i;
                wacc(warp)[h0][d0] = cv[i][0] + bc0;
                wacc(warp)[h0 + 1][d0] = cv[i][1] + bc1;
                wacc(warp)[h0][d0 + 1] = cv[i][2] + bc0;
                wacc(warp)[h0 + 1][d0 + 1] = cv[i][3] + bc1;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < QG; j++) {
            if (!MMA) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) l_w[j] += __shfl_xor_sync(FULL, l_w[j], o);
            }
#pragma unroll
            for (int o = 16; o >= LPR; o >>= 1) {
                accb[j] += __shfl_xor_sync(FULL, accb[j], o);
#pragma unroll
                for (int k = 0; k < 8; k++) acc[j][k] += __shfl_xor_sync(FULL, acc[j][k], o);
            }
        }
        if (lane < LPR) {
#pragma unroll
            for (int j = 0; j < QG; j++)
#pragma unroll
                for (int k = 0; k < 8; k++) wacc(warp)[j][c8 * 8 + k] = acc[j][k] + accb[j];
        }
    }
    if (bad_row) bad_s = 1;
    if (!MMA && lane == 0) {
#pragma unroll
        for (int j = 0; j < QG; j++) {
            wm_s[warp][j] = m_w[j];
            wl_s[warp][j] = l_w[j];
        }
    }
}
