//! One layer's K and V token slots in a block pool, dense or quantized.
//!
//! Slot `block * block_size + i` holds token `i` of `block`; a slot's row is all KV heads of
//! one token (`kv_heads * head_dim` values). Quantized rows use groups along the head dimension
//! (head_dim % group == 0), so groups never straddle heads and a row's codes are the heads'
//! codes one after the other.

use candle_core::{DType, Device, Result, Tensor};

use super::ops::{
    dequantize_as, fused_rotation, quantize_into_rows, quantize_rotated_into_rows,
    quantize_rows_into, slot_runs, Quantized, SlotRows,
};
use super::rotation::Rotation;
use super::side::SideWrites;
use super::{Fit, KvFormat, QuantFormat};

/// Storage of one layer: `[slots, width]` per K and V.
#[derive(Debug, Clone)]
pub enum LayerKv {
    Dense {
        k: Tensor,
        v: Tensor,
    },
    Affine {
        kfmt: QuantFormat,
        vfmt: QuantFormat,
        /// Rows hold rotated head vectors (the cache rotates; recorded so the format is whole).
        rotated: bool,
        k: Quantized,
        v: Quantized,
    },
}

impl LayerKv {
    pub fn zeros(format: KvFormat, slots: usize, width: usize, dev: &Device) -> Result<Self> {
        Ok(match format {
            KvFormat::Dense(dt) => LayerKv::Dense {
                k: Tensor::zeros((slots, width), dt, dev)?,
                v: Tensor::zeros((slots, width), dt, dev)?,
            },
            KvFormat::Affine {
                key,
                value,
                scale_dtype,
                rotated,
            } => {
                key.check_dim(width)?;
                value.check_dim(width)?;
                let q = |fmt: QuantFormat| -> Result<Quantized> {
                    Ok(Quantized {
                        codes: Tensor::zeros((slots, fmt.words_per_row(width)), DType::U32, dev)?,
                        scales: Tensor::zeros(
                            (slots, fmt.groups_per_row(width)),
                            scale_dtype,
                            dev,
                        )?,
                        biases: Tensor::zeros(
                            (slots, fmt.groups_per_row(width)),
                            scale_dtype,
                            dev,
                        )?,
                    })
                };
                LayerKv::Affine {
                    kfmt: key,
                    vfmt: value,
                    rotated,
                    k: q(key)?,
                    v: q(value)?,
                }
            }
        })
    }

