// kvq: the first steps of one tile of the warp-independent decode kernel (warp.cuh): the
// queries loaded once, the next tile staged, scores and the online softmax, SIMT and tensor-core.
#pragma once
#include "warp_shape.cuh"
#include "codes.cuh"
#include "async.cuh"

// Prologue: the chunk's QG query heads into q_s (scaled, rotated for the rotated scheme; absent
// heads 0), their per-chunk sums into qsum_s, and for tensor cores their f16 hi + lo B fragments
// into qa_s. Returns the power of two the fragments were divided by (1 for SIMT).
template <typename T, int B, int D, int GS>
__device__ __forceinline__ float warp_load_q(
    const T* __restrict__ q, float scale, const float* __restrict__ signs, int rotated, int b,
    int H, int kh, int G, int j0, int gn, bool bad_seq, float (*q_s)[D], float (*qsum_s)[D / 32],
    uint32_t (*qa_s)[32][QShape<T, B, D, GS>::QAW], unsigned& qmax_s, int& bad_s) {
    using S = QShape<T, B, D, GS>;
    constexpr bool MMA = S::MMA;
    constexpr int NCH = S::NCH, KS = S::KS, KST = S::KST, CPW = S::CPW;
    const int tid = threadIdx.x;
    const T* qb = q + ((size_t)b * H + (size_t)kh * G + j0) * D;
    for (int i = tid; i < QG * D; i += blockDim.x)
        q_s[i / D][i % D] = (i / D) < gn ? to_f(qb[i]) * scale : 0.f;
    if (tid == 0) {
        bad_s = bad_seq;
        qmax_s = 0;
    }
    __syncthreads();
    if (rotated) rotate_rows<D, QG>(&q_s[0][0], signs, tid, blockDim.x);
    for (int i = tid; i < QG * NCH; i += blockDim.x) {
        const float* src = &q_s[i / NCH][(i % NCH) * 32];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 32; k++) s += src[k];
        qsum_s[i / NCH][i % NCH] = s;
    }
    // Tensor-core q: scaled by a power of two so its largest value is near 1 (f16 range), split
    // into hi + lo, laid out as each lane's B fragment per k-step: lane (g, t) holds column g,
    // i.e. head g / 2's hi (g even) or lo (g odd) part.
    float qexp = 1.f;
    if (MMA) {
        float mx = 0.f;
        for (int i = tid; i < QG * D; i += blockDim.x) mx = fmaxf(mx, fabsf(q_s[i / D][i % D]));
        atomicMax(&qmax_s, __float_as_uint(mx));
        __syncthreads();
        const float qm = __uint_as_float(qmax_s);
        const int e = qm > 0.f && qm < 1e30f ? ilogbf(qm) + 1 : 0;
        qexp = ldexpf(1.f, e);
        const float inv = ldexpf(1.f, -e);
        static_assert(2 * QG == 8, "the B operand's 8 columns are QG heads × {hi, lo}");
        for (int i = tid; i < KST * 32; i += blockDim.x) {
            const int s = i / 32, l = i % 32, g = l >> 2, t = l & 3;
            // Lane t's j-th code word of a group is word t + 4j of the group (ldmatrix layout);
            // k-step s uses codes 4·(s % KS).. of the lane's words of group s / KS.
            const int u = 4 * (s % KS);
            const int d0 = (s / KS) * GS + CPW * (t + 4 * (u / CPW)) + u % CPW;
            float p[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float v = q_s[g >> 1][d0 + j] * inv;
                const float hi = __half2float(__float2half_rn(v));
                p[j] = (g & 1) ? v - hi : hi;
            }
            // k = (2t, 2t+1) hold dims d0, d0+2; k = (2t+8, 2t+9) dims d0+1, d0+3 (code_frag).
            qa_s[s][l][0] = pack_half2(p[0], p[2]);
            qa_s[s][l][1] = pack_half2(p[1], p[3]);
        }
    }
    __syncthreads();
    return qexp;
}

