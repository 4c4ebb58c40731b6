//! Where the decoder's tensors come from: a GGUF file ([`GgufMath`]: kept in its blocks for
//! kvq's CPU kernels, for candle's QMatMul, or dequantized with `--dequantize`), safetensors in
//! the compute dtype, or random weights of a real shape (`--load-format dummy`).
//!
//! The decoder asks for tensors by logical name ([`Name`]); each source maps names to its own
//! naming scheme. GGUF files of the Llama architecture store Q and K rows permuted for
//! interleaved RoPE (llama.cpp's converter does this); we undo the permutation on load, on the raw
//! quantized rows, so the model has one RoPE layout (rotate-half) for every source.

// Data here comes from files, HTTP bodies and the command line: no unwrap, expect or indexing
// that could panic on it (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::config::{Arch, ModelConfig};
use super::linear::{Embedding, Linear, Weight};
use crate::ops::gguf::QMatrix;

/// A decoder tensor, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Name {
    Embed,
    OutputNorm,
    LmHead,
    AttnNorm(usize),
    FfnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QNorm(usize),
    KNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// Gemma: norm of the attention output before the residual add.
    PostAttnNorm(usize),
    /// Gemma: norm of the MLP output before the residual add.
    PostFfnNorm(usize),
    /// Phi-3: q, k and v projections in one matrix (rows q, then k, then v).
    Qkv(usize),
    /// Phi-3: gate and up projections in one matrix (rows gate, then up).
    GateUp(usize),
}

impl Name {
    fn gguf(self) -> String {
        match self {
            Name::Embed => "token_embd".into(),
            Name::OutputNorm => "output_norm".into(),
            Name::LmHead => "output".into(),
            Name::AttnNorm(l) => format!("blk.{l}.attn_norm"),
            Name::FfnNorm(l) => format!("blk.{l}.ffn_norm"),
            Name::Q(l) => format!("blk.{l}.attn_q"),
            Name::K(l) => format!("blk.{l}.attn_k"),
            Name::V(l) => format!("blk.{l}.attn_v"),
            Name::O(l) => format!("blk.{l}.attn_output"),
            Name::QNorm(l) => format!("blk.{l}.attn_q_norm"),
            Name::KNorm(l) => format!("blk.{l}.attn_k_norm"),
            Name::Gate(l) => format!("blk.{l}.ffn_gate"),
            Name::Up(l) => format!("blk.{l}.ffn_up"),
            Name::Down(l) => format!("blk.{l}.ffn_down"),
            Name::PostAttnNorm(l) => format!("blk.{l}.post_attention_norm"),
            Name::PostFfnNorm(l) => format!("blk.{l}.post_ffw_norm"),
            Name::Qkv(l) => format!("blk.{l}.attn_qkv"),
            // llama.cpp keeps Phi-3's fused gate/up under the up projection's name.
            Name::GateUp(l) => format!("blk.{l}.ffn_up"),
        }
    }

    /// Whether this is an RMS-norm weight (Gemma's Hugging Face weights hold `w` for `1 + w`).
    fn is_norm(self) -> bool {
        matches!(
            self,
            Name::AttnNorm(_)
                | Name::FfnNorm(_)
                | Name::OutputNorm
                | Name::QNorm(_)
                | Name::KNorm(_)
                | Name::PostAttnNorm(_)
                | Name::PostFfnNorm(_)
        )
    }

    fn hf(self, arch: Arch) -> String {
        match self {
            // Gemma's norm before the MLP is its "pre-feedforward" norm; its
            // post_attention_layernorm normalizes the attention output instead.
            Name::FfnNorm(l) if arch.is_gemma() => {
                format!("model.layers.{l}.pre_feedforward_layernorm")
            }
            Name::Embed => "model.embed_tokens".into(),
            Name::OutputNorm => "model.norm".into(),
            Name::LmHead => "lm_head".into(),
            Name::AttnNorm(l) => format!("model.layers.{l}.input_layernorm"),
            Name::FfnNorm(l) => format!("model.layers.{l}.post_attention_layernorm"),
            Name::Q(l) => format!("model.layers.{l}.self_attn.q_proj"),
            Name::K(l) => format!("model.layers.{l}.self_attn.k_proj"),
            Name::V(l) => format!("model.layers.{l}.self_attn.v_proj"),
            Name::O(l) => format!("model.layers.{l}.self_attn.o_proj"),
            Name::QNorm(l) => format!("model.layers.{l}.self_attn.q_norm"),
            Name::KNorm(l) => format!("model.layers.{l}.self_attn.k_norm"),
            Name::Gate(l) => format!("model.layers.{l}.mlp.gate_proj"),
            Name::Up(l) => format!("model.layers.{l}.mlp.up_proj"),
            Name::Down(l) => format!("model.layers.{l}.mlp.down_proj"),
            Name::PostAttnNorm(l) => format!("model.layers.{l}.post_attention_layernorm"),
            Name::PostFfnNorm(l) => format!("model.layers.{l}.post_feedforward_layernorm"),
            Name::Qkv(l) => format!("model.layers.{l}.self_attn.qkv_proj"),
            Name::GateUp(l) => format!("model.layers.{l}.mlp.gate_up_proj"),
        }
    }
}

