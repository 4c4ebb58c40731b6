//! Decode attention: one new query token per sequence over its paged, optionally quantized cache
//! (docs/ARCHITECTURE.md).
//!
//! The kernels read the pool's blocks in place through each sequence's block table; quantized
//! blocks are never expanded to a dense copy. The CUDA kernel uses, per quantization group,
//! `q·k̂ = scale·(q·codes) + bias·Σq` and accumulates V as `Σ p·scale·code + Σ p·bias`; the CPU
//! kernel rebuilds each vector of values in registers (`code·scale + bias`, shared by the query
//! heads) and never stores it (`cpu` says why). Either way the per-value work is unpacking a
//! code and one multiply-add per query head. Grouped-query
//! attention: the `G = H / kv_heads` query heads of a KV head are handled together, so each K/V
//! row is read once for all of them. Softmax statistics are f32 and streamed: positions are split
//! into chunks, each chunk yields (max, sum, weighted V), and chunks are merged — which also lets
//! long contexts use every core (split-K).
//!
//! Three implementations, one contract:
//! - `cpu`: fused kernel, the thread pool over (sequence, position chunk);
//! - `cuda` (`--features cuda`): fused kernel of `kernels/decode.cu`, one thread block per
//!   (sequence, KV head, position split), plus a merge kernel;
//! - [`generic`]: gather → dequantize → dense attention with candle ops, for other backends and
//!   as the test reference.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod generic;

use candle_core::{DType, Device, Result, Tensor};
use std::borrow::Cow;

use crate::kv::format::rotation::Rotation;
use crate::kv::format::{LayerKv, QuantFormat};
use std::sync::atomic::{AtomicBool, Ordering};

static EXACT_ATTENTION: AtomicBool = AtomicBool::new(false);

/// Makes the CPU kernel attend over 4-bit caches in f32 (`--exact-attention`) instead of rounding
/// each query group and each V tile's softmax weights to 8 bits for integer dot products (`cpu`
/// module: its cost in KL is measured in README). Process-wide: set once from the command line.
pub fn set_exact_attention(on: bool) {
    EXACT_ATTENTION.store(on, Ordering::Relaxed);
}

/// Whether [`set_exact_attention`] is on.
pub fn exact_attention() -> bool {
    EXACT_ATTENTION.load(Ordering::Relaxed)
}

/// Whether the CPU kernel attends over keys of `format` at `head_dim` with 8-bit queries (and,
/// for 4-bit values, 8-bit weights) on this CPU (unless [`set_exact_attention`]).
pub fn cpu_int8_attention(format: &crate::kv::format::KvFormat, head_dim: usize) -> bool {
    cpu::int8_attention(format, head_dim)
}

/// Why a decode-attention call is refused; each message names the offending input.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("decode_attention: {0}")]
    Shape(String),
    #[error("decode_attention: sequence {seq}: {msg}")]
    Sequence { seq: usize, msg: String },
}

impl From<DecodeError> for candle_core::Error {
    fn from(e: DecodeError) -> Self {
        candle_core::Error::Msg(e.to_string())
    }
}

/// Sizes of one call, checked against each other.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Columns of the block table.
    pub max_blocks: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    pub block_size: usize,
}

fn shape_err(msg: String) -> candle_core::Error {
    DecodeError::Shape(msg).into()
}

