//! Every block type × every ISA this CPU has × odd shapes, against candle's dequantization.

use super::*;
use crate::ops::row_matmul;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A `[n, k]` matrix quantized to `ty` by candle, and its dequantized f32 values. Rows get
/// different offsets and spreads so that biases, mins and negative scales all occur.
fn quantized(ty: BlockType, n: usize, k: usize, seed: u64) -> (QMatrix, Vec<f32>) {
    let mut w = values(n * k, seed);
    for (r, row) in w.chunks_exact_mut(k).enumerate() {
        let (spread, offset) = (0.05 + 0.3 * (r % 5) as f32, 0.1 * (r % 3) as f32 - 0.1);
        for v in row {
            *v = *v * spread + offset;
        }
    }
    let t = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, ty.ggml()).unwrap();
    let deq: Vec<f32> = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (QMatrix::new(&q).unwrap(), deq)
}

/// Shapes `(m, n, k)`: batch 1, 3, 17 and more rows than a tile; row counts of `W` that are
/// not multiples of the register block or the tile; one to several blocks per row.
fn shapes(ty: BlockType) -> Vec<(usize, usize, usize)> {
    let b = ty.block_elems();
    vec![
        (1, 1, b),
        (1, 7, 2 * b),
        (3, 33, b),
        (17, 13, 3 * b),
        (5, 70, 2 * b),
        (70, 5, b),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn run_q(q: &QMatrix, x: &[f32], m: usize, isa: Isa) -> Vec<f32> {
    let (n, k) = q.dims();
    let mut y = vec![0f32; m * n];
    matmul_slices(q.ty, x, &q.w, (m, n, k), &mut y, isa);
    y
}

/// Within k ulps of Σ|x·w| of the f64 product of the dequantized weights, and bit for bit the
/// dense row-invariant matmul of those weights on the same ISA.
#[test]
fn equals_the_dense_product_of_the_dequantized_weights() {
    for ty in BlockType::ALL {
        for (m, n, k) in shapes(ty) {
            let (q, deq) = quantized(ty, n, k, 7);
            let x = values(m * k, 11);
            for isa in Isa::all_available() {
                let y = run_q(&q, &x, m, isa);
                let mut dense = vec![0f32; m * n];
                row_matmul::run(&x, &deq, m, n, k, &mut dense, isa);
                assert_eq!(bits(&y), bits(&dense), "{ty:?} {isa:?} {m}x{n}x{k}");
                for i in 0..m {
                    for j in 0..n {
                        let (xr, wr) = (&x[i * k..][..k], &deq[j * k..][..k]);
                        let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = xr.iter().zip(wr).map(|(a, b)| (*a * *b).abs() as f64).sum();
                        let err = (y[i * n + j] as f64 - want).abs();
                        assert!(
                            err <= mag * k as f64 * f32::EPSILON as f64 + 1e-30,
                            "{ty:?} {isa:?} {m}x{n}x{k} ({i},{j}): {} vs {want}",
                            y[i * n + j]
                        );
                    }
                }
            }
        }
    }
}

/// Row i of an m-row call equals the 1-row call on row i, bit for bit, and a window of rows
/// starting mid-block equals the same rows of the whole call.
#[test]
fn rows_do_not_depend_on_the_batch() {
    for ty in BlockType::ALL {
        let (m, n, k) = (19, 37, 2 * ty.block_elems());
        let (q, _) = quantized(ty, n, k, 3);
        let x = values(m * k, 5);
        for isa in Isa::all_available() {
            let all = run_q(&q, &x, m, isa);
            for i in [0, 3, 18] {
                let one = run_q(&q, &x[i * k..][..k], 1, isa);
                assert_eq!(
                    bits(&one),
                    bits(&all[i * n..][..n]),
                    "{ty:?} {isa:?} row {i}"
                );
            }
            let (a, b) = (5, 16);
            let part = run_q(&q, &x[a * k..b * k], b - a, isa);
            assert_eq!(
                bits(&part),
                bits(&all[a * n..b * n]),
                "{ty:?} {isa:?} rows {a}..{b}"
            );
        }
    }
}

/// Widening gives candle's dequantized values, bit for bit (the embedding lookup uses it).
#[test]
fn rows_are_candles_dequantized_values() {
    for ty in BlockType::ALL {
        let (n, k) = (9, 3 * ty.block_elems());
        let (q, deq) = quantized(ty, n, k, 9);
        let ids = [4u32, 0, 8, 4];
        let got: Vec<f32> = q
            .rows(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (r, &id) in ids.iter().enumerate() {
            let want = &deq[id as usize * k..][..k];
            assert_eq!(bits(&got[r * k..][..k]), bits(want), "{ty:?} row {id}");
        }
        let e = q.rows(&[9]).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }
}

#[test]
fn tensor_wrapper_keeps_leading_dims_and_dtype() {
    let (q, deq) = quantized(BlockType::Q4_1, 6, 64, 1);
    let x = Tensor::from_vec(values(2 * 3 * 64, 2), (2, 3, 64), &Device::Cpu).unwrap();
    let y = q.matmul_t(&x).unwrap();
    assert_eq!(y.dims(), [2, 3, 6]);
    let w = Tensor::from_vec(deq, (6, 64), &Device::Cpu).unwrap();
    let want = row_matmul::matmul_t(&x, &w).unwrap();
    let (a, b): (Vec<f32>, Vec<f32>) = (
        y.flatten_all().unwrap().to_vec1().unwrap(),
        want.flatten_all().unwrap().to_vec1().unwrap(),
    );
    assert_eq!(bits(&a), bits(&b));
    let yh = q.matmul_t(&x.to_dtype(DType::BF16).unwrap()).unwrap();
    assert_eq!(yh.dtype(), DType::BF16);
    let e = q.matmul_t(&x.narrow(2, 0, 32).unwrap()).unwrap_err();
    assert!(e.to_string().contains("GGUF block matmul"), "{e}");
}

#[test]
fn refuses_types_without_a_kernel() {
    let t = Tensor::from_vec(values(64, 1), (2, 32), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F16).unwrap();
    assert!(!QMatrix::supports(&q));
    let e = QMatrix::new(&q).unwrap_err().to_string();
    assert!(e.contains("no CPU block kernel"), "{e}");
}

/// Each type's split covers its GGUF block: header and codes add up to ggml's block size, and
/// the matrix keeps the tensor's bytes.
#[test]
fn splits_keep_the_block_bytes() {
    for ty in BlockType::ALL {
        with_block!(ty, B => {
            assert_eq!(B::BYTES, ty.ggml().type_size(), "{ty:?}");
            assert_eq!(B::ELEMS, ty.block_elems(), "{ty:?}");
            if B::HALF_HEAD {
                assert_eq!(B::HEAD, 2 * B::PARAMS, "{ty:?}");
            }
        });
        let (q, _) = quantized(ty, 5, 2 * ty.block_elems(), 2);
        assert_eq!(q.bytes(), 5 * 2 * ty.ggml().type_size(), "{ty:?}");
    }
}

/// Stacked matrices multiply as their parts, bit for bit; mixed types or widths do not stack.
#[test]
fn stacked_rows_equal_their_parts() {
    for ty in [BlockType::Q4_1, BlockType::Q8_0, BlockType::Q6K] {
        let k = 2 * ty.block_elems();
        let parts: Vec<(QMatrix, Vec<f32>)> = [9, 3, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| quantized(ty, n, k, 20 + i as u64))
            .collect();
        let refs: Vec<&QMatrix> = parts.iter().map(|p| &p.0).collect();
        let all = QMatrix::stack(&refs).unwrap();
        assert_eq!(all.dims(), (15, k));
        let x = values(3 * k, 4);
        for isa in Isa::all_available() {
            let y = run_q(&all, &x, 3, isa);
            let mut at = 0;
            for (p, _) in &parts {
                let yp = run_q(p, &x, 3, isa);
                let n = p.dims().0;
                for r in 0..3 {
                    assert_eq!(
                        bits(&yp[r * n..][..n]),
                        bits(&y[r * 15 + at..][..n]),
                        "{ty:?} {isa:?}"
                    );
                }
                at += n;
            }
        }
    }
    let (a, _) = quantized(BlockType::Q4_1, 2, 64, 1);
    let (b, _) = quantized(BlockType::Q4_0, 2, 64, 1);
    let (c, _) = quantized(BlockType::Q4_1, 2, 96, 1);
    assert!(QMatrix::stack(&[&a, &b]).is_none());
    assert!(QMatrix::stack(&[&a, &c]).is_none());
}
