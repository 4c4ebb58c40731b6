// kvq: the warp-independent decode kernel for quantized pools, head_dim 64 or 128 (design and
// sizes: warp_shape.cuh): the prologue, the loop over a warp's tiles calling its steps
// (warp_scores.cuh, warp_values.cuh), and the end of the block, which combines its warps and,
// in the last block of a head chunk, merges every split into the output.
#pragma once
#include "warp_scores.cuh"
#include "warp_values.cuh"
#include "merge.cuh"
#include "window.cuh"

// This block's (max, sum, weighted V) of each head from its warps' totals, for its split; NaN
// for a bad sequence or block id.
template <int D, typename Wacc>
__device__ __forceinline__ void warp_combine(
    int tid, int split, int Bn, int b, int H, int kh, int G, int j0, int gn, const int& bad_s,
    float (*wm_s)[QG], float (*wl_s)[QG], Wacc wacc, float* __restrict__ part_acc,
    float* __restrict__ part_ml) {
    const bool failed = bad_s != 0;
    const float nan = __int_as_float(0x7fc00000);
    const size_t base = ((size_t)split * Bn + b) * H + (size_t)kh * G + j0;
    for (int i = tid; i < gn * D; i += blockDim.x) {
        const int j = i / D, dd = i % D;
        float M = neg_inf();
#pragma unroll
        for (int w = 0; w < QW; w++) M = fmaxf(M, wm_s[w][j]);
        float num = 0.f, den = 0.f;
        if (M != neg_inf()) {
#pragma unroll
            for (int w = 0; w < QW; w++) {
                const float e = __expf(wm_s[w][j] - M);
                num += e * wacc(w)[j][dd];
                den += e * wl_s[w][j];
            }
        }
        part_acc[base * D + i] = failed ? nan : num;
        if (dd == 0) {
            part_ml[(base + j) * 2] = failed ? nan : M;
            part_ml[(base + j) * 2 + 1] = failed ? nan : den;
        }
    }
}

// The last block of this (sequence, KV head, head chunk) to finish (of the `live` quantized
// splits and the window's, when there is one) merges the live splits' partials into the output
// (no separate merge launch; the partials are still in L2), rotated back for the rotated scheme,
// then with the window's partials (splits nsplit, nsplit + 1, ...; window.cuh), and leaves the
// counter at 0 for the next call.
template <typename T, int D, bool WIN, typename Wacc>
__device__ __forceinline__ void warp_merge_last(
    int tid, int b, int kvh, int kh, int Bn, int H, int G, int j0, int gn, int live, int nsplit,
    int rotated, const float* __restrict__ signs, Wacc wacc, const float* __restrict__ part_acc,
    const float* __restrict__ part_ml, T* __restrict__ out, unsigned* __restrict__ counters,
    const WinRows& w) {
    const size_t cidx = ((size_t)b * kvh + kh) * gridDim.z + blockIdx.z;
    if (!last_to_finish(counters, cidx, live + (WIN ? w.splits : 0))) return;
    const size_t hstride = (size_t)Bn * H;  // one split's stride, in heads
    float* o_s = &wacc(0)[0][0];             // [QG][D]
    // Each thread owns IT (head, dim) outputs.
    constexpr int IT = QG * D / (QW * 32);
    const size_t hb = (size_t)b * H + (size_t)kh * G + j0;
    size_t hr[IT];
    int dd[IT];
    bool in[IT];
#pragma unroll
    for (int k = 0; k < IT; k++) {
        const int i = tid + k * QW * 32;
        hr[k] = hb + i / D;
        dd[k] = i % D;
        in[k] = i / D < gn;
    }
    if constexpr (!WIN) {
        float o[IT], l[IT];
        merge_splits<IT>(part_acc, part_ml, hstride, D, live, hr, dd, in, o, l);
#pragma unroll
        for (int k = 0; k < IT; k++) {
            if (!in[k]) continue;
            if (rotated) o_s[tid + k * QW * 32] = o[k];
            else out[hr[k] * D + dd[k]] = from_f<T>(o[k]);
        }
        if (tid == 0) counters[cidx] = 0;
        if (!rotated) return;
        __syncthreads();
        fwht<D>(o_s, gn, tid, blockDim.x);
        const float nrm = inv_sqrt_d(D);
        for (int i = tid; i < gn * D; i += blockDim.x)
            out[(hb + i / D) * D + i % D] = from_f<T>(o_s[i] * nrm * signs[i % D]);
        return;
    }
    // With a window: the quantized splits and the window's (splits nsplit, nsplit + 1, ...;
    // window.cuh) in one pass, under one max and one sum; the quantized part's weighted V is
    // rotated back (linear, so before normalizing) and added to the window's. A query whose
    // quantized part is empty takes the window alone (its quantized split carries NaN).
    const bool qempty = w.info[(size_t)b * 8 + 7] != 0;
    MergeSums<IT> r;
    merge_parts<IT>(part_acc, part_ml, hstride, D, qempty ? 0 : live, nsplit, w.splits, hr, dd, in,
                    r);
    if (tid == 0) counters[cidx] = 0;
    if (rotated) {
#pragma unroll
        for (int k = 0; k < IT; k++)
            if (in[k]) o_s[tid + k * QW * 32] = r.a0[k];
        __syncthreads();
        fwht<D>(o_s, gn, tid, blockDim.x);
        const float nrm = inv_sqrt_d(D);
#pragma unroll
        for (int k = 0; k < IT; k++)
            if (in[k]) r.a0[k] = o_s[tid + k * QW * 32] * nrm * signs[dd[k]];
    }
#pragma unroll
    for (int k = 0; k < IT; k++) {
        const float v = r.nan[k] ? __int_as_float(0x7fc00000) : (r.a0[k] + r.a1[k]) / r.den[k];
        if (in[k]) out[hr[k] * D + dd[k]] = from_f<T>(v);
    }
}

