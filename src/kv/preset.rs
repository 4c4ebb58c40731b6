//! What `--kv-bits 4` and `--kv-bits 3` mean: the best setting of that budget (issue 18).
//!
//! Given alone — without any flag that picks the cache's parts by hand (`--kv-key-bits`,
//! `--kv-value-bits`, `--kv-residual`, `--kv-sinks`, `--kv-center`) — a budget of `b` bits
//! means keys of `b` bits and values of `b − 1`, keys centred, and each sequence's newest
//! [`RESIDUAL`] and first [`SINKS`] positions attended through f16 copies. Over 2,048-token
//! windows that is 4.5 (3.5) bits per value, scales and copies included: what plain 4-bit
//! (3-bit) costs with its f16 scales. On the default model it cuts 4-bit's KL divergence
//! against the dense cache from 0.044 to 0.005 (README, "Quantized KV cache").
//!
//! The choice needs the model and the device, so it is made here, above the cache and the
//! kernels, once a model is loaded. Where the setting cannot run (soft-capped scores,
//! `--quantized-kv-start`) or has no fused decode kernel (Metal; CUDA with f32 activations or
//! a head_dim other than 64 or 128), the plain width stays and [`Resolved::notice`] says why.

use candle_core::{DType, Device};

use super::cache::KvOptions;

/// Newest positions of each sequence the preset attends through dense copies.
pub const RESIDUAL: usize = 60;
/// First positions of each sequence the preset attends through dense copies.
pub const SINKS: usize = 4;

/// Budgets (`--kv-bits`) that have a preset.
pub const BUDGETS: [u32; 2] = [4, 3];

/// Where the cache will run: what decides whether the preset can.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub head_dim: usize,
    /// The model soft-caps its attention scores (Gemma 2).
    pub soft_capped: bool,
    pub backend: Backend,
    /// The model's compute dtype (the queries').
    pub dtype: DType,
}

/// The device kind of a [`Target`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl Backend {
    pub fn of(device: &Device) -> Self {
        if device.is_cuda() {
            Backend::Cuda
        } else if device.is_metal() {
            Backend::Metal
        } else {
            Backend::Cpu
        }
    }
}

/// Options with the preset turned into parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub options: KvOptions,
    /// Why a requested preset fell back to the plain width (one line for the user).
    pub notice: Option<String>,
}

/// `opts` with a requested preset ([`KvOptions::preset`]) resolved for `target`; other options
/// are returned as they are.
pub fn resolve(opts: &KvOptions, target: &Target) -> Resolved {
    let mut options = opts.clone();
    options.preset = false;
    let budget = match opts.bits {
        Some(b) if opts.preset && BUDGETS.contains(&b) => b,
        _ => {
            return Resolved {
                options,
                notice: None,
            }
        }
    };
    if let Some(why) = blocker(opts, target) {
        return Resolved {
            options,
            notice: Some(format!(
                "--kv-bits {budget}: plain {budget}-bit keys and values, since {why} (elsewhere \
                 --kv-bits {budget} means {budget}-bit keys, {}-bit values, centred keys and \
                 {RESIDUAL} + {SINKS} dense positions)",
                budget - 1
            )),
        };
    }
    options.key_bits = Some(budget);
    options.value_bits = Some(budget - 1);
    options.residual = RESIDUAL;
    options.sinks = SINKS;
    options.center = true;
    Resolved {
        options,
        notice: None,
    }
}

