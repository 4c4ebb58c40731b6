//! Tests of the paged cache: block ownership, staging, windows, export/import.

use super::*;
use crate::kv::format::QuantFormat;
use crate::ops::testing::max_abs_diff;

fn cfg(num_blocks: usize) -> CacheConfig {
    CacheConfig::dense(2, 2, 32, 4, num_blocks, DType::F32)
}

fn rows(n: usize, base: f32) -> Tensor {
    Tensor::arange(0f32, (n * 64) as f32, &Device::Cpu)
        .unwrap()
        .affine(0.01, base as f64)
        .unwrap()
        .reshape((n, 64))
        .unwrap()
}

fn gather_all(c: &PagedKvCache, id: SeqId, from: usize, to: usize) -> (Tensor, Tensor) {
    let slots = c.slots(id, 0, from, to).unwrap();
    let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
    c.gather(0, id, &slots, DType::F32).unwrap()
}

#[test]
fn write_then_gather_round_trips_across_blocks() {
    let mut c = PagedKvCache::new(cfg(8), &Device::Cpu).unwrap();
    c.add_sequence(1).unwrap();
    c.add_sequence(2).unwrap();
    // Interleave growth so the two sequences' blocks are not contiguous.
    c.reserve(1, 3).unwrap();
    c.reserve(2, 6).unwrap();
    c.reserve(1, 9).unwrap(); // room for 9 tokens in all: a second block
    let (k1, v1) = (rows(9, 0.0), rows(9, 10.0));
    c.write(
        0,
        1,
        0,
        &k1.narrow(0, 0, 3).unwrap(),
        &v1.narrow(0, 0, 3).unwrap(),
    )
    .unwrap();
    c.write(
        0,
        1,
        3,
        &k1.narrow(0, 3, 6).unwrap(),
        &v1.narrow(0, 3, 6).unwrap(),
    )
    .unwrap();
    c.write(0, 2, 0, &rows(6, 5.0), &rows(6, 6.0)).unwrap();
    c.advance(1, 9).unwrap();
    let (k, v) = gather_all(&c, 1, 0, 9);
    assert_eq!(max_abs_diff(&k, &k1), 0.0);
    assert_eq!(max_abs_diff(&v, &v1), 0.0);
}

#[test]
fn reserve_is_all_or_nothing_and_remove_frees() {
    let mut c = PagedKvCache::new(cfg(3), &Device::Cpu).unwrap();
    c.add_sequence(7).unwrap();
    c.reserve(7, 8).unwrap(); // 2 blocks
    assert_eq!(c.free_blocks().total(), 1);
    c.add_sequence(8).unwrap();
    let err = c.reserve(8, 5).unwrap_err(); // needs 2, 1 free
    assert!(matches!(
        err,
        CacheError::OutOfBlocks {
            needed: 2,
            free: 1,
            total: 3,
            window: None
        }
    ));
    assert_eq!(c.free_blocks().total(), 1);
    c.remove_sequence(7);
    assert_eq!(c.free_blocks().total(), 3);
    c.reserve(8, 5).unwrap();
    assert_eq!(c.bytes_in_use(), 2 * c.config().bytes_per_block());
    assert_eq!(c.peak_bytes(), 2 * c.config().bytes_per_block());
}

#[test]
fn sliding_window_frees_blocks_and_keeps_bytes_flat() {
    let mut config = cfg(16);
    config.window = Some(6);
    let mut c = PagedKvCache::new(config, &Device::Cpu).unwrap();
    c.add_sequence(0).unwrap();
    let mut held = Vec::new();
    for pos in 0..40 {
        c.reserve(0, 1).unwrap();
        c.write(0, 0, pos, &rows(1, pos as f32), &rows(1, 0.0))
            .unwrap();
        c.advance(0, 1).unwrap();
        held.push(c.bytes_in_use());
    }
    // At most ceil(6/4) + 1 = 3 blocks once the window is full.
    let max_after = held[10..].iter().max().unwrap();
    assert!(*max_after <= 3 * c.config().bytes_per_block(), "{held:?}");
    // The window's positions are still readable and hold what was written.
    let (k, _) = gather_all(&c, 0, c.first_visible(0, 40), 40);
    let want = Tensor::cat(&(35..40).map(|p| rows(1, p as f32)).collect::<Vec<_>>(), 0).unwrap();
    assert_eq!(max_abs_diff(&k, &want), 0.0);
}

