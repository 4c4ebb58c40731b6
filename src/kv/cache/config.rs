//! What a cache looks like — its shape, per-layer formats, staging, window and pool sizes —
//! built from plain [`KvOptions`] and the model's [`ModelShape`] by one function
//! ([`KvOptions::cache_config`]) that every subcommand uses, and sized by one rule per use
//! ([`PoolSizing`]).

// The options come from the command line: no unwrap, expect or indexing that could panic on them
// (issue 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use candle_core::DType;

use crate::kv::format::rotation::Rotation;
use crate::kv::format::{scale_dtype_for, KvFormat, QuantFormat};

/// Why a set of KV options cannot make a cache (messages name the flags users type).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OptionsError(pub String);

type OptResult<T> = std::result::Result<T, OptionsError>;

fn fail<T>(msg: impl Into<String>) -> OptResult<T> {
    Err(OptionsError(msg.into()))
}

/// How quantized K/V are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// Plain MLX-compatible affine groups.
    Affine,
    /// A seeded randomized Hadamard rotation per head before affine quantization.
    Rotated,
}

impl QuantScheme {
    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Affine => "affine",
            QuantScheme::Rotated => "rotated",
        }
    }
}

/// The KV cache options of every subcommand, as plain data (the CLI's `--kv-*` flags).
#[derive(Debug, Clone, PartialEq)]
pub struct KvOptions {
    /// Bits of K and V (`None` with no per-side width: a dense cache).
    pub bits: Option<u32>,
    pub key_bits: Option<u32>,
    pub value_bits: Option<u32>,
    pub group_size: Option<usize>,
    pub quantized_kv_start: usize,
    /// `last`, `first` or comma-separated indices (negative from the end).
    pub dense_layers: Option<String>,
    pub max_kv_size: Option<usize>,
    pub block_size: usize,
    pub scheme: Option<QuantScheme>,
    /// dtype of dense pools (a dense cache, dense layers, staging); `None`: the compute dtype.
    pub dense_dtype: Option<DType>,
    /// `--kv-residual`: each query attends its newest this-many positions through dense (f16)
    /// copies of their rows instead of the quantized ones (0: off).
    pub residual: usize,
    /// `--kv-sinks`: the first this-many positions of a sequence too (needs `residual`).
    pub sinks: usize,
    /// `--kv-center`: quantized layers store keys minus their sequence's mean
    /// (`kv::cache::center`).
    pub center: bool,
    /// `bits` is a budget whose best setting `kv::preset::resolve` picks for the model (the
    /// CLI's `--kv-bits 4` / `3` given alone); resolved before [`KvOptions::cache_config`].
    pub preset: bool,
}

impl Default for KvOptions {
    fn default() -> Self {
        Self {
            bits: None,
            key_bits: None,
            value_bits: None,
            group_size: None,
            quantized_kv_start: 0,
            dense_layers: None,
            max_kv_size: None,
            block_size: 16,
            scheme: None,
            dense_dtype: None,
            residual: 0,
            sinks: 0,
            center: false,
            preset: false,
        }
    }
}

/// Most positions `--kv-residual` keeps dense.
pub const MAX_RESIDUAL: usize = 4096;
/// Most positions `--kv-sinks` keeps dense.
pub const MAX_SINKS: usize = 256;

/// The model dimensions a cache is shaped by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Each layer's own sliding window (`None`: global); empty: no layer has one.
    pub layer_windows: Vec<Option<usize>>,
    /// The context window: no sequence holds more positions.
    pub max_positions: usize,
}