    /// Writes rows `k`, `v` (`[n, width]`, any float dtype) into consecutive slots
    /// `first..first + n` (one block's run).
    pub fn write_run(&self, first: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            LayerKv::Dense { k: pk, v: pv } => {
                pk.slice_set(&k.to_dtype(pk.dtype())?.contiguous()?, 0, first)?;
                pv.slice_set(&v.to_dtype(pv.dtype())?.contiguous()?, 0, first)
            }
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k: qk,
                v: qv,
            } => {
                let fit = Fit::of(*rotated);
                quantize_rows_into(k, *kfmt, fit, qk, first)?;
                quantize_rows_into(v, *vfmt, fit, qv, first)
            }
        }
    }

    /// Writes rows `k`, `v` (`[n, width]`, any float dtype) into slots `rows` (one per input
    /// row): quantized pools in one fused launch per tensor on CUDA (see
    /// [`quantize_into_rows`]), otherwise run by run of consecutive slots.
    pub fn write_slots(&self, rows: &SlotRows, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k: qk,
                v: qv,
            } => {
                let fit = Fit::of(*rotated);
                quantize_into_rows(k, *kfmt, fit, qk, rows)?;
                quantize_into_rows(v, *vfmt, fit, qv, rows)
            }
            LayerKv::Dense { k: pk, v: pv } => {
                if super::scatter::prefer_scatter(pk, rows.as_slice()) {
                    super::scatter::scatter_rows(pk, rows, k)?;
                    return super::scatter::scatter_rows(pv, rows, v);
                }
                let rows = rows.as_slice();
                for (i, len) in slot_runs(rows) {
                    self.write_run(
                        rows[i] as usize,
                        &k.narrow(0, i, len)?,
                        &v.narrow(0, i, len)?,
                    )?;
                }
                Ok(())
            }
        }
    }

    /// Writes row `i` of `k`, `v` into slot `rows[i]` addressing the pool only through the
    /// slots' device copy: no choice here depends on the slot values (dense pools always take
    /// the scatter), so a captured CUDA graph of it serves any slots. `rot`: the rotated scheme.
    pub fn write_slots_on_device(
        &self,
        rows: &SlotRows,
        k: &Tensor,
        v: &Tensor,
        rot: Option<&Rotation>,
    ) -> Result<()> {
        match (self, rot) {
            (LayerKv::Dense { k: pk, v: pv }, None) => {
                super::scatter::scatter_rows(pk, rows, k)?;
                super::scatter::scatter_rows(pv, rows, v)
            }
            (LayerKv::Dense { .. }, Some(r)) => {
                self.write_slots_on_device(rows, &r.rotate(k)?, &r.rotate(v)?, None)
            }
            (LayerKv::Affine { .. }, Some(r)) => self.write_slots_rotated(rows, k, v, r),
            (LayerKv::Affine { .. }, None) => self.write_slots(rows, k, v),
        }
    }

    /// [`LayerKv::write_slots`] of `k`, `v` rotated by `rot` (the rotated scheme): one fused
    /// rotate-and-quantize launch for both where there is one ([`fused_rotation`]), else the
    /// rotation as a matmul and then the write.
    pub fn write_slots_rotated(
        &self,
        rows: &SlotRows,
        k: &Tensor,
        v: &Tensor,
        rot: &Rotation,
    ) -> Result<()> {
        if self.write_slots_fused(rows, k, v, rot, SideWrites::default())? {
            return Ok(());
        }
        self.write_slots(rows, &rot.rotate(k)?, &rot.rotate(v)?)
    }

    /// The fused launch of [`LayerKv::write_slots_rotated`] with a captured step's `side`
    /// writes in it; `false` (nothing written) where this layer has no such kernel.
    pub fn write_slots_fused(
        &self,
        rows: &SlotRows,
        k: &Tensor,
        v: &Tensor,
        rot: &Rotation,
        side: SideWrites,
    ) -> Result<bool> {
        let LayerKv::Affine {
            kfmt,
            vfmt,
            k: qk,
            v: qv,
            ..
        } = self
        else {
            return Ok(false);
        };
        if !((kfmt == vfmt || QuantFormat::one_bit_wider(*kfmt, *vfmt))
            && qk.scales.dtype() == qv.scales.dtype()
            && k.dtype() == v.dtype()
            && fused_rotation(k, qk.scales.dtype(), rot.head_dim()))
        {
            return Ok(false);
        }
        quantize_rotated_into_rows(
            k,
            v,
            (*kfmt, *vfmt),
            qk,
            qv,
            rows,
            rot.signs(),
            rot.head_dim(),
            side,
        )?;
        Ok(true)
    }

    /// K and V of `slots` (u32 `[n]`) as dense `[n, width]` tensors of `dtype` — quantized
    /// rows are dequantized here, only these rows, into `dtype` ([`dequantize_as`]: in f32 from
    /// f16 scales when computing in f32, as the fused decode kernels do).
    pub fn gather(&self, slots: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        match self {
            LayerKv::Dense { k, v } => Ok((
                k.index_select(slots, 0)?.to_dtype(dtype)?,
                v.index_select(slots, 0)?.to_dtype(dtype)?,
            )),
            LayerKv::Affine {
                kfmt, vfmt, k, v, ..
            } => {
                let pick = |q: &Quantized, fmt: &QuantFormat| -> Result<Tensor> {
                    let sub = Quantized {
                        codes: q.codes.index_select(slots, 0)?,
                        scales: q.scales.index_select(slots, 0)?,
                        biases: q.biases.index_select(slots, 0)?,
                    };
                    dequantize_as(&sub, *fmt, dtype)
                };
                Ok((pick(k, kfmt)?, pick(v, vfmt)?))
            }
        }
    }
}

/// Rows of one layer exactly as stored (a sequence's history taken out of the pool, or read
/// from a prompt-cache file): dense values, or codes + scales + biases. Moving rows in this form
/// never re-quantizes, so an imported history holds the very codes it was saved with.
#[derive(Debug, Clone)]
pub enum LayerRows {
    /// `[n, width]` each, the layer's dense dtype.
    Dense { k: Tensor, v: Tensor },
    /// `codes [n, words]`, `scales` / `biases [n, groups]` each.
    Affine {
        kfmt: QuantFormat,
        vfmt: QuantFormat,
        rotated: bool,
        k: Quantized,
        v: Quantized,
    },
}

/// The format of affine rows: the widths and scheme they were stored with, the scale dtype they
/// hold.
fn affine_format(kfmt: QuantFormat, vfmt: QuantFormat, rotated: bool, k: &Quantized) -> KvFormat {
    KvFormat::Affine {
        key: kfmt,
        value: vfmt,
        scale_dtype: k.scales.dtype(),
        rotated,
    }
}