#[test]
fn staging_promotes_to_quantized_with_the_same_codes_as_direct_writes() {
    let fmt = QuantFormat::new(4, 32).unwrap();
    let quant = KvFormat::affine(fmt, DType::F32, false);
    let mut direct = cfg(8);
    direct.formats = vec![quant; 2];
    let mut staged = direct.clone();
    staged.staging = Some(Staging {
        tokens: 6,
        dtype: DType::F32,
        num_blocks: 4,
    });
    let mut a = PagedKvCache::new(direct, &Device::Cpu).unwrap();
    let mut b = PagedKvCache::new(staged, &Device::Cpu).unwrap();
    for c in [&mut a, &mut b] {
        c.add_sequence(0).unwrap();
        for pos in 0..9 {
            c.reserve(0, 1).unwrap();
            c.write(
                0,
                0,
                pos,
                &rows(1, pos as f32 * 0.3),
                &rows(1, -(pos as f32)),
            )
            .unwrap();
            c.advance(0, 1).unwrap();
        }
    }
    let (ka, va) = gather_all(&a, 0, 0, 9);
    let (kb, vb) = gather_all(&b, 0, 0, 9);
    assert_eq!(max_abs_diff(&ka, &kb), 0.0);
    assert_eq!(max_abs_diff(&va, &vb), 0.0);
    // Quantized, not exact, and the staging blocks were given back.
    assert!(
        max_abs_diff(
            &ka,
            &Tensor::cat(
                &(0..9).map(|p| rows(1, p as f32 * 0.3)).collect::<Vec<_>>(),
                0
            )
            .unwrap()
        ) > 0.0
    );
    assert_eq!(b.group_staging_blocks(), vec![(4, 4)]);
}

fn affine(bits: u32) -> KvFormat {
    KvFormat::affine(QuantFormat::new(bits, 32).unwrap(), DType::F32, false)
}

/// Every stored tensor of `rows`, flattened to f32 (codes as their u32 values) per layer.
fn raw(rows: &[LayerRows]) -> Vec<Vec<Vec<f64>>> {
    let flat = |t: &Tensor| -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    rows.iter()
        .map(|r| match r {
            LayerRows::Dense { k, v } => vec![flat(k), flat(v)],
            LayerRows::Affine { k, v, .. } => [k, v]
                .iter()
                .flat_map(|q| [flat(&q.codes), flat(&q.scales), flat(&q.biases)])
                .collect(),
        })
        .collect()
}

/// Writes `n` tokens of seq `id` in steps of `step`, in both layers, values seeded by `base`.
fn fill(c: &mut PagedKvCache, id: SeqId, n: usize, step: usize, base: f32) {
    let (k, v) = (rows(n, base), rows(n, -base).sqr().unwrap());
    let mut at = 0;
    while at < n {
        let m = step.min(n - at);
        c.reserve(id, m).unwrap();
        for l in 0..2 {
            c.write(
                l,
                id,
                at,
                &k.narrow(0, at, m).unwrap(),
                &v.narrow(0, at, m).unwrap(),
            )
            .unwrap();
        }
        c.advance(id, m).unwrap();
        at += m;
    }
}

