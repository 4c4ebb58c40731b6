//! Fused kernels against the generic candle-op path on random data of many shapes (f32, f16,
//! bf16, leading dims, large and constant values), input refusals, and quantize_into.

use candle_core::{DType, Device, IndexOp, Tensor};
use kvq::kv::format::{self, Fit, QuantFormat, Quantized, SlotRows};

/// The values of `t` as bit patterns (u32 as they are, floats through f32): for equality.
pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::U32 => t.to_vec1::<u32>().unwrap(),
        _ => t
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims() && a.dtype() == b.dtype() && bits(a) == bits(b)
}

/// Largest |value| of `t`, read as f32.
fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

fn sample(shape: &[usize], dtype: DType, scale: f64) -> Tensor {
    let x = Tensor::randn(0f32, 1f32, shape, &Device::Cpu).unwrap();
    // Add a per-row offset so some groups are all-positive or all-negative.
    let off = Tensor::randn(0f32, 2f32, &shape[..shape.len() - 1], &Device::Cpu).unwrap();
    let x = x
        .broadcast_add(&off.unsqueeze(shape.len() - 1).unwrap())
        .unwrap();
    (x * scale).unwrap().to_dtype(dtype).unwrap()
}

#[test]
fn fused_equals_generic_on_random_data() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for b in QuantFormat::BITS {
            for g in QuantFormat::GROUP_SIZES {
                let fmt = QuantFormat::new(b, g).unwrap();
                for (shape, scale) in [
                    (vec![3, 5, 256], 1.0),
                    (vec![7, 128], 1000.0),
                    (vec![2, 2, 2, 384], 1e-3),
                ] {
                    if shape[shape.len() - 1] % g != 0 {
                        continue;
                    }
                    let x = sample(&shape, dtype, scale);
                    let f = format::quantize(&x, fmt).unwrap();
                    let r = format::generic::quantize(&x, fmt).unwrap();
                    let case = format!("{dtype:?} {fmt} {shape:?}");
                    assert!(same(&f.codes, &r.codes), "codes {case}");
                    assert!(same(&f.scales, &r.scales), "scales {case}");
                    assert!(same(&f.biases, &r.biases), "biases {case}");
                    let (fd, rd) = (
                        format::dequantize(&f, fmt).unwrap(),
                        format::generic::dequantize(&r, fmt).unwrap(),
                    );
                    assert!(same(&fd, &rd), "deq {case}");
                    assert_eq!(fd.dims(), x.dims());
                    // Sanity bound: within one step (the snapped scale can leave the far end half a step short).
                    let step = max_abs(&f.scales);
                    let err = max_abs(
                        &(fd.to_dtype(DType::F32).unwrap() - x.to_dtype(DType::F32).unwrap())
                            .unwrap(),
                    );
                    let amax = max_abs(&x);
                    let eps = match dtype {
                        DType::BF16 => 1e-2,
                        DType::F16 => 2e-3,
                        _ => 1e-6,
                    };
                    assert!(
                        err <= step * 1.01 + eps * amax,
                        "error {err} vs step {step} {case}"
                    );
                }
            }
        }
    }
}

#[test]
fn f32_rows_with_half_scales_fused_equals_generic() {
    for sdt in [DType::F16, DType::BF16] {
        for b in QuantFormat::BITS {
            for g in QuantFormat::GROUP_SIZES {
                let fmt = QuantFormat::new(b, g).unwrap();
                let x = sample(&[5, 3, 384], DType::F32, 3.0);
                let f = format::quantize_as(&x, fmt, sdt).unwrap();
                let r = format::generic::quantize_as(&x, fmt, sdt).unwrap();
                let case = format!("f32 into {sdt:?} {fmt}");
                assert!(same(&f.codes, &r.codes), "codes {case}");
                assert!(same(&f.scales, &r.scales), "scales {case}");
                assert!(same(&f.biases, &r.biases), "biases {case}");
                for out in [DType::F32, sdt] {
                    let fd = format::dequantize_as(&f, fmt, out).unwrap();
                    let rd = format::generic::dequantize_as(&r, fmt, out).unwrap();
                    assert!(same(&fd, &rd), "deq into {out:?} {case}");
                }
            }
        }
    }
}

