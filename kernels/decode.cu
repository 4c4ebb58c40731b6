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
// Each block writes (max, sum, weighted V) for its split; decode_merge combines the splits
// (dense pools: the last block of a head chunk does, in the same launch).
// A sequence with start >= len, len beyond its table or a block id outside the pool gets NaN.
// Quantized pools of one width (or keys one bit wider than values) at head_dim 64 or 128, and
// dense f16 / bf16 pools at 64, take the warp-independent kernel instead (decode_q_*, decode_qm_*; its design: decode/warp_shape.cuh),
// which merges the splits itself.
//
// The parts, in kernels/decode/: codes.cuh (codes as floats, fast exp, the rotation), block.cuh
// (the block-wide kernel above), warp_shape.cuh / warp_scores.cuh / warp_values.cuh / warp.cuh
// (the warp-independent kernel: its sizes, its steps, its loop), async.cuh (cp.async, ldmatrix,
// mma), merge.cuh (the split merge), residual.cuh and window.cuh (--kv-residual's dense rows:
// after the block-wide kernel, and as the warp kernel's extra split). This file holds the entry points the host looks up by name.
// Every entry point starts with pdl_start() (common.cuh): the host launches them as programmatic
// dependents (src/device/kernels/pdl.rs).
#include "decode/block.cuh"
#include "decode/warp.cuh"
#include "decode/merge.cuh"
#include "decode/residual.cuh"

#define KVQ_MERGE(TNAME, T)                                                                          \
    extern "C" __global__ void decode_merge_##TNAME(const float* part_acc, const float* part_ml,     \
                                                    T* out, int nsplit, int BH, int D, float* lse) { \
        pdl_start();                                                                                \
        merge_impl<T>(part_acc, part_ml, out, nsplit, BH, D, lse);                                  \
    }
KVQ_MERGE(f32, float)
KVQ_MERGE(f16, __half)
KVQ_MERGE(bf16, __nv_bfloat16)

// Dense pools: decode_<pool type>_dense_q<query type>_m<MG>, queries scaled in the kernel, up
// to MG query heads per block; the last block of a head chunk merges the splits into `out`.
#define KVQ_DENSE_QM(TNAME, T, QNAME, QT, MG)                                                       \
    extern "C" __global__ void __launch_bounds__(NT, 4) decode_##TNAME##_dense_q##QNAME##_m##MG(    \
        const QT* q, float scale, const T* kd, const T* vd, const uint32_t* tables,                  \
        const uint32_t* starts, const uint32_t* lens, int max_blocks, int num_blocks,                \
        int block_size, int kvh, int G, int D, int split_len, float* part_acc, float* part_ml,      \
        QT* out, unsigned* counters, int nsplit) {                                                   \
        pdl_start();                                                                                \
        decode_impl<T, 0, QT, MG>(q, scale, kd, vd, nullptr, nullptr, nullptr, nullptr, nullptr,    \
                                  nullptr, tables, starts, lens, max_blocks, num_blocks,            \
                                  block_size, kvh, G, D, 32, split_len, part_acc, part_ml, out,     \
                                  counters, nsplit);                                                \
    }
#define KVQ_DENSE_Q(TNAME, T, QNAME, QT)                                                             \
    KVQ_DENSE_QM(TNAME, T, QNAME, QT, 4) KVQ_DENSE_QM(TNAME, T, QNAME, QT, 8)
#define KVQ_DENSE(TNAME, T)                                                                          \
    KVQ_DENSE_Q(TNAME, T, f32, float) KVQ_DENSE_Q(TNAME, T, f16, __half)                            \
    KVQ_DENSE_Q(TNAME, T, bf16, __nv_bfloat16)