/// How many blocks the pools get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSizing {
    /// Room for `max_batch` sequences of up to `tokens` tokens each, fed in prompt chunks of
    /// `chunk` tokens (a sliding window caps what each can hold).
    Sequences {
        tokens: usize,
        max_batch: usize,
        chunk: usize,
    },
    /// A memory budget of `bytes` for the main pools, shared by the layer groups as a sequence
    /// of up to `tokens` tokens in chunks of `chunk` uses them (windowed groups get no more than
    /// `max_batch` sequences can hold while a global group takes the rest); staging for
    /// `max_batch`.
    Budget {
        bytes: usize,
        tokens: usize,
        max_batch: usize,
        chunk: usize,
    },
    /// One sequence at a time of up to `tokens` tokens in chunks of `chunk` (perplexity
    /// windows): the most it can hold at once, plus one block.
    Window { tokens: usize, chunk: usize },
}

impl KvOptions {
    /// Checks the options on their own (model-independent).
    pub fn validate(&self) -> OptResult<()> {
        if self.block_size == 0 || self.block_size > 4096 {
            return fail(format!(
                "--kv-block-size must be between 1 and 4096 (got {})",
                self.block_size
            ));
        }
        if !self.is_quantized() {
            for (set, flag) in [
                (self.group_size.is_some(), "--kv-group-size"),
                (self.quantized_kv_start > 0, "--quantized-kv-start"),
                (self.dense_layers.is_some(), "--kv-dense-layers"),
                (self.scheme.is_some(), "--kv-quant-scheme"),
                (self.residual > 0, "--kv-residual"),
                (self.sinks > 0, "--kv-sinks"),
                (self.center, "--kv-center"),
            ] {
                if set {
                    return fail(format!(
                        "{flag} only applies to a quantized cache: add --kv-bits"
                    ));
                }
            }
        }
        self.quant_formats()?;
        if self.max_kv_size == Some(0) {
            return fail("--max-kv-size must be at least 1");
        }
        if self.residual > MAX_RESIDUAL {
            return fail(format!(
                "--kv-residual must be between 0 and {MAX_RESIDUAL} (got {})",
                self.residual
            ));
        }
        if self.sinks > MAX_SINKS {
            return fail(format!(
                "--kv-sinks must be between 0 and {MAX_SINKS} (got {})",
                self.sinks
            ));
        }
        if self.sinks > 0 && self.residual == 0 {
            return fail("--kv-sinks needs --kv-residual (at least 1)");
        }
        if self.center && self.quantized_kv_start > 0 {
            return fail(
                "--kv-center cannot be combined with --quantized-kv-start (staged rows are kept \
                 as they come and would be moved uncentred)",
            );
        }
        if self.residual > 0 && self.quantized_kv_start > 0 {
            return fail(
                "--kv-residual cannot be combined with --quantized-kv-start (a staged sequence \
                 is dense already; its rows would have no dense copies once moved)",
            );
        }
        Ok(())
    }

    /// The scheme for a model with this head_dim: the chosen one, else rotated where the
    /// Hadamard transform applies.
    pub fn scheme_for(&self, head_dim: usize) -> QuantScheme {
        self.scheme.unwrap_or(if head_dim.is_power_of_two() {
            QuantScheme::Rotated
        } else {
            QuantScheme::Affine
        })
    }

    /// What the dense window and centring add to a setting's name: " + 60 dense + 4 sinks,
    /// centred keys", or nothing.
    pub fn window_label(&self) -> String {
        let mut s = String::new();
        if self.residual > 0 {
            s += &format!(" + {} dense", self.residual);
        }
        if self.sinks > 0 {
            s += &format!(" + {} sinks", self.sinks);
        }
        if self.center {
            s += ", centred keys";
        }
        s
    }

    /// Whether any of the widths asks for a quantized cache.
    pub fn is_quantized(&self) -> bool {
        self.bits.is_some() || self.key_bits.is_some() || self.value_bits.is_some()
    }

