// kvq: decode attention over the paged, optionally quantized KV pool (docs/ARCHITECTURE.md).
//
// Grid: x = (sequence, KV head), y = split of the visible positions (split-K, so long contexts
// fill the GPU), z = chunk of up to MAXG query heads of that KV head. 128 threads per block walk
// their split in tiles of 128 positions:
//   1. scores: one thread per position reads the whole K row of its KV head once and computes
//      the scores of all query heads of the chunk (q pre-scaled, in shared memory, broadcast);
//      quantized: per 32-code chunk, q·k = scale·(q·codes) + bias·Σq;
//   2. online softmax: one warp per head updates max / sum and turns scores into weights;
//   3. V: D/8 threads per row, each owning 8 values for all heads, accumulate p·v; quantized:
//      Σ (p·scale)·code + Σ p·bias. Codes are converted with the 2^23 float trick (no I2F).
// Each block writes (max, sum, weighted V) for its split; decode_merge combines the splits.
// A sequence with start >= len, len beyond its table or a block id outside the pool gets NaN.
#include "common.cuh"

#define NT 128
#define TILE 128
#define MAXG 8

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A code (< 2^23) as float: OR it into the mantissa of 2^23 and subtract 2^23.
__device__ __forceinline__ float code_f(uint32_t c) { return __int_as_float(c | 0x4B000000u) - 8388608.f; }

// Code k of a 32-code chunk held in B words.
template <int B> __device__ __forceinline__ float code_at(const uint32_t* w, int k) {
    const int bit = k * B, wi = bit >> 5, s = bit & 31;
    uint32_t c = w[wi] >> s;
    if (s + B > 32) c |= w[wi + 1] << (32 - s);
    return code_f(c & ((1u << B) - 1));
}

