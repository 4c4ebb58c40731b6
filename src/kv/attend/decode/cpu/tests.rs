//! The fused CPU decode kernel against the generic reference, on every ISA this CPU has.

use super::super::{check_shapes, read_tables};
use super::*;
use crate::kv::format::{KvFormat, QuantFormat};

/// Deterministic values in [-2, 2).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 22) as f32 - 2.0
        })
        .collect()
}

/// K/V values of a pool of `per_seq` blocks per sequence, and the tables, starts and lens
/// of `seqs` (start, len) over it; block ids reversed so tables are not the identity.
struct Fixture {
    bs: usize,
    kvh: usize,
    k: Tensor,
    v: Tensor,
    table: Vec<u32>,
    per_seq: usize,
    seqs: Vec<(usize, usize)>,
}

impl Fixture {
    fn new(seqs: &[(usize, usize)], per_seq: usize, kvh: usize, hd: usize, seed: u32) -> Self {
        let bs = 16;
        let num_blocks = seqs.len() * per_seq;
        let (slots, width) = (num_blocks * bs, kvh * hd);
        let dev = Device::Cpu;
        let k = Tensor::from_vec(values(slots * width, seed), (slots, width), &dev).unwrap();
        let v = Tensor::from_vec(values(slots * width, seed + 1), (slots, width), &dev);
        Fixture {
            bs,
            kvh,
            k,
            v: v.unwrap(),
            table: (0..num_blocks as u32).rev().collect(),
            per_seq,
            seqs: seqs.to_vec(),
        }
    }

    /// The fixture's K/V stored in `format`.
    fn pool(&self, format: KvFormat) -> LayerKv {
        let (slots, width) = self.k.dims2().unwrap();
        let kv = LayerKv::zeros(format, slots, width, &Device::Cpu).unwrap();
        kv.write_run(0, &self.k, &self.v).unwrap();
        kv
    }

    /// Shapes and host tables of a call for sequences `which` with queries `q`.
    fn call(&self, q: &Tensor, kv: &LayerKv, which: &[usize]) -> (Dims, Tables<'static>) {
        let (b, dev) = (which.len(), Device::Cpu);
        let u32s = |v: Vec<u32>| Tensor::from_vec(v, b, &dev).unwrap();
        let tables: Vec<u32> = which
            .iter()
            .flat_map(|&i| self.table[i * self.per_seq..(i + 1) * self.per_seq].to_vec())
            .collect();
        let tables = Tensor::from_vec(tables, (b, self.per_seq), &dev).unwrap();
        let starts = u32s(which.iter().map(|&i| self.seqs[i].0 as u32).collect());
        let lens = u32s(which.iter().map(|&i| self.seqs[i].1 as u32).collect());
        let dims = check_shapes(q, kv, &tables, &starts, &lens, self.bs, self.kvh).unwrap();
        let t = read_tables(&dims, &tables, &starts, &lens, None, false).unwrap();
        (dims, t)
    }

    /// The generic reference and every vector implementation's output for all sequences.
    fn outputs(&self, q: &Tensor, kv: &LayerKv, scale: f32) -> (Vec<f32>, Vec<(Isa, Vec<f32>)>) {
        let all: Vec<usize> = (0..self.seqs.len()).collect();
        let (dims, t) = self.call(q, kv, &all);
        let flat = |x: Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
        let want = flat(generic::decode_checked(q, kv, &dims, &t, scale).unwrap());
        let got = Isa::all_available()
            .into_iter()
            .map(|isa| {
                (
                    isa,
                    flat(decode_with(q, kv, &dims, &t, scale, isa, Keys::Exact).unwrap()),
                )
            })
            .collect();
        (want, got)
    }
}

