// kvq: the block-wide decode kernel (decode_<t>_dense_q<qt>_m<MG>, decode_<t>_b<bits>): dense
// pools, and the quantized pools the warp-independent kernel does not take. How it works: the top
// of kernels/decode.cu. Its steps are the functions below, in the order one tile runs them.
#pragma once
#include "codes.cuh"
#include "merge.cuh"

#define NT 128
#define TILE 128
// Query heads per block: MG = 4 when a KV head has at most 4 (its accumulators leave registers
// for more dense loads in flight), else MAXG.
#define MAXG 8

// Where one position's K and V sit: row r of the pool holds every KV head, head kh the words
// and groups at `head_*` inside it.
struct RowStrides {
    size_t row_words, head_words, row_groups, head_groups;
};

// 1. Scores of position t0 + tid for the chunk's gn query heads (q in q_s, pre-scaled; per
// 32-code chunk sums in qsum_s) into p_s, its pool slot into slot_s; a block id outside the
// pool marks the block bad.
template <typename T, int B, int MG>
__device__ __forceinline__ void block_scores(
    const T* __restrict__ kd, const uint32_t* __restrict__ kc, const T* __restrict__ ks,
    const T* __restrict__ kb, const uint32_t* __restrict__ tables, int b, int kh, int kvh, int D,
    int nch, int gn, int group, int max_blocks, int num_blocks, int block_size, long long t0,
    int tid, RowStrides rs, const float* q_s, const float* qsum_s, float* p_s, int* slot_s,
    int& bad_s) {
    const size_t row_words = rs.row_words, head_words = rs.head_words;
    const size_t row_groups = rs.row_groups, head_groups = rs.head_groups;
    const long long p = t0 + tid;
    const uint32_t blk = tables[(size_t)b * max_blocks + p / block_size];
    size_t slot = 0;
    if (blk >= (uint32_t)num_blocks) bad_s = 1;
    else slot = (size_t)blk * block_size + p % block_size;
    slot_s[tid] = (int)slot;
    float s[MG];
#pragma unroll
    for (int j = 0; j < MG; j++) s[j] = 0.f;
    if (B == 0) {
        // LU 16-byte loads of the row in flight per round trip (all of a 64-dim f16 row at
        // MG = 4; more at MAXG costs registers: 4 blocks per SM).
        constexpr int CH = 16 / (int)sizeof(T);  // values per load
        constexpr int LU = MG <= 4 ? 8 : 2;
        const uint4* row = reinterpret_cast<const uint4*>(kd + slot * kvh * D + (size_t)kh * D);
        const int nl = D / CH;
        for (int l0 = 0; l0 < nl; l0 += LU) {
            uint4 r[LU];
#pragma unroll
            for (int u = 0; u < LU; u++)
                if (l0 + u < nl) r[u] = row[l0 + u];
#pragma unroll
            for (int u = 0; u < LU; u++) {
                if (l0 + u >= nl) break;
                float v[CH];
                unpack16<T>(r[u], v);
                const int c = (l0 + u) * CH;
#pragma unroll
                for (int j = 0; j < MG; j++) {
                    if (j < gn) {
                        // q is the same for every thread: broadcast 16-byte loads.
                        const float4* qj = reinterpret_cast<const float4*>(q_s + j * D + c);
#pragma unroll
                        for (int h = 0; h < CH / 4; h++) {
                            const float4 a = qj[h];
                            s[j] += a.x * v[4 * h] + a.y * v[4 * h + 1] + a.z * v[4 * h + 2] +
                                    a.w * v[4 * h + 3];
                        }
                    }
                }
            }
        }
    } else {
        const uint32_t* row = kc + slot * row_words + kh * head_words;
        const T* sc_row = ks + slot * row_groups + kh * head_groups;
        const T* bi_row = kb + slot * row_groups + kh * head_groups;
        for (int c = 0; c < nch; c++) {
            uint32_t w[B > 0 ? B : 1];
            if (B % 4 == 0) {
#pragma unroll
                for (int i = 0; i < B / 4; i++) {
                    uint4 x = reinterpret_cast<const uint4*>(row + c * B)[i];
                    w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < B; i++) w[i] = row[c * B + i];
            }
            const int gi = c * 32 / group;
            const float sc = to_f(sc_row[gi]), bi = to_f(bi_row[gi]);
            float d[MG];
#pragma unroll
            for (int j = 0; j < MG; j++) d[j] = 0.f;
#pragma unroll
            for (int k = 0; k < 32; k += 4) {
                const float c0 = code_at<B>(w, k), c1 = code_at<B>(w, k + 1);
                const float c2 = code_at<B>(w, k + 2), c3 = code_at<B>(w, k + 3);
#pragma unroll
                for (int j = 0; j < MG; j++) {
                    if (j < gn) {
                        const float4 a = *reinterpret_cast<const float4*>(q_s + j * D + c * 32 + k);
                        d[j] += a.x * c0 + a.y * c1 + a.z * c2 + a.w * c3;
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < MG; j++)
                if (j < gn) s[j] += sc * d[j] + bi * qsum_s[j * nch + c];
        }
    }
#pragma unroll
    for (int j = 0; j < MG; j++)
        if (j < gn) p_s[j * TILE + tid] = s[j];
}

// 2. Online softmax over the tile's n scores, one warp per head: scores become weights, the
// head's max and sum move on, alpha_s says how much the old accumulators shrink.
__device__ __forceinline__ void block_softmax(
    int tid, int gn, int n, float* p_s, float* m_s, float* l_s, float* alpha_s) {
    const int warp = tid / 32, lane = tid % 32;
    for (int j = warp; j < gn; j += NT / 32) {
        float mx = neg_inf();
        for (int t = lane; t < n; t += 32) mx = fmaxf(mx, p_s[j * TILE + t]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_old = m_s[j], m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        for (int t = lane; t < n; t += 32) {
            const float e = __expf(p_s[j * TILE + t] - m_new);
            p_s[j * TILE + t] = e;
            sum += e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        __syncwarp();
        if (lane == 0) {
            const float a = __expf(m_old - m_new);
            alpha_s[j] = a;
            l_s[j] = l_s[j] * a + sum;
            m_s[j] = m_new;
        }
    }
}

// 3. V of the tile's n positions, D/8 threads per row (row group rg of nrg, values c8·8..+8):
// acc += p·v (dense), or acc += (p·scale)·code and accb += p·bias (quantized).
template <typename T, int B, int MG>
__device__ __forceinline__ void block_values(
    const T* __restrict__ vd, const uint32_t* __restrict__ vc, const T* __restrict__ vs,
    const T* __restrict__ vb, int kh, int kvh, int D, int gn, int group, int n, int rg, int nrg,
    int c8, RowStrides rs, const float* p_s, const int* slot_s, const float* alpha_s,
    float (&acc)[MG][8], float (&accb)[MG]) {
    const size_t row_words = rs.row_words, head_words = rs.head_words;
    const size_t row_groups = rs.row_groups, head_groups = rs.head_groups;
#pragma unroll
    for (int j = 0; j < MG; j++) {
        if (j < gn) {
            const float a = alpha_s[j];
            accb[j] *= a;
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] *= a;
        }
    }
    if constexpr (B == 0) {
        // VU rows in flight per round trip.
        constexpr int VU = MG <= 4 ? 4 : 2;
        for (int t0 = rg; t0 < n; t0 += VU * nrg) {
            float v[VU][8];
#pragma unroll
            for (int u = 0; u < VU; u++) {
                const int t = t0 + u * nrg;
                if (t < n) load8(vd + (size_t)slot_s[t] * kvh * D + (size_t)kh * D + c8 * 8, v[u]);
            }
#pragma unroll
            for (int u = 0; u < VU; u++) {
                const int t = t0 + u * nrg;
                if (t >= n) break;
#pragma unroll
                for (int j = 0; j < MG; j++) {
                    if (j < gn) {
                        const float pj = p_s[j * TILE + t];
#pragma unroll
                        for (int k = 0; k < 8; k++) acc[j][k] += pj * v[u][k];
                    }
                }
            }
        }
    } else {
        for (int t = rg; t < n; t += nrg) {
            const size_t slot = (size_t)slot_s[t];
            const unsigned char* row = reinterpret_cast<const unsigned char*>(
                vc + slot * row_words + kh * head_words);
            const uint64_t win = load_codes8<B>(row + c8 * B);
            const size_t gidx = slot * row_groups + kh * head_groups + (c8 * 8) / group;
            const float sc = to_f(vs[gidx]), bi = to_f(vb[gidx]);
            float cf[8];
#pragma unroll
            for (int k = 0; k < 8; k++) cf[k] = code_f((uint32_t)(win >> (k * B)) & ((1u << B) - 1));
#pragma unroll
            for (int j = 0; j < MG; j++) {
                if (j < gn) {
                    const float pj = p_s[j * TILE + t], ps = pj * sc;
                    accb[j] += pj * bi;
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[j][k] += ps * cf[k];
                }
            }
        }
    }
}

// 4. The row groups' accumulators (bias folded in) summed into red_s ([MG][D]). A row group
// is tpr = D/8 threads; when tpr is a power of two up to 32 the groups of a warp are summed by
// shuffles first, so there is one barrier per warp instead of one per group.
template <int MG>
__device__ __forceinline__ void block_sum_rows(
    float (&acc)[MG][8], float (&accb)[MG], int tid, int tpr, int rg, int nrg, int c8, int gn,
    int D, float* red_s) {
#pragma unroll
    for (int j = 0; j < MG; j++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] += accb[j];
    const bool shfl = tpr <= 32 && (tpr & (tpr - 1)) == 0;
    const int lane = tid % 32, warp = tid / 32;
    if (shfl) {
        for (int o = tpr; o < 32; o <<= 1)
#pragma unroll
            for (int j = 0; j < MG; j++)
#pragma unroll
                for (int k = 0; k < 8; k++) acc[j][k] += __shfl_xor_sync(0xffffffffu, acc[j][k], o);
    }
    const int nsum = shfl ? NT / 32 : nrg;
    const bool mine = shfl ? lane < tpr : rg < nrg;
    const int who = shfl ? warp : rg;
    for (int r = 0; r < nsum; r++) {
        if (mine && who == r) {
#pragma unroll
            for (int j = 0; j < MG; j++) {
                if (j < gn) {
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        float* dst = red_s + j * D + c8 * 8 + k;
                        *dst = (r == 0 ? 0.f : *dst) + acc[j][k];
                    }
                }
            }
        }
        __syncthreads();
    }
}

// The last block of a (sequence, KV head, head chunk) to finish merges the `live` splits'
// partials (live_splits) into `out` (no separate merge launch; the partials are still in L2) and leaves its counter at
// 0 for the next call. Four outputs per thread and round (merge_splits).
template <typename QT>
__device__ __forceinline__ void block_merge_last(
    int tid, int b, int kvh, int kh, int Bn, int H, int G, int j0, int gn, int D, int live,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, QT* __restrict__ out,
    unsigned* __restrict__ counters) {
    const size_t cidx = ((size_t)b * kvh + kh) * gridDim.z + blockIdx.z;
    if (!last_to_finish(counters, cidx, live)) return;
    const size_t hb = (size_t)b * H + (size_t)kh * G + j0;
    for (int i0 = 0; i0 < gn * D; i0 += 4 * NT) {
        size_t hr[4];
        int dd[4];
        bool in[4];
        float o[4], l[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int i = i0 + tid + k * NT;
            in[k] = i < gn * D;
            hr[k] = hb + i / D;
            dd[k] = i % D;
        }
        merge_splits<4>(part_acc, part_ml, (size_t)Bn * H, D, live, hr, dd, in, o, l);
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (in[k]) out[hr[k] * D + dd[k]] = from_f<QT>(o[k]);
    }
    if (tid == 0) counters[cidx] = 0;
}

// B == 0: dense rows kd / vd. Otherwise affine B-bit codes with per-group scales / biases.
// q: the queries in their own type QT, multiplied by `scale` as they are loaded.
template <typename T, int B, typename QT, int MG>
__device__ __forceinline__ void decode_impl(
    const QT* __restrict__ q, float scale, const T* __restrict__ kd, const T* __restrict__ vd,
    const uint32_t* __restrict__ kc, const T* __restrict__ ks, const T* __restrict__ kb,
    const uint32_t* __restrict__ vc, const T* __restrict__ vs, const T* __restrict__ vb,
    const uint32_t* __restrict__ tables, const uint32_t* __restrict__ starts,
    const uint32_t* __restrict__ lens, int max_blocks, int num_blocks, int block_size, int kvh,
    int G, int D, int group, int split_len, float* __restrict__ part_acc, float* __restrict__ part_ml,
    QT* __restrict__ out, unsigned* __restrict__ counters, int nsplit) {
    const int tid = threadIdx.x;
    const int b = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, Bn = gridDim.x / kvh;
    const int j0 = blockIdx.z * MG, gn = min(MG, G - j0);
    const int H = kvh * G, nch = D / 32;

    extern __shared__ float smem[];
    float* q_s = smem;                       // [MG][D]
    float* qsum_s = q_s + MG * D;          // [MG][D/32]
    float* p_s = qsum_s + MG * nch;        // [MG][TILE]
    int* slot_s = reinterpret_cast<int*>(p_s + MG * TILE);  // [TILE]
    float* red_s = reinterpret_cast<float*>(slot_s + TILE);   // [MG][D]
    __shared__ float m_s[MG], l_s[MG], alpha_s[MG];
    __shared__ int bad_s;

    const uint32_t start = starts[b], len = lens[b];
    const bool bad = len == 0 || start >= len ||
                     (uint64_t)len > (uint64_t)max_blocks * (uint64_t)block_size;
    const long long p0 = (long long)start + (long long)split * split_len;
    const long long p1 = min((long long)len, p0 + split_len);
    // With the merge in this launch, the splits past the sequence do nothing (without it, every
    // split writes its partials for decode_merge).
    const int live =
        out != nullptr ? live_splits(bad, start, len, split_len, nsplit) : (int)gridDim.y;
    if (split >= live) return;

    const QT* qb = q + ((size_t)b * H + (size_t)kh * G + j0) * D;
    for (int i = tid; i < gn * D; i += NT) q_s[i] = to_f(qb[i]) * scale;
    if (tid < MG) { m_s[tid] = neg_inf(); l_s[tid] = 0.f; }
    if (tid == 0) bad_s = bad;
    __syncthreads();
    if (B > 0) {
        for (int i = tid; i < gn * nch; i += NT) {
            const float* src = q_s + (i / nch) * D + (i % nch) * 32;
            float s = 0.f;
#pragma unroll
            for (int k = 0; k < 32; k++) s += src[k];
            qsum_s[i] = s;
        }
    }

    const int tpr = D / 8, nrg = NT / tpr, rg = tid / tpr, c8 = tid % tpr;
    const RowStrides rs = {(size_t)kvh * D * B / 32, (size_t)D * B / 32,
                           (size_t)kvh * (D / group), (size_t)(D / group)};
    float acc[MG][8], accb[MG];
#pragma unroll
    for (int j = 0; j < MG; j++) {
        accb[j] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = 0.f;
    }
    __syncthreads();

    if (!bad) {
        for (long long t0 = p0; t0 < p1; t0 += TILE) {
            const int n = (int)min((long long)TILE, p1 - t0);
            if (tid < n)
                block_scores<T, B, MG>(kd, kc, ks, kb, tables, b, kh, kvh, D, nch, gn, group,
                                   max_blocks, num_blocks, block_size, t0, tid, rs, q_s, qsum_s,
                                   p_s, slot_s, bad_s);
            __syncthreads();
            block_softmax(tid, gn, n, p_s, m_s, l_s, alpha_s);
            __syncthreads();
            if (rg < nrg)
                block_values<T, B, MG>(vd, vc, vs, vb, kh, kvh, D, gn, group, n, rg, nrg, c8, rs, p_s,
                                   slot_s, alpha_s, acc, accb);
            __syncthreads();
        }
    }
    block_sum_rows<MG>(acc, accb, tid, tpr, rg, nrg, c8, gn, D, red_s);
    // This split's (max, sum, weighted V) of each head; NaN for a bad sequence or block id.
    const bool failed = bad_s != 0;
    const float nan = __int_as_float(0x7fc00000);
    const size_t base = ((size_t)split * Bn + b) * H + (size_t)kh * G + j0;
    for (int i = tid; i < gn * D; i += NT) part_acc[base * D + i] = failed ? nan : red_s[i];
    if (tid < gn) {
        part_ml[(base + tid) * 2] = failed ? nan : m_s[tid];
        part_ml[(base + tid) * 2 + 1] = failed ? nan : l_s[tid];
    }
    if (out != nullptr)
        block_merge_last<QT>(tid, b, kvh, kh, Bn, H, G, j0, gn, D, live, part_acc, part_ml, out,
                             counters);
}
