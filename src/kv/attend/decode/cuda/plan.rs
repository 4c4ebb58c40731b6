//! Which decode kernel a layer takes and how its positions split into blocks: the kernel's name
//! and sizes (`choose`), the split plan (`plan`), the device facts they need.

use super::super::Dims;
use super::dtype_name;
use crate::device::kernels::decode_override;
use crate::kv::format::{LayerKv, QuantFormat};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor};
use std::collections::HashMap;
use std::sync::Mutex;

/// Must match NT, TILE and MAXG in kernels/decode/block.cuh.
pub(super) const THREADS: u32 = 128;
pub(super) const TILE: usize = 128;
pub(super) const MAXG: usize = 8;
/// Query heads per block of the dense kernel where a KV head has at most this many (its `_m4`
/// instances; `_m8` otherwise).
pub(super) const DENSE_MG: usize = 4;
/// Positions per split of the dense kernel are a multiple of this: one sequence of a few hundred
/// positions still fills several blocks per KV head (H100, 512 x 1: 64 → 935 tok/s, 128 → 917-931,
/// 32 → 896).
pub(super) const DENSE_GRANULE: usize = 64;
/// The head_dim at which dense f16 / bf16 pools take the warp kernel (see [`choose`]).
pub(super) const DENSE_WARP_HEAD_DIM: usize = 64;
/// Blocks to aim for: about four waves on an H100's 132 SMs.
pub(super) const TARGET_BLOCKS: usize = 512;
/// Query heads per block of the warp-independent quantized kernel (QG in
/// kernels/decode/warp_shape.cuh).
pub(super) const QG: usize = 4;
/// Largest head_dim the shared-memory layout is sized for (stays under 48 KiB).
pub(super) const MAX_HEAD_DIM: usize = 512;
/// Warps per block of the warp kernels (QW in kernels/decode/warp_shape.cuh).
pub(super) const QW: usize = 4;

/// Dynamic shared memory of a tensor-core kernel: per warp two staged tiles of 32 rows, each row
/// its K and V codes (`bits`: K and V widths) and its K and V scales and biases (STG in
/// kernels/decode/warp.cuh).
pub(super) fn stage_bytes(
    head_dim: usize,
    (kbits, vbits): (usize, usize),
    group: usize,
    scale_bytes: usize,
) -> usize {
    let codes = head_dim * (kbits + vbits) / 8;
    let scales = head_dim / group * scale_bytes;
    QW * 2 * 32 * (codes + 4 * scales)
}

/// Streaming multiprocessors of the device (asked once; every GPU of a host is alike here).
pub(super) fn sm_count(dev: &CudaDevice) -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

/// Blocks of a warp kernel resident per SM (registers and shared memory decide; asked once per
/// kernel and device, which is also allowed `smem` bytes of dynamic shared memory then): its grid
/// aims at one full wave.
pub(super) fn resident_blocks(f: &CudaFunction, name: &str, smem: usize) -> Result<usize> {
    static N: std::sync::OnceLock<Mutex<HashMap<String, usize>>> = std::sync::OnceLock::new();
    let mut m = N
        .get_or_init(Default::default)
        .lock()
        .expect("poisoned occupancy cache");
    if let Some(&n) = m.get(name) {
        return Ok(n);
    }
    if smem > 0 {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
    }
    let n = f
        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
        .w()?
        .max(1) as usize;
    m.insert(name.to_string(), n);
    Ok(n)
}

/// Splits per (sequence, KV head) and positions per split, from the table's capacity (the
/// lengths stay on the device). `one_wave`: at most `target` blocks (the device's resident
/// capacity), so no second, mostly idle wave; else about `target`.
pub(super) fn plan(
    dims: &Dims,
    head_chunks: usize,
    target: usize,
    one_wave: bool,
    granule: usize,
) -> (usize, usize) {
    let cap = dims.max_blocks * dims.block_size;
    let per_split_blocks = (dims.batch * dims.kv_heads * head_chunks).max(1);
    let want = if one_wave {
        target / per_split_blocks
    } else {
        target.div_ceil(per_split_blocks)
    };
    let max_splits = cap.div_ceil(granule).max(1);
    let nsplit = want.clamp(1, max_splits);
    let split_len = cap.div_ceil(nsplit).div_ceil(granule) * granule;
    (cap.div_ceil(split_len).max(1), split_len)
}