/// Every vector implementation this CPU has matches the generic reference, at head_dim 64
/// with GQA 3 (the default model's shape), for dense and odd/even bit widths.
#[test]
fn every_vector_code_matches_reference() {
    let (kvh, g, hd) = (2usize, 3usize, 64usize);
    let f = Fixture::new(&[(0, 37), (20, 150), (0, 1)], 10, kvh, hd, 1);
    let q = values(3 * kvh * g * hd, 3);
    let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
    // f32 scales: with f16 ones the reference rounds dequantized values to f16.
    let affine =
        |bits, group| KvFormat::affine(QuantFormat::new(bits, group).unwrap(), DType::F32, false);
    for format in [
        KvFormat::Dense(DType::F16),
        KvFormat::Dense(DType::F32),
        affine(4, 64),
        affine(4, 32),
        affine(3, 32),
        affine(2, 32),
        affine(8, 32),
    ] {
        let (want, got) = f.outputs(&q, &f.pool(format), 0.125);
        for (isa, got) in got {
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-2))
                .fold(0f32, f32::max);
            assert!(err < 1e-4, "{format:?} {isa:?}: rel err {err}");
        }
    }
}

/// The contract's measure of an output against the reference: max |error| / max |reference|.
fn contract_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Every vector implementation matches the generic reference at head_dim 128 for every bit
/// width × group size × GQA ratio {1, 3, 8} (query-head chunks of 1, 3 and 4+4; 4-bit
/// tables; column blocks spanning one group, two groups, or half a group), with ragged
/// lengths, an odd final row pair and V tiles cut short.
#[test]
fn every_isa_matches_reference_all_formats() {
    let (kvh, hd) = (2usize, 128usize);
    let f = Fixture::new(&[(0, 45), (3, 77), (0, 1)], 5, kvh, hd, 7);
    for g in [1usize, 3, 8] {
        let q = values(3 * kvh * g * hd, 9 + g as u32);
        let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
        for bits in [2u32, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                let fmt = QuantFormat::new(bits, group).unwrap();
                let kv = f.pool(KvFormat::affine(fmt, DType::F32, false));
                let (want, got) = f.outputs(&q, &kv, 0.1);
                for (isa, got) in got {
                    let err = contract_err(&got, &want);
                    assert!(err < 1e-4, "{bits}-bit g{group} GQA {g} {isa:?}: {err}");
                }
            }
        }
    }
}

/// A sequence decoded among others of other lengths (one of them long enough to be split
/// into many chunks) gives the same bits as decoded alone, on every vector implementation.
#[test]
fn a_sequence_does_not_depend_on_the_batch() {
    let (kvh, g, hd) = (3usize, 3usize, 64usize);
    let seqs = [(0usize, 37usize), (0, 700), (20, 150), (0, 1), (300, 1500)];
    let nb = seqs.len();
    let f = Fixture::new(&seqs, 1500usize.div_ceil(16), kvh, hd, 1);
    let q = values(nb * kvh * g * hd, 3);
    let q = Tensor::from_vec(q, (nb, kvh * g, hd), &Device::Cpu).unwrap();
    let call = |kv: &LayerKv, isa: Isa, keys: Keys, which: &[usize]| -> Vec<u32> {
        let ids: Vec<u32> = which.iter().map(|&i| i as u32).collect();
        let ids = Tensor::from_vec(ids, which.len(), &Device::Cpu).unwrap();
        let qb = q.index_select(&ids, 0).unwrap();
        let (dims, t) = f.call(&qb, kv, which);
        let out = decode_with(&qb, kv, &dims, &t, 0.125, isa, keys).unwrap();
        let out: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
        out.iter().map(|x| x.to_bits()).collect()
    };
    let affine = |bits| KvFormat::affine(QuantFormat::new(bits, 64).unwrap(), DType::F32, false);
    for format in [KvFormat::Dense(DType::F32), affine(4), affine(8)] {
        let kv = f.pool(format);
        for isa in Isa::all_available() {
            // The exact pass, and the 8-bit K pass where this CPU has it for these keys.
            let mut passes = vec![Keys::Exact];
            if matches!(&kv, LayerKv::Affine { kfmt, .. } if kfmt.bits() == 4) {
                passes.extend(int_passes(isa));
            }
            for keys in passes {
                let all: Vec<usize> = (0..nb).collect();
                let together = call(&kv, isa, keys, &all);
                let row = kvh * g * hd;
                for i in 0..nb {
                    let alone = call(&kv, isa, keys, &[i]);
                    assert_eq!(
                        alone,
                        together[i * row..(i + 1) * row],
                        "{format:?} {isa:?} {keys:?}: sequence {i}"
                    );
                }
            }
        }
    }
}