/// f16 scales of f32 rows are the f32 parameters rounded, the codes are computed from the
/// rounded parameters (so the rounding of a group's bias is not a shift of the whole group), and
/// dequantizing into f32 is `code·scale + bias` in f32 with the
/// parameters widened: what the fused decode kernels compute, so a cache computing in f32 and its
/// reference agree to f32 rounding.
#[test]
fn f16_scales_are_the_f32_parameters_rounded() {
    let fmt = QuantFormat::new(4, 64).unwrap();
    // Rows with large offsets: the case where a rounded bias would shift a whole group.
    let x = (sample(&[6, 256], DType::F32, 2.0) + 40.0).unwrap();
    let wide = format::quantize(&x, fmt).unwrap();
    let half = format::quantize_as(&x, fmt, DType::F16).unwrap();
    assert!(same(
        &half.scales,
        &wide.scales.to_dtype(DType::F16).unwrap()
    ));
    assert!(same(
        &half.biases,
        &wide.biases.to_dtype(DType::F16).unwrap()
    ));
    let widened = |q: &Quantized| Quantized {
        codes: q.codes.clone(),
        scales: q.scales.to_dtype(DType::F32).unwrap(),
        biases: q.biases.to_dtype(DType::F32).unwrap(),
    };
    let got = format::dequantize_as(&half, fmt, DType::F32).unwrap();
    assert!(same(
        &got,
        &format::dequantize(&widened(&half), fmt).unwrap()
    ));
    // Into the scales' own dtype it stays MLX's half-precision dequantize.
    let mlx = format::dequantize_as(&half, fmt, DType::F16).unwrap();
    assert!(same(&mlx, &format::dequantize(&half, fmt).unwrap()));
    // Codes of the rounded parameters: within a step of every value, as MLX's own (the snapped
    // scale can leave the far end half a step short), plus the parameters' rounding.
    let err = max_abs(&(format::dequantize(&widened(&half), fmt).unwrap() - &x).unwrap());
    let step = max_abs(&wide.scales);
    let amax = max_abs(&x);
    assert!(err <= step * 1.01 + amax / 1024.0, "{err} vs step {step}");
    // The codes are those of the rounded parameters: every value the stored scale and bias map
    // inside [0, n] is within half a stored step of its code's value.
    let g = |t: &Tensor| t.to_dtype(DType::F32).unwrap().reshape((6, 4, 1)).unwrap();
    let (s16, b16) = (g(&half.scales), g(&half.biases));
    let x3 = x.reshape((6, 4, 64)).unwrap();
    let t = x3.broadcast_sub(&b16).unwrap().broadcast_div(&s16).unwrap();
    let inside = t.ge(0f32).unwrap().mul(&t.le(15f32).unwrap()).unwrap();
    let excess = (got.reshape((6, 4, 64)).unwrap() - &x3)
        .unwrap()
        .abs()
        .unwrap()
        .broadcast_sub(&(s16.abs().unwrap() * 0.5).unwrap())
        .unwrap();
    let excess: f32 = inside
        .where_cond(&excess, &excess.zeros_like().unwrap())
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(excess <= amax * 1e-6, "{excess} past half a step");
}

#[test]
fn constant_and_zero_rows_round_trip_exactly() {
    let fmt = QuantFormat::new(4, 32).unwrap();
    for v in [0f32, 3.25, -7.5] {
        let x = Tensor::full(v, (2, 64), &Device::Cpu).unwrap();
        let y = format::dequantize(&format::quantize(&x, fmt).unwrap(), fmt).unwrap();
        assert_eq!(
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![v; 128]
        );
    }
}

#[test]
fn non_contiguous_input_is_accepted() {
    let fmt = QuantFormat::new(8, 64).unwrap();
    let x = sample(&[64, 4], DType::F32, 1.0)
        .t()
        .unwrap()
        .contiguous()
        .unwrap()
        .t()
        .unwrap()
        .t()
        .unwrap();
    let xt = sample(&[4, 128], DType::F32, 1.0).t().unwrap().t().unwrap();
    for t in [x, xt] {
        let a = format::quantize(&t, fmt).unwrap();
        let b = format::quantize(&t.contiguous().unwrap(), fmt).unwrap();
        assert!(same(&a.codes, &b.codes));
    }
}

#[test]
fn refuses_bad_inputs() {
    let fmt = QuantFormat::new(4, 64).unwrap();
    let e = format::quantize(
        &Tensor::zeros((2, 96), DType::F32, &Device::Cpu).unwrap(),
        fmt,
    )
    .unwrap_err();
    assert!(e.to_string().contains("32, 64, 128"), "{e}");
    let e = format::quantize(
        &Tensor::zeros((2, 64), DType::U32, &Device::Cpu).unwrap(),
        fmt,
    )
    .unwrap_err();
    assert!(e.to_string().contains("dtype"), "{e}");
    let q = format::quantize(
        &Tensor::zeros((2, 128), DType::F32, &Device::Cpu).unwrap(),
        fmt,
    )
    .unwrap();
    let bad = Quantized {
        codes: q.codes.narrow(1, 0, 8).unwrap(),
        ..q.clone()
    };
    assert!(format::dequantize(&bad, fmt).is_err());
    let bad = Quantized {
        biases: q.biases.to_dtype(DType::F16).unwrap(),
        ..q
    };
    assert!(format::dequantize(&bad, fmt).is_err());
}