// Staging: one tile's rows (this lane's position: hr, ok) into the stage at st; zero-size copies
// for positions outside the split. Codes: CPR lanes per row, 16 bytes each; scales: one lane per
// row (into sreg when SREG, stored once the tile is due).
template <typename T, int B, int D, int GS, int VB = B>
__device__ __forceinline__ void warp_stage(
    unsigned char* st, int lane, uint32_t hr, bool ok, const unsigned char* kcb,
    const unsigned char* vcb, const T* ks, const T* kb, const T* vs, const T* vb,
    unsigned short (&sreg)[4]) {
    using S = QShape<T, B, D, GS>;
    constexpr int HB = S::HB, NG = S::NG, CPR = S::CPR, SB = S::SB;
    constexpr int HBV = QShape<T, VB, D, GS>::HB;  // V code bytes of a row
    constexpr bool SREG = S::SREG;
    const unsigned FULL = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < CPR; i++) {
        const int idx = i * 32 + lane, r = idx / CPR, c = idx % CPR;
        const uint32_t h = __shfl_sync(FULL, hr, r);
        const bool o = __shfl_sync(FULL, ok, r);
        cp_async16(st + stage_off<HB>(r, c * 16), kcb + (size_t)h * HB + c * 16, o);
        if constexpr (VB == B)
            cp_async16(st + 32 * HB + stage_off<HB>(r, c * 16), vcb + (size_t)h * HB + c * 16, o);
    }
    if constexpr (VB != B) {
        // Narrower values: rows of HBV bytes in plain order, in 8-byte pieces (HBV = 3·D/8).
        static_assert(HBV % 8 == 0, "V rows of whole 8-byte pieces");
        constexpr int CPV = HBV / 8;
#pragma unroll
        for (int i = 0; i < CPV; i++) {
            const int idx = i * 32 + lane, r = idx / CPV, c = idx % CPV;
            const uint32_t h = __shfl_sync(FULL, hr, r);
            const bool o = __shfl_sync(FULL, ok, r);
            cp_async_small<8>(st + 32 * HB + r * HBV + c * 8, vcb + (size_t)h * HBV + c * 8, o);
        }
    }
    const T* src[4] = {ks, kb, vs, vb};
    unsigned char* sp = st + 32 * (HB + HBV);  // scales and biases
#pragma unroll
    for (int a = 0; a < 4; a++) {
        if constexpr (SREG) {
            sreg[a] = ok ? reinterpret_cast<const unsigned short*>(src[a])[hr] : 0;
        } else {
            cp_async_small<(SREG ? 4 : SB)>(sp + (a * 32 + lane) * SB, src[a] + (size_t)hr * NG, ok);
        }
    }
    cp_async_commit();
}

// Staging, scale rows of 2 bytes (SREG): the values warp_stage kept in registers, into the
// stage once its tile is due (after the scale rows' codes: offset 32 rows of K and V codes).
template <typename T, int B, int D, int GS, int VB = B>
__device__ __forceinline__ void stage_sreg(const unsigned char* st, int lane,
                                           const unsigned short (&sreg)[4]) {
    if constexpr (QShape<T, B, D, GS>::SREG) {
        constexpr int SCL = 32 * (QShape<T, B, D, GS>::HB + QShape<T, VB, D, GS>::HB);
        unsigned short* d = reinterpret_cast<unsigned short*>(const_cast<unsigned char*>(st) + SCL);
#pragma unroll
        for (int a = 0; a < 4; a++) d[a * 32 + lane] = sreg[a];
    }
}

