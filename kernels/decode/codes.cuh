// kvq: numbers of the decode kernels — codes as floats, fast exp, the rotation of the rotated
// scheme (kernels/decode.cu).
#pragma once
#include "../common.cuh"

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

// e^x by the SFU's 2^x, flushing results below f32's normal range to 0 (softmax weights that
// small do not count): no range fix-up around the approximation.
__device__ __forceinline__ float fast_exp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

// The rotated scheme (src/kv/format/rotation.rs): x·R with R = diag(s)·H/√D is a fast
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