#define KVQ_AFFINE(TNAME, T, B)                                                                      \
    extern "C" __global__ void decode_##TNAME##_b##B(                                               \
        const float* q, const uint32_t* kc, const T* ks, const T* kb, const uint32_t* vc,           \
        const T* vs, const T* vb, const uint32_t* tables, const uint32_t* starts,                   \
        const uint32_t* lens, int max_blocks, int num_blocks, int block_size, int kvh, int G, int D, \
        int group, int split_len, float* part_acc, float* part_ml) {                                \
        pdl_start();                                                                                \
        decode_impl<T, B, float, MAXG>(q, 1.f, nullptr, nullptr, kc, ks, kb, vc, vs, vb, tables,    \
                                       starts, lens, max_blocks, num_blocks, block_size, kvh, G, D, \
                                       group, split_len, part_acc, part_ml, nullptr, nullptr, 0);   \
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
// The window instances (_w) take the rows after the plain arguments (decode/residual.cuh).
#define KVQ_Q_ARGS_W(T)                                                                               \
    KVQ_Q_ARGS(T), const __half *ring_k, const __half *ring_v, const __half *new_k,                 \
        const __half *new_v, const uint32_t *win_info, int win_s, int win_r, int win_width,          \
        int win_splits
#define KVQ_WIN_PASS WinRows{ring_k, ring_v, new_k, new_v, win_info, win_s, win_r, win_width, win_splits}
#define KVQ_NO_WIN WinRows{nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0}

// SIMT scores, KB-bit keys and VB-bit values: decode_q_<dtype>_b<W>_d<head_dim>, W the one width,
// or <key bits>v<value bits> for keys one bit wider (the splits of --kv-bits 2.5 … 5.5). Every
// quantized warp kernel also comes as <name>_w, with --kv-residual's window blocks
// (decode/window.cuh; WIN in qdecode_impl).
#define KVQ_QW1(TNAME, T, KB, VB, W, D, SUF, WIN, ARGS, ROWS)                                        \
    extern "C" __global__ void __launch_bounds__(QW * 32, 4)                                        \
        decode_q_##TNAME##_b##W##_d##D##SUF(ARGS(T)) {                                                 \
        pdl_start();                                                                                \
        qdecode_impl<T, KB, D, 0, VB, WIN>(KVQ_Q_PASS, ROWS);                                        \
    }
#define KVQ_QW(TNAME, T, KB, VB, W, D)                                                               \
    KVQ_QW1(TNAME, T, KB, VB, W, D, , false, KVQ_Q_ARGS, KVQ_NO_WIN)                                 \
    KVQ_QW1(TNAME, T, KB, VB, W, D, _w, true, KVQ_Q_ARGS_W, KVQ_WIN_PASS)
#define KVQ_Q(TNAME, T, B, D) KVQ_QW(TNAME, T, B, B, B, D)

// Tensor-core scores, 4- and 8-bit: decode_qm_<dtype>_b<bits>_d<head_dim>_g<group>. 4-bit fits
// 128 registers (4 blocks per SM) and, at head_dim 128 in groups of 64 (the default group),
// 96 without spilling (5 blocks, measured faster on the H100 end to end; the other groups spill
// there); 8-bit needs more (3). The host asks the driver.
#define KVQ_QM_BLOCKS(B, D, GS) ((B) == 4 ? ((D) == 128 && (GS) == 64 ? 5 : 4) : 3)
#define KVQ_QM1(TNAME, T, B, D, GS, SUF, WIN, ARGS, ROWS)                                            \
    extern "C" __global__ void __launch_bounds__(QW * 32, KVQ_QM_BLOCKS(B, D, GS))                  \
        decode_qm_##TNAME##_b##B##_d##D##_g##GS##SUF(ARGS(T)) {                                        \
        pdl_start();                                                                                \
        qdecode_impl<T, B, D, GS, B, WIN>(KVQ_Q_PASS, ROWS);                                         \
    }
#define KVQ_QM(TNAME, T, B, D, GS)                                                                   \
    KVQ_QM1(TNAME, T, B, D, GS, , false, KVQ_Q_ARGS, KVQ_NO_WIN)                                     \
    KVQ_QM1(TNAME, T, B, D, GS, _w, true, KVQ_Q_ARGS_W, KVQ_WIN_PASS)

// 4-bit keys on tensor cores over 3-bit values read by the lanes (--kv-bits 3.5):
// decode_qm_<dtype>_b4v3_d<head_dim>_g<group>, 4 blocks per SM (the lanes' V accumulators).
#define KVQ_QMV1(TNAME, T, D, GS, SUF, WIN, ARGS, ROWS)                                              \
    extern "C" __global__ void __launch_bounds__(QW * 32, 4)                                        \
        decode_qm_##TNAME##_b4v3_d##D##_g##GS##SUF(ARGS(T)) {                                          \
        pdl_start();                                                                                \
        qdecode_impl<T, 4, D, GS, 3, WIN>(KVQ_Q_PASS, ROWS);                                         \
    }