#[test]
fn exported_rows_import_bit_for_bit_into_another_layout() {
    for fmt in [KvFormat::Dense(DType::F32), affine(4), affine(8)] {
        let mut config = cfg(16);
        config.formats = vec![fmt; 2];
        let mut a = PagedKvCache::new(config.clone(), &Device::Cpu).unwrap();
        a.add_sequence(1).unwrap();
        a.add_sequence(2).unwrap();
        fill(&mut a, 2, 5, 5, 3.0);
        fill(&mut a, 1, 11, 3, 0.5);
        let saved = a.export_rows(1).unwrap();
        assert_eq!(saved[0].len().unwrap(), 11);
        assert_eq!(saved[0].format(), fmt);

        // Another cache whose free blocks come in another order.
        let mut b = PagedKvCache::new(config, &Device::Cpu).unwrap();
        b.add_sequence(9).unwrap();
        fill(&mut b, 9, 7, 7, 1.0);
        b.add_sequence(4).unwrap();
        b.import_rows(4, &saved, 4).unwrap();
        assert_eq!(b.seq_len(4).unwrap(), 11);
        assert_eq!(raw(&b.export_rows(4).unwrap()), raw(&saved), "{fmt:?}");
        let (ka, va) = gather_all(&a, 1, 0, 11);
        let (kb, vb) = gather_all(&b, 4, 0, 11);
        assert_eq!(max_abs_diff(&ka, &kb), 0.0);
        assert_eq!(max_abs_diff(&va, &vb), 0.0);
        // The other sequence is untouched.
        assert_eq!(
            raw(&b.export_rows(9).unwrap()),
            raw(&{
                let mut c = PagedKvCache::new(b.config().clone(), &Device::Cpu).unwrap();
                c.add_sequence(9).unwrap();
                fill(&mut c, 9, 7, 7, 1.0);
                c.export_rows(9).unwrap()
            })
        );
    }
}

#[test]
fn quantized_codes_do_not_depend_on_what_else_is_in_the_cache() {
    // Alone, written in one run...
    let mut config = cfg(64);
    config.formats = vec![affine(4); 2];
    let mut alone = PagedKvCache::new(config.clone(), &Device::Cpu).unwrap();
    alone.add_sequence(0).unwrap();
    fill(&mut alone, 0, 30, 30, 0.25);
    // ...and among other sequences, in chunks and decode-sized steps, blocks interleaved.
    let mut busy = PagedKvCache::new(config, &Device::Cpu).unwrap();
    for id in [5, 0, 6] {
        busy.add_sequence(id).unwrap();
    }
    fill(&mut busy, 5, 9, 2, 7.0);
    fill(&mut busy, 0, 13, 13, 0.25);
    fill(&mut busy, 6, 40, 16, -2.0);
    let (k, v) = (rows(30, 0.25), rows(30, -0.25).sqr().unwrap());
    for pos in 13..30 {
        busy.reserve(0, 1).unwrap();
        for l in 0..2 {
            busy.write(
                l,
                0,
                pos,
                &k.narrow(0, pos, 1).unwrap(),
                &v.narrow(0, pos, 1).unwrap(),
            )
            .unwrap();
        }
        busy.advance(0, 1).unwrap();
    }
    assert_eq!(
        raw(&alone.export_rows(0).unwrap()),
        raw(&busy.export_rows(0).unwrap())
    );
    // The kernel itself: a row's codes are the same whichever rows share the call.
    let fmt = QuantFormat::new(4, 32).unwrap();
    let x = rows(300, -1.5);
    let all = crate::kv::format::quantize(&x, fmt).unwrap();
    for (at, n) in [(0, 1), (17, 5), (123, 150), (299, 1)] {
        let part = crate::kv::format::quantize(&x.narrow(0, at, n).unwrap(), fmt).unwrap();
        let cut = |t: &Tensor| t.narrow(0, at, n).unwrap();
        let whole = LayerRows::Affine {
            kfmt: fmt,
            vfmt: fmt,
            rotated: false,
            k: crate::kv::format::Quantized {
                codes: cut(&all.codes),
                scales: cut(&all.scales),
                biases: cut(&all.biases),
            },
            v: part.clone(),
        };
        let r = raw(&[whole]);
        assert_eq!(r[0][..3], r[0][3..], "rows {at}..{}", at + n);
    }
}