// 8 codes of B bits starting at byte p (8 codes = B bytes), in the low 8*B bits.
template <int B> __device__ __forceinline__ uint64_t load_codes8(const unsigned char* p) {
    if (B == 8) return *reinterpret_cast<const unsigned long long*>(p);
    if (B == 4) return *reinterpret_cast<const uint32_t*>(p);
    if (B == 2) return *reinterpret_cast<const unsigned short*>(p);
    uint64_t v = 0;
#pragma unroll
    for (int i = 0; i < B; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

// B == 0: dense rows kd / vd. Otherwise affine B-bit codes with per-group scales / biases.
// q: the queries in their own type QT, multiplied by `scale` as they are loaded.
template <typename T, int B, typename QT>
__device__ __forceinline__ void decode_impl(
    const QT* __restrict__ q, float scale, const T* __restrict__ kd, const T* __restrict__ vd,
    const uint32_t* __restrict__ kc, const T* __restrict__ ks, const T* __restrict__ kb,
    const uint32_t* __restrict__ vc, const T* __restrict__ vs, const T* __restrict__ vb,
    const uint32_t* __restrict__ tables, const uint32_t* __restrict__ starts,
    const uint32_t* __restrict__ lens, int max_blocks, int num_blocks, int block_size, int kvh,
    int G, int D, int group, int split_len, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const int tid = threadIdx.x;
    const int b = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, Bn = gridDim.x / kvh;
    const int j0 = blockIdx.z * MAXG, gn = min(MAXG, G - j0);
    const int H = kvh * G, nch = D / 32;

    extern __shared__ float smem[];
    float* q_s = smem;                       // [MAXG][D]
    float* qsum_s = q_s + MAXG * D;          // [MAXG][D/32]
    float* p_s = qsum_s + MAXG * nch;        // [MAXG][TILE]
    int* slot_s = reinterpret_cast<int*>(p_s + MAXG * TILE);  // [TILE]
    float* red_s = reinterpret_cast<float*>(slot_s + TILE);   // [MAXG][D]
    __shared__ float m_s[MAXG], l_s[MAXG], alpha_s[MAXG];
    __shared__ int bad_s;

    const uint32_t start = starts[b], len = lens[b];
    const bool bad = len == 0 || start >= len ||
                     (uint64_t)len > (uint64_t)max_blocks * (uint64_t)block_size;
    const long long p0 = (long long)start + (long long)split * split_len;
    const long long p1 = min((long long)len, p0 + split_len);

    const QT* qb = q + ((size_t)b * H + (size_t)kh * G + j0) * D;
    for (int i = tid; i < gn * D; i += NT) q_s[i] = to_f(qb[i]) * scale;
    if (tid < MAXG) { m_s[tid] = neg_inf(); l_s[tid] = 0.f; }
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
    const size_t row_words = (size_t)kvh * D * B / 32, head_words = (size_t)D * B / 32;
    const size_t row_groups = (size_t)kvh * (D / group), head_groups = D / group;
    float acc[MAXG][8], accb[MAXG];
#pragma unroll
    for (int j = 0; j < MAXG; j++) {
        accb[j] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = 0.f;
    }
    __syncthreads();

    if (!bad) {
        for (long long t0 = p0; t0 < p1; t0 += TILE) {
            const int n = (int)min((long long)TILE, p1 - t0);
            // 1. scores, one position per thread.
            if (tid < n) {
                const long long p = t0 + tid;
                const uint32_t blk = tables[(size_t)b * max_blocks + p / block_size];
                size_t slot = 0;
                if (blk >= (uint32_t)num_blocks) bad_s = 1;
                else slot = (size_t)blk * block_size + p % block_size;
                slot_s[tid] = (int)slot;
                float s[MAXG];
#pragma unroll
                for (int j = 0; j < MAXG; j++) s[j] = 0.f;
                if (B == 0) {
                    const T* row = kd + slot * kvh * D + (size_t)kh * D;
                    for (int c = 0; c < D; c += 8) {
                        float v[8];
                        load8(row + c, v);
#pragma unroll
                        for (int j = 0; j < MAXG; j++) {
                            if (j < gn) {
                                // q is the same for every thread: broadcast 16-byte loads.
                                const float4* qj = reinterpret_cast<const float4*>(q_s + j * D + c);
                                const float4 a = qj[0], e = qj[1];
                                s[j] += a.x * v[0] + a.y * v[1] + a.z * v[2] + a.w * v[3] +
                                        e.x * v[4] + e.y * v[5] + e.z * v[6] + e.w * v[7];
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
                        float d[MAXG];
#pragma unroll
                        for (int j = 0; j < MAXG; j++) d[j] = 0.f;
#pragma unroll
                        for (int k = 0; k < 32; k += 4) {
                            const float c0 = code_at<B>(w, k), c1 = code_at<B>(w, k + 1);
                            const float c2 = code_at<B>(w, k + 2), c3 = code_at<B>(w, k + 3);
#pragma unroll
                            for (int j = 0; j < MAXG; j++) {
                                if (j < gn) {
                                    const float4 a = *reinterpret_cast<const float4*>(q_s + j * D + c * 32 + k);
                                    d[j] += a.x * c0 + a.y * c1 + a.z * c2 + a.w * c3;
                                }
                            }
                        }
#pragma unroll
                        for (int j = 0; j < MAXG; j++)
                            if (j < gn) s[j] += sc * d[j] + bi * qsum_s[j * nch + c];
                    }
                }
#pragma unroll
                for (int j = 0; j < MAXG; j++)
                    if (j < gn) p_s[j * TILE + tid] = s[j];
            }
            __syncthreads();
            // 2. online softmax, one warp per head.
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
            __syncthreads();
            // 3. V, D/8 threads per row.
            if (rg < nrg) {
#pragma unroll
                for (int j = 0; j < MAXG; j++) {
                    if (j < gn) {
                        const float a = alpha_s[j];
                        accb[j] *= a;
#pragma unroll
                        for (int k = 0; k < 8; k++) acc[j][k] *= a;
                    }
                }
                for (int t = rg; t < n; t += nrg) {
                    const size_t slot = (size_t)slot_s[t];
                    if (B == 0) {
                        float v[8];
                        load8(vd + slot * kvh * D + (size_t)kh * D + c8 * 8, v);
#pragma unroll
                        for (int j = 0; j < MAXG; j++) {
                            if (j < gn) {
                                const float pj = p_s[j * TILE + t];
#pragma unroll
                                for (int k = 0; k < 8; k++) acc[j][k] += pj * v[k];
                            }
                        }
                    } else {
                        const unsigned char* row = reinterpret_cast<const unsigned char*>(
                            vc + slot * row_words + kh * head_words);
                        const uint64_t win = load_codes8<B>(row + c8 * B);
                        const size_t gidx = slot * row_groups + kh * head_groups + (c8 * 8) / group;
                        const float sc = to_f(vs[gidx]), bi = to_f(vb[gidx]);
                        float cf[8];
#pragma unroll
                        for (int k = 0; k < 8; k++) cf[k] = code_f((uint32_t)(win >> (k * B)) & ((1u << B) - 1));
#pragma unroll
                        for (int j = 0; j < MAXG; j++) {
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
            __syncthreads();
        }
    }
    // Sum the row groups' accumulators.
    for (int r = 0; r < nrg; r++) {
        if (rg == r) {
#pragma unroll
            for (int j = 0; j < MAXG; j++) {
                if (j < gn) {
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        float* dst = red_s + j * D + c8 * 8 + k;
                        *dst = (r == 0 ? 0.f : *dst) + acc[j][k] + accb[j];
                    }
                }
            }
        }
        __syncthreads();
    }
    const bool failed = bad_s != 0;
    const float nan = __int_as_float(0x7fc00000);
    const size_t base = ((size_t)split * Bn + b) * H + (size_t)kh * G + j0;
    for (int i = tid; i < gn * D; i += NT) part_acc[base * D + i] = failed ? nan : red_s[i];
    if (tid < gn) {
        part_ml[(base + tid) * 2] = failed ? nan : m_s[tid];
        part_ml[(base + tid) * 2 + 1] = failed ? nan : l_s[tid];
    }
}

// The rotated scheme (src/kv/rotation.rs): x·R with R = diag(s)·H/√D is a fast
// Walsh-Hadamard transform of s ⊙ x; its inverse is s ⊙ (H·x)/√D. `rows` vectors of D floats in
// shared memory, transformed in place by the whole block (ends with a barrier).
__device__ __forceinline__ float inv_sqrt_d(int D) { return (float)(1.0 / sqrt((double)D)); }

template <int D>
__device__ __forceinline__ void fwht(float* x, int rows, int tid, int nt) {
    for (int h = 1; h < D; h <<= 1) {
        for (int i = tid; i < rows * D / 2; i += nt) {
            const int j = i / (D / 2), r = i % (D / 2);
            const int a = j * D + (r / h) * 2 * h + (r % h), c = a + h;
            const float u = x[a], v = x[c];
            x[a] = u + v;
            x[c] = u - v;
        }
        __syncthreads();
    }
}

template <int D, int ROWS>
__device__ __forceinline__ void rotate_rows(float* x, const float* __restrict__ signs, int tid, int nt) {
    for (int i = tid; i < ROWS * D; i += nt) x[i] *= signs[i % D];
    __syncthreads();
    fwht<D>(x, ROWS, tid, nt);
    const float nrm = inv_sqrt_d(D);
    for (int i = tid; i < ROWS * D; i += nt) x[i] *= nrm;
    __syncthreads();
}

// Warp-independent kernel for quantized pools, head_dim D in {64, 128} (decode_q_* and, with
// tensor-core scores, decode_qm_*): each of the 4 warps walks its own tiles of 32 positions
// with its own online softmax, and only the end of the block combines them (the block-wide
// kernel above syncs its 128 threads three times per tile, so one tile's loads at most are in
// flight per block).
//   1. scores for QG = 4 query heads (grid z picks which; absent heads get q = 0 and are not
//      written), either
//      - SIMT (GS = 0, any width): one lane per position loads its K row and computes q·k̂ with
//        q in shared memory (broadcast reads), or
//      - tensor cores (GS = group size, 4- and 8-bit): S = Q·Kᵀ per group with
//        mma.m16n8k16 (rows = heads, columns = 8 positions, k = 16 dims). Codes are exact in
//        f16; q is split into two f16 terms (hi + lo, ~22 bits) so the products keep f32
//        accuracy; the group's scale and bias are applied to its partial dot products;
//   2. online softmax in registers;
//   3. V: D/8 lanes per position, 32·8/D positions per step; a lane takes the weights and the
//      slot of its position by shuffle and accumulates 8 values for every head.
// Bound by instruction issue and memory latency more than bandwidth, hence also:
//   - SIMT codes are read as x = 1 + c·2^-B, built from their bits by a shift and a logic op
//     (no int → float conversion): Σ q·(s·c + b) = s'·Σ q·x + (b − s')·Σ q with s' = s·2^B,
//     and likewise for V;
//   - each lane looks up its position's block two tiles ahead; the SIMT kernels ask L2 for the
//     next tile's rows while they work on this one, the tensor-core kernels copy the next tile
//     (codes, scales, biases) into shared memory with cp.async (two stages per warp), so their
//     loads are short and off the critical path (K fragments by ldmatrix);
//   - V loads are unconditional (a masked position reads zeros or slot 0 with weight 0), so
//     they can all be issued before the first multiply-add.
// q is read in the cache's element type and scaled here.
#define QG 4
#define QW 4

// Code k (B bits, k·B < 64) of the little-endian bit stream w[0], w[1], ... as 1 + c·2^-B: the
// code is moved to the top of the f32 mantissa and ORed into the bits of 1.0 (one LOP3 with
// both constants in registers).
template <int B> __device__ __forceinline__ float frac_at(const uint32_t* w, int k) {
    const int bit = k * B, wi = bit >> 5, s = bit & 31;
    constexpr int top = 23 - B;  // where the code's lowest bit must land
    uint32_t v;
    if (s + B > 32) {
        const uint32_t c = (w[wi] >> s) | (w[wi + 1] << (32 - s));
        v = c << top;
    } else if (s <= top) {
        v = w[wi] << (top - s);
    } else {
        v = w[wi] >> (s - top);
    }
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "r"(((1u << B) - 1) << top), "r"(0x3F800000u));
    return __int_as_float(r);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for the 32-byte sectors of the first and the last byte of `bytes` bytes from p: the
// whole span for rows of up to 64 bytes (4-bit and narrower at head_dim 128); for wider rows the
// middle sectors are left to the demand loads.
__device__ __forceinline__ void prefetch_span(const void* p, int bytes) {
    const char* c = reinterpret_cast<const char*>(p);
    prefetch_l2(c);
    if (((reinterpret_cast<uintptr_t>(c) & 31) + bytes) > 32) prefetch_l2(c + bytes - 1);
}

// Asynchronous global → shared copies (cp.async, sm_80+): a warp stages its next tile while it
// computes on the current one. `ok` false copies nothing and zero-fills (positions past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
template <int N> __device__ __forceinline__ void cp_async_small(void* dst, const void* src, bool ok) {
    static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(N), "r"(ok ? N : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Byte offset of byte `by` of row r (of 32) in a staged tile of HB-byte rows, swizzled in 16-byte
// chunks so that both readers are free of bank conflicts:
//   - ldmatrix (K codes): one chunk of 8 consecutive rows lands in 8 different 16-byte bank slots;
//   - the V reads (rows r0, r0+2, r0+4, r0+6 at once, each lane a slice of one) spread over both
//     halves (64-byte rows) or all quarters (32-byte rows) of the banks.
template <int HB> __device__ __forceinline__ int stage_off(int r, int by) {
    const int c = by >> 4, in = by & 15;
    if (HB == 128) return r * 128 + ((c ^ (r & 7)) << 4) + in;
    if (HB == 64) {
        const int half = (r ^ (r >> 1)) & 1, x = (r >> 1) & 3;
        return (r >> 1) * 128 + half * 64 + ((c ^ x) << 4) + in;
    }
    // HB == 32: rows r, r+2, r+4, r+6 fill one 128-byte line (quarter (r >> 1) & 3).
    const int line = ((r >> 3) << 1) | (r & 1), qt = (r >> 1) & 3;
    return line * 128 + qt * 32 + ((c ^ (r & 1)) << 4) + in;
}

// Lane L of the warp gets word (L & 3) of each 16-byte chunk of row row0 + (L >> 2) (the
// layout of an mma B fragment): ldmatrix over CPR chunks of 8 rows.
template <int HB> __device__ __forceinline__ void ldsm_rows(const unsigned char* base, int row0, int lane,
                                                            uint32_t* w) {
    constexpr int CPR = HB / 16;
    if (CPR == 2) {
        const unsigned a = (unsigned)__cvta_generic_to_shared(base + stage_off<HB>(row0 + (lane & 7), ((lane >> 3) & 1) << 4));
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                     : "=r"(w[0]), "=r"(w[1]) : "r"(a) : "memory");
    } else {
#pragma unroll
        for (int i = 0; i < CPR / 4; i++) {
            const int c = 4 * i + (lane >> 3);
            const unsigned a = (unsigned)__cvta_generic_to_shared(base + stage_off<HB>(row0 + (lane & 7), c << 4));
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(w[4 * i]), "=r"(w[4 * i + 1]), "=r"(w[4 * i + 2]), "=r"(w[4 * i + 3])
                         : "r"(a) : "memory");
        }
    }
}

// D = A·B + D for one m16n8k16 tile, f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// NG consecutive values of T as f32 (one aligned vector load where the size allows).
template <typename T, int NG> __device__ __forceinline__ void load_groups(const T* p, float* out) {
    if (sizeof(T) * NG == 4) {
        const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
        const T* h = reinterpret_cast<const T*>(&x);
#pragma unroll
        for (int i = 0; i < NG; i++) out[i] = to_f(h[i]);
    } else if (sizeof(T) * NG == 8) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        const T* h = reinterpret_cast<const T*>(&x);
#pragma unroll
        for (int i = 0; i < NG; i++) out[i] = to_f(h[i]);
    } else if (sizeof(T) * NG == 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        const T* h = reinterpret_cast<const T*>(&x);
#pragma unroll
        for (int i = 0; i < NG; i++) out[i] = to_f(h[i]);
    } else {
#pragma unroll
        for (int i = 0; i < NG; i++) out[i] = to_f(p[i]);
    }
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// The B fragment (two f16 pairs) of one k-step from the lane's code word x: B = 4: the 2 bytes
// at byte `byte` of x (4 codes: low/high nibble of each); B = 8: the 4 bytes of x. Dims d0..d3
// of the k-step map to k = (2t, 2t+8, 2t+1, 2t+9): b0 = (c(d0), c(d2)), b1 = (c(d1), c(d3)).
// Codes are exact in f16: 1024 + c built from bits, then 1024 subtracted.
template <int B> __device__ __forceinline__ void code_frag(uint32_t x, int byte, uint32_t& b0, uint32_t& b1) {
    const uint32_t magic = 0x64646464u;
    const __half2 k1024 = __floats2half2_rn(-1024.f, -1024.f);
    uint32_t r0, r1;
    if (B == 4) {
        const uint32_t sel = (uint32_t)byte | 0x40u | ((uint32_t)(byte + 1) << 8) | 0x4000u;
        r0 = __byte_perm(x, magic, sel) & 0xFF0FFF0Fu;
        r1 = __byte_perm(x >> 4, magic, sel) & 0xFF0FFF0Fu;
    } else {
        r0 = __byte_perm(x, magic, 0x4240);
        r1 = __byte_perm(x, magic, 0x4341);
    }
    const __half2 h0 = __hadd2(*reinterpret_cast<const __half2*>(&r0), k1024);
    const __half2 h1 = __hadd2(*reinterpret_cast<const __half2*>(&r1), k1024);
    b0 = *reinterpret_cast<const uint32_t*>(&h0);
    b1 = *reinterpret_cast<const uint32_t*>(&h1);
}

// e^x by the SFU's 2^x, flushing results below f32's normal range to 0 (softmax weights that
// small do not count): no range fix-up around the approximation.
__device__ __forceinline__ float fast_exp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

// Merges the position splits of IT outputs: output k is value dd[k] of head row hr[k], whose
// splits sit at rows s·BH + hr[k] of part_ml ([.., 2]: max, sum) and part_acc ([.., D]).
// Splits are read SC at a time for all IT outputs at once (one round trip to L2 per SC splits:
// the merge is latency-bound) and combined online. Empty splits (m = -inf) count for nothing;
// NaN (a bad sequence) propagates. Outputs with in[k] false read nothing.
template <int IT>
__device__ __forceinline__ void merge_splits(const float* __restrict__ part_acc,
                                             const float* __restrict__ part_ml, size_t BH, int D,
                                             int nsplit, const size_t* hr, const int* dd,
                                             const bool* in, float* o) {
    constexpr int SC = 4;
    float M[IT], num[IT], den[IT];
    bool any_nan[IT];
#pragma unroll
    for (int k = 0; k < IT; k++) {
        M[k] = neg_inf();
        num[k] = den[k] = 0.f;
        any_nan[k] = false;
    }
    for (int s0 = 0; s0 < nsplit; s0 += SC) {
        float m[IT][SC], l[IT][SC], a[IT][SC];
#pragma unroll
        for (int k = 0; k < IT; k++) {
#pragma unroll
            for (int u = 0; u < SC; u++) {
                const size_t h = (size_t)(s0 + u) * BH + hr[k];
                const bool ok = s0 + u < nsplit && in[k];
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
                if (m[k][u] != m[k][u]) any_nan[k] = true;
                else cm = fmaxf(cm, m[k][u]);
            }
            const float mn = fmaxf(M[k], cm);
            const float r = M[k] == neg_inf() ? 0.f : fast_exp(M[k] - mn);
            num[k] *= r;
            den[k] *= r;
#pragma unroll
            for (int u = 0; u < SC; u++) {
                const float w = m[k][u] == neg_inf() || m[k][u] != m[k][u] ? 0.f : fast_exp(m[k][u] - mn);
                num[k] += w * a[k][u];
                den[k] += w * l[k][u];
            }
            M[k] = mn;
        }
    }
#pragma unroll
    for (int k = 0; k < IT; k++) o[k] = any_nan[k] ? __int_as_float(0x7fc00000) : num[k] / den[k];
}

template <typename T, int B, int D, int GS>
__device__ __forceinline__ void qdecode_impl(
    const T* __restrict__ q, float scale, const uint32_t* __restrict__ kc, const T* __restrict__ ks,
    const T* __restrict__ kb, const uint32_t* __restrict__ vc, const T* __restrict__ vs,
    const T* __restrict__ vb, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ starts, const uint32_t* __restrict__ lens, int max_blocks,
    int num_blocks, int block_size, int kvh, int G, int group, int split_len,
    float* __restrict__ part_acc, float* __restrict__ part_ml, const float* __restrict__ signs,
    int rotated, T* __restrict__ out, unsigned* __restrict__ counters, int nsplit) {
    constexpr bool MMA = GS > 0;
    constexpr int HB = D * B / 8;                 // code bytes of one head in one row
    constexpr int VEC = (HB % 16 == 0) ? 16 : 8;  // SIMT K load width
    constexpr int NCH = D / 32;                   // 32-code chunks (B words each)
    constexpr int LPR = D / 8;                    // V lanes per position
    constexpr int RPS = 32 / LPR;                 // V positions per step
    constexpr float TWO_B = (float)(1u << B);
    // Tensor-core scores: groups per head, k-steps per group and in all, code words per lane
    // and position (a lane holds a quarter of each group of the row: GS·B/32 bytes).
    constexpr int NG = MMA ? D / GS : 1;
    constexpr int KS = MMA ? GS / 16 : 1;
    constexpr int KST = D / 16;
    constexpr int QWB = MMA ? GS * B / 32 : 4;   // bytes of a lane's quarter of a group
    constexpr int WPL = MMA ? NG * QWB / 4 : 1;  // words per lane and position
    // Tensor-core V (groups of 64 or 128: at most two per head): C[dim][col] += codes · P' with
    // 8 columns = (group, head) and P' = weight · that group's scale, so each group's scales
    // enter through its own columns; a dim keeps the column of its own group. A lane reads
    // bytes [gq·BPL, (gq+1)·BPL) of its positions' rows: dims [gq·D/8, (gq+1)·D/8).
    constexpr bool VMMA = MMA && NG <= 2;
    constexpr int MT = D / 16;      // m-tiles of 16 dims
    constexpr int BPL = HB / 8;     // bytes per lane and position
    constexpr int VW = (BPL + 3) / 4;
    // Staging (tensor-core kernels): each warp has two tiles of 32 rows in dynamic shared memory,
    // [K codes | V codes | K scales | K biases | V scales | V biases], and copies the next tile
    // with cp.async while it computes on this one. Scale rows of 2 bytes (one group, 16-bit
    // type; cp.async needs 4) go through registers instead.
    constexpr int CPR = HB / 16;                          // 16-byte chunks per code row
    constexpr int CPG = MMA ? GS * B / 128 : 1;           // chunks per group
    constexpr int CPW = 32 / B;                           // codes per 32-bit word
    constexpr int SB = NG * (int)sizeof(T);               // bytes of a row's scales (or biases)
    constexpr int STG = 32 * (2 * HB + 4 * SB);           // bytes of one staged tile
    constexpr bool SREG = SB < 4;
    const unsigned FULL = 0xffffffffu;
    if (MMA) group = GS;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;  // mma fragment coordinates
    const int b = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, Bn = gridDim.x / kvh;
    const int j0 = blockIdx.z * QG, gn = min(QG, G - j0);
    const int H = kvh * G;

    // q and the warps' V totals: static for the SIMT kernels; the tensor-core kernels keep them
    // in their staging memory (q before the first tile, each warp's totals in its own stages
    // after its last).
    __shared__ __align__(16) float q_st[MMA ? 1 : QG * D];
    __shared__ __align__(16) float wacc_st[MMA ? 1 : QW * QG * D];
    extern __shared__ __align__(16) unsigned char stage_s[];
    float(*q_s)[D] = reinterpret_cast<float(*)[D]>(MMA ? reinterpret_cast<float*>(stage_s) : q_st);
    auto wacc = [&](int w) -> float(*)[D] {
        return reinterpret_cast<float(*)[D]>(MMA ? reinterpret_cast<float*>(stage_s + w * 2 * STG)
                                                 : wacc_st + w * QG * D);
    };
    static_assert(!MMA || 2 * STG >= QG * D * 4, "a warp's stages hold its V totals");
    __shared__ float qsum_s[QG][NCH];
    __shared__ float wm_s[QW][QG], wl_s[QW][QG];
    __shared__ __align__(16) uint32_t qa_s[MMA ? KST : 1][32][4];  // q fragments: a0/a2, hi/lo
    __shared__ unsigned qmax_s;
    __shared__ int bad_s;

    const uint32_t start = starts[b], len = lens[b];
    const bool bad_seq = len == 0 || start >= len ||
                         (uint64_t)len > (uint64_t)max_blocks * (uint64_t)block_size;
    const uint32_t p0 = start + (uint32_t)split * (uint32_t)split_len;
    const uint32_t p1 = (uint32_t)min((long long)len, (long long)p0 + split_len);

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
    // into hi + lo, laid out as each lane's A fragment per k-step (rows ≥ QG are zero).
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
        for (int i = tid; i < KST * 32; i += blockDim.x) {
            const int s = i / 32, l = i % 32, g = l >> 2, t = l & 3;
            // Lane t's j-th code word of a group is word t + 4j of the group (ldmatrix layout);
            // k-step s uses codes 4·(s % KS).. of the lane's words of group s / KS.
            const int u = 4 * (s % KS);
            const int d0 = (s / KS) * GS + CPW * (t + 4 * (u / CPW)) + u % CPW;
            float v[4], hi[4], lo[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[j] = g < QG ? q_s[g < QG ? g : 0][d0 + j] * inv : 0.f;
                hi[j] = __half2float(__float2half_rn(v[j]));
                lo[j] = v[j] - hi[j];
            }
            qa_s[s][l][0] = pack_half2(hi[0], hi[2]);
            qa_s[s][l][1] = pack_half2(hi[1], hi[3]);
            qa_s[s][l][2] = pack_half2(lo[0], lo[2]);
            qa_s[s][l][3] = pack_half2(lo[1], lo[3]);
        }
    }
    __syncthreads();

    // A (slot, KV head) pair is a head row: hrow = slot·kvh + kh (32-bit; the host checks the
    // pool's size), its codes at hrow·HB bytes, its scales and biases at hrow·hg.
    const unsigned char* kcb = reinterpret_cast<const unsigned char*>(kc);
    const unsigned char* vcb = reinterpret_cast<const unsigned char*>(vc);
    const uint32_t hg = (uint32_t)(D / group), nkv = (uint32_t)kvh;
    const int c8 = lane % LPR, rsub = lane / LPR;
    const uint32_t* tab = tables + (size_t)b * max_blocks;
    const uint32_t bs = (uint32_t)block_size, nblk = (uint32_t)num_blocks;
    // A position's block (or an invalid id past the split's end).
    auto block_of = [&](uint32_t p) -> uint32_t { return p < p1 ? tab[p / bs] : 0xffffffffu; };
    // qsum per group (tensor-core path), for the bias term.
    float qsg[NG];
    if (MMA) {
#pragma unroll
        for (int gi = 0; gi < NG; gi++) {
            float s = 0.f;
            for (int c = gi * GS / 32; c < (gi + 1) * GS / 32; c++) s += qsum_s[gq < QG ? gq : 0][c];
            qsg[gi] = s;
        }
    }

    float m_w[QG], l_w[QG], acc[VMMA ? 1 : QG][8], accb[VMMA ? 1 : QG];
    float cv[VMMA ? MT : 1][4], accb_c = 0.f;  // tensor-core V: C tiles, bias of column gq
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
    bool bad_row = false;

    if (!bad_seq) {
        uint32_t t0 = p0 + (uint32_t)warp * 32;
        const uint32_t stride = QW * 32;
        // Position p's head row, if it is inside the split and its block is in the pool.
        auto locate = [&](uint32_t p, uint32_t blk, uint32_t& hr) -> bool {
            if (p >= p1) return false;
            if (blk >= nblk) {
                bad_row = true;
                return false;
            }
            hr = (blk * bs + p % bs) * nkv + kh;
            return true;
        };
        // Staging: one tile's rows (this lane's position: hr, ok) into stage `buf`; zero-size
        // copies for positions outside the split. Codes: CPR lanes per row, 16 bytes each;
        // scales: one lane per row (into sreg when SREG, stored once the tile is due).
        unsigned short sreg[4] = {0, 0, 0, 0};
        auto stage = [&](int buf, uint32_t hr, bool ok) {
            unsigned char* st = stage_s + (warp * 2 + buf) * STG;
#pragma unroll
            for (int i = 0; i < CPR; i++) {
                const int idx = i * 32 + lane, r = idx / CPR, c = idx % CPR;
                const uint32_t h = __shfl_sync(FULL, hr, r);
                const bool o = __shfl_sync(FULL, ok, r);
                cp_async16(st + stage_off<HB>(r, c * 16), kcb + (size_t)h * HB + c * 16, o);
                cp_async16(st + 32 * HB + stage_off<HB>(r, c * 16), vcb + (size_t)h * HB + c * 16, o);
            }
            const T* src[4] = {ks, kb, vs, vb};
#pragma unroll
            for (int a = 0; a < 4; a++) {
                if constexpr (SREG) {
                    sreg[a] = ok ? reinterpret_cast<const unsigned short*>(src[a])[hr] : 0;
                } else {
                    cp_async_small<(SREG ? 4 : SB)>(st + 64 * HB + (a * 32 + lane) * SB,
                                                    src[a] + (size_t)hr * NG, ok);
                }
            }
            cp_async_commit();
        };
        uint32_t blk1 = block_of(t0 + stride + lane);
        uint32_t hrow = 0;
        bool valid = locate(t0 + lane, block_of(t0 + lane), hrow);
        int buf = 0;
        if constexpr (MMA) stage(0, hrow, valid);
        for (; t0 < p1; t0 += stride) {
            const uint32_t p = t0 + lane;
            // The next tile: located now (its block ids were read a tile ago), staged (tensor
            // cores) or asked into L2 (SIMT); the block ids of the one after.
            uint32_t hrow_n = 0;
            const bool valid_n = locate(p + stride, blk1, hrow_n);
            blk1 = block_of(p + 2 * stride);
            const unsigned char* st = stage_s + (warp * 2 + buf) * STG;
            unsigned vmask = 0;
            if constexpr (MMA) {
                if constexpr (SREG) {
                    unsigned short* d = reinterpret_cast<unsigned short*>(const_cast<unsigned char*>(st) + 64 * HB);
#pragma unroll
                    for (int a = 0; a < 4; a++) d[a * 32 + lane] = sreg[a];
                }
                if (t0 + stride < p1) stage(buf ^ 1, hrow_n, valid_n);
                else cp_async_commit();
                cp_async_wait<1>();
                __syncwarp();
                vmask = __ballot_sync(FULL, valid);
            } else if (valid_n) {
                prefetch_span(kcb + (size_t)hrow_n * HB, HB);
                prefetch_span(vcb + (size_t)hrow_n * HB, HB);
                const int gb = (int)(hg * sizeof(T));
                prefetch_span(ks + (size_t)hrow_n * hg, gb);
                prefetch_span(kb + (size_t)hrow_n * hg, gb);
                prefetch_span(vs + (size_t)hrow_n * hg, gb);
                prefetch_span(vb + (size_t)hrow_n * hg, gb);
            }
            const unsigned char* sK = st;
            const unsigned char* sV = st + 32 * HB;
            const T* sKS = reinterpret_cast<const T*>(st + 64 * HB);
            const T* sKB = sKS + 32 * NG;
            const T* sVS = sKB + 32 * NG;
            const T* sVB = sVS + 32 * NG;
            const uint32_t vrow = valid ? hrow : 0xffffffffu;
            // SIMT: pj[j] = weight of this lane's position for head j. Tensor cores: pm[ν][e] =
            // weight of position 8ν + 2·tq + e for head gq (lanes gq < QG).
            float pj[QG], pm[4][2];
            if constexpr (!MMA) {
                // 1. scores.
                float s[QG];
#pragma unroll
                for (int j = 0; j < QG; j++) s[j] = neg_inf();
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
                // 2. online softmax; lane 0's position is always inside the split, so the tile
                // maximum is finite unless that row is bad (then the output is NaN anyway).
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
            } else {
                // 1. scores S = Q·Kᵀ by tensor cores, n-tile ν = positions 8ν..8ν+7 of the tile,
                // from the staged tile: a lane's words of position 8ν + gq's row by ldmatrix.
                static_assert(WPL == CPR, "a lane holds one word of each chunk of its row");
                uint32_t w[WPL];
                float sv[4][2];
#pragma unroll
                for (int nu = 0; nu < 4; nu++) {
                    // Scales and biases of the two positions of this lane's C fragment.
                    float sc[2][NG], bi[2][NG];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int r = 8 * nu + 2 * tq + e;
                        load_groups<T, NG>(sKS + r * NG, sc[e]);
                        load_groups<T, NG>(sKB + r * NG, bi[e]);
                    }
                    ldsm_rows<HB>(sK, 8 * nu, lane, w);
                    const uint32_t* wn = w;
                    float c[NG][4];
#pragma unroll
                    for (int gi = 0; gi < NG; gi++)
#pragma unroll
                        for (int i = 0; i < 4; i++) c[gi][i] = 0.f;
#pragma unroll
                    for (int s = 0; s < KST; s++) {
                        const int gi = s / KS, sp = s % KS;
                        const uint4 a = *reinterpret_cast<const uint4*>(qa_s[s][lane]);
                        uint32_t b0, b1;
                        if (B == 4) code_frag<4>(wn[gi * QWB / 4 + sp / 2], 2 * (sp % 2), b0, b1);
                        else code_frag<8>(wn[gi * QWB / 4 + sp], 0, b0, b1);
                        mma16816(c[gi], a.x, 0u, a.y, 0u, b0, b1);
                        mma16816(c[gi], a.z, 0u, a.w, 0u, b0, b1);
                    }
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float acc_s = 0.f;
#pragma unroll
                        for (int gi = 0; gi < NG; gi++) acc_s += sc[e][gi] * qexp * c[gi][e] + bi[e][gi] * qsg[gi];
                        sv[nu][e] = (vmask >> (8 * nu + 2 * tq + e)) & 1 ? acc_s : neg_inf();
                    }
                }
                // 2. online softmax: head gq's 32 scores sit in lanes 4gq..4gq+3.
                float mx = neg_inf();
#pragma unroll
                for (int nu = 0; nu < 4; nu++) mx = fmaxf(mx, fmaxf(sv[nu][0], sv[nu][1]));
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
                const float m_old = m_w[0];
                const float m_new = fmaxf(m_old, mx);
                const float alpha = m_new == neg_inf() ? 1.f : fast_exp(m_old - m_new);
                float ls = 0.f;
#pragma unroll
                for (int nu = 0; nu < 4; nu++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        pm[nu][e] = sv[nu][e] == neg_inf() ? 0.f : fast_exp(sv[nu][e] - m_new);
                        ls += pm[nu][e];
                    }
                // This lane's own head state lives in m_w[0] / l_w[0]; the V accumulators of
                // every head are rescaled by that head's alpha.
                m_w[0] = m_new;
                l_w[0] = l_w[0] * alpha + ls;
                if constexpr (VMMA) {
                    // Columns 2tq, 2tq+1 are heads (2tq)%4 and (2tq)%4 + 1; column gq is
                    // head gq%4.
                    const int h0 = (2 * tq) % 4;
                    const float a0 = __shfl_sync(FULL, alpha, 4 * h0);
                    const float a1 = __shfl_sync(FULL, alpha, 4 * (h0 + 1));
                    accb_c *= __shfl_sync(FULL, alpha, 4 * (gq % 4));
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
                        const float a = __shfl_sync(FULL, alpha, 4 * j);
                        accb[j] *= a;
#pragma unroll
                        for (int k = 0; k < 8; k++) acc[j][k] *= a;
                    }
                }
            }
            // 3. V. A masked position has weight 0, and its scale and bias are taken as 0 (its
            // staged bytes are zeros, the SIMT kernels read slot 0), so nothing non-finite enters.
            if constexpr (VMMA) {
                // Two k-tiles of 16 positions: this lane's positions 2tq, 2tq+1, 2tq+8, 2tq+9
                // of each (weights from lanes 4·(gq%4) + tq, the C layout of the scores).
                const uint32_t cmask = 0x000F000Fu * (B == 4) + 0x00FF00FFu * (B == 8);
                const uint32_t magic = 0x64006400u;
                const __half2 k1024 = __floats2half2_rn(-1024.f, -1024.f);
                const int gam = gq / 4;  // this lane's column's group
                const bool col_ok = gam < NG;
#pragma unroll
                for (int kt = 0; kt < 2; kt++) {
                    const int src = 4 * (gq % 4) + tq;
                    float pw[4];
                    pw[0] = __shfl_sync(FULL, pm[2 * kt][0], src);
                    pw[1] = __shfl_sync(FULL, pm[2 * kt][1], src);
                    pw[2] = __shfl_sync(FULL, pm[2 * kt + 1][0], src);
                    pw[3] = __shfl_sync(FULL, pm[2 * kt + 1][1], src);
                    uint32_t x[4][VW];
                    float pp[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const int r = 16 * kt + 2 * tq + (k & 1) + 8 * (k >> 1);
                        const bool ok = (vmask >> r) & 1;
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
                        const int at = r * NG + (col_ok ? gam : 0);
                        const float sc = ok && col_ok ? to_f(sVS[at]) : 0.f;
                        const float bi = ok && col_ok ? to_f(sVB[at]) : 0.f;
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
                            s01 = r01 >> 4;
                            s23 = r23 >> 4;
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
                            uint32_t h;
                            asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(raw[k]), "r"(cmask), "r"(magic));
                            const __half2 c = __hadd2(*reinterpret_cast<const __half2*>(&h), k1024);
                            a[k] = *reinterpret_cast<const uint32_t*>(&c);
                        }
                        mma16816(cv[i], a[0], a[1], a[2], a[3], bh0, bh1);
                        mma16816(cv[i], a[0], a[1], a[2], a[3], bl0, bl1);
                    }
                }
            } else {
#pragma unroll
                for (int st = 0; st < 32 / RPS; st++) {
                    int r;
                    float pr[QG];
                    if constexpr (!MMA) {
                        r = st * RPS + rsub;
#pragma unroll
                        for (int j = 0; j < QG; j++) pr[j] = __shfl_sync(FULL, pj[j], r);
                    } else {
                        // Positions 8ν + e + 2t whose weights sit in the same register of lanes
                        // 4j + t: t = t1 + (4 / RPS)·rsub.
                        constexpr int TS = 4 / RPS;
                        const int t1 = st % TS, e = (st / TS) % 2, nu = st / (2 * TS);
                        const int t = t1 + TS * rsub;
                        r = 8 * nu + e + 2 * t;
#pragma unroll
                        for (int j = 0; j < QG; j++) pr[j] = __shfl_sync(FULL, pm[nu][e], 4 * j + t);
                    }
                    bool ok;
                    uint64_t win;
                    float sc, bi;
                    if constexpr (MMA) {  // from the staged tile
                        ok = (vmask >> r) & 1;
                        win = load_codes8<B>(sV + stage_off<HB>(r, c8 * B));
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
            if constexpr (MMA) {
                __syncwarp();  // this stage is read; the next iteration stages into it
                buf ^= 1;
            }
            hrow = hrow_n;
            valid = valid_n;
        }
        if constexpr (MMA) cp_async_wait<0>();  // nothing lands after the stages turn into wacc
    }
    // The warp's totals: l over the lanes holding a head's weights, V over the lanes that share
    // a column slice.
    if (MMA) {
        // Lane 4j + t holds head j's running max (the same in its 4 lanes) and a partial sum.
        l_w[0] += __shfl_xor_sync(FULL, l_w[0], 1);
        l_w[0] += __shfl_xor_sync(FULL, l_w[0], 2);
#pragma unroll
        for (int j = 0; j < QG; j++) {
            const float mj = __shfl_sync(FULL, m_w[0], 4 * j), lj = __shfl_sync(FULL, l_w[0], 4 * j);
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
    __syncthreads();
    // Combine the warps into this block's (max, sum, weighted V).
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
    // The last block of this (sequence, KV head, head chunk) to finish merges every split's
    // partials into the output (no separate merge launch; the partials are still in L2) and
    // leaves the counter at 0 for the next call.
    __shared__ bool last_s;
    __threadfence();
    __syncthreads();
    const size_t cidx = ((size_t)b * kvh + kh) * gridDim.z + blockIdx.z;
    if (tid == 0) last_s = atomicAdd(&counters[cidx], 1u) == (unsigned)nsplit - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    const size_t hstride = (size_t)Bn * H;  // one split's stride, in heads
    float* o_s = &wacc(0)[0][0];             // [QG][D]
    // Each thread owns IT (head, dim) outputs.
    constexpr int IT = QG * D / (QW * 32);
    const size_t hb = (size_t)b * H + (size_t)kh * G + j0;
    size_t hr[IT];
    int dd[IT];
    bool in[IT];
    float o[IT];
#pragma unroll
    for (int k = 0; k < IT; k++) {
        const int i = tid + k * QW * 32;
        hr[k] = hb + i / D;
        dd[k] = i % D;
        in[k] = i / D < gn;
    }
    merge_splits<IT>(part_acc, part_ml, hstride, D, nsplit, hr, dd, in, o);
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
}

// Combines the block-wide kernels' splits: out[bh] = Σ e^(m_s - M) acc_s / Σ e^(m_s - M) l_s,
// written in the query's element type (merge_splits). One block per (sequence, head), up to 256
// threads, at most two values of a row per thread (D ≤ 512).
template <typename T>
__device__ __forceinline__ void merge_impl(const float* __restrict__ part_acc,
                                           const float* __restrict__ part_ml, T* __restrict__ out,
                                           int nsplit, int BH, int D) {
    const size_t bh = blockIdx.x;
    size_t hr[2] = {bh, bh};
    int dd[2];
    bool in[2];
    float o[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        dd[k] = threadIdx.x + k * blockDim.x;
        in[k] = dd[k] < D;
    }
    merge_splits<2>(part_acc, part_ml, (size_t)BH, D, nsplit, hr, dd, in, o);
#pragma unroll
    for (int k = 0; k < 2; k++)
        if (in[k]) out[bh * D + dd[k]] = from_f<T>(o[k]);
}

#define KVQ_MERGE(TNAME, T)                                                                          \
    extern "C" __global__ void decode_merge_##TNAME(const float* part_acc, const float* part_ml,     \
                                                    T* out, int nsplit, int BH, int D) {           \
        merge_impl<T>(part_acc, part_ml, out, nsplit, BH, D);                                       \
    }
KVQ_MERGE(f32, float)
KVQ_MERGE(f16, __half)
KVQ_MERGE(bf16, __nv_bfloat16)

// Dense pools: decode_<pool type>_dense_q<query type>, queries scaled in the kernel.
#define KVQ_DENSE_Q(TNAME, T, QNAME, QT)                                                             \
    extern "C" __global__ void decode_##TNAME##_dense_q##QNAME(                                     \
        const QT* q, float scale, const T* kd, const T* vd, const uint32_t* tables,                  \
        const uint32_t* starts, const uint32_t* lens, int max_blocks, int num_blocks,                \
        int block_size, int kvh, int G, int D, int split_len, float* part_acc, float* part_ml) {    \
        decode_impl<T, 0, QT>(q, scale, kd, vd, nullptr, nullptr, nullptr, nullptr, nullptr,        \
                              nullptr, tables, starts, lens, max_blocks, num_blocks, block_size,    \
                              kvh, G, D, 32, split_len, part_acc, part_ml);                         \
    }
#define KVQ_DENSE(TNAME, T)                                                                          \
    KVQ_DENSE_Q(TNAME, T, f32, float) KVQ_DENSE_Q(TNAME, T, f16, __half)                            \
    KVQ_DENSE_Q(TNAME, T, bf16, __nv_bfloat16)

#define KVQ_AFFINE(TNAME, T, B)                                                                      \
    extern "C" __global__ void decode_##TNAME##_b##B(                                               \
        const float* q, const uint32_t* kc, const T* ks, const T* kb, const uint32_t* vc,           \
        const T* vs, const T* vb, const uint32_t* tables, const uint32_t* starts,                   \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G, int D, \
        int group, int split_len, float* part_acc, float* part_ml) {                                \
        decode_impl<T, B, float>(q, 1.f, nullptr, nullptr, kc, ks, kb, vc, vs, vb, tables, starts,  \
                                 lens,                                                              \
                          max_blocks, num_blocks, block_size, kvh, G, D, group, split_len,          \
                          part_acc, part_ml);                                                       \
    }

#define KVQ_ALL(TNAME, T)                                                                            \
    KVQ_DENSE(TNAME, T)                                                                              \
    KVQ_AFFINE(TNAME, T, 2) KVQ_AFFINE(TNAME, T, 3) KVQ_AFFINE(TNAME, T, 4)                          \
    KVQ_AFFINE(TNAME, T, 5) KVQ_AFFINE(TNAME, T, 6) KVQ_AFFINE(TNAME, T, 8)

#define KVQ_Q_ARGS(T)                                                                                 \
    const T* q, float scale, const uint32_t* kc, const T* ks, const T* kb, const uint32_t* vc,      \
        const T* vs, const T* vb, const uint32_t* tables, const uint32_t* starts,                   \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G,        \
        int group, int split_len, float* part_acc, float* part_ml, const float* signs, int rotated,  \
        T* out, unsigned* counters, int nsplit
#define KVQ_Q_PASS                                                                                   \
    q, scale, kc, ks, kb, vc, vs, vb, tables, starts, lens, max_blocks, num_blocks, block_size, kvh, \
        G, group, split_len, part_acc, part_ml, signs, rotated, out, counters, nsplit

// SIMT scores, any width: decode_q_<dtype>_b<bits>_d<head_dim>.
#define KVQ_Q(TNAME, T, B, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(QW * 32, 4)                                        \
        decode_q_##TNAME##_b##B##_d##D(KVQ_Q_ARGS(T)) {                                                \
        qdecode_impl<T, B, D, 0>(KVQ_Q_PASS);                                                        \
    }

// Tensor-core scores, 4- and 8-bit: decode_qm_<dtype>_b<bits>_d<head_dim>_g<group>. 4-bit fits
// 128 registers (4 blocks per SM), 8-bit needs more (3); the host asks the driver.
#define KVQ_QM(TNAME, T, B, D, GS)                                                                   \
    extern "C" __global__ void __launch_bounds__(QW * 32, B == 4 ? 4 : 3)                           \
        decode_qm_##TNAME##_b##B##_d##D##_g##GS(KVQ_Q_ARGS(T)) {                                       \
        qdecode_impl<T, B, D, GS>(KVQ_Q_PASS);                                                       \
    }

#define KVQ_Q_D(TNAME, T, D)                                                                         \
    KVQ_Q(TNAME, T, 2, D) KVQ_Q(TNAME, T, 3, D) KVQ_Q(TNAME, T, 4, D)                                \
    KVQ_Q(TNAME, T, 5, D) KVQ_Q(TNAME, T, 6, D) KVQ_Q(TNAME, T, 8, D)

#define KVQ_QM_B(TNAME, T, B)                                                                        \
    KVQ_QM(TNAME, T, B, 64, 32) KVQ_QM(TNAME, T, B, 64, 64)                                          \
    KVQ_QM(TNAME, T, B, 128, 32) KVQ_QM(TNAME, T, B, 128, 64) KVQ_QM(TNAME, T, B, 128, 128)

#define KVQ_Q_ALL(TNAME, T)                                                                          \
    KVQ_Q_D(TNAME, T, 64) KVQ_Q_D(TNAME, T, 128) KVQ_QM_B(TNAME, T, 4) KVQ_QM_B(TNAME, T, 8)

KVQ_Q_ALL(f32, float)
KVQ_Q_ALL(f16, __half)
KVQ_Q_ALL(bf16, __nv_bfloat16)

KVQ_ALL(f32, float)
KVQ_ALL(f16, __half)
KVQ_ALL(bf16, __nv_bfloat16)
