//! Fused decode attention (`kv::decode::decode_attention`) against the reference
//! (`kv::decode::generic`: gather → dequantize → dense attention), over every quantized format,
//! GQA ratios 1/3/8, ragged lengths (1, mid-block, several CPU chunks), shuffled block tables,
//! sliding windows whose freed blocks hold invalid ids, and a batch as large as the number of KV
//! heads (the masked-broadcast bug of mlx-lm #1322/#1467). With `--features cuda` on a GPU
//! machine the CUDA kernel is checked against the same reference.

use candle_core::{DType, Device, Tensor};
use kvq::kv::attend::decode::{decode_attention, generic};
use kvq::kv::format::QuantFormat;
use kvq::kv::format::{KvFormat, LayerKv};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};
use rand_distr::StandardNormal;

const BLOCK: usize = 16;
const HEAD_DIM: usize = 128;

/// A batch over one layer's pool: tables map positions to shuffled blocks; entries before the
/// window and after the end are `u32::MAX`, so reading them would fail the checks (or the test).
struct Case {
    kv: LayerKv,
    q: Tensor,
    tables: Tensor,
    starts: Tensor,
    lens: Tensor,
    kv_heads: usize,
}

fn randn(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.sample::<f32, _>(StandardNormal) * std)
        .collect()
}

/// `seqs`: (start, len) per sequence.
fn build(
    format: KvFormat,
    kv_heads: usize,
    gqa: usize,
    seqs: &[(usize, usize)],
    q_dtype: DType,
    seed: u64,
) -> Case {
    build_d(format, kv_heads, gqa, seqs, q_dtype, seed, HEAD_DIM)
}

/// [`build`] with another head_dim.
fn build_d(
    format: KvFormat,
    kv_heads: usize,
    gqa: usize,
    seqs: &[(usize, usize)],
    q_dtype: DType,
    seed: u64,
    head_dim: usize,
) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let need: Vec<usize> = seqs.iter().map(|&(_, l)| l.div_ceil(BLOCK)).collect();
    let max_blocks = need.iter().max().copied().unwrap_or(1) + 2;
    let num_blocks = need.iter().sum::<usize>() + 5;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let mut tables = vec![u32::MAX; seqs.len() * max_blocks];
    let mut next = 0;
    for (b, &(s, l)) in seqs.iter().enumerate() {
        for i in 0..l.div_ceil(BLOCK) {
            if i >= s / BLOCK {
                tables[b * max_blocks + i] = ids[next];
            }
            next += 1;
        }
    }
    let width = kv_heads * head_dim;
    let slots = num_blocks * BLOCK;
    let kv = LayerKv::zeros(format, slots, width, &Device::Cpu).unwrap();
    let k = Tensor::from_vec(
        randn(&mut rng, slots * width, 1.0),
        (slots, width),
        &Device::Cpu,
    )
    .unwrap();
    let v = Tensor::from_vec(
        randn(&mut rng, slots * width, 1.0),
        (slots, width),
        &Device::Cpu,
    )
    .unwrap();
    kv.write_run(0, &k, &v).unwrap();
    let h = kv_heads * gqa;
    // Larger queries make the softmax peaked, as in real models.
    let q = Tensor::from_vec(
        randn(&mut rng, seqs.len() * h * head_dim, 3.0),
        (seqs.len(), h, head_dim),
        &Device::Cpu,
    )
    .unwrap()
    .to_dtype(q_dtype)
    .unwrap();
    let n = seqs.len();
    Case {
        kv,
        q,
        tables: Tensor::from_vec(tables, (n, max_blocks), &Device::Cpu).unwrap(),
        starts: Tensor::from_vec(
            seqs.iter().map(|s| s.0 as u32).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )
        .unwrap(),
        lens: Tensor::from_vec(
            seqs.iter().map(|s| s.1 as u32).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )
        .unwrap(),
        kv_heads,
    }
}

fn scale() -> f32 {
    1.0 / (HEAD_DIM as f32).sqrt()
}

