// kvq: the warp-independent decode kernel for quantized pools (decode_q_*, decode_qm_*) and
// dense f16 / bf16 pools (decode_q_*_b16_*, SIMT steps reading the values themselves): its
// design, its tiling constants and the sizes derived from them. The kernel is in warp.cuh, its
// steps in warp_scores.cuh and warp_values.cuh.
#pragma once
#include "../common.cuh"

// with its own online softmax, and only the end of the block combines them (the block-wide
// kernel above syncs its 128 threads three times per tile, so one tile's loads at most are in
// flight per block).
//   1. scores for QG = 4 query heads (grid z picks which; absent heads get q = 0 and are not
//      written), either
//      - SIMT (GS = 0, any width): one lane per position loads its K row and computes q·k̂ with
//        q in shared memory (broadcast reads), or
//      - tensor cores (GS = group size, 4- and 8-bit keys; with 4-bit keys also 3-bit values,
//        read by the lanes of step 3): S = K·Qᵀ per group with
//        mma.m16n8k16 (rows = 16 positions, columns = 4 heads × {hi, lo}, k = 16 dims). Codes
//        are exact in f16; q is split into two f16 terms (hi + lo, ~22 bits) that sit in
//        neighbouring columns, so one product keeps f32 accuracy and every lane ends with one
//        head's scores of 4 positions; the group's scale and bias are applied to its partial
//        dot products;
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

// Sizes of one kernel instance: element type T, B-bit codes, head_dim D, tensor-core group size
// GS (0: SIMT scores).
template <typename T, int B, int D, int GS> struct QShape {
    static constexpr bool MMA = GS > 0;
    // B = 16: a dense f16 / bf16 pool read by the SIMT steps (no codes, no scales).
    static constexpr bool DENSE = B == 16;
    static_assert(!DENSE || !MMA, "dense pools take the SIMT steps");
    static constexpr int HB = D * B / 8;  // code bytes of one head in one row
    static constexpr int VEC = (HB % 16 == 0) ? 16 : 8;  // SIMT K load width
    static constexpr int NCH = D / 32;  // 32-code chunks (B words each)
    static constexpr int LPR = D / 8;  // V lanes per position
    static constexpr int RPS = 32 / LPR;  // V positions per step
    static constexpr float TWO_B = (float)(1u << B);
    // Tensor-core scores: groups per head, k-steps per group and in all, code words per lane
    // and position (a lane holds a quarter of each group of the row: GS·B/32 bytes).
    static constexpr int NG = MMA ? D / GS : 1;
    static constexpr int KS = MMA ? GS / 16 : 1;
    static constexpr int KST = D / 16;
    static constexpr int QWB = MMA ? GS * B / 32 : 4;  // bytes of a lane's quarter of a group
    static constexpr int WPL = MMA ? NG * QWB / 4 : 1;  // words per lane and position
    // q fragment words per lane and k-step: the B operand's two registers (column n = head n/2,
    // its hi part for even n, lo for odd).
    static constexpr int QAW = 2;
    // Tensor-core V (groups of 64 or 128: at most two per head): C[dim][col] += codes · P' with
    // 8 columns = (group, head) and P' = weight · that group's scale, so each group's scales
    // enter through its own columns; a dim keeps the column of its own group. A lane reads
    // bytes [gq·BPL, (gq+1)·BPL) of its positions' rows: dims [gq·D/8, (gq+1)·D/8).
    // Only the widths the tensor-core kernels have (4, 8); a narrower V beside 4-bit keys
    // (--kv-bits 3.5) takes the lanes, reading its staged rows in plain order (warp_stage).
    static constexpr bool VMMA = MMA && NG <= 2 && (B == 4 || B == 8);
    static constexpr int MT = D / 16;  // m-tiles of 16 dims
    static constexpr int BPL = HB / 8;  // bytes per lane and position
    static constexpr int VW = (BPL + 3) / 4;
    // Staging (tensor-core kernels): each warp has two tiles of 32 rows in dynamic shared memory,
    // [K codes | V codes | K scales | K biases | V scales | V biases], and copies the next tile
    // with cp.async while it computes on this one. Scale rows of 2 bytes (one group, 16-bit
    // type; cp.async needs 4) go through registers instead.
    static constexpr int CPR = HB / 16;  // 16-byte chunks per code row
    static constexpr int CPW = 32 / B;  // codes per 32-bit word
    static constexpr int SB = NG * (int)sizeof(T);  // bytes of a row's scales (or biases)
    static constexpr int STG = 32 * (2 * HB + 4 * SB);  // bytes of one staged tile (VB = B)
    static constexpr bool SREG = SB < 4;
    // Accumulator rows kept per lane: one per head, or a single unused row with tensor-core V.
    static constexpr int AR = VMMA ? 1 : QG;
    static constexpr int CR = VMMA ? MT : 1;  // tensor-core V: C tiles
};