/// How a GGUF model's matmuls are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufMath {
    /// Weights dequantized to dense `--dtype` tensors (`--dequantize`).
    Dense,
    /// Weights kept in their blocks, multiplied by kvq's CPU kernels ([`crate::ops::gguf`]):
    /// the dense f32 product of the dequantized weights (the CPU default).
    Blocks,
    /// candle's QMatMul (activations rounded to 8-bit blocks; `--keep-quantized`, and GPUs).
    Candle,
}

struct GgufSource {
    path: PathBuf,
    file: std::fs::File,
    content: gguf_file::Content,
    math: GgufMath,
    /// Undo llama.cpp's Q/K row permutation (Llama-architecture GGUF only).
    unpermute_qk: bool,
}

enum Source {
    Gguf(Box<GgufSource>),
    Safetensors(candle_nn::VarBuilder<'static>),
    Dummy,
}

/// Loads decoder tensors on one device in one compute dtype.
pub struct Weights {
    source: Source,
    device: Device,
    dtype: DType,
    cfg: ModelConfig,
}

impl Weights {
    /// Opens a GGUF file: reads and checks its header (a truncated file is reported here, not
    /// half-way through loading).
    pub fn gguf(
        path: &Path,
        cfg: &ModelConfig,
        content: gguf_file::Content,
        device: &Device,
        dtype: DType,
        math: GgufMath,
    ) -> Result<Self> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot open model file {}", path.display()))?;
        let len = file.metadata()?.len();
        let mut needed = content.tensor_data_offset;
        for (name, info) in content.tensor_infos.iter() {
            let bytes = tensor_bytes(info)
                .with_context(|| format!("tensor {name} in {}", path.display()))?;
            needed = needed.max(content.tensor_data_offset + info.offset + bytes as u64);
        }
        if len < needed {
            bail!(
                "model file {} is truncated: its header needs {needed} bytes but the file has {len}",
                path.display()
            );
        }
        let src = GgufSource {
            path: path.to_path_buf(),
            file,
            content,
            math,
            unpermute_qk: cfg.arch == Arch::Llama || cfg.arch == Arch::Mistral,
        };
        Ok(Self {
            source: Source::Gguf(Box::new(src)),
            device: device.clone(),
            dtype,
            cfg: cfg.clone(),
        })
    }