// A window block (window.cuh) of this head chunk, beside the quantized splits: the partial of
// its rows, then the merge if it is the last to finish.
template <typename T, int D, typename Wacc>
__device__ __forceinline__ void window_block(
    const T* __restrict__ q, float scale, const WinRows& w, int tid, int b, int kvh, int kh,
    int Bn, int H, int G, int j0, int gn, int live, int nsplit, int rotated,
    const float* __restrict__ signs, float (*wm_s)[QG], float (*wl_s)[QG], Wacc wacc, int& bad_s,
    float* __restrict__ part_acc, float* __restrict__ part_ml, T* __restrict__ out,
    unsigned* __restrict__ counters) {
    const int split = blockIdx.y;
    window_split<T, D>(q, scale, w, split - nsplit, b, kh, H, G, j0, gn, wm_s, wl_s, wacc, bad_s);
    __syncthreads();
    warp_combine<D>(tid, split, Bn, b, H, kh, G, j0, gn, bad_s, wm_s, wl_s, wacc, part_acc,
                    part_ml);
    warp_merge_last<T, D, true>(tid, b, kvh, kh, Bn, H, G, j0, gn, live, nsplit, rotated, signs,
                                wacc, part_acc, part_ml, out, counters, w);
}

// One sequence's block table inside a split ending at p1. block_of: a position's block (or an
// invalid id past the split's end) and its index q = p / bs in the table, kept for the
// position's offset in its block; tensor-core kernels shift for power-of-two block sizes (the
// default 16) instead of dividing, the SIMT ones keep p / bs and p % bs (fewer spills there).
// locate: the position's head row, if it is inside the split and its block is in the pool.
template <bool MMA> struct SeqBlocks {
    const uint32_t* tab;
    uint32_t bs, p1, nblk, nkv, kh, shift;
    bool pow2;
    __device__ __forceinline__ SeqBlocks(const uint32_t* t, uint32_t bs_, uint32_t p1_,
                                         uint32_t nblk_, uint32_t nkv_, uint32_t kh_)
        : tab(t), bs(bs_), p1(p1_), nblk(nblk_), nkv(nkv_), kh(kh_),
          shift((uint32_t)(__ffs((int)bs_) - 1)), pow2((bs_ & (bs_ - 1)) == 0) {}
    __device__ __forceinline__ uint32_t block_of(uint32_t p, uint32_t& q) const {
        if constexpr (!MMA) return p < p1 ? tab[p / bs] : 0xffffffffu;
        if (p >= p1) return 0xffffffffu;
        q = pow2 ? p >> shift : p / bs;
        return tab[q];
    }
    __device__ __forceinline__ bool locate(uint32_t p, uint32_t blk, uint32_t q, uint32_t& hr,
                                           bool& bad) const {
        if (p >= p1) return false;
        if (blk >= nblk) {
            bad = true;
            return false;
        }
        hr = (blk * bs + (MMA ? p - q * bs : p % bs)) * nkv + kh;
        return true;
    }
};