#[test]
fn quantize_into_writes_only_the_named_slots() {
    let fmt = QuantFormat::new(3, 32).unwrap();
    let (slots, d) = (10usize, 128usize);
    let pool = Quantized {
        codes: Tensor::zeros((slots, fmt.words_per_row(d)), DType::U32, &Device::Cpu).unwrap(),
        scales: Tensor::zeros((slots, fmt.groups_per_row(d)), DType::F16, &Device::Cpu).unwrap(),
        biases: Tensor::zeros((slots, fmt.groups_per_row(d)), DType::F16, &Device::Cpu).unwrap(),
    };
    let x = sample(&[3, d], DType::F32, 1.0);
    let ids = Tensor::new(&[7u32, 2, 5], &Device::Cpu).unwrap();
    format::quantize_into(&x, fmt, &pool, &ids).unwrap();
    let want = format::quantize_as(&x, fmt, DType::F16).unwrap();
    for (i, slot) in [7usize, 2, 5].into_iter().enumerate() {
        assert!(same(
            &pool.codes.i(slot).unwrap(),
            &want.codes.i(i).unwrap()
        ));
        assert!(same(
            &pool.scales.i(slot).unwrap(),
            &want.scales.i(i).unwrap()
        ));
        assert!(same(
            &pool.biases.i(slot).unwrap(),
            &want.biases.i(i).unwrap()
        ));
    }
    for slot in [0usize, 1, 3, 4, 6, 8, 9] {
        assert!(
            bits(&pool.codes.i(slot).unwrap()).iter().all(|&w| w == 0),
            "slot {slot} touched"
        );
    }
    let e = format::quantize_into(
        &x,
        fmt,
        &pool,
        &Tensor::new(&[1u32, 2, 10], &Device::Cpu).unwrap(),
    );
    assert!(e.unwrap_err().to_string().contains("outside the pool"));
}

#[test]
fn quantize_rows_into_writes_only_its_run() {
    let fmt = QuantFormat::new(5, 64).unwrap();
    let (slots, d) = (9usize, 128usize);
    let pool = Quantized {
        codes: Tensor::zeros((slots, fmt.words_per_row(d)), DType::U32, &Device::Cpu).unwrap(),
        scales: Tensor::zeros((slots, fmt.groups_per_row(d)), DType::BF16, &Device::Cpu).unwrap(),
        biases: Tensor::zeros((slots, fmt.groups_per_row(d)), DType::BF16, &Device::Cpu).unwrap(),
    };
    let x = sample(&[3, d], DType::F32, 1.0);
    format::quantize_rows_into(&x, fmt, Fit::MinMax, &pool, 4).unwrap();
    let want = format::quantize_as(&x, fmt, DType::BF16).unwrap();
    for i in 0..3 {
        assert!(same(
            &pool.codes.i(4 + i).unwrap(),
            &want.codes.i(i).unwrap()
        ));
        assert!(same(
            &pool.scales.i(4 + i).unwrap(),
            &want.scales.i(i).unwrap()
        ));
        assert!(same(
            &pool.biases.i(4 + i).unwrap(),
            &want.biases.i(i).unwrap()
        ));
    }
    for slot in [0usize, 1, 2, 3, 7, 8] {
        assert!(
            bits(&pool.codes.i(slot).unwrap()).iter().all(|&w| w == 0),
            "slot {slot} touched"
        );
    }
    let e = format::quantize_rows_into(&x, fmt, Fit::MinMax, &pool, 7).unwrap_err();
    assert!(e.to_string().contains("outside the pool"), "{e}");
    let e = format::quantize_rows_into(
        &sample(&[2, 64], DType::F32, 1.0),
        fmt,
        Fit::MinMax,
        &pool,
        0,
    );
    assert!(e.is_err());
}