/// The 8-bit K passes this CPU has for `isa`.
fn int_passes(isa: Isa) -> Vec<Keys> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if int8::vnni_available() => vec![Keys::Madd, Keys::Vnni],
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => vec![Keys::Madd],
        _ => vec![],
    }
}

/// Queries whose every group of 64 (after `scale`) lies on its own 8-bit grid, one value at
/// the grid's end: the 8-bit K pass then holds them exactly, so it must match the reference as
/// closely as the exact pass does — a misplaced byte, lane or scale would show.
fn grid_queries(rows: usize, hd: usize, scale: f32, seed: u32) -> Vec<f32> {
    let ints = values(rows * hd, seed);
    let steps = values(rows * hd / 64, seed + 1);
    let mut q = vec![0f32; rows * hd];
    for (gi, (out, k)) in q
        .chunks_exact_mut(64)
        .zip(ints.chunks_exact(64))
        .enumerate()
    {
        let sigma = (0.5 + steps[gi].abs()) / 127.0 / scale;
        for (i, (o, &v)) in out.iter_mut().zip(k).enumerate() {
            let n = if i == gi % 64 {
                127.0
            } else {
                (v * 63.0).round()
            };
            *o = sigma * n;
        }
    }
    q
}

/// The 8-bit K pass (every implementation this CPU has) matches the generic reference on
/// queries it holds exactly, at head_dim 64 and 128, GQA 1, 3 and 8 (query-head chunks of 1,
/// 3 and 4 + 4), 4-bit keys with 4-bit and 3-bit values, ragged lengths (tasks of several
/// chunks, an odd last row); with f16 and bf16 scales it matches the exact pass.
#[test]
fn int8_keys_match_reference_on_grid_queries() {
    let scale = 0.1;
    let flat = |x: Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
    for hd in [64usize, 128] {
        let kvh = 3usize;
        let f = Fixture::new(&[(0, 45), (3, 277), (0, 1)], 18, kvh, hd, 17);
        for g in [1usize, 3, 8] {
            let q = grid_queries(3 * kvh * g, hd, scale, 19 + g as u32);
            let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
            // The values take the 8-bit-weight V pass; with their scales zero each output is
            // `Σ p·b / Σ p`, which that pass sums exactly, so only the K pass is under test.
            for vb in [4u32, 3] {
                let fmt = |b| QuantFormat::new(b, 64).unwrap();
                let pool = |scale_dtype| {
                    zero_value_scales(f.pool(KvFormat::Affine {
                        key: fmt(4),
                        value: fmt(vb),
                        scale_dtype,
                        rotated: false,
                    }))
                };
                let kv = pool(DType::F32);
                let all: Vec<usize> = (0..3).collect();
                let (dims, t) = f.call(&q, &kv, &all);
                let want = flat(generic::decode_checked(&q, &kv, &dims, &t, scale).unwrap());
                for isa in Isa::all_available() {
                    for keys in int_passes(isa) {
                        assert_eq!(key_pass(&kv, hd, isa), *int_passes(isa).last().unwrap());
                        let got = flat(decode_with(&q, &kv, &dims, &t, scale, isa, keys).unwrap());
                        let err = contract_err(&got, &want);
                        assert!(
                            err < 1e-4,
                            "K4/V{vb} hd{hd} GQA {g} {isa:?} {keys:?}: {err}"
                        );
                        for sd in [DType::F16, DType::BF16] {
                            let kv = pool(sd);
                            let run =
                                |k| flat(decode_with(&q, &kv, &dims, &t, scale, isa, k).unwrap());
                            let err = contract_err(&run(keys), &run(Keys::Exact));
                            assert!(err < 1e-4, "{sd:?} K4/V{vb} hd{hd} GQA {g} {isa:?}: {err}");
                        }
                    }
                }
            }
        }
    }
}

