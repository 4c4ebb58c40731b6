//! The bit widths of a quantized KV setting, as users name it: one width for K and V (`4`), or
//! an average with a half (`3.5`) whose keys are one bit wider than its values — keys are the
//! sensitive half, since softmax turns key error into weight error.

use super::{QuantError, QuantFormat};
use serde::Serialize;

/// K and V code widths of one setting (`--kv-bits`, a `--bits` row of `kvq bench-kv-cache`).
/// Parsed from `4` or `3.5` (= 4-bit K / 3-bit V); shown as `4` or `K4/V3`; serialized as the
/// width or the average (3.5). Whole widths are checked where the format is made (the message
/// names the allowed widths); an average is checked when parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvWidths {
    pub key: u32,
    pub value: u32,
}

impl KvWidths {
    /// K and V both `bits` wide.
    pub fn same(bits: u32) -> Self {
        Self {
            key: bits,
            value: bits,
        }
    }

    /// The K and V formats of this setting with groups of `group_size`.
    pub fn formats(self, group_size: usize) -> Result<(QuantFormat, QuantFormat), QuantError> {
        let f = |b| QuantFormat::new(b, group_size);
        Ok((f(self.key)?, f(self.value)?))
    }

    /// A setting as the lists of `kvq perplexity --compare` and `kvq bench-kv-cache --bits`
    /// name it: what [`str::parse`] takes, or `KEY/VALUE` widths (`6/4`).
    pub fn parse_pair(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((k, v)) => match (k.trim().parse(), v.trim().parse()) {
                (Ok(key), Ok(value)) => Ok(Self { key, value }),
                _ => Err(format!(
                    "'{}' is not KEY/VALUE bit widths (e.g. 6/4)",
                    s.trim()
                )),
            },
            None => s.parse(),
        }
    }

    /// The setting as a JSON number: the width, or the average (3.5).
    pub fn json(self) -> serde_json::Value {
        if self.key == self.value {
            serde_json::json!(self.key)
        } else {
            serde_json::json!(f64::from(self.key + self.value) / 2.0)
        }
    }
}

impl Serialize for KvWidths {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json().serialize(s)
    }
}

impl std::fmt::Display for KvWidths {
    /// `4` or `K5/V4`: the prefix of a mode label (`4-bit`, `K5/V4-bit`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key == self.value {
            write!(f, "{}", self.key)
        } else {
            write!(f, "K{}/V{}", self.key, self.value)
        }
    }
}

impl std::str::FromStr for KvWidths {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "'{t}' is not a KV width: allowed 2, 3, 4, 5, 6, 8, or the averages 2.5, 3.5, 4.5, \
                 5.5 (keys one bit wider than values)"
            )
        };
        match t.strip_suffix(".5") {
            Some(whole) => match whole.parse::<u32>() {
                Ok(v) if (2..=5).contains(&v) => Ok(Self {
                    key: v + 1,
                    value: v,
                }),
                _ => Err(bad()),
            },
            None => t.parse::<u32>().map(Self::same).map_err(|_| bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::KvWidths;

    /// Widths and half averages parse, show and serialize as users name them.
    #[test]
    fn parse_show_and_serialize() {
        let w = |s: &str| s.parse::<KvWidths>().unwrap();
        assert_eq!(w("3.5"), KvWidths { key: 4, value: 3 });
        assert_eq!(w(" 8 "), KvWidths::same(8));
        assert_eq!(
            (w("4.5").to_string(), w("4").to_string()),
            ("K5/V4".into(), "4".into())
        );
        assert_eq!(
            serde_json::to_string(&[w("4.5"), w("4")]).unwrap(),
            "[4.5,4]"
        );
        for bad in ["1.5", "6.5", "3.25", "4.0", "x", ""] {
            assert!(
                bad.parse::<KvWidths>().unwrap_err().contains("3.5"),
                "{bad}"
            );
        }
        let p = |s: &str| KvWidths::parse_pair(s);
        assert_eq!(p("6/4"), Ok(KvWidths { key: 6, value: 4 }));
        assert_eq!(p("4.5"), Ok(KvWidths { key: 5, value: 4 }));
        assert!(p("4/x").unwrap_err().contains("KEY/VALUE"));
        assert!(
            "6/4".parse::<KvWidths>().is_err(),
            "--kv-bits takes no pair"
        );
    }
}