    /// Memory-maps safetensors files (single or sharded) in `dtype`.
    pub fn safetensors(
        files: &[PathBuf],
        cfg: &ModelConfig,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        // SAFETY: the files are not modified while mapped (the usual safetensors contract).
        let vb = unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(files, dtype, device) }
            .context("cannot read safetensors weights")?;
        Ok(Self {
            source: Source::Safetensors(vb),
            device: device.clone(),
            dtype,
            cfg: cfg.clone(),
        })
    }

    /// Random N(0, 0.02²) weights (norm weights 1) of the config's shape.
    pub fn dummy(cfg: &ModelConfig, device: &Device, dtype: DType, seed: u64) -> Result<Self> {
        device.set_seed(seed).ok();
        Ok(Self {
            source: Source::Dummy,
            device: device.clone(),
            dtype,
            cfg: cfg.clone(),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn has(&self, name: Name) -> bool {
        match &self.source {
            Source::Gguf(g) => g
                .content
                .tensor_infos
                .contains_key(&format!("{}.weight", name.gguf())),
            Source::Safetensors(vb) => {
                vb.contains_tensor(&format!("{}.weight", name.hf(self.cfg.arch)))
            }
            Source::Dummy => match name {
                Name::LmHead => !self.cfg.tie_word_embeddings,
                Name::QNorm(_) | Name::KNorm(_) => self.cfg.qk_norm,
                Name::PostAttnNorm(_) | Name::PostFfnNorm(_) => self.cfg.arch.is_gemma(),
                Name::Qkv(_) | Name::GateUp(_) => self.cfg.arch == Arch::Phi3,
                Name::Q(_) | Name::K(_) | Name::V(_) | Name::Gate(_) | Name::Up(_) => {
                    self.cfg.arch != Arch::Phi3
                }
                _ => true,
            },
        }
    }

    /// A dense vector or matrix (norm weights, embeddings) in the compute dtype.
    pub fn dense(&mut self, name: Name, shape: &[usize]) -> Result<Tensor> {
        let t = match &mut self.source {
            Source::Gguf(g) => {
                let q = g.qtensor(&format!("{}.weight", name.gguf()), &self.device)?;
                q.dequantize(&self.device)?.to_dtype(self.dtype)?
            }
            Source::Safetensors(vb) => {
                let hf = name.hf(self.cfg.arch);
                let t = vb
                    .get(shape, &format!("{hf}.weight"))
                    .with_context(|| format!("weight {hf}"))?;
                if self.cfg.arch.is_gemma() && name.is_norm() {
                    // One norm for every source: GGUF already stores 1 + w.
                    t.affine(1.0, 1.0)?
                } else {
                    t
                }
            }
            Source::Dummy if name.is_norm() => Tensor::ones(shape, self.dtype, &self.device)?,
            Source::Dummy => {
                Tensor::randn(0f32, 0.02, shape, &self.device)?.to_dtype(self.dtype)?
            }
        };
        if t.dims() != shape {
            bail!(
                "weight {:?} has shape {:?}, the config expects {:?}",
                name,
                t.dims(),
                shape
            );
        }
        Ok(t)
    }

    /// A projection of `in_dim` → `out_dim` (weight `[out, in]`), with its bias when `bias`.
    pub fn linear(
        &mut self,
        name: Name,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let (w, b) = match &mut self.source {
            Source::Gguf(g) => {
                let base = name.gguf();
                let heads = match name {
                    Name::Q(_) if g.unpermute_qk => Some(self.cfg.num_heads),
                    Name::K(_) if g.unpermute_qk => Some(self.cfg.num_kv_heads),
                    _ => None,
                };
                // Permuted tensors are read on the CPU, where their raw rows are reachable.
                let load_dev = if heads.is_some() {
                    Device::Cpu
                } else {
                    self.device.clone()
                };
                // Checked before reading and un-permuting (which divides by the row count).
                let name = format!("{base}.weight");
                if let Some(info) = g.content.tensor_infos.get(&name) {
                    if info.shape.dims() != [out_dim, in_dim] {
                        bail!(
                            "tensor {name} has shape {:?}, the config expects [{out_dim}, {in_dim}]",
                            info.shape.dims()
                        );
                    }
                }
                let mut q = g.qtensor(&name, &load_dev)?;
                if let Some(h) = heads {
                    q = unpermute_rows(&q, h, &self.device)?;
                }
                let w = if g.math == GgufMath::Dense || is_float(q.dtype()) {
                    Weight::Candle(QMatMul::Tensor(
                        q.dequantize(&self.device)?.to_dtype(self.dtype)?,
                    ))
                } else if g.math == GgufMath::Blocks && QMatrix::supports(&q) {
                    Weight::Blocks(Arc::new(QMatrix::new(&q)?))
                } else {
                    Weight::Candle(QMatMul::from_qtensor(q)?)
                };
                let b = if bias {
                    let bq = g.qtensor(&format!("{base}.bias"), &self.device)?;
                    Some(bq.dequantize(&self.device)?.to_dtype(self.dtype)?)
                } else {
                    None
                };
                (w, b)
            }
            Source::Safetensors(vb) => {
                let base = name.hf(self.cfg.arch);
                let w = vb
                    .get((out_dim, in_dim), &format!("{base}.weight"))
                    .with_context(|| format!("weight {base}.weight"))?;
                let b = if bias {
                    Some(
                        vb.get(out_dim, &format!("{base}.bias"))
                            .with_context(|| format!("weight {base}.bias"))?,
                    )
                } else {
                    None
                };
                (Weight::Candle(QMatMul::Tensor(w)), b)
            }
            Source::Dummy => {
                let w = Tensor::randn(0f32, 0.02, (out_dim, in_dim), &self.device)?
                    .to_dtype(self.dtype)?;
                let b = if bias {
                    Some(Tensor::zeros(out_dim, self.dtype, &self.device)?)
                } else {
                    None
                };
                (Weight::Candle(QMatMul::Tensor(w)), b)
            }
        };
        Ok(Linear::new(w, b))
    }

    /// The token embeddings `[vocab, hidden]`: kept in their GGUF blocks where the model's
    /// matmuls are ([`GgufMath::Blocks`]; rows are dequantized as they are looked up), else
    /// dense in the compute dtype.
    pub fn embedding(&mut self, vocab: usize, hidden: usize) -> Result<Embedding> {
        if let Source::Gguf(g) = &mut self.source {
            if g.math == GgufMath::Blocks && self.device.is_cpu() {
                let q = g.qtensor("token_embd.weight", &self.device)?;
                if QMatrix::supports(&q) {
                    let m = Arc::new(QMatrix::new(&q)?);
                    if m.dims() != (vocab, hidden) {
                        bail!(
                            "tensor token_embd.weight has shape {:?}, the config expects [{vocab}, {hidden}]",
                            m.dims()
                        );
                    }
                    return Ok(Embedding::Blocks(m, self.dtype));
                }
            }
        }
        Ok(Embedding::Dense(self.dense(Name::Embed, &[vocab, hidden])?))
    }

    /// The output projection: `lm_head`, or the token embeddings when they are tied. For GGUF the
    /// embedding matrix stays quantized here too (the same blocks as the lookup's, where those
    /// are kept in blocks).
    pub fn lm_head(&mut self, vocab: usize, hidden: usize, embed: &Embedding) -> Result<Linear> {
        if self.has(Name::LmHead) {
            return self.linear(Name::LmHead, hidden, vocab, false);
        }
        let dense = match embed {
            Embedding::Blocks(m, _) => return Ok(Linear::new(Weight::Blocks(m.clone()), None)),
            Embedding::Dense(t) => t,
        };
        if let Source::Gguf(g) = &mut self.source {
            if g.math == GgufMath::Candle {
                let q = g.qtensor("token_embd.weight", &self.device)?;
                if !is_float(q.dtype()) {
                    return Ok(Linear::new(Weight::Candle(QMatMul::from_qtensor(q)?), None));
                }
            }
        }
        Ok(Linear::new(
            Weight::Candle(QMatMul::Tensor(dense.clone())),
            None,
        ))
    }
}

impl GgufSource {
    fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            bail!("model file {} has no tensor {name}", self.path.display());
        }
        self.content
            .tensor(&mut self.file, name, device)
            .with_context(|| format!("cannot read tensor {name} from {}", self.path.display()))
    }
}