    /// The key and value formats, or `None` for a dense cache.
    pub fn quant_formats(&self) -> OptResult<Option<(QuantFormat, QuantFormat)>> {
        if !self.is_quantized() {
            return Ok(None);
        }
        let g = self.group_size.unwrap_or(64);
        let side = |own: Option<u32>, flag: &str| -> OptResult<QuantFormat> {
            let (bits, from) = match (own, self.bits) {
                (Some(b), _) => (b, flag),
                (None, Some(b)) => (b, "--kv-bits"),
                (None, None) => {
                    return fail(format!(
                        "{flag} is missing: give --kv-bits for both halves, or both \
                         --kv-key-bits and --kv-value-bits"
                    ))
                }
            };
            QuantFormat::new(bits, g)
                .map_err(|e| OptionsError(format!("{from} {bits} --kv-group-size {g}: {e}")))
        };
        Ok(Some((
            side(self.key_bits, "--kv-key-bits")?,
            side(self.value_bits, "--kv-value-bits")?,
        )))
    }

    /// The layers `dense_layers` names, resolved against `n` layers.
    fn dense_layer_list(&self, n: usize) -> OptResult<Vec<usize>> {
        let Some(spec) = &self.dense_layers else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for part in spec.split(',').map(str::trim) {
            let idx: i64 = match part {
                "last" => -1,
                "first" => 0,
                p => p.parse().map_err(|_| {
                    OptionsError(format!(
                        "--kv-dense-layers: '{p}' is not a layer index (use last, first or integers)"
                    ))
                })?,
            };
            let l = if idx < 0 { n as i64 + idx } else { idx };
            if l < 0 || l >= n as i64 {
                return fail(format!(
                    "--kv-dense-layers: layer {idx} is out of range for a {n}-layer model"
                ));
            }
            out.push(l as usize);
        }
        Ok(out)
    }

    /// The cache these options ask for, for a model of `shape` computing in `dtype` (dense and
    /// staging pools in `dense_dtype`, else `dtype`; affine scales and biases in
    /// [`scale_dtype_for`] `dtype`), with its pools sized by `sizing`. Allocates nothing.
    pub fn cache_config(
        &self,
        shape: ModelShape,
        dtype: DType,
        sizing: PoolSizing,
    ) -> OptResult<CacheConfig> {
        self.validate()?;
        if self.preset {
            return fail("--kv-bits: the budget was not resolved for the model (kv::preset)");
        }
        let ModelShape {
            num_layers,
            num_kv_heads,
            head_dim,
            layer_windows,
            max_positions,
        } = shape;
        let dense = self.dense_dtype.unwrap_or(dtype);
        let mut cfg = CacheConfig::dense(
            num_layers,
            num_kv_heads,
            head_dim,
            self.block_size,
            0,
            dense,
        );
        if let Some((key, value)) = self.quant_formats()? {
            key.check_dim(head_dim).map_err(|e| {
                OptionsError(format!(
                    "--kv-group-size {} does not fit this model's head_dim {head_dim} ({e}); \
                     allowed group sizes divide {head_dim}",
                    key.group_size(),
                ))
            })?;
            let rotated = self.scheme_for(head_dim) == QuantScheme::Rotated;
            if rotated {
                Rotation::check(head_dim).map_err(|e| {
                    OptionsError(format!("--kv-quant-scheme rotated: {e}; use affine"))
                })?;
            }
            let dense_layers = self.dense_layer_list(num_layers)?;
            for (l, f) in cfg.formats.iter_mut().enumerate() {
                if !dense_layers.contains(&l) {
                    *f = KvFormat::Affine {
                        key,
                        value,
                        scale_dtype: scale_dtype_for(dtype),
                        rotated,
                    };
                }
            }
            if self.quantized_kv_start > 0 {
                cfg.staging = Some(Staging {
                    tokens: self.quantized_kv_start,
                    dtype: dense,
                    num_blocks: 0,
                });
            }
        }
        cfg.window = self.max_kv_size;
        cfg.residual = self.residual;
        cfg.sinks = self.sinks;
        cfg.center = self.center;
        cfg.layer_windows = layer_windows;
        cfg.max_seq_len = Some(max_positions);
        cfg.size_pools(sizing);
        Ok(cfg)
    }
}