/// `kv` with every V scale zero: each value is its group's bias.
fn zero_value_scales(kv: LayerKv) -> LayerKv {
    match kv {
        LayerKv::Affine {
            kfmt,
            vfmt,
            rotated,
            k,
            mut v,
        } => {
            v.scales = v.scales.zeros_like().unwrap();
            LayerKv::Affine {
                kfmt,
                vfmt,
                rotated,
                k,
                v,
            }
        }
        dense => dense,
    }
}

/// Off the grid the 8-bit passes differ from the exact ones by the query's and the weights'
/// rounding only: close (uniform data, where outputs are small averages: under 2% of the
/// largest), and not the same bits (the passes run where asked).
#[test]
fn int8_passes_round_queries_and_weights() {
    let (kvh, g, hd) = (2usize, 4usize, 128usize);
    let f = Fixture::new(&[(0, 300)], 19, kvh, hd, 23);
    let q = values(kvh * g * hd, 29);
    let q = Tensor::from_vec(q, (1, kvh * g, hd), &Device::Cpu).unwrap();
    let flat = |x: Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
    // 4-bit values, and 3-bit ones (widened to nibbles for the same pass).
    for vbits in [4, 3] {
        let kv = f.pool(KvFormat::Affine {
            key: QuantFormat::new(4, 64).unwrap(),
            value: QuantFormat::new(vbits, 64).unwrap(),
            scale_dtype: DType::F32,
            rotated: false,
        });
        let (dims, t) = f.call(&q, &kv, &[0]);
        for isa in Isa::all_available() {
            let exact = flat(decode_with(&q, &kv, &dims, &t, 0.125, isa, Keys::Exact).unwrap());
            for keys in int_passes(isa) {
                let got = flat(decode_with(&q, &kv, &dims, &t, 0.125, isa, keys).unwrap());
                let err = contract_err(&got, &exact);
                assert!(err > 0.0 && err < 2e-2, "V{vbits} {isa:?} {keys:?}: {err}");
            }
        }
    }
}

/// The 8-bit passes together (4-bit keys, 4-bit or 3-bit values) match the generic reference where both
/// hold their inputs exactly: one-hot queries (the K pass's grid), keys that give each query
/// head a score of 0 or −100 per position (numerators 1 or ~0, a pattern per head), and V
/// scales `s0·k/127` for integers `k`, ±127 at every even slot (so every tile's weights are on
/// its grid) — a misplaced weight, row, code or output value would show. Head_dim 64 and 128,
/// GQA 1, 3 and 8, ragged lengths (tiles cut short), every implementation this CPU has.
#[test]
fn int8_values_match_reference_on_grid_weights() {
    for vbits in [4, 3] {
        int8_values_on_grid_weights(vbits);
    }
}

