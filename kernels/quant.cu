// kvq: affine group quantization (docs/ARCHITECTURE.md), bit-exact with MLX.
// One thread handles 8 consecutive values of a row: 8 codes of B bits are exactly B bytes, so
// each thread reads/writes a byte-aligned piece of the packed stream. Groups (32/64/128 values)
// are g/8 adjacent lanes of one warp and reduce min/max with xor shuffles.
// All float arithmetic uses explicit round-to-nearest intrinsics so nvcc never contracts
// mul+add into an fma (which would change the last bit versus MLX's CPU output).
#include "common.cuh"

template <typename T> __device__ __forceinline__ void store8(T* p, const float* v) {
    if (sizeof(T) == 4) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        uint4 a;
        T* h = reinterpret_cast<T*>(&a);
#pragma unroll
        for (int k = 0; k < 8; k++) h[k] = from_f<T>(v[k]);
        *reinterpret_cast<uint4*>(p) = a;
    }
}

// Chunks of 8 values per thread in quantize: all loads are issued before any arithmetic so
// enough bytes are in flight per SM to cover memory latency (one 16-byte load each is too few).
#define KVQ_Q_UNROLL 4

// ROUND (input wider than T: f32 rows into f16 / bf16 parameters): the parameters are rounded
// to T first and the codes computed from the rounded values (src/kv/format/ops.rs, quantize_as);
// otherwise MLX: codes from the f32 parameters.
template <typename T, int B, bool ROUND>
__device__ __forceinline__ void quantize_chunk(const float* v, float mn, float mx, uint64_t t, int lanes,
                                               uint32_t* __restrict__ codes, T* __restrict__ scales,
                                               T* __restrict__ biases) {
    const float n = (float)((1u << B) - 1);
    const bool side = fabsf(mn) > fabsf(mx);
    float scale = fmaxf(__fdiv_rn(__fsub_rn(mx, mn), n), 1e-7f);
    if (!side) scale = -scale;
    const float edge = side ? mn : mx;
    const float q0 = rintf(__fdiv_rn(edge, scale));
    float bias = 0.f;
    if (q0 != 0.f) { scale = __fdiv_rn(edge, q0); bias = edge; }
    if (ROUND) { scale = to_f(from_f<T>(scale)); bias = to_f(from_f<T>(bias)); }
    uint64_t packed = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float c = __fdiv_rn(__fsub_rn(v[k], bias), scale);
        c = fminf(fmaxf(c, 0.f), n);
        packed |= (uint64_t)(uint32_t)rintf(c) << (k * B);
    }
    unsigned char* out = reinterpret_cast<unsigned char*>(codes) + t * B;
    if (B == 8) *reinterpret_cast<uint64_t*>(out) = packed;
    else if (B == 4) *reinterpret_cast<uint32_t*>(out) = (uint32_t)packed;
    else if (B == 2) *reinterpret_cast<uint16_t*>(out) = (uint16_t)packed;
    else {
#pragma unroll
        for (int k = 0; k < B; k++) out[k] = (unsigned char)(packed >> (8 * k));
    }
    if (t % lanes == 0) {
        const uint64_t gi = t / lanes;
        scales[gi] = from_f<T>(scale);
        biases[gi] = from_f<T>(bias);
    }
}

// `rows` (optional): input row r is written as row rows[r] of the outputs (a paged pool), each
// row `cpr` chunks of 8 values; null writes row r to row r. Input IT: T, or f32 with narrower T.
template <typename IT, typename T, int B>
__device__ __forceinline__ void quantize_impl(const IT* __restrict__ x, uint32_t* __restrict__ codes,
                                              T* __restrict__ scales, T* __restrict__ biases,
                                              uint64_t nchunks, int group,
                                              const uint32_t* __restrict__ rows = nullptr, uint64_t cpr = 1) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;  // a multiple of 32: lanes stay aligned
    const uint64_t t0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int lanes = group / 8;  // 4, 8 or 16: aligned sub-warps
    float v[KVQ_Q_UNROLL][8];
