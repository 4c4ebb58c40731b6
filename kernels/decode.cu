// kvq: decode attention over the paged, optionally quantized KV pool (DESIGN.md §6).
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
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define NT 128
#define TILE 128
#define MAXG 8

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 8 consecutive values (16-byte aligned) as f32.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* v) {
    if (sizeof(T) == 4) {
        float4 a = reinterpret_cast<const float4*>(p)[0];
        float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 a = *reinterpret_cast<const uint4*>(p);
        const T* h = reinterpret_cast<const T*>(&a);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = to_f(h[k]);
    }
}

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
template <typename T, int B>
__device__ __forceinline__ void decode_impl(
    const float* __restrict__ q, const T* __restrict__ kd, const T* __restrict__ vd,
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

    const float* qb = q + ((size_t)b * H + (size_t)kh * G + j0) * D;
    for (int i = tid; i < gn * D; i += NT) q_s[i] = qb[i];
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

// Warp-independent kernel for quantized pools, head_dim D in {64, 128} (decode_q_*):
// the block-wide kernel above syncs its 128 threads three times per tile of positions, so at
// most one tile's loads are in flight per block and the quantized rows' unpacking sits between
// them. Here each of the 4 warps walks its own tiles of 32 positions with its own online
// softmax, and only the end of the block combines them:
//   1. scores: one lane per position; the lane loads its K row (D·B/8 bytes) in 8/16-byte
//      pieces and computes q·k̂ = Σ_chunks scale·(q·codes) + bias·Σq for QG query heads
//      (q in shared memory, read by all lanes at one address: broadcast);
//   2. warp max / exp in registers (the running sum stays per lane until the end);
//   3. V: D/8 lanes per position, 32·8/D positions per step; a lane takes the weights and the
//      slot of its position by shuffle and accumulates 8 values for every head.
// Heads are handled QG = 4 at a time (grid z); absent heads get q = 0 and are not written.
#define QG 4
#define QW 4

template <typename T, int B, int D>
__device__ __forceinline__ void qdecode_impl(
    const float* __restrict__ q, const uint32_t* __restrict__ kc, const T* __restrict__ ks,
    const T* __restrict__ kb, const uint32_t* __restrict__ vc, const T* __restrict__ vs,
    const T* __restrict__ vb, const uint32_t* __restrict__ tables,
    const uint32_t* __restrict__ starts, const uint32_t* __restrict__ lens, int max_blocks,
    int num_blocks, int block_size, int kvh, int G, int group, int split_len,
    float* __restrict__ part_acc, float* __restrict__ part_ml, const float* __restrict__ signs,
    int rotated) {
    constexpr int HB = D * B / 8;                 // code bytes of one head in one row
    constexpr int VEC = (HB % 16 == 0) ? 16 : 8;  // K load width
    constexpr int NCH = D / 32;                   // 32-code chunks (B words each)
    constexpr int LPR = D / 8;                    // V lanes per position
    constexpr int RPS = 32 / LPR;                 // V positions per step
    const unsigned FULL = 0xffffffffu;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, Bn = gridDim.x / kvh;
    const int j0 = blockIdx.z * QG, gn = min(QG, G - j0);
    const int H = kvh * G;

    __shared__ __align__(16) float q_s[QG][D];
    __shared__ float qsum_s[QG][NCH];
    __shared__ float wm_s[QW][QG], wl_s[QW][QG];
    __shared__ __align__(16) float wacc_s[QW][QG][D];
    __shared__ int bad_s;

    const uint32_t start = starts[b], len = lens[b];
    const bool bad_seq = len == 0 || start >= len ||
                         (uint64_t)len > (uint64_t)max_blocks * (uint64_t)block_size;
    const long long p0 = (long long)start + (long long)split * split_len;
    const long long p1 = min((long long)len, p0 + split_len);

    const float* qb = q + ((size_t)b * H + (size_t)kh * G + j0) * D;
    for (int i = tid; i < QG * D; i += blockDim.x) q_s[i / D][i % D] = (i / D) < gn ? qb[i] : 0.f;
    if (tid == 0) bad_s = bad_seq;
    __syncthreads();
    if (rotated) rotate_rows<D, QG>(&q_s[0][0], signs, tid, blockDim.x);
    for (int i = tid; i < QG * NCH; i += blockDim.x) {
        const float* src = &q_s[i / NCH][(i % NCH) * 32];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 32; k++) s += src[k];
        qsum_s[i / NCH][i % NCH] = s;
    }
    __syncthreads();

    const size_t row_words = (size_t)kvh * D * B / 32, head_words = (size_t)D * B / 32;
    const size_t row_groups = (size_t)kvh * (D / group), head_groups = D / group;
    const int c8 = lane % LPR, rsub = lane / LPR;

    float m_w[QG], l_w[QG], acc[QG][8], accb[QG];
#pragma unroll
    for (int j = 0; j < QG; j++) {
        m_w[j] = neg_inf();
        l_w[j] = 0.f;
        accb[j] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = 0.f;
    }
    bool bad_row = false;

    if (!bad_seq) {
        for (long long t0 = p0 + (long long)warp * 32; t0 < p1; t0 += QW * 32) {
            const long long p = t0 + lane;
            bool valid = p < p1;
            size_t slot = 0;
            if (valid) {
                const uint32_t blk = tables[(size_t)b * max_blocks + p / block_size];
                if (blk >= (uint32_t)num_blocks) {
                    bad_row = true;
                    valid = false;
                } else {
                    slot = (size_t)blk * block_size + p % block_size;
                }
            }
            // 1. scores.
            float s[QG];
#pragma unroll
            for (int j = 0; j < QG; j++) s[j] = neg_inf();
            if (valid) {
                const unsigned char* row =
                    reinterpret_cast<const unsigned char*>(kc + slot * row_words + kh * head_words);
                uint32_t w[HB / 4];
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
                const T* sc_row = ks + slot * row_groups + kh * head_groups;
                const T* bi_row = kb + slot * row_groups + kh * head_groups;
#pragma unroll
                for (int j = 0; j < QG; j++) s[j] = 0.f;
#pragma unroll
                for (int c = 0; c < NCH; c++) {
                    const int gi = c * 32 / group;
                    const float sc = to_f(sc_row[gi]), bi = to_f(bi_row[gi]);
                    float d[QG];
#pragma unroll
                    for (int j = 0; j < QG; j++) d[j] = 0.f;
#pragma unroll
                    for (int k = 0; k < 32; k += 4) {
                        const float x0 = code_at<B>(w + c * B, k), x1 = code_at<B>(w + c * B, k + 1);
                        const float x2 = code_at<B>(w + c * B, k + 2), x3 = code_at<B>(w + c * B, k + 3);
#pragma unroll
                        for (int j = 0; j < QG; j++) {
                            const float4 a = *reinterpret_cast<const float4*>(&q_s[j][c * 32 + k]);
                            d[j] += a.x * x0 + a.y * x1 + a.z * x2 + a.w * x3;
                        }
                    }
#pragma unroll
                    for (int j = 0; j < QG; j++) s[j] += sc * d[j] + bi * qsum_s[j][c];
                }
            }
            // 2. online softmax; lane 0's position is always inside the split, so the tile
            // maximum is finite unless that row is bad (then the output is NaN anyway).
            float pj[QG];
#pragma unroll
            for (int j = 0; j < QG; j++) {
                float mx = s[j];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
                const float m_new = fmaxf(m_w[j], mx);
                const float alpha = m_new == neg_inf() ? 1.f : __expf(m_w[j] - m_new);
                pj[j] = valid ? __expf(s[j] - m_new) : 0.f;
                l_w[j] = l_w[j] * alpha + pj[j];
                accb[j] *= alpha;
#pragma unroll
                for (int k = 0; k < 8; k++) acc[j][k] *= alpha;
                m_w[j] = m_new;
            }
            // 3. V.
#pragma unroll
            for (int st = 0; st < 32 / RPS; st++) {
                const int r = st * RPS + rsub;
                const size_t slot_r = (size_t)__shfl_sync(FULL, (unsigned long long)slot, r);
                const int ok = __shfl_sync(FULL, (int)valid, r);
                float pr[QG];
#pragma unroll
                for (int j = 0; j < QG; j++) pr[j] = __shfl_sync(FULL, pj[j], r);
                if (ok) {
                    const unsigned char* vrow = reinterpret_cast<const unsigned char*>(
                        vc + slot_r * row_words + kh * head_words);
                    const uint64_t win = load_codes8<B>(vrow + c8 * B);
                    const size_t gidx = slot_r * row_groups + kh * head_groups + (c8 * 8) / group;
                    const float sc = to_f(vs[gidx]), bi = to_f(vb[gidx]);
                    float cf[8];
#pragma unroll
                    for (int k = 0; k < 8; k++) cf[k] = code_f((uint32_t)(win >> (k * B)) & ((1u << B) - 1));
#pragma unroll
                    for (int j = 0; j < QG; j++) {
                        const float ps = pr[j] * sc;
                        accb[j] += pr[j] * bi;
#pragma unroll
                        for (int k = 0; k < 8; k++) acc[j][k] += ps * cf[k];
                    }
                }
            }
        }
    }
    // The warp's totals: l over all lanes, V over the lanes that share a column slice.
#pragma unroll
    for (int j = 0; j < QG; j++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l_w[j] += __shfl_xor_sync(FULL, l_w[j], o);
#pragma unroll
        for (int o = 16; o >= LPR; o >>= 1) {
            accb[j] += __shfl_xor_sync(FULL, accb[j], o);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] += __shfl_xor_sync(FULL, acc[j][k], o);
        }
    }
    if (bad_row) bad_s = 1;
    if (lane < LPR) {
#pragma unroll
        for (int j = 0; j < QG; j++)
#pragma unroll
            for (int k = 0; k < 8; k++) wacc_s[warp][j][c8 * 8 + k] = acc[j][k] + accb[j];
    }
    if (lane == 0) {
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
                num += e * wacc_s[w][j][dd];
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

// Combines the splits: out[bh] = Σ e^(m_s - M) acc_s / Σ e^(m_s - M) l_s. Empty splits have
// m = -inf and are skipped; NaN (a bad sequence) propagates. `rotated`: the kernel attended in
// the rotated space (q rotated in its prologue), so the output is rotated back here:
// s ⊙ (H·o)/√D. Only the warp kernel rotates in place, so D is 64 or 128 (the host checks).
extern "C" __global__ void decode_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                        float* __restrict__ out, int nsplit, int BH, int D,
                                        const float* __restrict__ signs, int rotated) {
    __shared__ float o_s[128];
    const int bh = blockIdx.x;
    float M = neg_inf();
    bool nan_seen = false;
    for (int s = 0; s < nsplit; s++) {
        const float m = part_ml[((size_t)s * BH + bh) * 2];
        if (m != m) nan_seen = true;
        else M = fmaxf(M, m);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int s = 0; s < nsplit; s++) {
            const float m = part_ml[((size_t)s * BH + bh) * 2];
            if (m == neg_inf()) continue;
            const float w = expf(m - M);
            num += w * part_acc[((size_t)s * BH + bh) * D + d];
            den += w * part_ml[((size_t)s * BH + bh) * 2 + 1];
        }
        const float o = nan_seen ? __int_as_float(0x7fc00000) : num / den;
        if (rotated) o_s[d] = o;
        else out[(size_t)bh * D + d] = o;
    }
    if (!rotated) return;
    __syncthreads();
    if (D == 64) fwht<64>(o_s, 1, threadIdx.x, blockDim.x);
    else fwht<128>(o_s, 1, threadIdx.x, blockDim.x);
    const float nrm = inv_sqrt_d(D);
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[(size_t)bh * D + d] = o_s[d] * nrm * signs[d];
}