/// Checks shapes and dtypes of all inputs (no data is read).
fn check_shapes(
    q: &Tensor,
    kv: &LayerKv,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    block_size: usize,
    num_kv_heads: usize,
) -> Result<Dims> {
    if !matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(shape_err(format!(
            "q must be f32, f16 or bf16, got {:?}",
            q.dtype()
        )));
    }
    let (batch, heads, head_dim) = q
        .dims3()
        .map_err(|_| shape_err(format!("q must be [B, H, D], got {:?}", q.dims())))?;
    if block_size == 0 || num_kv_heads == 0 || head_dim == 0 {
        return Err(shape_err(format!(
            "block_size ({block_size}), num_kv_heads ({num_kv_heads}) and head_dim ({head_dim}) must be at least 1"
        )));
    }
    if heads % num_kv_heads != 0 {
        return Err(shape_err(format!(
            "{heads} query heads are not a multiple of {num_kv_heads} KV heads"
        )));
    }
    let width = num_kv_heads * head_dim;
    let (rows, row_width) = kv.check_pool(head_dim, shape_err)?;
    if row_width != width {
        return Err(shape_err(format!(
            "cache rows hold {row_width} values; {num_kv_heads} KV heads x head_dim {head_dim} = {width}"
        )));
    }
    if rows % block_size != 0 {
        return Err(shape_err(format!(
            "pool of {rows} slots is not a whole number of blocks of {block_size}"
        )));
    }
    let max_blocks = match block_tables.dims() {
        [b, m] if *b == batch && block_tables.dtype() == DType::U32 => *m,
        d => {
            return Err(shape_err(format!(
                "block_tables must be u32 [{batch}, max_blocks], got {:?} {d:?}",
                block_tables.dtype()
            )))
        }
    };
    for (name, t) in [("starts", starts), ("lens", lens)] {
        if t.dims() != [batch] || t.dtype() != DType::U32 {
            return Err(shape_err(format!(
                "{name} must be u32 [{batch}], got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
    }
    let dev = q.device();
    let same = |t: &Tensor| t.device().same_device(dev);
    if !(kv.is_on(dev) && same(block_tables) && same(starts) && same(lens)) {
        return Err(shape_err(
            "q, the cache, block_tables, starts and lens must be on one device".into(),
        ));
    }
    Ok(Dims {
        batch,
        heads,
        head_dim,
        kv_heads: num_kv_heads,
        group: heads / num_kv_heads,
        max_blocks,
        num_blocks: rows / block_size,
        block_size,
    })
}

/// The host side of a step's block tables (row-major `[B, max_blocks]`), starts and lens, as
/// the step's plan built them before uploading: the CPU and generic paths use these instead of
/// reading the tensors back in every layer.
#[derive(Debug, Clone, Default)]
pub struct HostTables {
    pub tables: Vec<u32>,
    pub starts: Vec<u32>,
    pub lens: Vec<u32>,
}

impl HostTables {
    pub fn view(&self) -> HostView<'_> {
        HostView {
            tables: &self.tables,
            starts: &self.starts,
            lens: &self.lens,
        }
    }
}

/// [`HostTables`] borrowed, or put together from other slices (the residual window passes the
/// plan's tables with its own starts and lens, without copying the tables).
#[derive(Debug, Clone, Copy)]
pub struct HostView<'a> {
    pub tables: &'a [u32],
    pub starts: &'a [u32],
    pub lens: &'a [u32],
}

/// Host views of the block tables, starts and lens, checked against the pool: every visible
/// position must map to an existing block.
pub(crate) struct Tables<'a> {
    pub tables: Cow<'a, [u32]>,
    pub starts: Cow<'a, [u32]>,
    pub lens: Cow<'a, [u32]>,
}

/// Host u32s, borrowed from the plan or read back from a tensor.
type Ids<'a> = Cow<'a, [u32]>;

fn read_tables<'a>(
    dims: &Dims,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    host: Option<HostView<'a>>,
    allow_empty: bool,
) -> Result<Tables<'a>> {
    let (tables, starts, lens): (Ids, Ids, Ids) = match host {
        Some(h) => (
            Cow::Borrowed(h.tables),
            Cow::Borrowed(h.starts),
            Cow::Borrowed(h.lens),
        ),
        None => (
            Cow::Owned(block_tables.flatten_all()?.to_vec1()?),
            Cow::Owned(starts.to_vec1()?),
            Cow::Owned(lens.to_vec1()?),
        ),
    };
    if tables.len() != dims.batch * dims.max_blocks
        || starts.len() != dims.batch
        || lens.len() != dims.batch
    {
        return Err(shape_err(format!(
            "host tables of {} / {} / {} entries for {} sequences x {} blocks",
            tables.len(),
            starts.len(),
            lens.len(),
            dims.batch,
            dims.max_blocks
        )));
    }
    for b in 0..dims.batch {
        let (s, l) = (starts[b] as usize, lens[b] as usize);
        let err =
            |msg: String| -> candle_core::Error { DecodeError::Sequence { seq: b, msg }.into() };
        if !allow_empty && (l == 0 || s >= l) {
            return Err(err(format!(
                "needs start < len and len >= 1 (the new token), got start {s}, len {l}"
            )));
        }
        if s > l {
            return Err(err(format!("needs start <= len, got start {s}, len {l}")));
        }
        if l > dims.max_blocks * dims.block_size {
            return Err(err(format!(
                "len {l} exceeds its block table of {} blocks x {}",
                dims.max_blocks, dims.block_size
            )));
        }
        let row = &tables[b * dims.max_blocks..(b + 1) * dims.max_blocks];
        for &blk in &row[s / dims.block_size..l.div_ceil(dims.block_size)] {
            if blk as usize >= dims.num_blocks {
                return Err(err(format!(
                    "block id {blk} is outside the pool of {} blocks",
                    dims.num_blocks
                )));
            }
        }
    }
    Ok(Tables {
        tables,
        starts,
        lens,
    })
}