impl LayerRows {
    /// The rows' tensors in file order (`tag::file_tensors`): K then V, each as one dense
    /// tensor or as codes, scales, biases.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            LayerRows::Dense { k, v } => vec![k, v],
            LayerRows::Affine { k, v, .. } => vec![
                &k.codes, &k.scales, &k.biases, &v.codes, &v.scales, &v.biases,
            ],
        }
    }

    /// Rows of `format` from their tensors in [`LayerRows::tensors`]'s order.
    pub fn from_tensors(format: &KvFormat, ts: Vec<Tensor>) -> Result<Self> {
        Ok(match (format, ts.as_slice()) {
            (KvFormat::Dense(_), [k, v]) => LayerRows::Dense {
                k: k.clone(),
                v: v.clone(),
            },
            (
                KvFormat::Affine {
                    key,
                    value,
                    rotated,
                    ..
                },
                [kc, ks, kb, vc, vs, vb],
            ) => LayerRows::Affine {
                kfmt: *key,
                vfmt: *value,
                rotated: *rotated,
                k: Quantized {
                    codes: kc.clone(),
                    scales: ks.clone(),
                    biases: kb.clone(),
                },
                v: Quantized {
                    codes: vc.clone(),
                    scales: vs.clone(),
                    biases: vb.clone(),
                },
            },
            _ => candle_core::bail!("{} tensors do not make rows of {format:?}", ts.len()),
        })
    }

    /// The storage format these rows are in.
    pub fn format(&self) -> KvFormat {
        match self {
            LayerRows::Dense { k, .. } => KvFormat::Dense(k.dtype()),
            LayerRows::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                ..
            } => affine_format(*kfmt, *vfmt, *rotated, k),
        }
    }

    /// Number of rows (tokens).
    pub fn len(&self) -> Result<usize> {
        match self {
            LayerRows::Dense { k, .. } => k.dim(0),
            LayerRows::Affine { k, .. } => k.codes.dim(0),
        }
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Rows `start..start + n`.
    pub fn narrow(&self, start: usize, n: usize) -> Result<Self> {
        let q = |q: &Quantized| -> Result<Quantized> {
            Ok(Quantized {
                codes: q.codes.narrow(0, start, n)?,
                scales: q.scales.narrow(0, start, n)?,
                biases: q.biases.narrow(0, start, n)?,
            })
        };
        Ok(match self {
            LayerRows::Dense { k, v } => LayerRows::Dense {
                k: k.narrow(0, start, n)?,
                v: v.narrow(0, start, n)?,
            },
            LayerRows::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                v,
            } => LayerRows::Affine {
                kfmt: *kfmt,
                vfmt: *vfmt,
                rotated: *rotated,
                k: q(k)?,
                v: q(v)?,
            },
        })
    }
}

impl LayerKv {
    /// Slots and values per row of this pool, after checking that it is a well-formed pool for
    /// heads of `head_dim` values: dense K and V `[slots, width]` of one float dtype, or the
    /// codes, scales and biases of its affine formats, K and V alike in slots, width and scale
    /// dtype. A malformed pool gets `err` of what is wrong.
    pub fn check_pool(
        &self,
        head_dim: usize,
        err: impl Fn(String) -> candle_core::Error,
    ) -> Result<(usize, usize)> {
        Ok(match self {
            LayerKv::Dense { k, v } => {
                if k.dims() != v.dims() || k.dtype() != v.dtype() || k.rank() != 2 {
                    return Err(err(format!(
                        "dense K {:?} {:?} and V {:?} {:?} must both be [slots, width] of one dtype",
                        k.dims(),
                        k.dtype(),
                        v.dims(),
                        v.dtype()
                    )));
                }
                if !matches!(k.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                    return Err(err(format!(
                        "dense cache must be f32, f16 or bf16, got {:?}",
                        k.dtype()
                    )));
                }
                (k.dim(0)?, k.dim(1)?)
            }
            LayerKv::Affine {
                kfmt, vfmt, k, v, ..
            } => {
                let mut widths = Vec::with_capacity(2);
                for (name, t, fmt) in [("K", k, kfmt), ("V", v, vfmt)] {
                    fmt.check_dim(head_dim)
                        .map_err(|e| err(format!("{name}: {e}")))?;
                    let ok = t.codes.rank() == 2
                        && t.codes.dtype() == DType::U32
                        && t.scales.rank() == 2
                        && t.scales.dims() == t.biases.dims()
                        && t.scales.dtype() == t.biases.dtype()
                        && t.codes.dim(0)? == t.scales.dim(0)?
                        && matches!(t.scales.dtype(), DType::F32 | DType::F16 | DType::BF16);
                    if !ok {
                        return Err(err(format!(
                            "quantized {name}: codes {:?} {:?}, scales {:?} {:?}, biases {:?} {:?} are not a {fmt} pool",
                            t.codes.dims(), t.codes.dtype(), t.scales.dims(), t.scales.dtype(),
                            t.biases.dims(), t.biases.dtype()
                        )));
                    }
                    let w = t.scales.dim(1)? * fmt.group_size();
                    if t.codes.dim(1)? != fmt.words_per_row(w) {
                        return Err(err(format!(
                            "quantized {name} codes have {} words per row; {fmt} needs {} for width {w}",
                            t.codes.dim(1)?,
                            fmt.words_per_row(w)
                        )));
                    }
                    widths.push(w);
                }
                if k.codes.dim(0)? != v.codes.dim(0)?
                    || widths[0] != widths[1]
                    || k.scales.dtype() != v.scales.dtype()
                {
                    return Err(err(
                        "quantized K and V pools differ in slots, width or scale dtype".into(),
                    ));
                }
                (k.codes.dim(0)?, widths[0])
            }
        })
    }