/// The kernel a layer's decode takes: its name, whether it is a warp-independent kernel and its
/// dynamic shared memory (the staging of the tensor-core kernels; 0 for the others).
pub(super) struct Choice {
    pub(super) name: String,
    pub(super) warp: bool,
    pub(super) smem: usize,
    /// Query heads per block.
    pub(super) chunk: usize,
}

/// Quantized pools with one width for K and V, or keys one bit wider than values
/// ([`QuantFormat::one_bit_wider`]), and head_dim 64 or 128 take the warp-independent kernel: with tensor-core
/// scores for 4 and 8 bits of one width and for 4-bit keys over 3-bit values (decode_qm_*,
/// `--kv-bits 3.5`: its V by the lanes; H200, default model's shape at 16K, and 4 × 8 KV
/// heads × 128: see README), SIMT otherwise (decode_q_*);
/// so do dense f16 / bf16 pools at head_dim 64 (SIMT, decode_q_*_b16_*; H100, default model,
/// f16: 512 × 1 1,193–1,199 against 927–929 tok/s, 4096 × 64 14.2K against 8.4K;
/// KVQ_CUDA_DECODE=dense-block keeps them on the block-wide dense kernel for A/B).
/// That kernel reads the queries in the pool's scale type, so f32 queries over half scales (a
/// cache computing in f32, `kv::format::scale_dtype_for`) take the block-wide kernel, which
/// reads them in f32. KVQ_CUDA_DECODE=v1 selects the block-wide kernel, =v2 the SIMT scores
/// for every width (A/B and tests).
pub(super) fn choose(q: &Tensor, kv: &LayerKv, dims: &Dims) -> Result<Choice> {
    let d = dims.head_dim;
    let choice = decode_override();
    let warp = match kv {
        LayerKv::Affine { kfmt, vfmt, k, .. } => {
            affine_warp(q.dtype(), (kfmt, vfmt), k.scales.dtype(), dims)
        }
        // Dense f16 / bf16 pools read with queries of their own type (the SIMT steps), at
        // head_dim 64: at 128 the block-wide kernel measured faster (H100, seed-002 shape,
        // 2 × 50K positions, 8 KV heads of 2 query heads: 222.8 against 197.9 tok/s).
        LayerKv::Dense { k, .. } => {
            matches!(k.dtype(), DType::F16 | DType::BF16)
                && q.dtype() == k.dtype()
                && d == DENSE_WARP_HEAD_DIM
                && fits_u32_rows(dims)
                && !matches!(choice, "v1" | "dense-block")
        }
    };
    let mma = match kv {
        // One width of 4 or 8 bits, or 4-bit keys over 3-bit values (V by the lanes).
        LayerKv::Affine { kfmt, vfmt, .. } => {
            let widths = match (kfmt.bits(), vfmt.bits()) {
                (k, v) if k == v => matches!(k, 4 | 8),
                (k, v) => (k, v) == (4, 3),
            };
            warp && widths
                && kfmt.group_size() == vfmt.group_size()
                && kfmt.group_size() <= d
                && choice != "v2"
        }
        LayerKv::Dense { .. } => false,
    };
    let name = match kv {
        LayerKv::Dense { k, .. } if warp => format!("decode_q_{}_b16_d{d}", dtype_name(k.dtype())?),
        LayerKv::Dense { k, .. } => format!(
            "decode_{}_dense_q{}_m{}",
            dtype_name(k.dtype())?,
            dtype_name(q.dtype())?,
            dense_chunk(dims)
        ),
        LayerKv::Affine {
            kfmt: fmt, vfmt, k, ..
        } => {
            let t = dtype_name(k.scales.dtype())?;
            let (bits, g) = (fmt.bits(), fmt.group_size());
            if mma && fmt != vfmt {
                format!("decode_qm_{t}_b{bits}v{}_d{d}_g{g}", vfmt.bits())
            } else if mma {
                format!("decode_qm_{t}_b{bits}_d{d}_g{g}")
            } else if warp && fmt != vfmt {
                format!("decode_q_{t}_b{bits}v{}_d{d}", vfmt.bits())
            } else if warp {
                format!("decode_q_{t}_b{bits}_d{d}")
            } else {
                format!("decode_{t}_b{bits}")
            }
        }
    };
    let smem = match kv {
        LayerKv::Affine { kfmt, vfmt, k, .. } if mma => stage_bytes(
            d,
            (kfmt.bits() as usize, vfmt.bits() as usize),
            kfmt.group_size(),
            k.scales.dtype().size_in_bytes(),
        ),
        _ => 0,
    };
    let chunk = match kv {
        _ if warp => QG,
        LayerKv::Dense { .. } => dense_chunk(dims),
        LayerKv::Affine { .. } => MAXG,
    };
    Ok(Choice {
        name,
        warp,
        smem,
        chunk,
    })
}