/// Dense staging for `--quantized-kv-start`.
#[derive(Debug, Clone, PartialEq)]
pub struct Staging {
    /// A sequence moves to the main pool before it reaches this many tokens.
    pub tokens: usize,
    pub dtype: DType,
    pub num_blocks: usize,
}

/// Shape, formats and budget of a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in each layer group's main pool, in [`CacheConfig::groups`] order (the memory
    /// budget); one entry serves every group.
    pub pool_blocks: Vec<usize>,
    /// Main-pool format of each layer.
    pub formats: Vec<KvFormat>,
    pub staging: Option<Staging>,
    /// Sliding window: a query sees at most this many most recent positions (itself included).
    pub window: Option<usize>,
    /// The model's own sliding window of each layer (`None`: global), before `window` caps
    /// it; empty: no layer has one.
    pub layer_windows: Vec<Option<usize>>,
    /// Most positions one sequence can hold (the model's context window), if known: staging
    /// past it is never used.
    pub max_seq_len: Option<usize>,
    /// Newest positions each query of a quantized layer attends through dense f16 copies of
    /// their rows (`--kv-residual`; 0: none). The quantized rows are written as always; the
    /// copies are kept per sequence beside the pools (`kv::cache::residual`).
    pub residual: usize,
    /// First positions of each sequence every query attends through dense copies
    /// (`--kv-sinks`, attention sinks; only with `residual`).
    pub sinks: usize,
    /// Quantized layers store keys minus their sequence's mean (`--kv-center`,
    /// `kv::cache::center`).
    pub center: bool,
}

impl CacheConfig {
    /// A cache with every layer in one dense dtype and `num_blocks` blocks in each group.
    pub fn dense(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: DType,
    ) -> Self {
        Self {
            num_layers,
            num_kv_heads,
            head_dim,
            block_size,
            pool_blocks: vec![num_blocks],
            formats: vec![KvFormat::Dense(dtype); num_layers],
            staging: None,
            window: None,
            layer_windows: Vec::new(),
            max_seq_len: None,
            residual: 0,
            sinks: 0,
            center: false,
        }
    }

    /// The window `layer` attends through: its own, capped by `--max-kv-size`.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let own = self.layer_windows.get(layer).copied().flatten();
        match (own, self.window) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The widest window over all layers (`None` when some layer is global): the positions a
    /// sequence must keep.
    pub fn kept_window(&self) -> Option<usize> {
        (0..self.num_layers.max(1))
            .map(|l| self.layer_window(l))
            .try_fold(0, |m, w| w.map(|w| m.max(w)))
    }

    /// Values in one K (or V) row: all KV heads of one token.
    pub fn width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes one token occupies in the main pool over all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        let w = self.width();
        self.formats.iter().map(|f| f.kv_row_bytes(w)).sum()
    }

    /// Bytes of one sequence's dense residual copies (`--kv-residual`) over all quantized
    /// layers, K and V: the newest `residual` rows and the first `sinks` at 2 bytes a value (a
    /// prompt chunk's own rows come on top while it is attended).
    pub fn residual_bytes(&self) -> usize {
        let layers = self
            .formats
            .iter()
            .filter(|f| matches!(f, KvFormat::Affine { .. }))
            .count();
        (self.residual + self.sinks) * layers * 2 * self.width() * 2
    }

    /// Bytes one token occupies in the staging pool.
    pub fn staging_bytes_per_token(&self) -> usize {
        self.staging.as_ref().map_or(0, |s| {
            self.num_layers * 2 * self.width() * s.dtype.size_in_bytes()
        })
    }

    /// Bytes of one main-pool block over all layers (a block of every group), K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.block_size * self.bytes_per_token()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The format of each layer in which a new sequence keeps its first `n` tokens: dense
    /// staging below the `--quantized-kv-start` threshold, else the main pool's formats.
    pub fn formats_for_prefix(&self, n: usize) -> Vec<KvFormat> {
        match &self.staging {
            Some(st) if self.prefix_in_staging(n) => {
                vec![KvFormat::Dense(st.dtype); self.num_layers]
            }
            _ => self.formats.clone(),
        }
    }

    /// Whether a new sequence of `n` tokens still lives in the dense staging pool.
    pub fn prefix_in_staging(&self, n: usize) -> bool {
        matches!(&self.staging, Some(st) if st.tokens > 0 && n < st.tokens)
    }
}