#define KVQ_QMV(TNAME, T, D, GS)                                                                     \
    KVQ_QMV1(TNAME, T, D, GS, , false, KVQ_Q_ARGS, KVQ_NO_WIN)                                       \
    KVQ_QMV1(TNAME, T, D, GS, _w, true, KVQ_Q_ARGS_W, KVQ_WIN_PASS)
#define KVQ_QMV_ALL(TNAME, T)                                                                        \
    KVQ_QMV(TNAME, T, 64, 32) KVQ_QMV(TNAME, T, 64, 64) KVQ_QMV(TNAME, T, 128, 32)                   \
    KVQ_QMV(TNAME, T, 128, 64) KVQ_QMV(TNAME, T, 128, 128)

#define KVQ_QKV_D(TNAME, T, D)                                                                       \
    KVQ_QW(TNAME, T, 3, 2, 3v2, D) KVQ_QW(TNAME, T, 4, 3, 4v3, D) KVQ_QW(TNAME, T, 5, 4, 5v4, D)     \
    KVQ_QW(TNAME, T, 6, 5, 6v5, D)

#define KVQ_Q_D(TNAME, T, D)                                                                         \
    KVQ_Q(TNAME, T, 2, D) KVQ_Q(TNAME, T, 3, D) KVQ_Q(TNAME, T, 4, D)                                \
    KVQ_Q(TNAME, T, 5, D) KVQ_Q(TNAME, T, 6, D) KVQ_Q(TNAME, T, 8, D)

#define KVQ_QM_B(TNAME, T, B)                                                                        \
    KVQ_QM(TNAME, T, B, 64, 32) KVQ_QM(TNAME, T, B, 64, 64)                                          \
    KVQ_QM(TNAME, T, B, 128, 32) KVQ_QM(TNAME, T, B, 128, 64) KVQ_QM(TNAME, T, B, 128, 128)

#define KVQ_Q_ALL(TNAME, T)                                                                          \
    KVQ_Q_D(TNAME, T, 64) KVQ_Q_D(TNAME, T, 128) KVQ_QM_B(TNAME, T, 4) KVQ_QM_B(TNAME, T, 8)        \
    KVQ_QKV_D(TNAME, T, 64) KVQ_QKV_D(TNAME, T, 128) KVQ_QMV_ALL(TNAME, T)

KVQ_Q_ALL(f32, float)
KVQ_Q_ALL(f16, __half)
KVQ_Q_ALL(bf16, __nv_bfloat16)

// Dense f16 / bf16 pools on the warp kernel's SIMT steps (16-bit "codes": the values
// themselves, no scales): decode_q_<dtype>_b16_d64 (at head_dim 128 the block-wide dense kernel
// measured faster; src/kv/attend/decode/cuda/plan.rs).
KVQ_QW1(f16, __half, 16, 16, 16, 64, , false, KVQ_Q_ARGS, KVQ_NO_WIN)
KVQ_QW1(bf16, __nv_bfloat16, 16, 16, 16, 64, , false, KVQ_Q_ARGS, KVQ_NO_WIN)

KVQ_ALL(f32, float)
KVQ_ALL(f16, __half)
KVQ_ALL(bf16, __nv_bfloat16)

// --kv-residual's dense part and merge: residual_merge_<query type> (decode/residual.cuh).
#define KVQ_RESIDUAL(TNAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) residual_merge_##TNAME(                       \
        const T* q, const T* oq, const float* lse, T* out, const __half* ring_k,                    \
        const __half* ring_v, const __half* new_k, const __half* new_v, const uint32_t* info, int H, \
        int kvh, int D, int S, int R, int width, float scale) {                                     \
        pdl_start();                                                                                \
        residual_merge_impl<T>(q, oq, lse, out, ring_k, ring_v, new_k, new_v, info, H, kvh, D, S, R, \
                               width, scale);                                                      \
    }
KVQ_RESIDUAL(f32, float)
KVQ_RESIDUAL(f16, __half)
KVQ_RESIDUAL(bf16, __nv_bfloat16)