#define KVQ_DENSE(TNAME, T)                                                                          \
    extern "C" __global__ void decode_##TNAME##_dense(                                              \
        const float* q, const T* kd, const T* vd, const uint32_t* tables, const uint32_t* starts,    \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G, int D, \
        int split_len, float* part_acc, float* part_ml) {                                           \
        decode_impl<T, 0>(q, kd, vd, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, tables,  \
                          starts, lens, max_blocks, num_blocks, block_size, kvh, G, D, 32,          \
                          split_len, part_acc, part_ml);                                            \
    }

#define KVQ_AFFINE(TNAME, T, B)                                                                      \
    extern "C" __global__ void decode_##TNAME##_b##B(                                               \
        const float* q, const uint32_t* kc, const T* ks, const T* kb, const uint32_t* vc,           \
        const T* vs, const T* vb, const uint32_t* tables, const uint32_t* starts,                   \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G, int D, \
        int group, int split_len, float* part_acc, float* part_ml) {                                \
        decode_impl<T, B>(q, nullptr, nullptr, kc, ks, kb, vc, vs, vb, tables, starts, lens,        \
                          max_blocks, num_blocks, block_size, kvh, G, D, group, split_len,          \
                          part_acc, part_ml);                                                       \
    }

#define KVQ_ALL(TNAME, T)                                                                            \
    KVQ_DENSE(TNAME, T)                                                                              \
    KVQ_AFFINE(TNAME, T, 2) KVQ_AFFINE(TNAME, T, 3) KVQ_AFFINE(TNAME, T, 4)                          \
    KVQ_AFFINE(TNAME, T, 5) KVQ_AFFINE(TNAME, T, 6) KVQ_AFFINE(TNAME, T, 8)

