//! The fused decode-step write with its side writes (`kv::format::SideWrites`: the key means
//! subtracted, the dense copies of `--kv-residual` written in the same launch) against the
//! separate operations it replaces: candle's subtraction and cast, then the plain fused write.
//! Bit for bit, since a captured step and an eager one must store the same cache.

#[cfg(feature = "cuda")]
#[test]
fn cuda_side_writes_equal_the_separate_operations() {
    use candle_core::{DType, Device, Tensor};
    use kvq::kv::format::rotation::Rotation;
    use kvq::kv::format::{self, DenseCopies, QuantFormat, Quantized, SideWrites, SlotRows};

    use crate::quant_ops::bits;

    let dev = Device::new_cuda(0).expect("a CUDA device");
    for (kb, vb, dtype, hd, kvh, centred, copies) in [
        (4, 3, DType::F16, 64, 3, true, true),
        (4, 4, DType::BF16, 128, 2, true, true),
        (4, 4, DType::F16, 64, 2, false, true),
        (5, 4, DType::F16, 128, 1, true, false),
        (8, 8, DType::F32, 64, 2, true, true),
    ] {
        let case =
            format!("K{kb}/V{vb} {dtype:?} head_dim {hd} x{kvh} means {centred} copies {copies}");
        let (kf, vf) = (
            QuantFormat::new(kb, 64).unwrap(),
            QuantFormat::new(vb, 64).unwrap(),
        );
        let width = kvh * hd;
        let rot = Rotation::new(hd, 3, &dev).unwrap();
        let sdt = format::scale_dtype_for(dtype);
        let pool = |fmt: QuantFormat| {
            let zeros = |cols: usize, dt: DType| Tensor::zeros((10, cols), dt, &dev).unwrap();
            Quantized {
                codes: zeros(fmt.words_per_row(width), DType::U32),
                scales: zeros(fmt.groups_per_row(width), sdt),
                biases: zeros(fmt.groups_per_row(width), sdt),
            }
        };
        let rand = |scale: f64| {
            (Tensor::randn(0f32, 1f32, (5, width), &dev).unwrap() * scale)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let (xk, xv, mu) = (rand(2.0), rand(1.0), rand(0.7));
        let slots = SlotRows::new(vec![3, 4, 9, 1, 0]);
        // Ring rows, and sink rows: rows 1 and 3 are sinks too.
        let ring = Tensor::new(&[7u32, 8, 9, 10, 11], &dev).unwrap();
        let sink = Tensor::new(&[7u32, 1, 9, 3, 11], &dev).unwrap();
        let dense = || Tensor::zeros((12, width), DType::F16, &dev).unwrap();
        let (ck, cv) = (dense(), dense());

        let (fk, fv) = (pool(kf), pool(vf));
        let side = SideWrites {
            means: centred.then_some(&mu),
            copies: copies.then_some(DenseCopies {
                k: &ck,
                v: &cv,
                rows: &ring,
                sinks: &sink,
            }),
        };
        format::quantize_rotated_into_rows(
            &xk,
            &xv,
            (kf, vf),
            &fk,
            &fv,
            &slots,
            rot.signs(),
            hd,
            side,
        )
        .unwrap();

        let (rk, rv) = (pool(kf), pool(vf));
        let k = if centred {
            (&xk - &mu).unwrap()
        } else {
            xk.clone()
        };
        let plain = SideWrites::default();
        format::quantize_rotated_into_rows(
            &k,
            &xv,
            (kf, vf),
            &rk,
            &rv,
            &slots,
            rot.signs(),
            hd,
            plain,
        )
        .unwrap();
        for (got, want, what) in [(&fk, &rk, "keys"), (&fv, &rv, "values")] {
            for (g, w) in [
                (&got.codes, &want.codes),
                (&got.scales, &want.scales),
                (&got.biases, &want.biases),
            ] {
                assert_eq!(bits(g), bits(w), "{case}: {what} in the pool");
            }
        }
        // The copies: each row at its ring row and its sink row, as candle casts it; every
        // other row untouched.
        let (kh, vh) = (
            k.to_dtype(DType::F16).unwrap(),
            xv.to_dtype(DType::F16).unwrap(),
        );
        let rows_of = |t: &Tensor| -> Vec<Vec<u32>> {
            (0..t.dim(0).unwrap())
                .map(|r| bits(&t.get(r).unwrap()))
                .collect()
        };
        let (gk, gv, wk, wv) = (rows_of(&ck), rows_of(&cv), rows_of(&kh), rows_of(&vh));
        let zero = vec![0u32; width];
        for r in 0..12usize {
            let from = [7, 8, 9, 10, 11, 1, 3]
                .iter()
                .position(|&x| x == r)
                .map(|i| [0, 1, 2, 3, 4, 1, 3][i]);
            let (want_k, want_v) = match (copies, from) {
                (true, Some(i)) => (&wk[i], &wv[i]),
                _ => (&zero, &zero),
            };
            assert_eq!(&gk[r], want_k, "{case}: copy row {r} of K");
            assert_eq!(&gv[r], want_v, "{case}: copy row {r} of V");
        }
    }
}