    /// Whether the pool's tensors are on `dev`.
    pub fn is_on(&self, dev: &Device) -> bool {
        let on = |t: &Tensor| t.device().same_device(dev);
        match self {
            LayerKv::Dense { k, v } => on(k) && on(v),
            LayerKv::Affine { k, v, .. } => on(&k.codes) && on(&v.codes),
        }
    }

    /// The format of this layer's slots.
    pub fn format(&self) -> KvFormat {
        match self {
            LayerKv::Dense { k, .. } => KvFormat::Dense(k.dtype()),
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                ..
            } => affine_format(*kfmt, *vfmt, *rotated, k),
        }
    }

    /// The stored rows of `slots` (u32 `[n]`), without dequantizing.
    pub fn read_rows(&self, slots: &Tensor) -> Result<LayerRows> {
        Ok(match self {
            LayerKv::Dense { k, v } => LayerRows::Dense {
                k: k.index_select(slots, 0)?,
                v: v.index_select(slots, 0)?,
            },
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                v,
            } => {
                let pick = |q: &Quantized| -> Result<Quantized> {
                    Ok(Quantized {
                        codes: q.codes.index_select(slots, 0)?,
                        scales: q.scales.index_select(slots, 0)?,
                        biases: q.biases.index_select(slots, 0)?,
                    })
                };
                LayerRows::Affine {
                    kfmt: *kfmt,
                    vfmt: *vfmt,
                    rotated: *rotated,
                    k: pick(k)?,
                    v: pick(v)?,
                }
            }
        })
    }

    /// Writes stored rows into `slots` (u32 `[n]`) as they are: same format required, nothing is
    /// converted or re-quantized.
    pub fn write_rows(&self, slots: &Tensor, rows: &LayerRows) -> Result<()> {
        if rows.format() != self.format() {
            candle_core::bail!(
                "rows stored as {:?} cannot go into a layer stored as {:?}",
                rows.format(),
                self.format()
            );
        }
        let n = slots.dim(0)?;
        if rows.len()? != n {
            candle_core::bail!("{} rows for {n} slots", rows.len()?);
        }
        if n == 0 {
            return Ok(());
        }
        let put = |pool: &Tensor, src: &Tensor| -> Result<()> {
            let src = src.to_device(pool.device())?.contiguous()?;
            if src.dim(1)? != pool.dim(1)? {
                candle_core::bail!(
                    "rows of width {} for a layer of width {}",
                    src.dim(1)?,
                    pool.dim(1)?
                );
            }
            let idx = slots
                .unsqueeze(1)?
                .broadcast_as(src.shape())?
                .contiguous()?;
            pool.scatter_set(&idx, &src, 0)
        };
        match (self, rows) {
            (LayerKv::Dense { k: pk, v: pv }, LayerRows::Dense { k, v }) => {
                put(pk, k)?;
                put(pv, v)
            }
            (LayerKv::Affine { k: pk, v: pv, .. }, LayerRows::Affine { k, v, .. }) => {
                for (p, s) in [(pk, k), (pv, v)] {
                    put(&p.codes, &s.codes)?;
                    put(&p.scales, &s.scales)?;
                    put(&p.biases, &s.biases)?;
                }
                Ok(())
            }
            _ => candle_core::bail!("rows and layer formats differ"),
        }
    }
}