/// Decode attention: one new query token per sequence over its paged cache, reading the pool's
/// blocks directly — quantized blocks are never expanded to a dense copy: for a group,
/// `q·k̂ = scale·(q·codes) + bias·Σq` (and V accumulated as `p·(scale·code + bias)`).
///
/// `q`: `[B, H, D]` (after RoPE; f32/f16/bf16); `kv`: the layer's pool; `block_tables`: u32
/// `[B, max_blocks]` (row b = block ids of sequence b in position order; unused entries
/// arbitrary); `starts`: u32 `[B]`, the first visible position (sliding window: positions before
/// it are not attended and their blocks may be freed); `lens`: u32 `[B]`, positions `0..len`
/// exist (the new token's own K/V already written at `len - 1`). GQA: `H = kv_heads * G`, query
/// head h uses KV head `h / G`, with no K/V copies per query head. Softmax in f32. Returns
/// `[B, H, D]` in q's dtype.
///
/// On the CPU and the generic path, tables, starts and lens are checked (`start < len`, `len`
/// within the table, block ids within the pool) and a bad sequence is an error. The CUDA kernel
/// does not copy them back to the host (that would stall every decode step): it checks them on
/// the device and writes NaN for a sequence that fails those checks.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &Tensor,
    kv: &LayerKv,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
) -> Result<Tensor> {
    decode_attention_rotated(
        q,
        kv,
        block_tables,
        starts,
        lens,
        block_size,
        num_kv_heads,
        scale,
        None,
    )
}

/// [`decode_attention`] over a pool of rows stored rotated by `rot` (the `rotated` scheme;
/// `None`: plain rows): attends with `q·R` and rotates the output back (`o·Rᵀ`), so it returns
/// what attention over the unrotated rows would. The CUDA kernel for quantized head_dim 64 / 128
/// pools does both in place (Walsh-Hadamard transforms in its prologue and in its split merge);
/// elsewhere they are two small matmuls around the kernel.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_rotated(
    q: &Tensor,
    kv: &LayerKv,
    block_tables: &Tensor,
    starts: &Tensor,
    lens: &Tensor,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
    rot: Option<&Rotation>,
) -> Result<Tensor> {
    let tables = StepTables {
        tables: block_tables,
        starts,
        lens,
        host: None,
    };
    decode_attention_step(q, kv, &tables, block_size, num_kv_heads, scale, rot)
}

/// One decode step's block tables, starts and lens on the device, with their host copies when
/// the caller built them (see [`HostTables`]).
pub struct StepTables<'a> {
    pub tables: &'a Tensor,
    pub starts: &'a Tensor,
    pub lens: &'a Tensor,
    pub host: Option<HostView<'a>>,
}

/// Whether a CUDA decode step over a layer stored in `format` (head_dim `head_dim`, queries of
/// `q`) stays on the device's fused kernels, with no host reads: every format but mixed
/// key/value widths, and those where the warp kernel reads them (what CUDA graphs need).
#[cfg(feature = "cuda")]
pub fn cuda_fuses(format: &crate::kv::format::KvFormat, head_dim: usize, q: DType) -> bool {
    match format {
        crate::kv::format::KvFormat::Affine {
            key,
            value,
            scale_dtype,
            ..
        } if key != value => cuda::warp_reads(key, value, *scale_dtype, q, head_dim),
        _ => true,
    }
}

