//! The names of formats: tags in prompt-cache files (`kvq.layers`), the tensors a layer's rows
//! are stored as, the wording of messages and the labels of `serve`'s metrics.

// Tags come from prompt-cache files: no unwrap, expect or indexing that could panic on them (issue
// 21; clippy enforces it in CI).
#![warn(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use candle_core::DType;

use super::{KvFormat, QuantFormat};

/// A format as `serve`'s `/metrics` labels a pool: `dense-f16`, `affine-k4-v4-g64`,
/// `rotated-k8-v8-g64`.
pub fn format_label(f: &KvFormat) -> String {
    match f {
        KvFormat::Dense(d) => format!("dense-{d:?}").to_lowercase(),
        KvFormat::Affine {
            key,
            value,
            rotated,
            ..
        } => format!(
            "{}-k{}-v{}-g{}",
            if *rotated { "rotated" } else { "affine" },
            key.bits(),
            value.bits(),
            key.group_size()
        ),
    }
}

/// A format as written in `kvq.layers`.
pub fn format_tag(f: &KvFormat) -> String {
    match f {
        KvFormat::Dense(dt) => format!("dense:{}", dt.as_str()),
        KvFormat::Affine {
            key,
            value,
            scale_dtype,
            rotated,
        } => format!(
            "{}:{}/{}:{}:{}",
            if *rotated { "rotated" } else { "affine" },
            key.bits(),
            value.bits(),
            key.group_size(),
            scale_dtype.as_str()
        ),
    }
}

/// A format as a person reads it in an error message.
pub fn format_name(f: &KvFormat) -> String {
    match f {
        KvFormat::Dense(dt) => format!("dense {}", dt.as_str()),
        KvFormat::Affine {
            key,
            value,
            scale_dtype,
            rotated,
        } => {
            let width = if key == value {
                format!("{key}")
            } else {
                format!("keys {key}, values {value}")
            };
            let scheme = if *rotated { "rotated" } else { "affine" };
            format!("{scheme} {width} with {} scales", scale_dtype.as_str())
        }
    }
}

pub fn parse_format(tag: &str) -> Option<KvFormat> {
    let parts: Vec<&str> = tag.split(':').collect();
    match parts.as_slice() {
        ["dense", dt] => Some(KvFormat::Dense(parse_dtype(dt)?)),
        [scheme @ ("affine" | "rotated"), bits, group, dt] => {
            let (k, v) = bits.split_once('/')?;
            let g: usize = group.parse().ok()?;
            Some(KvFormat::Affine {
                key: QuantFormat::new(k.parse().ok()?, g).ok()?,
                value: QuantFormat::new(v.parse().ok()?, g).ok()?,
                scale_dtype: parse_dtype(dt)?,
                rotated: *scheme == "rotated",
            })
        }
        _ => None,
    }
}

pub fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        _ => None,
    }
}

/// The tensors of one layer: (name, columns, dtype) in file order.
pub fn file_tensors(l: usize, f: &KvFormat, width: usize) -> Vec<(String, usize, DType)> {
    let mut out = Vec::new();
    for kv in ["k", "v"] {
        match f {
            KvFormat::Affine {
                key,
                value,
                scale_dtype,
                ..
            } => {
                let fmt = if kv == "k" { key } else { value };
                out.push((
                    format!("{l}.{kv}.codes"),
                    fmt.words_per_row(width),
                    DType::U32,
                ));
                out.push((
                    format!("{l}.{kv}.scales"),
                    fmt.groups_per_row(width),
                    *scale_dtype,
                ));
                out.push((
                    format!("{l}.{kv}.biases"),
                    fmt.groups_per_row(width),
                    *scale_dtype,
                ));
            }
            other => out.push((format!("{l}.{kv}"), width, dense_dtype(other))),
        }
    }
    out
}

fn dense_dtype(f: &KvFormat) -> DType {
    match f {
        KvFormat::Dense(dt) => *dt,
        _ => DType::F32,
    }
}