/// `quantize_into_rows` on `dev`: rows scattered over a pool (a run of consecutive slots, a
/// lone slot, a descending pair) equal `quantize_as` of the same f32 rows with the pool's scale
/// dtype on the CPU, bit for bit, and
/// the other slots stay untouched; slots outside the pool and a row count mismatch are refused.
fn check_into_rows(dev: &Device) {
    for (nbits, g, dtype, width) in [
        (4, 64, DType::F16, 192),
        (8, 32, DType::BF16, 128),
        (3, 128, DType::F32, 256),
        (4, 32, DType::F32, 64),
    ] {
        let fmt = QuantFormat::new(nbits, g).unwrap();
        let slots = 12usize;
        let zeros = |cols: usize, dt: DType| Tensor::zeros((slots, cols), dt, dev).unwrap();
        let pool = Quantized {
            codes: zeros(fmt.words_per_row(width), DType::U32),
            scales: zeros(fmt.groups_per_row(width), dtype),
            biases: zeros(fmt.groups_per_row(width), dtype),
        };
        let rows = [3u32, 4, 5, 9, 1, 0];
        let x = sample(&[rows.len(), width], DType::F32, 2.0);
        format::quantize_into_rows(
            &x.to_device(dev).unwrap(),
            fmt,
            Fit::MinMax,
            &pool,
            &SlotRows::new(rows.to_vec()),
        )
        .unwrap();
        let want = format::quantize_as(&x, fmt, dtype).unwrap();
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            for (got, want) in [
                (&pool.codes, &want.codes),
                (&pool.scales, &want.scales),
                (&pool.biases, &want.biases),
            ] {
                assert!(
                    same(&cpu(&got.i(r).unwrap()), &want.i(i).unwrap()),
                    "bits {nbits} g {g} {dtype:?}: row {i} -> slot {r}"
                );
            }
        }
        for slot in [2usize, 6, 7, 8, 10, 11] {
            assert!(
                bits(&cpu(&pool.codes.i(slot).unwrap()))
                    .iter()
                    .all(|&w| w == 0),
                "slot {slot} touched"
            );
        }
        let xd = x.to_device(dev).unwrap();
        let bad = SlotRows::new(vec![0, 1, 2, 3, 4, 12]);
        let e = format::quantize_into_rows(&xd, fmt, Fit::MinMax, &pool, &bad).unwrap_err();
        assert!(e.to_string().contains("outside the pool"), "{e}");
        let e =
            format::quantize_into_rows(&xd, fmt, Fit::MinMax, &pool, &SlotRows::new(vec![0, 1]))
                .unwrap_err();
        assert!(e.to_string().contains("rows for"), "{e}");
    }
}

#[test]
fn quantize_into_rows_scatters_exact_rows() {
    check_into_rows(&Device::Cpu);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_quantize_into_rows_scatters_exact_rows() {
    check_into_rows(&Device::new_cuda(0).expect("a CUDA device"));
}

/// The fused rotated write takes one format for K and V or keys one bit wider than values; any
/// other pair is refused by name, whatever the device.
#[test]
fn rotated_write_refuses_other_mixed_pairs() {
    let dev = Device::Cpu;
    let f = |b| QuantFormat::new(b, 64).unwrap();
    let pool = |fmt: QuantFormat| {
        let zeros = |cols: usize, dt: DType| Tensor::zeros((4, cols), dt, &dev).unwrap();
        Quantized {
            codes: zeros(fmt.words_per_row(128), DType::U32),
            scales: zeros(fmt.groups_per_row(128), DType::F32),
            biases: zeros(fmt.groups_per_row(128), DType::F32),
        }
    };
    let x = sample(&[2, 128], DType::F32, 1.0);
    let signs = Tensor::ones(128, DType::F32, &dev).unwrap();
    let rows = SlotRows::new(vec![0, 1]);
    for (k, v) in [(8, 4), (4, 5), (6, 4)] {
        let (pk, pv) = (pool(f(k)), pool(f(v)));
        let e = format::quantize_rotated_into_rows(
            &x,
            &x,
            (f(k), f(v)),
            &pk,
            &pv,
            &rows,
            &signs,
            128,
            Default::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!(
                "no fused kernel for {k}-bit g64 keys with {v}-bit g64 values"
            )),
            "{k}/{v}: {e}"
        );
    }
}

