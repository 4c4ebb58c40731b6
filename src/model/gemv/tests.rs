//! The fused projections against the unfused candle ops they replace (on a GPU).
use super::*;
use candle_core::{Device, D};

fn rand(shape: &[usize], dev: &Device, dtype: DType) -> Tensor {
    Tensor::randn(0f32, 1f32, shape, dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let scale = b
        .abs()
        .unwrap()
        .max_keepdim(D::Minus1)
        .unwrap()
        .clamp(1f32, f32::MAX)
        .unwrap();
    (a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .broadcast_div(&scale)
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Every epilogue, with and without the norm prologue and a bias, rows 1..=8, against the
/// unfused ops; each row's result does not depend on the other rows of the call. 256 x 20000
/// is a logits-like shape: thousands of blocks, several waves.
#[test]
fn fused_projection_matches_unfused_ops_and_rows_are_independent() {
    let dev = Device::new_cuda(0).expect("a CUDA device");
    for dtype in [DType::F16, DType::BF16] {
        let tol = if dtype == DType::F16 { 4e-3 } else { 3e-2 };
        for (k, n) in [(576, 960), (1536, 576), (64, 3072), (256, 20000)] {
            let w = rand(&[n, k], &dev, dtype).affine(0.05, 0.0).unwrap();
            let bias = rand(&[n], &dev, dtype);
            let nw = rand(&[k], &dev, dtype);
            for rows in 1..=MAX_ROWS {
                let x = rand(&[rows, k], &dev, dtype);
                let res = rand(&[rows, k], &dev, dtype);
                let out_res = rand(&[rows, n], &dev, dtype);
                let s = (&x + &res).unwrap();
                let xn = candle_nn::ops::rms_norm(&s, &nw, 1e-5).unwrap();
                let y = xn.matmul(&w.t().unwrap()).unwrap();
                let yb = y.broadcast_add(&bias).unwrap();
                let plain = x.matmul(&w.t().unwrap()).unwrap();
                let norm = Some((&nw, 1e-5f32));
                // Store with norm, residual and bias.
                let (sum, got) =
                    project(&x, Some(&res), norm, &w, Some(&bias), Epilogue::Store).unwrap();
                assert_eq!(max_err(&sum.unwrap(), &s), 0.0, "residual sum");
                let e = max_err(&got, &yb);
                assert!(e < tol, "{dtype:?} {k}x{n} rows {rows}: store {e}");
                // Add, no prologue.
                let (_, got) = project(&x, None, None, &w, None, Epilogue::Add(&out_res)).unwrap();
                let e = max_err(&got, &(&plain + &out_res).unwrap());
                assert!(e < tol, "{dtype:?} {k}x{n} rows {rows}: add {e}");
                // Gated unit with the norm.
                let f = n / 2;
                let (_, got) =
                    project(&x, None, norm, &w, None, Epilogue::Glu { gelu: false }).unwrap();
                let xn0 = candle_nn::ops::rms_norm(&x, &nw, 1e-5).unwrap();
                let y0 = xn0.matmul(&w.t().unwrap()).unwrap();
                let want = (candle_nn::ops::silu(&y0.narrow(1, 0, f).unwrap()).unwrap()
                    * y0.narrow(1, f, f).unwrap())
                .unwrap();
                let e = max_err(&got, &want);
                assert!(e < tol, "{dtype:?} {k}x{n} rows {rows}: glu {e}");
                // Logits.
                let (_, got) = project(&x, None, None, &w, None, Epilogue::Logits).unwrap();
                assert_eq!(got.dtype(), DType::F32);
                let e = max_err(&got, &plain);
                assert!(e < tol, "{dtype:?} {k}x{n} rows {rows}: logits {e}");
                // Row independence: row r alone equals row r of the whole call, bit for bit.
                let (_, all) =
                    project(&x, Some(&res), norm, &w, Some(&bias), Epilogue::Store).unwrap();
                for r in 0..rows {
                    let one = |t: &Tensor| t.narrow(0, r, 1).unwrap();
                    let (_, alone) = project(
                        &one(&x),
                        Some(&one(&res)),
                        norm,
                        &w,
                        Some(&bias),
                        Epilogue::Store,
                    )
                    .unwrap();
                    assert_eq!(max_err(&alone, &one(&all)), 0.0, "row {r} of {rows}");
                }
            }
        }
    }
}

/// q|k|v with RoPE against the plain projection then kernels/fused.cu's rope_qkv, into
/// fresh k/v and into pool rows.
#[test]
fn fused_rope_projection_matches_projection_then_rope() {
    let dev = Device::new_cuda(0).expect("a CUDA device");
    let (heads, kv_heads, d, k) = (9, 3, 64, 576);
    let n = (heads + 2 * kv_heads) * d;
    let positions = 4096;
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let angles: Vec<f32> = (0..positions)
        .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
        .collect();
    let ang = Tensor::from_vec(angles, (positions, d / 2), &dev).unwrap();
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    for dtype in [DType::F16, DType::BF16] {
        let tol = if dtype == DType::F16 { 4e-3 } else { 3e-2 };
        let w = rand(&[n, k], &dev, dtype).affine(0.05, 0.0).unwrap();
        let nw = rand(&[k], &dev, dtype);
        for rows in 1..=MAX_ROWS {
            let x = rand(&[rows, k], &dev, dtype);
            let pos: Vec<u32> = (0..rows as u32).map(|r| 17 + 411 * r).collect();
            let pos = Tensor::from_vec(pos, rows, &dev).unwrap();
            let norm = Some((&nw, 1e-5f32));
            let (_, y) = project(&x, None, norm, &w, None, Epilogue::Store).unwrap();
            let (q0, k0, v0) =
                crate::model::fused::rope_qkv(&y, &pos, (&cos, &sin), (heads, kv_heads, d), None)
                    .unwrap();
            let rope = |pool| RopeOut {
                pos: &pos,
                cos: &cos,
                sin: &sin,
                heads,
                kv_heads,
                head_dim: d,
                pool,
            };
            let (_, q, kv) = project_rope(&x, None, norm, &w, None, rope(None)).unwrap();
            let (kf, vf) = kv.unwrap();
            let e = max_err(&q.flatten_from(1).unwrap(), &q0.flatten_from(1).unwrap());
            assert!(e < tol, "{dtype:?} rows {rows}: q {e}");
            assert!(max_err(&kf, &k0) < tol, "{dtype:?} rows {rows}: k");
            assert!(max_err(&vf, &v0) < tol, "{dtype:?} rows {rows}: v");
            // Into pool rows 2r + 1 of 20.
            let kp = Tensor::zeros((20, kv_heads * d), dtype, &dev).unwrap();
            let vp = Tensor::zeros((20, kv_heads * d), dtype, &dev).unwrap();
            let slots: Vec<u32> = (0..rows as u32).map(|r| 2 * r + 1).collect();
            let slots = Tensor::from_vec(slots, rows, &dev).unwrap();
            let (_, q2, kv) =
                project_rope(&x, None, norm, &w, None, rope(Some((&kp, &vp, &slots)))).unwrap();
            assert!(kv.is_none());
            assert_eq!(max_err(&q2, &q), 0.0, "q into pools");
            let kp_rows = kp.index_select(&slots, 0).unwrap();
            let vp_rows = vp.index_select(&slots, 0).unwrap();
            assert_eq!(max_err(&kp_rows, &kf), 0.0, "k pool rows");
            assert_eq!(max_err(&vp_rows, &vf), 0.0, "v pool rows");
        }
    }
}