fn is_float(t: GgmlDType) -> bool {
    matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

fn tensor_bytes(info: &gguf_file::TensorInfo) -> Result<usize> {
    let n = info.shape.elem_count();
    let bs = info.ggml_dtype.block_size();
    if !n.is_multiple_of(bs) {
        bail!("{} elements do not fill {:?} blocks", n, info.ggml_dtype);
    }
    Ok(n / bs * info.ggml_dtype.type_size())
}

/// Inverts llama.cpp's permutation of Q/K rows: within each head of `d` rows, GGUF row
/// `2i + half` is Hugging Face row `half * d/2 + i`. Rows are whole quantization blocks, so the
/// raw bytes move without requantizing.
fn unpermute_rows(q: &QTensor, heads: usize, device: &Device) -> Result<QTensor> {
    let dims = q.shape().dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if rows == 0 || heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        bail!("cannot un-permute {rows} rows into {heads} heads");
    }
    let d = rows / heads;
    let data = q.data()?;
    if !data.len().is_multiple_of(rows) {
        bail!("{} bytes do not split into {rows} rows", data.len());
    }
    let src_rows: Vec<&[u8]> = data.chunks_exact(data.len() / rows).collect();
    // Hugging Face row `dst` (head h, half, i) is GGUF row h*d + 2i + half.
    let mut out = Vec::with_capacity(data.len());
    for dst in 0..rows {
        let (h, r) = (dst / d, dst % d);
        let (half, i) = (r / (d / 2), r % (d / 2));
        let src = src_rows
            .get(h * d + 2 * i + half)
            .context("un-permuting Q/K rows: row out of range")?;
        out.extend_from_slice(src);
    }
    let storage = QStorage::from_data(Cow::Owned(out), device, q.dtype())?;
    Ok(QTensor::new(storage, dims)?)
}