/// The softmax scale of a case's head_dim.
fn scale_of(c: &Case) -> f32 {
    1.0 / (c.q.dim(2).unwrap() as f32).sqrt()
}

/// The signature both decode entry points share.
type DecodeFn = fn(
    &Tensor,
    &LayerKv,
    &Tensor,
    &Tensor,
    &Tensor,
    usize,
    usize,
    f32,
) -> candle_core::Result<Tensor>;

/// `f` on a case, on the device its tensors are on.
fn run(c: &Case, f: DecodeFn) -> Tensor {
    f(
        &c.q,
        &c.kv,
        &c.tables,
        &c.starts,
        &c.lens,
        BLOCK,
        c.kv_heads,
        scale_of(c),
    )
    .unwrap()
}

fn reference(c: &Case) -> Tensor {
    run(c, generic::decode_attention)
}

/// The fused decode of a case — on the CPU its exact kernel, the one the 1e-4 contract holds
/// (the 8-bit query pass for 4-bit keys is checked against it in the crate's unit tests; no
/// other test of this binary attends in-process, so the process-wide switch is safe here).
fn fused(c: &Case) -> Tensor {
    kvq::kv::attend::decode::set_exact_attention(true);
    run(c, decode_attention)
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    assert_eq!(got.dtype(), want.dtype());
    let g: Vec<f32> = got
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let w: Vec<f32> = want
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let scale = w.iter().fold(0f32, |a, b| a.max(b.abs()));
    assert!(scale > 0.0 && scale.is_finite());
    g.iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0f32,
            |a, b| if b.is_nan() { f32::INFINITY } else { a.max(b) },
        )
        / scale
}

/// Ragged batches: length 1, lengths ending mid-block, a long sequence spanning several CPU
/// chunks, and windows (start > 0) whose earlier blocks are gone.
fn layouts() -> Vec<(usize, Vec<(usize, usize)>)> {
    vec![
        (2, vec![(0, 1), (0, 37), (9, 1100), (50, 64)]),
        // As many sequences as KV heads.
        (3, vec![(0, 23), (17, 18), (0, 200)]),
    ]
}

fn affine(bits: u32, g: usize, scale_dtype: DType) -> KvFormat {
    KvFormat::affine(QuantFormat::new(bits, g).unwrap(), scale_dtype, false)
}

