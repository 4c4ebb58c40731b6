// kvq: merging the position splits of decode attention into the output (kernels/decode.cu).
#pragma once
#include "codes.cuh"

// The splits that hold positions of a sequence [start, len): the first ⌈(len − start) /
// split_len⌉ of nsplit (the host plans splits from the table's capacity, which may be far
// longer); 1 for a bad sequence, whose split 0 carries the NaN. Kernels that merge their own
// splits skip the others entirely, and their merge reads only these.
__device__ __forceinline__ int live_splits(bool bad, uint32_t start, uint32_t len, int split_len,
                                           int nsplit) {
    if (bad) return 1;
    const long long n = ((long long)len - (long long)start + split_len - 1) / split_len;
    return (int)min((long long)nsplit, max(1LL, n));
}

// Whether this block is the last of `live` to finish its (sequence, KV head, head chunk), counted
// in counters[cidx]: its partials are written before it counts, and the last one sees everyone's.
__device__ __forceinline__ bool last_to_finish(unsigned* __restrict__ counters, size_t cidx,
                                               int live) {
    __shared__ bool last_s;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_s = atomicAdd(&counters[cidx], 1u) == (unsigned)live - 1;
    __syncthreads();
    const bool last = last_s;
    if (last) __threadfence();
    return last;
}

// Running sums of an online merge of split partials for IT outputs: the max M of their
// scores, the weighted V of two sets of splits (a0, a1: one may be rotated, the other not),
// their common sum den, and whether a NaN (a bad sequence) was met.
template <int IT> struct MergeSums {
    float M[IT], a0[IT], a1[IT], den[IT];
    bool nan[IT];
};

// Merges splits [0, n0) into a0 and splits [w0, w0 + n1) into a1, output k being value dd[k]
// of head row hr[k], whose split s sits at row s·BH + hr[k] of part_ml ([.., 2]: max, sum) and
// part_acc ([.., D]). Splits are read SC at a time for all IT outputs at once (one round trip
// to L2 per SC splits, both sets in the same trips: the merge is latency-bound) and combined
// online. Empty splits (m = -inf) count for nothing; NaN propagates. Outputs with in[k] false
// read nothing.
template <int IT>
__device__ __forceinline__ void merge_parts(const float* __restrict__ part_acc,
                                            const float* __restrict__ part_ml, size_t BH, int D,
                                            int n0, int w0, int n1, const size_t* hr,
                                            const int* dd, const bool* in, MergeSums<IT>& r) {
    constexpr int SC = 4;
#pragma unroll
    for (int k = 0; k < IT; k++) {
        r.M[k] = neg_inf();
        r.a0[k] = r.a1[k] = r.den[k] = 0.f;
        r.nan[k] = false;
    }
    const int n = n0 + n1;
    for (int s0 = 0; s0 < n; s0 += SC) {
        float m[IT][SC], l[IT][SC], a[IT][SC];
#pragma unroll
        for (int k = 0; k < IT; k++) {
#pragma unroll
            for (int u = 0; u < SC; u++) {
                const int s = s0 + u;
                const size_t h = (size_t)(s < n0 ? s : w0 + s - n0) * BH + hr[k];
                const bool ok = s < n && in[k];
                m[k][u] = ok ? __ldcg(&part_ml[h * 2]) : neg_inf();
                l[k][u] = ok ? __ldcg(&part_ml[h * 2 + 1]) : 0.f;
                a[k][u] = ok ? __ldcg(&part_acc[h * D + dd[k]]) : 0.f;
            }
        }
#pragma unroll
        for (int k = 0; k < IT; k++) {
            float cm = neg_inf();
#pragma unroll
            for (int u = 0; u < SC; u++) {
                if (m[k][u] != m[k][u]) r.nan[k] = true;
                else cm = fmaxf(cm, m[k][u]);
            }
            const float mn = fmaxf(r.M[k], cm);
            const float c = r.M[k] == neg_inf() ? 0.f : fast_exp(r.M[k] - mn);
            r.a0[k] *= c;
            r.a1[k] *= c;
            r.den[k] *= c;
#pragma unroll
            for (int u = 0; u < SC; u++) {
                const float w = m[k][u] == neg_inf() || m[k][u] != m[k][u] ? 0.f : fast_exp(m[k][u] - mn);
                if (s0 + u < n0) r.a0[k] += w * a[k][u];
                else r.a1[k] += w * a[k][u];
                r.den[k] += w * l[k][u];
            }
            r.M[k] = mn;
        }
    }
}

// merge_parts of one set, normalized: o[k] and its head's log-sum-exp lse[k] (−inf for none,
// NaN for a bad sequence), what a merge with attention over other rows needs.
template <int IT>
__device__ __forceinline__ void merge_splits(const float* __restrict__ part_acc,
                                             const float* __restrict__ part_ml, size_t BH, int D,
                                             int nsplit, const size_t* hr, const int* dd,
                                             const bool* in, float* o, float* lse) {
    MergeSums<IT> r;
    merge_parts<IT>(part_acc, part_ml, BH, D, nsplit, 0, 0, hr, dd, in, r);
#pragma unroll
    for (int k = 0; k < IT; k++) {
        const float nan = __int_as_float(0x7fc00000);
        o[k] = r.nan[k] ? nan : r.a0[k] / r.den[k];
        lse[k] = r.nan[k] ? nan : r.den[k] > 0.f ? r.M[k] + __logf(r.den[k]) : neg_inf();
    }
}

// Combines the block-wide kernels' splits: out[bh] = Σ e^(m_s - M) acc_s / Σ e^(m_s - M) l_s,
// written in the query's element type (merge_splits), and each head's log-sum-exp into `lse`
// when it is not null. One block per (sequence, head), up to 256 threads, at most two values of
// a row per thread (D ≤ 512).
template <typename T>
__device__ __forceinline__ void merge_impl(const float* __restrict__ part_acc,
                                           const float* __restrict__ part_ml, T* __restrict__ out,
                                           int nsplit, int BH, int D, float* __restrict__ lse) {
    const size_t bh = blockIdx.x;
    size_t hr[2] = {bh, bh};
    int dd[2];
    bool in[2];
    float o[2], l[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        dd[k] = threadIdx.x + k * blockDim.x;
        in[k] = dd[k] < D;
    }
    merge_splits<2>(part_acc, part_ml, (size_t)BH, D, nsplit, hr, dd, in, o, l);
    if (lse != nullptr && threadIdx.x == 0) lse[bh] = l[0];
#pragma unroll
    for (int k = 0; k < 2; k++)
        if (in[k]) out[bh * D + dd[k]] = from_f<T>(o[k]);
}