// VB: the width of the value codes when it differs from the keys' B (keys one bit wider than
// values, the splits of --kv-bits 2.5 … 5.5: SIMT, and 4-bit keys over 3-bit values on tensor
// cores, whose V takes the lanes); the steps that read V take it, with V's shape SV. WIN: the
// instance with --kv-residual's window blocks (window.cuh); the plain instances are compiled
// without them, whose code cost the tensor-core kernels 3–5% at head_dim 128 even unused (H200,
// 4 × 8 KV heads at 16K: 0.053–0.055 → 0.056 ms).
template <typename T, int B, int D, int GS, int VB = B, bool WIN = false>
__device__ __forceinline__ void qdecode_impl(
    const T* __restrict__ q, float scale, const uint32_t* __restrict__ kc, const T* __restrict__ ks,
    const T* __restrict__ kb, const uint32_t* __restrict__ vc, const T* __restrict__ vs,
    const T* __restrict__ vb, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ starts, const uint32_t* __restrict__ lens, int max_blocks,
    int num_blocks, int block_size, int kvh, int G, int group, int split_len,
    float* __restrict__ part_acc, float* __restrict__ part_ml, const float* __restrict__ signs,
    int rotated, T* __restrict__ out, unsigned* __restrict__ counters, int nsplit,
    const WinRows w) {
    using S = QShape<T, B, D, GS>;
    using SV = QShape<T, VB, D, GS>;
    static_assert(VB == B || GS == 0 || (B == 4 && VB == 3), "mixed widths on tensor cores: K4/V3");
    constexpr bool MMA = S::MMA, VMMA = SV::VMMA;
    constexpr int HB = S::HB, NCH = S::NCH, LPR = S::LPR, NG = S::NG, KST = S::KST;
    // One staged tile: K and V codes, then the four scale rows (S::STG when VB == B).
    constexpr int SCL = 32 * (HB + SV::HB);
    constexpr int STG = MMA ? SCL + 32 * 4 * S::SB : S::STG;
    const unsigned FULL = 0xffffffffu;
    if (MMA) group = GS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;  // mma fragment coordinates
    const int b = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, Bn = gridDim.x / kvh;
    const int j0 = blockIdx.z * QG, gn = min(QG, G - j0), H = kvh * G;

    // q and the warps' V totals: static (SIMT), or in the staging memory (tensor cores: q before
    // the first tile, each warp's totals in its own stages after its last).
    __shared__ __align__(16) float q_st[MMA ? 1 : QG * D];
    __shared__ __align__(16) float wacc_st[MMA ? 1 : QW * QG * D];
    extern __shared__ __align__(16) unsigned char stage_s[];
    // Tensor cores: q in warp 0's second stage, free until that warp's first tile is in (the
    // first stages are filled while q is prepared).
    float(*q_s)[D] = reinterpret_cast<float(*)[D]>(MMA ? reinterpret_cast<float*>(stage_s + STG) : q_st);
    auto wacc = [&](int w) -> float(*)[D] {
        return reinterpret_cast<float(*)[D]>(MMA ? reinterpret_cast<float*>(stage_s + w * 2 * STG)
                                                 : wacc_st + w * QG * D);
    };
    static_assert(!MMA || STG >= QG * D * 4, "a stage holds q, a warp's two its V totals");
    __shared__ float qsum_s[QG][NCH], wm_s[QW][QG], wl_s[QW][QG];
    __shared__ __align__(16) uint32_t qa_s[MMA ? KST : 1][32][S::QAW];  // q fragments (QAW)
    __shared__ unsigned qmax_s;
    __shared__ int bad_s;

    const uint32_t start = starts[b], len = lens[b];
    const bool bad_seq = len == 0 || start >= len ||
                         (uint64_t)len > (uint64_t)max_blocks * (uint64_t)block_size;
    const uint32_t p0 = start + (uint32_t)split * (uint32_t)split_len;
    const uint32_t p1 = (uint32_t)min((long long)len, (long long)p0 + split_len);
    const int live = live_splits(bad_seq, start, len, split_len, nsplit);
    if constexpr (WIN) if (split >= nsplit) {
        return window_block<T, D>(q, scale, w, tid, b, kvh, kh, Bn, H, G, j0, gn, live, nsplit,
                                  rotated, signs, wm_s, wl_s, wacc, bad_s, part_acc, part_ml, out,
                                  counters);
    }
    if (split >= live) return;
    // A (slot, KV head) pair is a head row: hrow = slot·kvh + kh (32-bit; the host checks the
    // pool's size), its codes at hrow·HB bytes, its scales and biases at hrow·hg.
    const unsigned char* kcb = reinterpret_cast<const unsigned char*>(kc);
    const unsigned char* vcb = reinterpret_cast<const unsigned char*>(vc);
    const uint32_t hg = (uint32_t)(D / group), nkv = (uint32_t)kvh;
    const int c8 = lane % LPR, rsub = lane / LPR;
    const SeqBlocks<MMA> blocks(tables + (size_t)b * max_blocks, (uint32_t)block_size, p1,
                                (uint32_t)num_blocks, nkv, (uint32_t)kh);
    bool bad_row = false;
    // The warp's first tile: located, and for tensor cores staged before q is prepared.
    uint32_t t0 = p0 + (uint32_t)warp * 32;
    const uint32_t stride = QW * 32;
    unsigned short sreg[4] = {0, 0, 0, 0};
    auto stage = [&](int buf, uint32_t hr, bool ok) {
        warp_stage<T, B, D, GS, VB>(stage_s + (warp * 2 + buf) * STG, lane, hr, ok, kcb, vcb, ks,
                                    kb, vs, vb, sreg);
    };
    uint32_t q0 = 0, q1 = 0, blk1 = 0, hrow = 0;
    bool valid = false;
    if (!bad_seq) {
        blk1 = blocks.block_of(t0 + stride + lane, q1);
        const uint32_t blk0 = blocks.block_of(t0 + lane, q0);
        valid = blocks.locate(t0 + lane, blk0, q0, hrow, bad_row);
        if constexpr (MMA) stage(0, hrow, valid);
    }
    const float qexp = warp_load_q<T, B, D, GS>(q, scale, signs, rotated, b, H, kh, G, j0, gn,
                                                bad_seq, q_s, qsum_s, qa_s, qmax_s, bad_s);
    // qsum per group (tensor-core path), for the bias term; the warp's softmax state.
    float qsg[NG], m_w[QG], l_w[QG], acc[SV::AR][8], accb[SV::AR];
    float cv[SV::CR][4], accb_c = 0.f;  // tensor-core V: C tiles, bias of column gq
    warp_start<T, VB, D, GS>(tq, qsum_s, qsg, m_w, l_w, acc, accb, cv);

    if (!bad_seq) {
        int buf = 0;
        for (; t0 < p1; t0 += stride) {
            const uint32_t p = t0 + lane;
            // The next tile: located now (its block ids were read a tile ago), staged (tensor
            // cores) or asked into L2 (SIMT); the block ids of the one after.
            uint32_t hrow_n = 0;
            const bool valid_n = blocks.locate(p + stride, blk1, q1, hrow_n, bad_row);
            blk1 = blocks.block_of(p + 2 * stride, q1);
            const unsigned char* st = stage_s + (warp * 2 + buf) * STG;
            unsigned vmask = 0;
            if constexpr (MMA) {
                stage_sreg<T, B, D, GS, VB>(st, lane, sreg);
                if (t0 + stride < p1) stage(buf ^ 1, hrow_n, valid_n);
                else cp_async_commit();
                cp_async_wait<1>();
                __syncwarp();
                vmask = __ballot_sync(FULL, valid);
            } else if (valid_n) {
                warp_prefetch<T, B, D, GS, VB>(hrow_n, hg, kcb, vcb, ks, kb, vs, vb);
            }
            const unsigned char* sK = st;
            const unsigned char* sV = st + 32 * HB;
            const T* sKS = reinterpret_cast<const T*>(st + SCL);
            const T* sKB = sKS + 32 * NG;
            const T* sVS = sKB + 32 * NG;
            const T* sVB = sVS + 32 * NG;
            const uint32_t vrow = valid ? hrow : 0xffffffffu;
            // SIMT: pj[j] = weight of this lane's position for head j. Tensor cores: pm[μ][e] =
            // weight of position 16μ + gq + 8e for head tq.
            float pj[QG], pm[2][2];
            if constexpr (!MMA) {
                float s[QG];
                warp_scores_simt<T, B, D, GS>(valid, hrow, kcb, ks, kb, hg, group, q_s, qsum_s, s);
                warp_softmax_simt<T, B, D, GS>(s, valid, m_w, l_w, acc, accb, pj);
            } else {
                float sv[2][2];
                warp_scores_mma<T, B, D, GS>(lane, gq, tq, vmask, sK, sKS, sKB, qa_s, qexp, qsg, sv);
                warp_softmax_mma<T, VB, D, GS>(sv, gq, tq, m_w, l_w, acc, accb, cv, accb_c, pm);
            }
            if constexpr (VMMA)
                warp_values_mma<T, B, D, GS>(pm, gq, tq, vmask, sV, sVS, sVB, cv, accb_c);
            else
                warp_values_lanes<T, VB, D, GS>(pj, pm, rsub, c8, vmask, sV, sVS, sVB, vrow, vcb,
                                                vs, vb, hg, group, acc, accb);
            if constexpr (MMA) {
                __syncwarp();  // this stage is read; the next iteration stages into it
                buf ^= 1;
            }
            hrow = hrow_n;
            valid = valid_n;
        }
        if constexpr (MMA) cp_async_wait<0>();  // nothing lands after the stages turn into wacc
    }
    warp_totals<T, VB, D, GS>(lane, warp, gq, tq, c8, bad_row, m_w, l_w, acc, accb, cv, accb_c, wm_s,
                             wl_s, bad_s, wacc);
    __syncthreads();
    warp_combine<D>(tid, split, Bn, b, H, kh, G, j0, gn, bad_s, wm_s, wl_s, wacc, part_acc,
                    part_ml);
    warp_merge_last<T, D, WIN>(tid, b, kvh, kh, Bn, H, G, j0, gn, live, nsplit, rotated, signs,
                               wacc, part_acc, part_ml, out, counters, w);
}
