//! The quantization format (bits × group size) and the checks every op runs before touching data.

use candle_core::DType;

/// Why a quantization setting or an input is refused. Each message names the allowed values so a
/// CLI user can fix the flag without reading the docs.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("unsupported bit width {0} (allowed: 2, 3, 4, 5, 6, 8)")]
    Bits(u32),
    #[error("unsupported group size {0} (allowed: 32, 64, 128)")]
    GroupSize(usize),
    #[error("last dimension {dim} is not a multiple of the group size {group_size} (allowed group sizes: 32, 64, 128)")]
    Dim { dim: usize, group_size: usize },
    #[error("{op}: unsupported dtype {dtype:?} (allowed: f32, f16, bf16)")]
    DType { op: &'static str, dtype: DType },
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
}

impl From<QuantError> for candle_core::Error {
    fn from(e: QuantError) -> Self {
        candle_core::Error::Msg(e.to_string())
    }
}

/// Affine group quantization setting: `bits` per value, one f-type scale and bias per
/// `group_size` consecutive values of the last dimension (docs/ARCHITECTURE.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    bits: u32,
    group_size: usize,
}

impl QuantFormat {
    pub const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
    pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

    pub fn new(bits: u32, group_size: usize) -> Result<Self, QuantError> {
        if !Self::BITS.contains(&bits) {
            return Err(QuantError::Bits(bits));
        }
        if !Self::GROUP_SIZES.contains(&group_size) {
            return Err(QuantError::GroupSize(group_size));
        }
        Ok(Self { bits, group_size })
    }

    /// Whether keys in `key` and values in `value` are the split the fused kernels read besides
    /// one format for both: keys one bit wider, groups of one size (what `--kv-bits 2.5 … 5.5`
    /// name).
    pub fn one_bit_wider(key: QuantFormat, value: QuantFormat) -> bool {
        key.group_size() == value.group_size()
            && key.bits() == value.bits() + 1
            && (2..=5).contains(&value.bits())
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// Largest code, `2^bits - 1`.
    pub fn max_code(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// A row of `d` values must split into whole groups. Every allowed group size is a multiple
    /// of 32, so whole groups also make whole u32 words for any bit width.
    pub fn check_dim(&self, d: usize) -> Result<(), QuantError> {
        if d == 0
            || !d.is_multiple_of(self.group_size)
            || !(d * self.bits as usize).is_multiple_of(32)
        {
            return Err(QuantError::Dim {
                dim: d,
                group_size: self.group_size,
            });
        }
        Ok(())
    }

    pub fn words_per_row(&self, d: usize) -> usize {
        d * self.bits as usize / 32
    }

    pub fn groups_per_row(&self, d: usize) -> usize {
        d / self.group_size
    }

    /// Stored bytes of one quantized row: u32 codes plus one scale and one bias per group.
    pub fn bytes_per_row(&self, d: usize, scale_dtype: DType) -> usize {
        self.words_per_row(d) * 4 + 2 * self.groups_per_row(d) * scale_dtype.size_in_bytes()
    }

    /// Bits stored per value, codes and group parameters included (`bits + 2*s/g`).
    pub fn bits_per_value(&self, scale_dtype: DType) -> f64 {
        self.bits as f64 + 2.0 * (scale_dtype.size_in_bytes() * 8) as f64 / self.group_size as f64
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-bit/g{}", self.bits, self.group_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_settings_naming_allowed_values() {
        let e = QuantFormat::new(7, 64).unwrap_err().to_string();
        assert!(e.contains("7") && e.contains("2, 3, 4, 5, 6, 8"), "{e}");
        let e = QuantFormat::new(4, 48).unwrap_err().to_string();
        assert!(e.contains("48") && e.contains("32, 64, 128"), "{e}");
        let f = QuantFormat::new(4, 64).unwrap();
        assert!(f.check_dim(96).is_err());
        assert!(f.check_dim(0).is_err());
        assert!(f.check_dim(128).is_ok());
    }

    #[test]
    fn sizes_follow_the_format() {
        let f = QuantFormat::new(3, 32).unwrap();
        assert_eq!(f.words_per_row(128), 12);
        assert_eq!(f.groups_per_row(128), 4);
        assert_eq!(f.bytes_per_row(128, DType::F16), 12 * 4 + 2 * 4 * 2);
        let f8 = QuantFormat::new(8, 64).unwrap();
        assert_eq!(f8.bits_per_value(DType::F16), 8.5);
        assert_eq!(f8.bits_per_value(DType::F32), 9.0);
    }
}