#define KVQ_Q(TNAME, T, B, D)                                                                        \
    extern "C" __global__ void __launch_bounds__(QW * 32, 4) decode_q_##TNAME##_b##B##_d##D(         \
        const float* q, const uint32_t* kc, const T* ks, const T* kb, const uint32_t* vc,           \
        const T* vs, const T* vb, const uint32_t* tables, const uint32_t* starts,                   \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G,        \
        int group, int split_len, float* part_acc, float* part_ml, const float* signs, int rotated) {\
        qdecode_impl<T, B, D>(q, kc, ks, kb, vc, vs, vb, tables, starts, lens, max_blocks,          \
                              num_blocks, block_size, kvh, G, group, split_len, part_acc, part_ml,  \
                              signs, rotated);                                                      \
    }

#define KVQ_Q_D(TNAME, T, D)                                                                         \
    KVQ_Q(TNAME, T, 2, D) KVQ_Q(TNAME, T, 3, D) KVQ_Q(TNAME, T, 4, D)                                \
    KVQ_Q(TNAME, T, 5, D) KVQ_Q(TNAME, T, 6, D) KVQ_Q(TNAME, T, 8, D)

#define KVQ_Q_ALL(TNAME, T) KVQ_Q_D(TNAME, T, 64) KVQ_Q_D(TNAME, T, 128)

KVQ_Q_ALL(f32, float)
KVQ_Q_ALL(f16, __half)
KVQ_Q_ALL(bf16, __nv_bfloat16)

KVQ_ALL(f32, float)
KVQ_ALL(f16, __half)
KVQ_ALL(bf16, __nv_bfloat16)