#[test]
fn import_refuses_other_formats_and_respects_staging_and_window() {
    let mut q4 = cfg(16);
    q4.formats = vec![affine(4); 2];
    let mut a = PagedKvCache::new(q4.clone(), &Device::Cpu).unwrap();
    a.add_sequence(0).unwrap();
    fill(&mut a, 0, 10, 10, 1.0);
    let saved = a.export_rows(0).unwrap();

    let mut q8 = q4.clone();
    q8.formats = vec![affine(8); 2];
    let mut b = PagedKvCache::new(q8, &Device::Cpu).unwrap();
    b.add_sequence(0).unwrap();
    let e = b.import_rows(0, &saved, 4).unwrap_err().to_string();
    assert!(
        e.contains("layer 0") && e.contains("bits: 4") && e.contains("bits: 8"),
        "{e}"
    );
    assert_eq!(b.seq_len(0).unwrap(), 0);
    assert_eq!(b.free_blocks().total(), 16);

    // Below --quantized-kv-start a sequence is dense: quantized rows do not fit, dense do.
    let mut staged = q4.clone();
    staged.staging = Some(Staging {
        tokens: 12,
        dtype: DType::F32,
        num_blocks: 4,
    });
    let mut c = PagedKvCache::new(staged.clone(), &Device::Cpu).unwrap();
    c.add_sequence(0).unwrap();
    assert!(c.import_rows(0, &saved, 4).is_err());
    let mut dense = PagedKvCache::new(cfg(16), &Device::Cpu).unwrap();
    dense.add_sequence(0).unwrap();
    fill(&mut dense, 0, 10, 10, 1.0);
    c.import_rows(0, &dense.export_rows(0).unwrap(), 4).unwrap();
    assert!(!c.in_main_pool(0).unwrap());
    // Past the threshold the quantized rows go straight to the main pool.
    let mut d = PagedKvCache::new(
        CacheConfig {
            staging: Some(Staging {
                tokens: 8,
                ..staged.staging.clone().unwrap()
            }),
            ..staged
        },
        &Device::Cpu,
    )
    .unwrap();
    d.add_sequence(0).unwrap();
    d.import_rows(0, &saved, 4).unwrap();
    assert!(d.in_main_pool(0).unwrap());
    assert_eq!(raw(&d.export_rows(0).unwrap()), raw(&saved));

    // A window: chunks free what slid out, and export then refuses.
    let mut long = PagedKvCache::new(cfg(32), &Device::Cpu).unwrap();
    long.add_sequence(0).unwrap();
    fill(&mut long, 0, 40, 8, 0.1);
    let mut w = cfg(32);
    w.window = Some(6);
    let mut win = PagedKvCache::new(w, &Device::Cpu).unwrap();
    win.add_sequence(0).unwrap();
    win.import_rows(0, &long.export_rows(0).unwrap(), 4)
        .unwrap();
    assert!(win
        .owned_blocks(0)
        .unwrap()
        .fits_in(&win.config().max_blocks_for(40, 4)));
    let (k, _) = gather_all(&win, 0, win.first_visible(0, 40), 40);
    assert_eq!(
        max_abs_diff(&k, &rows(40, 0.1).narrow(0, 35, 5).unwrap()),
        0.0
    );
    let e = win.export_rows(0).unwrap_err().to_string();
    assert!(e.contains("--max-kv-size"), "{e}");
}