#pragma unroll
    for (int u = 0; u < KVQ_Q_UNROLL; u++) {
        const uint64_t t = t0 + u * stride;
        if (t < nchunks) {
            load8(x + t * 8, v[u]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v[u][k] = 0.f;
        }
    }
#pragma unroll
    for (int u = 0; u < KVQ_Q_UNROLL; u++) {
        const uint64_t t = t0 + u * stride;
        float mn = v[u][0], mx = v[u][0];
#pragma unroll
        for (int k = 1; k < 8; k++) { mn = fminf(mn, v[u][k]); mx = fmaxf(mx, v[u][k]); }
        for (int off = lanes / 2; off > 0; off >>= 1) {
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        }
        if (t < nchunks) {
            const uint64_t to = rows ? (uint64_t)rows[t / cpr] * cpr + t % cpr : t;
            quantize_chunk<T, B, (sizeof(IT) > sizeof(T))>(v[u], mn, mx, to, lanes, codes, scales, biases);
        }
    }
}

// Output O: T (MLX: half types round the product and the sum), or f32 from narrower T (the
// parameters widened, f32 arithmetic).
template <typename T, typename O, int B>
__device__ __forceinline__ void dequantize_impl(const uint32_t* __restrict__ codes, const T* __restrict__ scales,
                                                const T* __restrict__ biases, O* __restrict__ out,
                                                uint64_t nchunks, int group) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nchunks) return;
    const uint64_t bit = t * 8 * B;
    const uint64_t w0 = bit / 32;
    const int s = (int)(bit % 32);
    uint64_t win = codes[w0];
    if (s + 8 * B > 32) win |= (uint64_t)codes[w0 + 1] << 32;
    win >>= s;
    const uint64_t gi = t * 8 / group;
    const float sc = to_f(scales[gi]), bi = to_f(biases[gi]);
    const uint32_t mask = (1u << B) - 1;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float p = __fmul_rn((float)((uint32_t)(win >> (k * B)) & mask), sc);
        p = to_f(from_f<O>(p));  // half types round the product, as MLX computes in half
        v[k] = __fadd_rn(p, bi);
    }
    store8(out + t * 8, v);
}