/// [`decode_attention_rotated`] with the step's tables as one argument.
pub fn decode_attention_step(
    q: &Tensor,
    kv: &LayerKv,
    step: &StepTables<'_>,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
    rot: Option<&Rotation>,
) -> Result<Tensor> {
    let (block_tables, starts, lens) = (step.tables, step.starts, step.lens);
    let dims = check_shapes(q, kv, block_tables, starts, lens, block_size, num_kv_heads)?;
    if dims.batch == 0 {
        return q.zeros_like();
    }
    // The fused kernels read K and V in one format, or keys one bit wider than values
    // (`QuantFormat::one_bit_wider`; CUDA: on its warp kernel, `cuda::reads`); other mixed
    // widths take the generic path (still only the visible rows are dequantized).
    let cpu_fused = cpu_fuses(kv);
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::reads(q, kv, &dims) {
        return cuda::decode(q, kv, &dims, block_tables, starts, lens, scale, rot);
    }
    let t = read_tables(&dims, block_tables, starts, lens, step.host, false)?;
    Ok(in_rotated_space(q, rot, |q| {
        let o = match q.device() {
            Device::Cpu if cpu_fused => cpu::decode(q, kv, &dims, &t, scale)?,
            _ => generic::decode_checked(q, kv, &dims, &t, scale)?,
        };
        Ok((o, ()))
    })?
    .0)
}

/// Whether the fused CPU kernel reads `kv`: K and V of one format, or keys one bit wider.
fn cpu_fuses(kv: &LayerKv) -> bool {
    match kv {
        LayerKv::Affine { kfmt, vfmt, .. } => {
            kfmt == vfmt || QuantFormat::one_bit_wider(*kfmt, *vfmt)
        }
        LayerKv::Dense { .. } => true,
    }
}

/// Runs `f` on `q` rotated into `rot`'s space (if any) and rotates its output back.
fn in_rotated_space<T>(
    q: &Tensor,
    rot: Option<&Rotation>,
    f: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
) -> Result<(Tensor, T)> {
    match rot {
        Some(r) => {
            let (o, x) = f(&r.rotate(q)?)?;
            Ok((r.unrotate(&o)?, x))
        }
        None => f(q),
    }
}

/// [`decode_attention_step`] on the CPU's fused kernel, with each query head's log-sum-exp of its
/// scaled scores (`[B·H]`, −∞ where a query has no positions): a query's `starts` may equal its
/// `lens` (no positions; zeros out). What attention over the quantized part of a history needs
/// to merge with attention over other rows (`kv::attend::residual`). Other devices and formats
/// without a fused CPU kernel are refused ([`cuda_step_window`] is CUDA's merge).
pub fn decode_attention_step_lse(
    q: &Tensor,
    kv: &LayerKv,
    step: &StepTables<'_>,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
    rot: Option<&Rotation>,
) -> Result<(Tensor, Vec<f32>)> {
    let (block_tables, starts, lens) = (step.tables, step.starts, step.lens);
    let dims = check_shapes(q, kv, block_tables, starts, lens, block_size, num_kv_heads)?;
    if !q.device().is_cpu() || !cpu_fuses(kv) {
        return Err(shape_err(
            "merging with other rows needs the fused CPU kernel (a CPU cache with K and V of one \
             width, or keys one bit wider)"
                .into(),
        ));
    }
    if dims.batch == 0 {
        return Ok((q.zeros_like()?, Vec::new()));
    }
    let t = read_tables(&dims, block_tables, starts, lens, step.host, true)?;
    in_rotated_space(q, rot, |q| cpu::decode_lse(q, kv, &dims, &t, scale))
}

/// [`decode_attention_step`] on the CUDA kernels, merged with `--kv-residual`'s dense rows
/// `rows` (each query's sinks and window; the step's tables cover the quantized part only): the
/// quantized layers the fused kernels read. What `kv::attend::residual::gpu` runs.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub fn cuda_step_window(
    q: &Tensor,
    kv: &LayerKv,
    step: &StepTables<'_>,
    block_size: usize,
    num_kv_heads: usize,
    scale: f32,
    rot: Option<&Rotation>,
    rows: &DenseRows<'_>,
) -> Result<Tensor> {
    let (block_tables, starts, lens) = (step.tables, step.starts, step.lens);
    let dims = check_shapes(q, kv, block_tables, starts, lens, block_size, num_kv_heads)?;
    if !q.device().is_cuda() || !cuda::reads(q, kv, &dims) {
        return Err(shape_err(
            "merging with other rows on a GPU needs the fused CUDA kernels (a quantized CUDA \
             cache with K and V of one width, or keys one bit wider at head_dim 64 or 128)"
                .into(),
        ));
    }
    if dims.batch == 0 {
        return q.zeros_like();
    }
    cuda::decode_window(q, kv, &dims, (block_tables, starts, lens), scale, rot, rows)
}

#[cfg(feature = "cuda")]
pub use cuda::residual::DenseRows;