/// Why the preset cannot apply to `target`, if it cannot.
fn blocker(opts: &KvOptions, t: &Target) -> Option<String> {
    let fused_dim = matches!(t.head_dim, 64 | 128);
    if t.soft_capped {
        Some("this model soft-caps its attention scores (centred keys would change them)".into())
    } else if opts.quantized_kv_start > 0 {
        Some("--quantized-kv-start stages rows dense (they would have no dense copies)".into())
    } else if t.backend == Backend::Metal {
        Some("Metal has no fused kernel for the dense window".into())
    } else if t.backend == Backend::Cuda && t.dtype == DType::F32 {
        Some("on CUDA the dense window needs f16 or bf16 activations (--dtype)".into())
    } else if t.backend == Backend::Cuda && !fused_dim {
        Some(format!(
            "CUDA has no fused kernel for keys wider than values at head_dim {}",
            t.head_dim
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(backend: Backend) -> Target {
        Target {
            head_dim: 64,
            soft_capped: false,
            backend,
            dtype: DType::F16,
        }
    }

    fn preset(bits: u32) -> KvOptions {
        KvOptions {
            bits: Some(bits),
            preset: true,
            ..KvOptions::default()
        }
    }

    #[test]
    fn budgets_become_their_best_setting() {
        for (b, backend) in [(4, Backend::Cpu), (3, Backend::Cpu), (4, Backend::Cuda)] {
            let r = resolve(&preset(b), &target(backend));
            assert_eq!(r.notice, None);
            let o = r.options;
            assert_eq!((o.key_bits, o.value_bits), (Some(b), Some(b - 1)));
            assert_eq!((o.residual, o.sinks, o.center), (RESIDUAL, SINKS, true));
            assert!(!o.preset);
            // What the cache makes of it: the split, the window and the centring.
            let cfg = o
                .cache_config(
                    crate::kv::cache::ModelShape {
                        num_layers: 2,
                        num_kv_heads: 3,
                        head_dim: 64,
                        layer_windows: Vec::new(),
                        max_positions: 4096,
                    },
                    DType::F32,
                    crate::kv::cache::PoolSizing::Window {
                        tokens: 2048,
                        chunk: 512,
                    },
                )
                .unwrap();
            assert_eq!((cfg.residual, cfg.sinks, cfg.center), (60, 4, true));
            let crate::kv::format::KvFormat::Affine { key, value, .. } = cfg.formats[0] else {
                panic!("a quantized layer")
            };
            assert_eq!((key.bits(), value.bits()), (b, b - 1));
        }
    }

    #[test]
    fn other_widths_and_hand_picked_parts_stay_as_given() {
        for o in [
            preset(8),
            preset(2),
            KvOptions {
                bits: Some(4),
                ..KvOptions::default()
            },
        ] {
            let r = resolve(&o, &target(Backend::Cpu));
            assert_eq!(r.notice, None);
            assert_eq!(r.options, KvOptions { preset: false, ..o });
        }
    }

    #[test]
    fn falls_back_with_the_reason_where_it_cannot_run() {
        let staged = KvOptions {
            quantized_kv_start: 64,
            ..preset(4)
        };
        let cases = [
            (
                preset(4),
                Target {
                    soft_capped: true,
                    ..target(Backend::Cpu)
                },
                "soft-caps",
            ),
            (staged, target(Backend::Cpu), "--quantized-kv-start"),
            (preset(3), target(Backend::Metal), "Metal"),
            (
                preset(4),
                Target {
                    dtype: DType::F32,
                    ..target(Backend::Cuda)
                },
                "f16 or bf16",
            ),
            (
                preset(4),
                Target {
                    head_dim: 256,
                    ..target(Backend::Cuda)
                },
                "head_dim 256",
            ),
        ];
        for (o, t, why) in cases {
            let r = resolve(&o, &t);
            let notice = r.notice.expect("a notice");
            assert!(notice.contains(why), "{notice}");
            let b = o.bits.unwrap();
            assert!(
                notice.starts_with(&format!("--kv-bits {b}: plain {b}-bit")),
                "{notice}"
            );
            assert_eq!(r.options, KvOptions { preset: false, ..o });
        }
        // The CPU runs the preset at any head_dim (its exact kernel reads every width).
        let wide = Target {
            head_dim: 256,
            ..target(Backend::Cpu)
        };
        assert_eq!(resolve(&preset(4), &wide).notice, None);
    }
}