// The rotated scheme (src/kv/rotation.rs) fused into the cache write: each head vector x of D
// values is rotated as (s ⊙ x)·H/√D by a fast Walsh–Hadamard transform over the D/8 lanes that
// hold it (three butterfly stages in registers, the rest by xor shuffles), rounded to the input's
// type as the unfused path's rotation does, then quantized and written as quantize_rows does. Lanes
// past the end compute on zeros and store nothing (every lane takes part in the shuffles).
//
// A captured decode step's side writes ride along (null pointers: none): `means` (keys only) is
// subtracted from each input value first, in IT arithmetic as candle's subtraction
// (--kv-center), and the values as they are then go as f16 (rounded as candle's cast) to rows
// copy_rows[r] and copy_sinks[r] of `copies` for input row r (--kv-residual's dense copies,
// unrotated; the sink row equals the ring row when the row is no sink). One launch instead of
// the copies' own kernel and the centring's subtraction per layer.
template <typename IT, typename T, int B, int D>
__device__ __forceinline__ void quantize_rot_impl(const IT* __restrict__ x, uint32_t* __restrict__ codes,
                                                  T* __restrict__ scales, T* __restrict__ biases,
                                                  uint64_t nchunks, int group, const uint32_t* __restrict__ rows,
                                                  uint64_t cpr, const float* __restrict__ signs,
                                                  const IT* __restrict__ means, __half* __restrict__ copies,
                                                  const uint32_t* __restrict__ copy_rows,
                                                  const uint32_t* __restrict__ copy_sinks) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int lv = (int)(t % (D / 8));  // this chunk's place in its head vector
    float v[8];
    if (t < nchunks) {
        if (means != nullptr) {
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = to_f(IT(x[t * 8 + k] - means[t * 8 + k]));
        } else {
            load8(x + t * 8, v);
        }
        if (copies != nullptr) {
            const uint64_t r = t / cpr, c = (t % cpr) * 8, w = cpr * 8;
            const uint32_t ring = copy_rows[r], sink = copy_sinks[r];
            store8(copies + ring * w + c, v);
            if (sink != ring) store8(copies + sink * w + c, v);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __fmul_rn(v[k], signs[lv * 8 + k]);
#pragma unroll
    for (int h = 1; h < 8; h <<= 1)
#pragma unroll
        for (int k = 0; k < 8; k++)
            if ((k & h) == 0) {
                const float a = v[k], b = v[k + h];
                v[k] = __fadd_rn(a, b);
                v[k + h] = __fsub_rn(a, b);
            }
#pragma unroll
    for (int m = 1; m < D / 8; m <<= 1)
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float o = __shfl_xor_sync(0xffffffffu, v[k], m);
            v[k] = (lv & m) ? __fsub_rn(o, v[k]) : __fadd_rn(v[k], o);
        }
    const float nrm = (float)(1.0 / sqrt((double)D));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = to_f(from_f<IT>(__fmul_rn(v[k], nrm)));
    const int lanes = group / 8;
    float mn = v[0], mx = v[0];
#pragma unroll
    for (int k = 1; k < 8; k++) { mn = fminf(mn, v[k]); mx = fmaxf(mx, v[k]); }
    for (int off = lanes / 2; off > 0; off >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    if (t < nchunks) {
        const uint64_t to = (uint64_t)rows[t / cpr] * cpr + t % cpr;
        quantize_chunk<T, B, (sizeof(IT) > sizeof(T))>(v, mn, mx, to, lanes, codes, scales, biases);
    }
}

// K and V of a step in one launch (grid y: 0 = K, 1 = V), input IT (f32 or the pool's type),
// with a captured step's side writes (quantize_rot_impl; null pointers where there are none),
// KB-bit keys and VB-bit values, head_dim D: quantize_rot_rows_<input>_<pool>_b<W>_d<D>, W the
// one width, or <key bits>v<value bits> for keys one bit wider (the splits of --kv-bits 2.5 … 5.5).
#define KVQ_QUANT_ROT(INAME, IT, TNAME, T, KB, VB, W, D)                                            \
    extern "C" __global__ void quantize_rot_rows_##INAME##_##TNAME##_b##W##_d##D(                   \
        const IT* xk, const IT* xv, uint32_t* kc, T* ks, T* kb, uint32_t* vc, T* vs, T* vb,         \
        uint64_t nchunks, int group, const uint32_t* rows, uint64_t cpr, const float* signs,        \
        const IT* means, __half* copy_k, __half* copy_v, const uint32_t* copy_rows,                 \
        const uint32_t* copy_sinks) {                                                               \
        pdl_start();                                                                                \
        if (blockIdx.y == 0)                                                                        \
            quantize_rot_impl<IT, T, KB, D>(xk, kc, ks, kb, nchunks, group, rows, cpr, signs,       \
                                            means, copy_k, copy_rows, copy_sinks);                  \
        else                                                                                        \
            quantize_rot_impl<IT, T, VB, D>(xv, vc, vs, vb, nchunks, group, rows, cpr, signs,       \
                                            nullptr, copy_v, copy_rows, copy_sinks);                \
    }

// Quantize X rows into T parameters: quantize_<x>_<t>_b<bits>, quantize_rows_<x>_<t>_b<bits>.
#define KVQ_QUANT(XNAME, X, TNAME, T, B)                                                            \
    extern "C" __global__ void quantize_##XNAME##_##TNAME##_b##B(                                   \
        const X* x, uint32_t* codes, T* scales, T* biases, uint64_t nchunks, int group) {          \
        quantize_impl<X, T, B>(x, codes, scales, biases, nchunks, group);                           \
    }                                                                                               \
    extern "C" __global__ void quantize_rows_##XNAME##_##TNAME##_b##B(                              \
        const X* x, uint32_t* codes, T* scales, T* biases, uint64_t nchunks, int group,            \
        const uint32_t* rows, uint64_t cpr) {                                                       \
        quantize_impl<X, T, B>(x, codes, scales, biases, nchunks, group, rows, cpr);                \
    }
