//! The names of formats: tags in prompt-cache files (`kvq.layers`), the tensors a layer's rows
//! are stored as, and the wording of messages.

use candle_core::DType;

use super::{KvFormat, QuantFormat};

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