fn int8_values_on_grid_weights(vbits: u32) {
    let flat = |x: Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1().unwrap() };
    let fmt = QuantFormat::new(4, 64).unwrap();
    let vfmt = QuantFormat::new(vbits, 64).unwrap();
    let format = KvFormat::Affine {
        key: fmt,
        value: vfmt,
        scale_dtype: DType::F32,
        rotated: false,
    };
    for hd in [64usize, 128] {
        let kvh = 3usize;
        for g in [1usize, 3, 8] {
            let mut f = Fixture::new(&[(0, 45), (3, 277), (0, 1)], 18, kvh, hd, 31);
            let (slots, width) = f.k.dims2().unwrap();
            // Query head j of KV head kh: C at dim j. Key: −1 at dim j where head j is off.
            let off = |slot: usize, kh: usize, j: usize| {
                slot % 2 == 1 && !(slot * 7 + kh * 5 + j * 3).is_multiple_of(4)
            };
            let mut k = vec![0f32; slots * width];
            for slot in 0..slots {
                for kh in 0..kvh {
                    for j in 0..g {
                        if off(slot, kh, j) {
                            k[slot * width + kh * hd + j] = -1.0;
                        }
                    }
                }
            }
            f.k = Tensor::from_vec(k, (slots, width), &Device::Cpu).unwrap();
            let mut q = vec![0f32; 3 * kvh * g * hd];
            for (r, row) in q.chunks_exact_mut(hd).enumerate() {
                row[r % g] = 100.0;
            }
            let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
            let kv = match f.pool(format) {
                LayerKv::Affine { k, mut v, .. } => {
                    let groups = width / 64;
                    let ints = values(slots * groups, 37);
                    let scales: Vec<f32> = ints
                        .iter()
                        .enumerate()
                        .map(|(i, &x)| {
                            let k = if (i / groups) % 2 == 0 {
                                127f32.copysign(x)
                            } else {
                                (x * 63.0).round()
                            };
                            0.02 * k / 127.0
                        })
                        .collect();
                    v.scales = Tensor::from_vec(scales, (slots, groups), &Device::Cpu).unwrap();
                    LayerKv::Affine {
                        kfmt: fmt,
                        vfmt,
                        rotated: false,
                        k,
                        v,
                    }
                }
                LayerKv::Dense { .. } => unreachable!("an affine format"),
            };
            let all: Vec<usize> = (0..3).collect();
            let (dims, t) = f.call(&q, &kv, &all);
            let want = flat(generic::decode_checked(&q, &kv, &dims, &t, 1.0).unwrap());
            for isa in Isa::all_available() {
                for keys in int_passes(isa) {
                    let got = flat(decode_with(&q, &kv, &dims, &t, 1.0, isa, keys).unwrap());
                    let err = contract_err(&got, &want);
                    assert!(
                        err < 1e-4,
                        "V{vbits} hd{hd} GQA {g} {isa:?} {keys:?}: {err}"
                    );
                }
            }
        }
    }
}

/// Keys one bit wider than values (the splits `--kv-bits 2.5 … 5.5` name) read by the fused
/// kernel match the generic reference on every ISA, at head_dim 128 and 64 for every group
/// size and GQA 1, 3, 8: 4-bit keys with 3-bit values permute the query but not the output,
/// 5-bit keys with 4-bit values the output but not the query.
#[test]
fn keys_one_bit_wider_than_values_match_reference() {
    for hd in [128usize, 64] {
        let kvh = 2usize;
        let f = Fixture::new(&[(0, 45), (3, 77), (0, 1)], 5, kvh, hd, 11);
        for g in [1usize, 3, 8] {
            let q = values(3 * kvh * g * hd, 13 + g as u32);
            let q = Tensor::from_vec(q, (3, kvh * g, hd), &Device::Cpu).unwrap();
            for (kb, vb) in [(3u32, 2u32), (4, 3), (5, 4), (6, 5)] {
                for group in [32usize, 64, 128].into_iter().filter(|&gs| gs <= hd) {
                    let fmt = |b| QuantFormat::new(b, group).unwrap();
                    let kv = f.pool(KvFormat::Affine {
                        key: fmt(kb),
                        value: fmt(vb),
                        scale_dtype: DType::F32,
                        rotated: false,
                    });
                    assert!(QuantFormat::one_bit_wider(fmt(kb), fmt(vb)));
                    let (want, got) = f.outputs(&q, &kv, 0.1);
                    for (isa, got) in got {
                        let err = contract_err(&got, &want);
                        assert!(
                            err < 1e-4,
                            "K{kb}/V{vb} g{group} hd{hd} GQA {g} {isa:?}: {err}"
                        );
                    }
                }
            }
        }
    }
    let f = |b| QuantFormat::new(b, 64).unwrap();
    assert!(!QuantFormat::one_bit_wider(f(8), f(4)) && !QuantFormat::one_bit_wider(f(4), f(5)));
    let g32 = QuantFormat::new(4, 32).unwrap();
    assert!(!QuantFormat::one_bit_wider(f(5), g32));
}