/// Every (head_dim, group, GQA) of `shapes` × every bit width × the ragged layouts, f32 queries
/// and scales of `sdt` (f16: what a cache computing in f32 stores), with a label; seeds count up
/// from `seed`.
fn affine_cases(
    shapes: &[(usize, &[usize], &[usize])],
    mut seed: u64,
    sdt: DType,
) -> Vec<(String, Case)> {
    let mut out = Vec::new();
    for &(d, groups, gqas) in shapes {
        for &g in groups {
            for bits in QuantFormat::BITS {
                for &gqa in gqas {
                    for (kvh, seqs) in layouts() {
                        seed += 1;
                        let c = build_d(affine(bits, g, sdt), kvh, gqa, &seqs, DType::F32, seed, d);
                        out.push((
                            format!(
                                "d {d} bits {bits} g {g} {sdt:?} scales gqa {gqa} kvh {kvh} \
                                 {seqs:?}"
                            ),
                            c,
                        ));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn cpu_affine_matches_reference_all_formats() {
    let shapes: [(usize, &[usize], &[usize]); 1] =
        [(HEAD_DIM, &QuantFormat::GROUP_SIZES, &[1, 3, 8])];
    for sdt in [DType::F32, DType::F16] {
        for (what, c) in affine_cases(&shapes, 0, sdt) {
            let err = rel_err(&fused(&c), &reference(&c));
            assert!(err < 1e-4, "{what}: rel err {err}");
        }
    }
}

#[test]
fn cpu_dense_matches_reference() {
    for (dt, tol) in [(DType::F32, 1e-4), (DType::F16, 1e-4), (DType::BF16, 1e-4)] {
        for gqa in [1, 3, 8] {
            for (kvh, seqs) in layouts() {
                let c = build(
                    KvFormat::Dense(dt),
                    kvh,
                    gqa,
                    &seqs,
                    DType::F32,
                    7 + gqa as u64,
                );
                let got = fused(&c);
                let err = rel_err(&got, &reference(&c));
                assert!(err < tol, "{dt:?} gqa {gqa} kvh {kvh}: rel err {err}");
            }
        }
    }
}

#[test]
fn cpu_half_queries_and_half_scales() {
    // Half scales with f32 queries: the reference dequantizes into f32 with the parameters
    // widened, as the fused kernel computes, so they agree to f32 rounding. Half queries: the
    // output is rounded to the query's dtype.
    for (fmt, qdt, tol) in [
        (affine(4, 64, DType::F16), DType::F32, 1e-4),
        (affine(8, 32, DType::BF16), DType::F32, 1e-4),
        (affine(4, 64, DType::F32), DType::F16, 2e-3),
        (affine(4, 64, DType::F16), DType::F16, 2e-3),
        (KvFormat::Dense(DType::F16), DType::BF16, 1e-2),
    ] {
        let (kvh, seqs) = layouts().remove(0);
        let c = build(fmt, kvh, 4, &seqs, qdt, 99);
        let got = fused(&c);
        let err = rel_err(&got, &reference(&c));
        assert!(err < tol, "{fmt:?} q {qdt:?}: rel err {err}");
    }
}

#[test]
fn quantized_output_is_close_to_dense_attention() {
    // Sanity of the whole path: 8-bit attention over the same data is close to dense attention.
    let (kvh, seqs) = layouts().remove(0);
    let dense = build(KvFormat::Dense(DType::F32), kvh, 2, &seqs, DType::F32, 5);
    let q8 = build(affine(8, 64, DType::F32), kvh, 2, &seqs, DType::F32, 5);
    let a = fused(&dense);
    let b = fused(&q8);
    let err = rel_err(&b, &a);
    assert!(err > 0.0 && err < 0.05, "8-bit vs dense rel err {err}");
}

#[test]
fn bad_inputs_are_refused() {
    let (kvh, seqs) = layouts().remove(1);
    let c = build(affine(4, 32, DType::F32), kvh, 2, &seqs, DType::F32, 3);
    let call = |tables: &Tensor, starts: &Tensor, lens: &Tensor, kvh: usize| {
        decode_attention(&c.q, &c.kv, tables, starts, lens, BLOCK, kvh, scale())
            .unwrap_err()
            .to_string()
    };
    let u = |v: Vec<u32>| Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).unwrap();
    // start >= len, len 0.
    assert!(call(&c.tables, &u(vec![0, 18, 0]), &c.lens, kvh).contains("start"));
    assert!(call(&c.tables, &c.starts, &u(vec![0, 18, 200]), kvh).contains("len"));
    // len beyond the table, block id outside the pool.
    let mb = c.tables.dim(1).unwrap() as u32;
    let e = call(
        &c.tables,
        &c.starts,
        &u(vec![23, 18, mb * BLOCK as u32 + 1]),
        kvh,
    );
    assert!(e.contains("exceeds"), "{e}");
    let e = call(&c.tables, &c.starts, &u(vec![23, 18, 209]), kvh);
    assert!(
        e.contains("outside the pool") || e.contains("block id"),
        "{e}"
    );
    // Heads not a multiple of KV heads; wrong table dtype.
    assert!(call(&c.tables, &c.starts, &c.lens, 4).contains("multiple"));
    let e = call(
        &c.tables.to_dtype(DType::I64).unwrap(),
        &c.starts,
        &c.lens,
        kvh,
    );
    assert!(e.contains("block_tables"), "{e}");
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use kvq::kv::format::Quantized;

    fn to_gpu(c: &Case, dev: &Device) -> Case {
        let mv = |t: &Tensor| t.to_device(dev).unwrap();
        let mq = |q: &Quantized| Quantized {
            codes: mv(&q.codes),
            scales: mv(&q.scales),
            biases: mv(&q.biases),
        };
        let kv = match &c.kv {
            LayerKv::Dense { k, v } => LayerKv::Dense { k: mv(k), v: mv(v) },
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                v,
            } => LayerKv::Affine {
                kfmt: *kfmt,
                vfmt: *vfmt,
                rotated: *rotated,
                k: mq(k),
                v: mq(v),
            },
        };
        Case {
            kv,
            q: mv(&c.q),
            tables: mv(&c.tables),
            starts: mv(&c.starts),
            lens: mv(&c.lens),
            kv_heads: c.kv_heads,
        }
    }

    fn check(c: &Case, dev: &Device, tol: f32, what: &str) {
        let got = fused(&to_gpu(c, dev));
        let err = rel_err(&got, &reference(c));
        assert!(err < tol, "{what}: rel err {err}");
    }

    #[test]
    fn cuda_matches_reference_all_formats() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        // Every width and group at head_dim 128; head_dim 64 (the default model's) and one other
        // than 64 / 128 (block-wide kernel) with the groups that fit.
        let shapes: [(usize, &[usize], &[usize]); 3] = [
            (HEAD_DIM, &QuantFormat::GROUP_SIZES, &[1, 3, 8]),
            (64, &[32, 64], &[1, 3]),
            (96, &[32], &[1, 3]),
        ];
        for sdt in [DType::F32, DType::F16] {
            for (what, c) in affine_cases(&shapes, 1000, sdt) {
                check(&c, &dev, 1e-4, &what);
            }
        }
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for gqa in [1, 3, 8, 16] {
                for (kvh, seqs) in layouts() {
                    let c = build(
                        KvFormat::Dense(dt),
                        kvh,
                        gqa,
                        &seqs,
                        DType::F32,
                        7 + gqa as u64,
                    );
                    check(&c, &dev, 1e-4, &format!("dense {dt:?} gqa {gqa} kvh {kvh}"));
                }
            }
        }
        let (kvh, seqs) = layouts().remove(0);
        let c = build(affine(4, 64, DType::F16), kvh, 16, &seqs, DType::F16, 77);
        check(&c, &dev, 5e-3, "4-bit f16 scales, f16 q, gqa 16");
        // Queries far outside f16's range (the tensor-core scores scale q by a power of two
        // before splitting it into f16 terms) and far below it.
        for (bits, mul) in [(4, 1e5), (8, 1e5), (4, 1e-6), (8, 1e-6)] {
            let (kvh, seqs) = layouts().remove(0);
            let mut c = build(affine(bits, 64, DType::F32), kvh, 4, &seqs, DType::F32, 90);
            c.q = (&c.q * mul).unwrap();
            check(&c, &dev, 1e-4, &format!("bits {bits} q x {mul}"));
        }
        let c = build(
            affine(8, 32, DType::BF16),
            kvh_of_first(),
            4,
            &layouts()[0].1,
            DType::BF16,
            78,
        );
        check(&c, &dev, 2e-2, "8-bit bf16 scales, bf16 q, gqa 4");
    }

    /// Keys one bit wider than values (the `--kv-bits 2.5 … 5.5` splits) on the warp kernel's
    /// mixed instances (SIMT `decode_q_*_b<K>v<V>_*`, and K4/V3 on tensor cores,
    /// `decode_qm_*_b4v3_*`; the planner's unit test checks they are the ones chosen) match the
    /// reference at head_dim 128 and 64, every group, GQA 1, 3, 8, f32 and f16 scales (f16
    /// queries over f16 scales too: the warp kernel reads queries in the scales' type).
    #[test]
    fn cuda_keys_one_bit_wider_than_values_match_reference() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let mut seed = 3000;
        for (d, groups) in [(HEAD_DIM, &[32usize, 64, 128][..]), (64, &[32, 64][..])] {
            for &g in groups {
                for (kb, vb) in [(3u32, 2u32), (4, 3), (5, 4), (6, 5)] {
                    for sdt in [DType::F32, DType::F16] {
                        for gqa in [1, 3, 8] {
                            let (kvh, seqs) = layouts().remove(seed as usize % 2);
                            seed += 1;
                            let f = |b| QuantFormat::new(b, g).unwrap();
                            let format = KvFormat::Affine {
                                key: f(kb),
                                value: f(vb),
                                scale_dtype: sdt,
                                rotated: false,
                            };
                            let c = build_d(format, kvh, gqa, &seqs, DType::F32, seed, d);
                            let what = format!("K{kb}/V{vb} d {d} g {g} {sdt:?} gqa {gqa}");
                            check(&c, &dev, 1e-4, &what);
                            if sdt == DType::F16 {
                                let c = build_d(format, kvh, gqa, &seqs, sdt, seed, d);
                                check(&c, &dev, 5e-3, &format!("{what}, f16 q"));
                            }
                        }
                    }
                }
            }
        }
    }

    fn kvh_of_first() -> usize {
        layouts()[0].0
    }

    /// Rotated pools: the kernel's in-place Walsh-Hadamard rotation of q and of the output
    /// equals rotate → reference attention → rotate back (f32 matmuls on the CPU).
    #[test]
    fn cuda_rotated_matches_rotate_attend_unrotate() {
        use kvq::kv::attend::decode::decode_attention_rotated;
        use kvq::kv::format::rotation::{Rotation, DEFAULT_SEED};
        let dev = Device::new_cuda(0).expect("a CUDA device");
        for d in [64, 128] {
            for (bits, sdt) in [(4, DType::F32), (8, DType::F32), (4, DType::F16)] {
                for (kvh, seqs) in layouts() {
                    let seed = 500 + d as u64 + bits as u64 + kvh as u64;
                    let c = build_d(affine(bits, 32, sdt), kvh, 3, &seqs, DType::F32, seed, d);
                    let cpu_rot = Rotation::new(d, DEFAULT_SEED, &Device::Cpu).unwrap();
                    let want = cpu_rot
                        .unrotate(
                            &generic::decode_attention(
                                &cpu_rot.rotate(&c.q).unwrap(),
                                &c.kv,
                                &c.tables,
                                &c.starts,
                                &c.lens,
                                BLOCK,
                                c.kv_heads,
                                scale_of(&c),
                            )
                            .unwrap(),
                        )
                        .unwrap();
                    let g = to_gpu(&c, &dev);
                    let rot = Rotation::new(d, DEFAULT_SEED, &dev).unwrap();
                    let got = decode_attention_rotated(
                        &g.q,
                        &g.kv,
                        &g.tables,
                        &g.starts,
                        &g.lens,
                        BLOCK,
                        c.kv_heads,
                        scale_of(&c),
                        Some(&rot),
                    )
                    .unwrap();
                    let err = rel_err(&got, &want);
                    assert!(
                        err < 1e-4,
                        "rotated d {d} bits {bits} {sdt:?} scales kvh {kvh}: rel err {err}"
                    );
                }
            }
        }
    }

    #[test]
    fn cuda_bad_tables_give_nan_for_that_sequence_only() {
        let dev = Device::new_cuda(0).expect("a CUDA device");
        let (kvh, seqs) = layouts().remove(1);
        let c = build(affine(4, 32, DType::F32), kvh, 2, &seqs, DType::F32, 3);
        let g = to_gpu(&c, &dev);
        // Sequence 1 gets a start past its length.
        let starts = Tensor::from_vec(vec![0u32, 40, 0], 3, &dev).unwrap();
        let got = decode_attention(
            &g.q,
            &g.kv,
            &g.tables,
            &starts,
            &g.lens,
            BLOCK,
            kvh,
            scale(),
        )
        .unwrap();
        let got: Vec<Vec<f32>> = got
            .to_device(&Device::Cpu)
            .unwrap()
            .flatten_from(1)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert!(got[1].iter().all(|x| x.is_nan()));
        assert!(got[0].iter().chain(&got[2]).all(|x| x.is_finite()));
    }
}
