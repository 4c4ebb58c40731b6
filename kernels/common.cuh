// kvq: device helpers shared by every kernel file (quant.cu, decode.cu, gemv.cu, fused.cu):
// element conversions with explicit rounding (no contraction differences from MLX), 16-byte
// chunks widened to floats, warp sums.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

// 8 values of a 16-byte row chunk of f16 or bf16 as floats.
template <typename T> struct Pair2;
template <> struct Pair2<__half> { using type = __half2; };
template <> struct Pair2<__nv_bfloat16> { using type = __nv_bfloat162; };
__device__ __forceinline__ float2 to_f2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_f2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
template <typename T>
__device__ __forceinline__ void widen8(uint4 v, const T*, float* f) {
    const typename Pair2<T>::type* h = reinterpret_cast<const typename Pair2<T>::type*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 p = to_f2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

// Sum of v over the warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Programmatic dependent launch (src/device/kernels/pdl.rs): pdl_trigger lets the next kernel in
// the stream start launching; pdl_wait blocks until the kernel before this one has finished and
// its writes are visible. Kernels launched with the attribute call pdl_wait before they read
// anything an earlier kernel wrote or write anything; launched plainly, both do nothing.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Both, for kernels with nothing to do before their inputs are ready.
__device__ __forceinline__ void pdl_start() {
    pdl_trigger();
    pdl_wait();
}

// The gated unit's activation of the gate value g: GELU (tanh approximation) or SiLU, in f32.
__device__ __forceinline__ float gate_act(float g, int gelu) {
    if (gelu) {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        return 0.5f * g * (1.f + tanhf(k0 * (g + k1 * g * g * g)));
    }
    return g / (1.f + expf(-g));
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 8 consecutive values = 32 bytes (f32) or 16 bytes (f16/bf16), as f32; callers guarantee
// 16-byte alignment.
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

// The 16 bytes of r as 16 / sizeof(T) values of T, widened to f32.
template <typename T> __device__ __forceinline__ void unpack16(const uint4& r, float* v) {
    const T* h = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int k = 0; k < 16 / (int)sizeof(T); k++) v[k] = to_f(h[k]);
}