impl CacheConfig {
    /// Sets the main and staging pools' block counts by `sizing` (the one place pools are sized).
    pub fn size_pools(&mut self, sizing: PoolSizing) {
        self.pool_blocks = self.group_pool_blocks(sizing);
        let max_batch = match sizing {
            PoolSizing::Sequences { max_batch, .. } | PoolSizing::Budget { max_batch, .. } => {
                max_batch
            }
            PoolSizing::Window { .. } => 1,
        };
        let bs = self.block_size;
        let most = self.max_seq_len.unwrap_or(usize::MAX);
        // Every group's staging pool gets the same count: a staged sequence is short.
        if let Some(st) = self.staging.as_mut() {
            let staged = st.tokens.min(most);
            st.num_blocks = max_batch.saturating_mul(staged.div_ceil(bs) + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two global layers of 3 KV heads × 64.
    fn shape() -> ModelShape {
        ModelShape {
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 64,
            layer_windows: Vec::new(),
            max_positions: 4096,
        }
    }

    #[test]
    fn quantized_caches_store_16_bit_scales_whatever_the_compute_dtype() {
        let shape = shape();
        let opts = KvOptions {
            bits: Some(4),
            ..KvOptions::default()
        };
        let sizing = PoolSizing::Window {
            tokens: 2048,
            chunk: 512,
        };
        for (dtype, scales) in [
            (DType::F32, DType::F16),
            (DType::F16, DType::F16),
            (DType::BF16, DType::BF16),
        ] {
            let cfg = opts.cache_config(shape.clone(), dtype, sizing).unwrap();
            assert!(cfg.formats.iter().all(|f| f.value_dtype() == scales));
            // Per head row: 64 × 4 bits = 32 B of codes + a 2-byte scale and bias (4.5 bits
            // per value); 3 KV heads, K and V, 2 layers.
            assert_eq!(cfg.bytes_per_token(), 2 * 2 * 3 * 36, "{dtype:?}");
        }
    }

    /// `dense_dtype` sets the dense cache, the dense layers and the staging of a quantized
    /// cache; the scales of its quantized layers still follow the compute dtype.
    #[test]
    fn dense_pools_take_the_dense_dtype() {
        let shape = shape();
        let sizing = PoolSizing::Sequences {
            tokens: 256,
            max_batch: 2,
            chunk: 64,
        };
        let half = |o: KvOptions| KvOptions {
            dense_dtype: Some(DType::F16),
            ..o
        };
        let dense = half(KvOptions::default())
            .cache_config(shape.clone(), DType::F32, sizing)
            .unwrap();
        assert_eq!(dense.formats, vec![KvFormat::Dense(DType::F16); 2]);
        assert_eq!(dense.bytes_per_token(), 2 * 2 * 3 * 64 * 2);
        let mixed = half(KvOptions {
            bits: Some(4),
            dense_layers: Some("last".into()),
            quantized_kv_start: 32,
            ..KvOptions::default()
        })
        .cache_config(shape.clone(), DType::F32, sizing)
        .unwrap();
        assert_eq!(mixed.formats[1], KvFormat::Dense(DType::F16));
        assert_eq!(mixed.formats[0].value_dtype(), DType::F16);
        assert_eq!(mixed.staging.as_ref().map(|s| s.dtype), Some(DType::F16));
        // Unset: the compute dtype, as before.
        let plain = KvOptions::default()
            .cache_config(shape, DType::F32, sizing)
            .unwrap();
        assert_eq!(plain.formats, vec![KvFormat::Dense(DType::F32); 2]);
    }
}
