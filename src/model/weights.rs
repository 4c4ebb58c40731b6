//! Where the decoder's tensors come from: a GGUF file (kept quantized for candle's QMatMul, or
//! dequantized with `--dequantize`), safetensors in the compute dtype, or random weights of a
//! real shape (`--load-format dummy`).
//!
//! The decoder asks for tensors by logical name ([`Name`]); each source maps names to its own
//! naming scheme. GGUF files of the Llama architecture store Q and K rows permuted for
//! interleaved RoPE (llama.cpp's converter does this); we undo the permutation on load, on the raw
//! quantized rows, so the model has one RoPE layout (rotate-half) for every source.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::borrow::Cow;
use std::path::{Path, PathBuf};

use super::config::{Arch, ModelConfig};
use crate::ops::row_matmul;

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
        }
    }

    fn hf(self) -> String {
        match self {
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
        }
    }
}

/// A projection `y = x Wᵀ (+ b)`; W quantized (GGUF) or dense.
#[derive(Debug, Clone)]
pub struct Linear {
    w: QMatMul,
    b: Option<Tensor>,
}

impl Linear {
    /// Whether the weight stays in a quantized GGUF block type (candle's QMatMul).
    pub fn is_quantized(&self) -> bool {
        matches!(self.w, QMatMul::QTensor(_))
    }

    /// `x`: [T, in] → [T, out]. Dense weights on the CPU (f32, f16, bf16) go through
    /// [`row_matmul`](crate::ops::row_matmul), so each output row depends only on its own input
    /// row, however many rows share the call (batch invariance; it is also faster than candle's
    /// gemm at these shapes).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            QMatMul::Tensor(w) if row_matmul::supports(x, w) => row_matmul::matmul_t(x, w)?,
            w => w.forward(x)?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

struct GgufSource {
    path: PathBuf,
    file: std::fs::File,
    content: gguf_file::Content,
    dequantize: bool,
    /// Undo llama.cpp's Q/K row permutation (Llama-architecture GGUF only).
    unpermute_qk: bool,
}

enum Source {
    Gguf(Box<GgufSource>),
    Safetensors(candle_nn::VarBuilder<'static>),
    Dummy,
}

/// Whether a GGUF model should run on dense weights by default: on the CPU, candle multiplies
/// Q4_1, Q5_0 and Q5_1 blocks with scalar code (no SIMD kernel), several times slower than a
/// dense f32 matmul of the same layer; for such a model, and when the dense copy takes at most
/// half the available memory, dense wins on speed and is exact (no 8-bit activation rounding).
pub fn dense_is_better(content: &gguf_file::Content, device: &Device, dtype: DType) -> bool {
    if !device.is_cpu() {
        return false;
    }
    let scalar_only =
        |t: GgmlDType| matches!(t, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1);
    if !content
        .tensor_infos
        .values()
        .any(|i| scalar_only(i.ggml_dtype))
    {
        return false;
    }
    let dense_bytes: usize = content
        .tensor_infos
        .values()
        .map(|i| i.shape.elem_count() * dtype.size_in_bytes())
        .sum();
    dense_bytes <= available_memory() / 2
}

/// Memory the OS can give us now (Linux `MemAvailable`; 4 GiB where it cannot be read).
pub fn available_memory() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map_or(4 << 30, |kb| kb * 1024)
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
        dequantize: bool,
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
            dequantize,
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
            Source::Safetensors(vb) => vb.contains_tensor(&format!("{}.weight", name.hf())),
            Source::Dummy => match name {
                Name::LmHead => !self.cfg.tie_word_embeddings,
                Name::QNorm(_) | Name::KNorm(_) => self.cfg.qk_norm,
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
            Source::Safetensors(vb) => vb
                .get(shape, &format!("{}.weight", name.hf()))
                .with_context(|| format!("weight {}", name.hf()))?,
            Source::Dummy => match name {
                Name::AttnNorm(_)
                | Name::FfnNorm(_)
                | Name::OutputNorm
                | Name::QNorm(_)
                | Name::KNorm(_) => Tensor::ones(shape, self.dtype, &self.device)?,
                _ => Tensor::randn(0f32, 0.02, shape, &self.device)?.to_dtype(self.dtype)?,
            },
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
                let mut q = g.qtensor(&format!("{base}.weight"), &load_dev)?;
                if let Some(h) = heads {
                    q = unpermute_rows(&q, h, &self.device)?;
                }
                if q.shape().dims() != [out_dim, in_dim] {
                    bail!(
                        "tensor {base}.weight has shape {:?}, the config expects [{out_dim}, {in_dim}]",
                        q.shape().dims()
                    );
                }
                let w = if g.dequantize || is_float(q.dtype()) {
                    QMatMul::Tensor(q.dequantize(&self.device)?.to_dtype(self.dtype)?)
                } else {
                    QMatMul::from_qtensor(q)?
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
                let base = name.hf();
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
                (QMatMul::Tensor(w), b)
            }
            Source::Dummy => {
                let w = Tensor::randn(0f32, 0.02, (out_dim, in_dim), &self.device)?
                    .to_dtype(self.dtype)?;
                let b = if bias {
                    Some(Tensor::zeros(out_dim, self.dtype, &self.device)?)
                } else {
                    None
                };
                (QMatMul::Tensor(w), b)
            }
        };
        Ok(Linear { w, b })
    }

    /// The output projection: `lm_head`, or the token embeddings when they are tied. For GGUF the
    /// embedding matrix stays quantized here too.
    pub fn lm_head(&mut self, vocab: usize, hidden: usize, embed: &Tensor) -> Result<Linear> {
        if self.has(Name::LmHead) {
            return self.linear(Name::LmHead, hidden, vocab, false);
        }
        if let Source::Gguf(g) = &mut self.source {
            if !g.dequantize {
                let q = g.qtensor("token_embd.weight", &self.device)?;
                if !is_float(q.dtype()) {
                    return Ok(Linear {
                        w: QMatMul::from_qtensor(q)?,
                        b: None,
                    });
                }
            }
        }
        Ok(Linear {
            w: QMatMul::Tensor(embed.clone()),
            b: None,
        })
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
    let rows = dims[0];
    if !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        bail!("cannot un-permute {rows} rows into {heads} heads");
    }
    let d = rows / heads;
    let data = q.data()?;
    let row_bytes = data.len() / rows;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for half in 0..2 {
            for i in 0..d / 2 {
                let src = h * d + 2 * i + half;
                let dst = h * d + half * (d / 2) + i;
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    let storage = QStorage::from_data(Cow::Owned(out), device, q.dtype())?;
    Ok(QTensor::new(storage, dims)?)
}