// Dequantize T parameters into O values: dequantize_<t>_<o>_b<bits>.
#define KVQ_DEQUANT(TNAME, T, ONAME, O, B)                                                          \
    extern "C" __global__ void dequantize_##TNAME##_##ONAME##_b##B(                                 \
        const uint32_t* codes, const T* scales, const T* biases, O* out, uint64_t nchunks,         \
        int group) {                                                                                \
        dequantize_impl<T, O, B>(codes, scales, biases, out, nchunks, group);                       \
    }

#define KVQ_ROT_D(INAME, IT, TNAME, T, KB, VB, W)                                                  \
    KVQ_QUANT_ROT(INAME, IT, TNAME, T, KB, VB, W, 64) KVQ_QUANT_ROT(INAME, IT, TNAME, T, KB, VB, W, 128)
#define KVQ_ROT_ALL(INAME, IT, TNAME, T)                                                             \
    KVQ_ROT_D(INAME, IT, TNAME, T, 2, 2, 2) KVQ_ROT_D(INAME, IT, TNAME, T, 3, 3, 3)                 \
    KVQ_ROT_D(INAME, IT, TNAME, T, 4, 4, 4) KVQ_ROT_D(INAME, IT, TNAME, T, 5, 5, 5)                 \
    KVQ_ROT_D(INAME, IT, TNAME, T, 6, 6, 6) KVQ_ROT_D(INAME, IT, TNAME, T, 8, 8, 8)                 \
    KVQ_ROT_D(INAME, IT, TNAME, T, 3, 2, 3v2) KVQ_ROT_D(INAME, IT, TNAME, T, 4, 3, 4v3)             \
    KVQ_ROT_D(INAME, IT, TNAME, T, 5, 4, 5v4) KVQ_ROT_D(INAME, IT, TNAME, T, 6, 5, 6v5)
#define KVQ_QUANT_ALL(XNAME, X, TNAME, T)                                                           \
    KVQ_QUANT(XNAME, X, TNAME, T, 2) KVQ_QUANT(XNAME, X, TNAME, T, 3)                               \
    KVQ_QUANT(XNAME, X, TNAME, T, 4) KVQ_QUANT(XNAME, X, TNAME, T, 5)                               \
    KVQ_QUANT(XNAME, X, TNAME, T, 6) KVQ_QUANT(XNAME, X, TNAME, T, 8)
#define KVQ_DEQUANT_ALL(TNAME, T, ONAME, O)                                                         \
    KVQ_DEQUANT(TNAME, T, ONAME, O, 2) KVQ_DEQUANT(TNAME, T, ONAME, O, 3)                           \
    KVQ_DEQUANT(TNAME, T, ONAME, O, 4) KVQ_DEQUANT(TNAME, T, ONAME, O, 5)                           \
    KVQ_DEQUANT(TNAME, T, ONAME, O, 6) KVQ_DEQUANT(TNAME, T, ONAME, O, 8)

// Each type into its own parameters (MLX), and f32 rows into half parameters (a cache computing
// in f32: kv::format::scale_dtype_for); dequantize into the parameters' type, or half into f32.
KVQ_QUANT_ALL(f32, float, f32, float)
KVQ_QUANT_ALL(f16, __half, f16, __half)
KVQ_QUANT_ALL(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
KVQ_QUANT_ALL(f32, float, f16, __half)
KVQ_QUANT_ALL(f32, float, bf16, __nv_bfloat16)
KVQ_DEQUANT_ALL(f32, float, f32, float)
KVQ_DEQUANT_ALL(f16, __half, f16, __half)
KVQ_DEQUANT_ALL(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
KVQ_DEQUANT_ALL(f16, __half, f32, float)
KVQ_DEQUANT_ALL(bf16, __nv_bfloat16, f32, float)
// Rotated writes: f32 input into every pool type, and f16 / bf16 input into a pool of its type.
KVQ_ROT_ALL(f32, float, f32, float)
KVQ_ROT_ALL(f32, float, f16, __half)
KVQ_ROT_ALL(f32, float, bf16, __nv_bfloat16)
KVQ_ROT_ALL(f16, __half, f16, __half)
KVQ_ROT_ALL(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
