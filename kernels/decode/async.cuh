// kvq: data movement and tensor-core steps of the warp-independent decode kernel
// (kernels/decode/warp.cuh): L2 prefetch, cp.async staging into swizzled shared memory,
// ldmatrix, mma.m16n8k16 and the f16 fragments of codes.
#pragma once
#include "../common.cuh"

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
// Codes are exact in f16, built from bits and the offset subtracted: a low nibble ORed into 1024
// (0x6400, mantissa unit 1), a high nibble left in place and ORed into 64 (0x5400, unit 1/16),
// so one byte permute serves both halves and no shift is needed.
template <int B> __device__ __forceinline__ void code_frag(uint32_t x, int byte, uint32_t& b0, uint32_t& b1) {
    uint32_t r0, r1;
    if (B == 4) {
        const uint32_t y = __byte_perm(x, 0u, (uint32_t)byte | ((uint32_t)(byte + 1) << 8));
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r0) : "r"(y), "r"(0x000F000Fu), "r"(0x64006400u));
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r1) : "r"(y), "r"(0x00F000F0u), "r"(0x54005400u));
        const __half2 h0 = __hadd2(*reinterpret_cast<const __half2*>(&r0), __floats2half2_rn(-1024.f, -1024.f));
        const __half2 h1 = __hadd2(*reinterpret_cast<const __half2*>(&r1), __floats2half2_rn(-64.f, -64.f));
        b0 = *reinterpret_cast<const uint32_t*>(&h0);
        b1 = *reinterpret_cast<const uint32_t*>(&h1);
        return;
    }
    const uint32_t magic = 0x64646464u;
    const __half2 k1024 = __floats2half2_rn(-1024.f, -1024.f);
    r0 = __byte_perm(x, magic, 0x4240);
    r1 = __byte_perm(x, magic, 0x4341);
    const __half2 h0 = __hadd2(*reinterpret_cast<const __half2*>(&r0), k1024);
    const __half2 h1 = __hadd2(*reinterpret_cast<const __half2*>(&r1), k1024);
    b0 = *reinterpret_cast<const uint32_t*>(&h0);
    b1 = *reinterpret_cast<const uint32_t*>(&h1);
}