/// The fused rotate-and-quantize write against rotating (matmul) then quantizing, for one width
/// and for keys one bit wider than values: the two rotations differ only in rounding, so codes agree except at rounding boundaries and every
/// dequantized value within one code step; slots not written stay untouched.
#[cfg(feature = "cuda")]
#[test]
fn cuda_quantize_rotated_into_rows_matches_rotate_then_quantize() {
    use kvq::kv::format::rotation::Rotation;
    let dev = Device::new_cuda(0).expect("a CUDA device");
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    for (nbits, vbits, g, dtype, hd, kvh) in [
        (4, 4, 64, DType::F16, 128, 2),
        (8, 8, 32, DType::BF16, 64, 3),
        (3, 3, 128, DType::F32, 128, 1),
        (2, 2, 32, DType::F16, 64, 2),
        (4, 4, 128, DType::F16, 64, 2),
        (5, 5, 64, DType::F32, 64, 1),
        (6, 6, 32, DType::F16, 128, 1),
        (5, 4, 64, DType::F16, 128, 2),
        (4, 3, 32, DType::F32, 64, 1),
        (3, 2, 128, DType::BF16, 128, 1),
        (6, 5, 64, DType::F16, 64, 3),
    ] {
        let (fmt, vfmt) = (
            QuantFormat::new(nbits, g).unwrap(),
            QuantFormat::new(vbits, g).unwrap(),
        );
        let width = kvh * hd;
        let rot = Rotation::new(hd, 7, &dev).unwrap();
        let slots = 12usize;
        let pool = |fmt: QuantFormat| {
            let zeros = |cols: usize, dt: DType| Tensor::zeros((slots, cols), dt, &dev).unwrap();
            Quantized {
                codes: zeros(fmt.words_per_row(width), DType::U32),
                scales: zeros(fmt.groups_per_row(width), dtype),
                biases: zeros(fmt.groups_per_row(width), dtype),
            }
        };
        // Rows in f32, and in the pool's dtype (the model's activations on the GPU).
        let inputs = if dtype == DType::F32 {
            vec![DType::F32]
        } else {
            vec![DType::F32, dtype]
        };
        for in_dtype in inputs {
            let (fk, fv, rk, rv) = (pool(fmt), pool(vfmt), pool(fmt), pool(vfmt));
            let rows = SlotRows::new(vec![3, 4, 5, 9, 1, 0]);
            let xk = sample(&[6, width], in_dtype, 2.0).to_device(&dev).unwrap();
            let xv = sample(&[6, width], in_dtype, 0.5).to_device(&dev).unwrap();
            let fmts = (fmt, vfmt);
            format::quantize_rotated_into_rows(
                &xk,
                &xv,
                fmts,
                &fk,
                &fv,
                &rows,
                rot.signs(),
                hd,
                Default::default(),
            )
            .unwrap();
            format::quantize_into_rows(&rot.rotate(&xk).unwrap(), fmt, Fit::MinMax, &rk, &rows)
                .unwrap();
            format::quantize_into_rows(&rot.rotate(&xv).unwrap(), vfmt, Fit::MinMax, &rv, &rows)
                .unwrap();
            let case = format!(
                "bits {nbits}/{vbits} g {g} {in_dtype:?} into {dtype:?} head_dim {hd} x{kvh}"
            );
            for (got, want, fmt) in [(&fk, &rk, fmt), (&fv, &rv, vfmt)] {
                let (gc, wc) = (bits(&cpu(&got.codes)), bits(&cpu(&want.codes)));
                let same_words = gc.iter().zip(&wc).filter(|(a, b)| a == b).count();
                assert!(
                    same_words * 10 >= gc.len() * 9,
                    "{case}: only {same_words} of {} code words agree",
                    gc.len()
                );
                let deq = |q: &Quantized| {
                    let q = Quantized {
                        codes: cpu(&q.codes),
                        scales: cpu(&q.scales),
                        biases: cpu(&q.biases),
                    };
                    let d = format::dequantize(&q, fmt).unwrap();
                    d.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
                };
                let steps = cpu(&want.scales)
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let (a, b) = (deq(got), deq(want));
                for slot in 0..slots {
                    for i in 0..width {
                        let step = steps[slot][i / g].abs();
                        let diff = (a[slot][i] - b[slot][i]).abs();
                        assert!(
                            diff <= step * 1.01 + 1e-5,
                            "{case}: slot {slot} value {i}: {} vs {} (step {step})",
                            a[slot][i],
                            b[slot][i]
                        );
                    }
                }
                for slot in [2usize, 6, 7, 8, 10, 11] {
                    assert!(
                        gc[slot * fmt.words_per_row(width)..(slot + 1) * fmt.words_per_row(width)]
                            .iter()
                            .all(|&w| w == 0),
                        "{case}: slot {slot} touched"
                    );
                }
            }
        }
        let (fk, fv) = (pool(fmt), pool(vfmt));
        let rows = SlotRows::new(vec![3, 4, 5, 9, 1, 0]);
        let xk = sample(&[6, width], DType::F32, 1.0)
            .to_device(&dev)
            .unwrap();
        let xv = xk.clone();
        let e = format::quantize_rotated_into_rows(
            &xk,
            &xv,
            (fmt, vfmt),
            &fk,
            &fv,
            &rows,
            &xk, // signs that are not one head vector
            hd,
            Default::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("signs"), "{e}");
    }
}