// 1. SIMT scores: the lane's position (head row hrow, if valid) against the QG heads, read
// straight from the pool; -inf where not valid.
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_scores_simt(
    bool valid, uint32_t hrow, const unsigned char* kcb, const T* ks, const T* kb, uint32_t hg,
    int group, float (*q_s)[D], float (*qsum_s)[D / 32], float (&s)[QG]) {
    using S = QShape<T, B, D, GS>;
    constexpr int HB = S::HB, VEC = S::VEC, NCH = S::NCH;
    constexpr float TWO_B = S::TWO_B;
#pragma unroll
    for (int j = 0; j < QG; j++) s[j] = neg_inf();
    if constexpr (S::DENSE) {
        if (!valid) return;
        // A dense row: D values of T, in parts of up to 64 values whose loads are all issued
        // before their first multiply-add.
        constexpr int CH = D / 8 > 8 ? 8 : D / 8;
        const uint4* row = reinterpret_cast<const uint4*>(kcb + (size_t)hrow * HB);
#pragma unroll
        for (int j = 0; j < QG; j++) s[j] = 0.f;
#pragma unroll
        for (int c0 = 0; c0 < D / 8; c0 += CH) {
            uint4 raw[CH];
#pragma unroll
            for (int c = 0; c < CH; c++) raw[c] = row[c0 + c];
#pragma unroll
            for (int cc = 0; cc < CH; cc++) {
                const int c = c0 + cc;
                float x[8];
                widen8(raw[cc], (const T*)nullptr, x);
#pragma unroll
                for (int j = 0; j < QG; j++) {
                    const float4 a = *reinterpret_cast<const float4*>(&q_s[j][c * 8]);
                    const float4 b = *reinterpret_cast<const float4*>(&q_s[j][c * 8 + 4]);
                    s[j] = fmaf(a.x, x[0], s[j]);
                    s[j] = fmaf(a.y, x[1], s[j]);
                    s[j] = fmaf(a.z, x[2], s[j]);
                    s[j] = fmaf(a.w, x[3], s[j]);
                    s[j] = fmaf(b.x, x[4], s[j]);
                    s[j] = fmaf(b.y, x[5], s[j]);
                    s[j] = fmaf(b.z, x[6], s[j]);
                    s[j] = fmaf(b.w, x[7], s[j]);
                }
            }
        }
        return;
    }
    if (valid) {
        const unsigned char* row = kcb + (size_t)hrow * HB;
        uint32_t w[HB / 4 + 1];
#pragma unroll
        for (int i = 0; i < HB / VEC; i++) {
            if (VEC == 16) {
                const uint4 x = reinterpret_cast<const uint4*>(row)[i];
                w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
            } else {
                const uint2 x = reinterpret_cast<const uint2*>(row)[i];
                w[2 * i] = x.x; w[2 * i + 1] = x.y;
            }
        }
        w[HB / 4] = 0;
        const T* sc_row = ks + (size_t)hrow * hg;
        const T* bi_row = kb + (size_t)hrow * hg;
#pragma unroll
        for (int j = 0; j < QG; j++) s[j] = 0.f;
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            const int gi = c * 32 / group;
            const float sc = to_f(sc_row[gi]) * TWO_B, bi = to_f(bi_row[gi]);
            float d[QG];
#pragma unroll
            for (int j = 0; j < QG; j++) d[j] = 0.f;
#pragma unroll
            for (int k = 0; k < 32; k += 4) {
                const float x0 = frac_at<B>(w + c * B, k), x1 = frac_at<B>(w + c * B, k + 1);
                const float x2 = frac_at<B>(w + c * B, k + 2), x3 = frac_at<B>(w + c * B, k + 3);
#pragma unroll
                for (int j = 0; j < QG; j++) {
                    const float4 a = *reinterpret_cast<const float4*>(&q_s[j][c * 32 + k]);
                    d[j] = fmaf(a.x, x0, d[j]);
                    d[j] = fmaf(a.y, x1, d[j]);
                    d[j] = fmaf(a.z, x2, d[j]);
                    d[j] = fmaf(a.w, x3, d[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < QG; j++) s[j] += sc * d[j] + (bi - sc) * qsum_s[j][c];
        }
    }
}

// 2. SIMT online softmax over the warp's 32 positions: pj = this lane's position's weight per
// head; the running max and sum move on and the accumulators are rescaled. Lane 0's position is
// always inside the split, so the tile maximum is finite unless that row is bad (then the output
// is NaN anyway).
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_softmax_simt(
    const float (&s)[QG], bool valid, float (&m_w)[QG], float (&l_w)[QG],
    float (&acc)[QShape<T, B, D, GS>::AR][8], float (&accb)[QShape<T, B, D, GS>::AR],
    float (&pj)[QG]) {
    const unsigned FULL = 0xffffffffu;
#pragma unroll
    for (int j = 0; j < QG; j++) {
        float mx = s[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
        const float m_new = fmaxf(m_w[j], mx);
        const float alpha = m_new == neg_inf() ? 1.f : fast_exp(m_w[j] - m_new);
        pj[j] = valid ? fast_exp(s[j] - m_new) : 0.f;
        l_w[j] = l_w[j] * alpha + pj[j];
        accb[j] *= alpha;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] *= alpha;
        m_w[j] = m_new;
    }
}

// 1. Tensor-core scores S = K·Qᵀ, m-tile μ = positions 16μ..16μ+15 of the tile, from the staged
// tile (sK codes, sKS / sKB scales and biases): a lane's words of position 8ν + gq's row by
// ldmatrix (n-tiles ν = 2μ, 2μ + 1 are the A operand's rows gq and gq + 8). sv[μ][e]: head tq,
// position 16μ + gq + 8e (its hi and lo columns summed); -inf where masked out by vmask. The
// k-steps are the outer loop, so each k-step's q fragment is read once for both m-tiles; each
// accumulator takes k-step 0, 1, ... of a group in order, and the groups enter a score in order.
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_scores_mma(
    int lane, int gq, int tq, unsigned vmask, const unsigned char* sK, const T* sKS, const T* sKB,
    uint32_t (*qa_s)[32][QShape<T, B, D, GS>::QAW], float qexp,
    const float (&qsg)[QShape<T, B, D, GS>::NG], float (&sv)[2][2]) {
    using S = QShape<T, B, D, GS>;
    constexpr int HB = S::HB, NG = S::NG, KS = S::KS, QWB = S::QWB, WPL = S::WPL;
    constexpr int CPR = S::CPR;
    static_assert(WPL == CPR, "a lane holds one word of each chunk of its row");
    uint32_t w[4][WPL];
#pragma unroll
    for (int nu = 0; nu < 4; nu++) ldsm_rows<HB>(sK, 8 * nu, lane, w[nu]);
    // Σ over groups of scale·(q·codes) (in units of qexp) and of bias·Σq.
    float dot[2][2], bias[2][2];
#pragma unroll
    for (int mu = 0; mu < 2; mu++) dot[mu][0] = dot[mu][1] = bias[mu][0] = bias[mu][1] = 0.f;
#pragma unroll
    for (int gi = 0; gi < NG; gi++) {
        float c[2][4];
#pragma unroll
        for (int mu = 0; mu < 2; mu++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[mu][i] = 0.f;
#pragma unroll
        for (int sp = 0; sp < KS; sp++) {
            const int s = gi * KS + sp;
            const uint2 q2 = *reinterpret_cast<const uint2*>(qa_s[s][lane]);
#pragma unroll
            for (int mu = 0; mu < 2; mu++) {
                uint32_t a[4];  // rows gq (n-tile 2μ): a0, a2; rows gq + 8 (2μ + 1): a1, a3
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t* x = w[2 * mu + h];
                    if (B == 4) code_frag<4>(x[gi * QWB / 4 + sp / 2], 2 * (sp % 2), a[h], a[h + 2]);
                    else code_frag<8>(x[gi * QWB / 4 + sp], 0, a[h], a[h + 2]);
                }
                mma16816(c[mu], a[0], a[1], a[2], a[3], q2.x, q2.y);
            }
        }
        // This group's scale and bias of the two positions of each m-tile's C fragment.
#pragma unroll
        for (int mu = 0; mu < 2; mu++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = 16 * mu + gq + 8 * e;
                const float sc = to_f(sKS[r * NG + gi]), bi = to_f(sKB[r * NG + gi]);
                dot[mu][e] = fmaf(sc, c[mu][2 * e] + c[mu][2 * e + 1], dot[mu][e]);
                bias[mu][e] = fmaf(bi, qsg[gi], bias[mu][e]);
            }
    }
#pragma unroll
    for (int mu = 0; mu < 2; mu++)
#pragma unroll
        for (int e = 0; e < 2; e++)
            sv[mu][e] = (vmask >> (16 * mu + gq + 8 * e)) & 1 ? fmaf(qexp, dot[mu][e], bias[mu][e])
                                                            : neg_inf();
}

// 2. Tensor-core online softmax: head tq's 32 scores sit in the 8 lanes 4g + tq; pm[μ][e] = the
// weight of position 16μ + gq + 8e for head tq. This lane's own head state lives in m_w[0] /
// l_w[0]; the V accumulators of every head are rescaled by that head's alpha (from lane h).
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_softmax_mma(
    const float (&sv)[2][2], int gq, int tq, float (&m_w)[QG], float (&l_w)[QG],
    float (&acc)[QShape<T, B, D, GS>::AR][8], float (&accb)[QShape<T, B, D, GS>::AR],
    float (&cv)[QShape<T, B, D, GS>::CR][4], float& accb_c, float (&pm)[2][2]) {
    using S = QShape<T, B, D, GS>;
    constexpr bool VMMA = S::VMMA;
    constexpr int MT = S::MT;
    const unsigned FULL = 0xffffffffu;
    float mx = fmaxf(fmaxf(sv[0][0], sv[0][1]), fmaxf(sv[1][0], sv[1][1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
    const float m_old = m_w[0];
    const float m_new = fmaxf(m_old, mx);
    const float alpha = m_new == neg_inf() ? 1.f : fast_exp(m_old - m_new);
    float ls = 0.f;
#pragma unroll
    for (int mu = 0; mu < 2; mu++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            pm[mu][e] = sv[mu][e] == neg_inf() ? 0.f : fast_exp(sv[mu][e] - m_new);
            ls += pm[mu][e];
        }
    m_w[0] = m_new;
    l_w[0] = l_w[0] * alpha + ls;
    if constexpr (VMMA) {
        // Columns 2tq, 2tq+1 are heads (2tq)%4 and (2tq)%4 + 1; column gq is
        // head gq%4.
        const int h0 = (2 * tq) % 4;
        const float a0 = __shfl_sync(FULL, alpha, h0);
        const float a1 = __shfl_sync(FULL, alpha, h0 + 1);
        accb_c *= __shfl_sync(FULL, alpha, gq % 4);
#pragma unroll
        for (int i = 0; i < MT; i++) {
            cv[i][0] *= a0;
            cv[i][1] *= a1;
            cv[i][2] *= a0;
            cv[i][3] *= a1;
        }
    } else {
#pragma unroll
        for (int j = 0; j < QG; j++) {
            const float a = __shfl_sync(FULL, alpha, j);
            accb[j] *= a;
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] *= a;
        }
    }
}

// SIMT: asks L2 for the next tile's rows (head row hrow_n) while this one is worked on.
template <typename T, int B, int D, int GS, int VB = B>
__device__ __forceinline__ void warp_prefetch(
    uint32_t hrow_n, uint32_t hg, const unsigned char* kcb, const unsigned char* vcb, const T* ks,
    const T* kb, const T* vs, const T* vb) {
    constexpr int HB = QShape<T, B, D, GS>::HB, VHB = QShape<T, VB, D, GS>::HB;
    prefetch_span(kcb + (size_t)hrow_n * HB, HB);
    prefetch_span(vcb + (size_t)hrow_n * VHB, VHB);
    if constexpr (QShape<T, B, D, GS>::DENSE) return;  // no scales
    const int gb = (int)(hg * sizeof(T));
    prefetch_span(ks + (size_t)hrow_n * hg, gb);
    prefetch_span(kb + (size_t)hrow_n * hg, gb);
    prefetch_span(vs + (size_t)hrow_n * hg, gb);
    prefetch_span(vb + (size_t)hrow_n * hg, gb);
}

// Starting state of a warp: every head's max -inf and sum 0, accumulators 0; for tensor cores
// qsg, the sum of head tq's q over each group (for the bias term).
template <typename T, int B, int D, int GS>
__device__ __forceinline__ void warp_start(
    int tq, float (*qsum_s)[D / 32], float (&qsg)[QShape<T, B, D, GS>::NG], float (&m_w)[QG],
    float (&l_w)[QG], float (&acc)[QShape<T, B, D, GS>::AR][8],
    float (&accb)[QShape<T, B, D, GS>::AR], float (&cv)[QShape<T, B, D, GS>::CR][4]) {
    using S = QShape<T, B, D, GS>;
    constexpr bool MMA = S::MMA, VMMA = S::VMMA;
    constexpr int NG = S::NG, MT = S::MT;
    if (MMA) {
#pragma unroll
        for (int gi = 0; gi < NG; gi++) {
            float s = 0.f;
            for (int c = gi * GS / 32; c < (gi + 1) * GS / 32; c++) s += qsum_s[tq][c];
            qsg[gi] = s;
        }
    }
#pragma unroll
    for (int j = 0; j < QG; j++) {
        m_w[j] = neg_inf();
        l_w[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < (VMMA ? 1 : QG); j++) {
        accb[j] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < (VMMA ? MT : 1); i++)
#pragma unroll
        for (int k = 0; k < 4; k++) cv[i][k] = 0.f;
}