#[test]
fn windowed_groups_hold_their_window_and_reuse_only_held_prefix_blocks() {
    // Layer 0 slides over 8 positions, layer 1 is global; blocks of 4.
    let mut config = cfg(16);
    config.layer_windows = vec![Some(8), None];
    let mut c = PagedKvCache::new(config, &Device::Cpu).unwrap();
    assert_eq!(c.groups().len(), 2);
    assert_eq!((c.group_of(0), c.group_of(1)), (1, 0));
    c.enable_prefix_cache().unwrap();
    c.add_sequence(0).unwrap();
    fill(&mut c, 0, 20, 3, 0.5);
    // The global group holds all 5 blocks; the window keeps positions 13.. (blocks 3 and 4).
    assert_eq!(c.owned_blocks(0).unwrap(), Blocks(vec![5, 2]));
    let bb = c.config().group_block_bytes();
    assert_eq!(c.group_bytes_in_use(), vec![5 * bb[0], 2 * bb[1]]);
    assert_eq!(c.free_blocks(), Blocks(vec![11, 14]));
    let tokens: Vec<u32> = (0..30).collect();
    c.register_prefix(0, &tokens[..20]).unwrap();
    let (k0, v0) = {
        let slots = c.slots(0, 1, 13, 20).unwrap();
        let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
        c.gather(0, 0, &slots, DType::F32).unwrap()
    };
    c.remove_sequence(0);
    // A prompt of the first 18 tokens would need blocks 2..4 of the window: not held.
    c.add_sequence(1).unwrap();
    assert_eq!(c.attach_prefix(1, &tokens[..20], 18).unwrap(), 0);
    c.remove_sequence(1);
    // A longer prompt reuses all 20: the window's blocks 3 and 4 are what it can see.
    c.add_sequence(2).unwrap();
    assert_eq!(c.attach_prefix(2, &tokens, 28).unwrap(), 20);
    assert_eq!(c.owned_blocks(2).unwrap(), Blocks(vec![5, 2]));
    let slots = c.slots(2, 1, 13, 20).unwrap();
    let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
    let (k2, v2) = c.gather(0, 2, &slots, DType::F32).unwrap();
    assert_eq!((max_abs_diff(&k0, &k2), max_abs_diff(&v0, &v2)), (0.0, 0.0));
    assert!(
        c.slots(2, 1, 0, 12).is_err(),
        "left the window before it was cached"
    );
    // Decoding on frees what leaves the window: parked as cached, not lost.
    c.reserve(2, 4).unwrap();
    for l in 0..2 {
        c.write(l, 2, 20, &rows(4, 9.0), &rows(4, 8.0)).unwrap();
    }
    c.advance(2, 4).unwrap();
    assert_eq!(c.owned_blocks(2).unwrap(), Blocks(vec![6, 2]));
    assert_eq!(c.group_prefix_cached(), vec![0, 1]);
}

#[test]
fn a_kept_history_stays_whole_until_the_step_after_its_prompt() {
    let mut config = cfg(16);
    config.window = Some(6);
    let mut c = PagedKvCache::new(config, &Device::Cpu).unwrap();
    c.add_sequence(0).unwrap();
    c.keep_history(0, 12).unwrap();
    fill(&mut c, 0, 12, 5, 1.0);
    // Every block of the prompt is held and exports whole.
    assert_eq!(c.owned_blocks(0).unwrap(), Blocks(vec![3]));
    assert_eq!(c.export_rows(0).unwrap()[0].len().unwrap(), 12);
    assert!(c
        .owned_blocks(0)
        .unwrap()
        .fits_in(&c.config().max_blocks_keeping(40, 5, 12)));
    // The next token lets the window take over.
    fill_more(&mut c, 0, 12, 1);
    assert_eq!(c.owned_blocks(0).unwrap(), Blocks(vec![2]));
    assert!(c.export_rows(0).is_err());
}

/// Writes `n` more tokens of `id` from position `at` in both layers.
fn fill_more(c: &mut PagedKvCache, id: SeqId, at: usize, n: usize) {
    c.reserve(id, n).unwrap();
    for l in 0..2 {
        c.write(l, id, at, &rows(n, 3.0), &rows(n, 4.0)).unwrap();
    }
    c.advance(id, n).unwrap();
}