/// Whether the warp kernel reads keys in `kfmt` with values in `vfmt` (scales and biases of
/// `scales`) for queries of `q` at head_dim `d`: one format, or keys one bit wider
/// ([`QuantFormat::one_bit_wider`]); queries in the scales' type or both f32.
pub(crate) fn warp_reads(
    kfmt: &QuantFormat,
    vfmt: &QuantFormat,
    scales: DType,
    q: DType,
    d: usize,
) -> bool {
    (kfmt == vfmt || QuantFormat::one_bit_wider(*kfmt, *vfmt))
        && !(q == DType::F32 && scales != DType::F32)
        && matches!(d, 64 | 128)
}

/// Whether an affine pool (keys in `kfmt`, values in `vfmt`, scales of `scales`) takes the warp
/// kernel for queries of `q` ([`choose`]'s rule, without naming the kernel).
pub(super) fn affine_warp(
    q: DType,
    (kfmt, vfmt): (&QuantFormat, &QuantFormat),
    scales: DType,
    dims: &Dims,
) -> bool {
    warp_reads(kfmt, vfmt, scales, q, dims.head_dim)
        && fits_u32_rows(dims)
        && decode_override() != "v1"
}

/// Whether every (slot, KV head) row of the pool has a 32-bit index (the warp kernel's).
fn fits_u32_rows(dims: &Dims) -> bool {
    dims.num_blocks
        .saturating_mul(dims.block_size)
        .saturating_mul(dims.kv_heads)
        < u32::MAX as usize
}

/// Query heads per block of the dense kernel (its `_m` suffix).
pub(super) fn dense_chunk(dims: &Dims) -> usize {
    if dims.group <= DENSE_MG {
        DENSE_MG
    } else {
        MAXG
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::format::KvFormat;
    use candle_core::Device;

    /// Keys one bit wider than values take the warp kernel's SIMT instance named after both
    /// widths, K4/V3 its tensor-core one (staging both widths); other mixed pairs, and f32
    /// queries over half scales, do not take the warp kernel (the caller sends them to the
    /// generic path).
    #[test]
    fn keys_one_bit_wider_take_the_mixed_warp_kernel() {
        let dims = Dims {
            batch: 1,
            heads: 8,
            head_dim: 128,
            kv_heads: 2,
            group: 4,
            max_blocks: 4,
            num_blocks: 8,
            block_size: 16,
        };
        let pool = |k: u32, v: u32, sdt: DType| {
            let f = |b| QuantFormat::new(b, 64).unwrap();
            let format = KvFormat::Affine {
                key: f(k),
                value: f(v),
                scale_dtype: sdt,
                rotated: false,
            };
            LayerKv::zeros(format, 128, 256, &Device::Cpu).unwrap()
        };
        let q = |dt: DType| Tensor::zeros((1, 8, 128), dt, &Device::Cpu).unwrap();
        for (k, v) in [(3, 2), (5, 4), (6, 5)] {
            let c = choose(&q(DType::F16), &pool(k, v, DType::F16), &dims).unwrap();
            assert!(c.warp, "K{k}/V{v}");
            assert_eq!(c.name, format!("decode_q_f16_b{k}v{v}_d128"));
            assert_eq!(c.smem, 0);
        }
        let c = choose(&q(DType::F16), &pool(4, 3, DType::F16), &dims).unwrap();
        assert_eq!(c.name, "decode_qm_f16_b4v3_d128_g64");
        // Two stages per warp of 32 rows: 64 + 48 code bytes and four 2-byte scale rows each.
        assert_eq!(c.smem, QW * 2 * 32 * (64 + 48 + 4 * 2 * 2));
        let c = choose(&q(DType::F16), &pool(4, 4, DType::F16), &dims).unwrap();
        assert_eq!(c.name, "decode_qm_f16_b4_d128_g64");
        for (k, v, qdt) in [(8, 4, DType::F16), (4, 5, DType::F16), (5, 4, DType::F32)] {
            let c = choose(&q(qdt), &pool(k, v, DType::F16), &dims).unwrap();
            assert!(!c.warp, "K{k}/V{v} {qdt:?}");
        }
    }
}
