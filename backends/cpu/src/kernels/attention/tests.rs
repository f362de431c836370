//! Paged attention against dense attention computed directly from the same f16 K/V values.

use super::*;
use crate::quant::testing::TestRng;

struct Case {
    lay: KvLayout,
    n_heads: usize,
    num_blocks: usize,
}

/// Dense reference: for query row at position `pos`, attend to keys `lo..=pos`.
fn dense(
    q: &[f32],
    keys: &[Vec<f32>],
    vals: &[Vec<f32>],
    (lo, pos): (usize, usize),
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let q16: Vec<f64> = q
        .iter()
        .map(|&v| f16::from_f32(v).to_f32() as f64)
        .collect();
    let scores: Vec<f64> = (lo..=pos)
        .map(|j| (0..hd).map(|d| q16[d] * keys[j][d] as f64).sum::<f64>() * scale as f64)
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    (0..hd)
        .map(|d| {
            (lo..=pos)
                .map(|j| e[j - lo] / sum * vals[j][d] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

#[test]
fn paged_matches_dense_for_mixed_sequences() {
    // Sequences: (history already cached, new tokens this step).
    check_against_dense(&[(0, 5), (37, 1), (16, 20), (100, 1)], 64);
}

/// One decoding sequence alone takes a task per query head (one row each: on AVX2 the K and V
/// blocks go straight from f16 into the multiply-adds), with whole and partial last blocks.
#[test]
fn a_decoding_sequence_alone_matches_dense() {
    check_against_dense(&[(70, 1)], 64);
    check_against_dense(&[(300, 1)], 64);
    check_against_dense(&[(15, 1)], 64);
}

/// Long histories are split over the KV into parts merged by their softmax mass (a different
/// order of the same sums): within the same tolerance of the dense reference. Covered: decode
/// tokens split in two and three parts, a few new tokens whose rows see different amounts of the
/// last part, a last part of a single block, and a sequence of several chunks (never split).
#[test]
fn split_kv_matches_dense_for_long_histories() {
    check_against_dense(
        &[
            (2100, 1),
            (1040, 1),
            (1100, 5),
            (1500, 12),
            (2047, 1),
            (40, 1),
        ],
        560,
    );
}

/// Outputs of every query row, for `shapes` as (history, new tokens) batched in one call, with
/// the cache and the queries a fixed seed makes; checks each against the dense reference.
fn check_against_dense(shapes: &[(usize, usize)], num_blocks: usize) -> Vec<Vec<f32>> {
    check_window_against_dense(shapes, num_blocks, None)
}

/// A sliding window (Gemma 3's local layers): each row sees only its last `window` positions,
/// in prefill chunks that start past the window and in decode tokens far beyond it; windows
/// shorter than, equal to and longer than a block.
#[test]
fn sliding_window_matches_dense() {
    for window in [5, 16, 37] {
        check_window_against_dense(
            &[(0, 40), (37, 1), (16, 20), (300, 1), (3, 2)],
            96,
            Some(window),
        );
    }
}

/// `check_against_dense` with a sliding window.
fn check_window_against_dense(
    shapes: &[(usize, usize)],
    num_blocks: usize,
    window: Option<usize>,
) -> Vec<Vec<f32>> {
    let pool = ThreadPool::new(2);
    let c = Case {
        lay: KvLayout {
            n_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            // Two layers' K and V interleaved block by block, as the backend lays them out;
            // this test uses the second layer.
            block_stride: 4 * 3 * 64 * 16,
        },
        n_heads: 9,
        num_blocks,
    };
    let (hd, nkv, bs) = (c.lay.head_dim, c.lay.n_kv_heads, c.lay.block_size);
    let mut rng = TestRng::new(5);
    let mut cache = vec![f16::ZERO; c.num_blocks * c.lay.block_stride];
    let (k_base, v_base) = (2 * c.lay.block_elems(), 3 * c.lay.block_elems());
    // Hand out blocks in a scrambled order so tables are not contiguous.
    let mut free: Vec<u32> = (0..c.num_blocks as u32).rev().step_by(1).collect();
    free.sort_by_key(|b| (b * 7919) % 64);
    let ld = (c.n_heads + 2 * nkv) * hd;
    let total_new: usize = shapes.iter().map(|s| s.1).sum();
    let mut qkv = vec![0f32; total_new * ld];
    let mut tables = Vec::new();
    let mut all_keys = Vec::new();
    let mut all_vals = Vec::new();
    let mut row = 0;
    for &(hist, new) in shapes {
        let len = hist + new;
        let table: Vec<u32> = (0..len.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
        // K/V per position and kv head, kept as the f16 values the cache will hold.
        let mut keys = vec![vec![vec![0f32; hd]; len]; nkv];
        let mut vals = keys.clone();
        for pos in 0..len {
            let mut kv_row = vec![0f32; ld];
            for h in 0..nkv {
                for d in 0..hd {
                    let kv = f16::from_f32(rng.uniform(-1.0, 1.0)).to_f32();
                    let vv = f16::from_f32(rng.uniform(-1.0, 1.0)).to_f32();
                    keys[h][pos][d] = kv;
                    vals[h][pos][d] = vv;
                    kv_row[c.n_heads * hd + h * hd + d] = kv;
                    kv_row[(c.n_heads + nkv) * hd + h * hd + d] = vv;
                }
            }
            let slot = table[pos / bs] * bs as u32 + (pos % bs) as u32;
            let kv_cols = (c.n_heads * hd, (c.n_heads + nkv) * hd);
            kv_write(
                &c.lay,
                &kv_row[kv_cols.0..],
                ld,
                &kv_row[kv_cols.1..],
                ld,
                &[slot],
                &mut cache,
                k_base,
                v_base,
            );
            if pos >= hist {
                let r = row + pos - hist;
                qkv[r * ld..(r + 1) * ld].copy_from_slice(&kv_row);
                for x in &mut qkv[r * ld..r * ld + c.n_heads * hd] {
                    *x = rng.uniform(-2.0, 2.0);
                }
            }
        }
        tables.push(table);
        all_keys.push(keys);
        all_vals.push(vals);
        row += new;
    }
    let mut seqs = Vec::new();
    let mut row = 0;
    for (i, &(hist, new)) in shapes.iter().enumerate() {
        seqs.push(AttnSeq {
            q_row: row,
            n_q: new,
            start_pos: hist,
            block_table: &tables[i],
        });
        row += new;
    }
    let p = AttnParams {
        lay: c.lay,
        n_heads: c.n_heads,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    };
    let ldo = c.n_heads * hd;
    let mut outs = Vec::new();
    for isa in Isa::available() {
        let mut out = vec![0f32; total_new * ldo];
        paged_attention(
            &pool,
            isa,
            &p,
            &qkv,
            ld,
            &seqs,
            &cache[k_base..],
            &cache[v_base..],
            &mut out,
            ldo,
        )
        .unwrap();
        for (i, s) in seqs.iter().enumerate() {
            for tq in 0..s.n_q {
                let r = s.q_row + tq;
                for h in 0..c.n_heads {
                    let kvh = h / (c.n_heads / nkv);
                    let want = dense(
                        &qkv[r * ld + h * hd..r * ld + (h + 1) * hd],
                        &all_keys[i][kvh],
                        &all_vals[i][kvh],
                        (
                            window.map_or(0, |w| (s.start_pos + tq + 1).saturating_sub(w)),
                            s.start_pos + tq,
                        ),
                        hd,
                        p.scale,
                    );
                    for d in 0..hd {
                        let g = out[r * ldo + h * hd + d];
                        assert!(
                            (g - want[d]).abs() < 2e-3,
                            "{} seq {i} token {tq} head {h} dim {d}: {g} vs {}",
                            isa.name(),
                            want[d]
                        );
                    }
                }
            }
        }
        outs.push(out);
    }
    // AVX2 runs the portable path's arithmetic in the portable path's order (a decoding row
    // reads f16 straight into its multiply-adds): the same bits as the scalar build of it.
    let isas = Isa::available();
    let at = |want: Isa| isas.iter().position(|&i| i == want);
    if let (Some(sc), Some(av)) = (at(Isa::Scalar), at(Isa::Avx2)) {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&outs[sc]) == bits(&outs[av]),
            "AVX2 and scalar attention differ"
        );
    }
    outs
}

/// Whether a history is split depends on the sequence alone: a long decode sequence gives the
/// same bits alone and batched with others.
#[test]
fn split_kv_result_does_not_depend_on_the_batch() {
    let alone = check_against_dense(&[(2100, 1)], 200);
    let batched = check_against_dense(&[(2100, 1), (30, 1), (0, 9)], 200);
    let ldo = 9 * 64;
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a[..ldo], b[..ldo]);
    }
}

/// A decoding batch (a task per sequence for all its KV heads) gives a sequence the bits it gets
/// alone (a task per query head).
#[test]
fn a_decoding_batch_gives_each_sequence_its_bits_alone() {
    let mut shapes = vec![(100usize, 1usize)];
    shapes.extend([0usize, 5, 15, 16, 17, 40, 63, 150].iter().map(|&h| (h, 1)));
    let alone = check_against_dense(&shapes[..1], 200);
    let batched = check_against_dense(&shapes, 200);
    let ldo = 9 * 64;
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a[..ldo], b[..ldo]);
    }
}

/// Two sequences that claim the same query rows would write the same output: refused, as are
/// block tables pointing past the cache.
#[test]
fn overlapping_query_rows_and_stray_blocks_are_refused() {
    let pool = ThreadPool::new(2);
    let lay = KvLayout {
        n_kv_heads: 1,
        head_dim: 16,
        block_size: 4,
        block_stride: 16 * 4,
    };
    let p = AttnParams {
        lay,
        n_heads: 2,
        scale: 0.25,
        window: None,
    };
    let k_cache = vec![f16::ZERO; 4 * lay.block_elems()];
    let v_cache = k_cache.clone();
    let ld = 4 * 16;
    let q = vec![0.5f32; 6 * ld];
    let mut out = vec![0f32; 6 * 32];
    let table = [0u32, 1];
    let seq = |q_row, n_q| AttnSeq {
        q_row,
        n_q,
        start_pos: 0,
        block_table: &table,
    };
    let run = |seqs: &[AttnSeq], out: &mut [f32]| {
        paged_attention(
            &pool,
            Isa::active(),
            &p,
            &q,
            ld,
            seqs,
            &k_cache,
            &v_cache,
            out,
            32,
        )
    };
    assert!(run(&[seq(0, 3), seq(3, 3)], &mut out).is_ok());
    let r = run(&[seq(0, 4), seq(3, 3)], &mut out);
    assert!(matches!(r, Err(KernelError::BadShape { .. })), "{r:?}");
    let stray = [0u32, 9];
    let r = run(
        &[AttnSeq {
            block_table: &stray,
            ..seq(0, 6)
        }],
        &mut out,
    );
    assert!(matches!(r, Err(KernelError::BadShape { .. })), "{r:?}");
}

/// Every K and V value lands in its slot as the f16 nearest to it (ties to even, subnormals,
/// overflow to infinity), whatever instructions convert it.
#[test]
fn kv_write_stores_each_value_rounded_to_f16() {
    let lay = KvLayout {
        n_kv_heads: 2,
        head_dim: 16,
        block_size: 4,
        block_stride: 2 * 2 * 16 * 4,
    };
    let width = lay.n_kv_heads * lay.head_dim;
    let mut rng = TestRng::new(11);
    let special = [
        1.0 + f32::EPSILON * 4096.0, // 1 + 2^-11, halfway between two f16s: ties to even
        6.0e-8,                      // subnormal in f16
        70000.0,                     // beyond f16: infinity
        -0.0,
    ];
    let rows = 6;
    let k: Vec<f32> = (0..rows * width)
        .map(|i| {
            special
                .get(i)
                .copied()
                .unwrap_or_else(|| rng.uniform(-4.0, 4.0))
        })
        .collect();
    let v: Vec<f32> = k.iter().map(|x| -x * 0.5).collect();
    let slots = [0u32, 5, 6, 11, 2, 13];
    let mut cache = vec![f16::from_f32(9.0); 4 * lay.block_stride];
    let (k_base, v_base) = (0, lay.block_elems());
    kv_write(
        &lay, &k, width, &v, width, &slots, &mut cache, k_base, v_base,
    );
    for (i, &slot) in slots.iter().enumerate() {
        let (b, t) = (slot as usize / 4, slot as usize % 4);
        for kvh in 0..lay.n_kv_heads {
            for d in 0..lay.head_dim {
                let j = i * width + kvh * lay.head_dim + d;
                let got_k = cache[k_base + lay.k_at(b, kvh, d, t)];
                let got_v = cache[v_base + lay.v_at(b, kvh, t, d)];
                assert_eq!(
                    got_k.to_bits(),
                    f16::from_f32(k[j]).to_bits(),
                    "K {i} {kvh} {d}"
                );
                assert_eq!(
                    got_v.to_bits(),
                    f16::from_f32(v[j]).to_bits(),
                    "V {i} {kvh} {d}"
                );
            }
        }
    }
}

/// The parallel write leaves the cache exactly as the serial one: a decoding batch of scattered
/// slots over the model's interleaved layout, and a slot named twice (falls back, last wins).
#[test]
fn parallel_kv_write_equals_the_serial_one() {
    let layers = 3;
    let lay = KvLayout {
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        block_stride: 2 * layers * 3 * 64 * 16,
    };
    let width = lay.n_kv_heads * lay.head_dim;
    let pool = ThreadPool::new(2);
    let mut rng = TestRng::new(29);
    let rows = 40;
    let k: Vec<f32> = (0..rows * width).map(|_| rng.uniform(-4.0, 4.0)).collect();
    let v: Vec<f32> = (0..rows * width).map(|_| rng.uniform(-4.0, 4.0)).collect();
    let blocks = 50;
    let mut slots: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 37 + 5) % (blocks * 16))
        .collect();
    for dup in [false, true] {
        if dup {
            slots[7] = slots[30];
        }
        for layer in [0, 2] {
            let (k_base, v_base) = (
                2 * layer * lay.block_elems(),
                (2 * layer + 1) * lay.block_elems(),
            );
            let fill = f16::from_f32(9.0);
            let mut want = vec![fill; blocks as usize * lay.block_stride];
            let mut got = want.clone();
            kv_write(
                &lay, &k, width, &v, width, &slots, &mut want, k_base, v_base,
            );
            kv_write_parallel(
                &pool, &lay, &k, width, &v, width, &slots, &mut got, k_base, v_base,
            )
            .unwrap();
            assert!(want != vec![fill; want.len()]);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "dup {dup} layer {layer}"
            );
        }
    }
}

/// Not a test: prints batch-1 decode attention time per step over `ALAYERS` layers (default 30:
/// SmolLM2's shape, 9 query heads over 3 KV heads of 64, 16-token blocks) at `ACTX` positions,
/// with the caches pushed out of the CPU caches between steps as a decode step's weight reads
/// do: `cargo test --release -p npu-backend-cpu --lib decode_attention_speed -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn decode_attention_speed() {
    let var = |n: &str, d: usize| std::env::var(n).map_or(d, |v| v.parse().unwrap());
    let (layers, ctx) = (var("ALAYERS", 30), var("ACTX", 300));
    let lay = KvLayout {
        n_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        block_stride: 2 * layers * 3 * 64 * 16,
    };
    let p = AttnParams {
        lay,
        n_heads: 9,
        scale: 0.125,
        window: None,
    };
    let n_blocks = ctx.div_ceil(16);
    let mut rng = TestRng::new(3);
    let cache: Vec<f16> = (0..n_blocks * lay.block_stride)
        .map(|_| f16::from_f32(rng.uniform(-1.0, 1.0)))
        .collect();
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let q: Vec<f32> = (0..9 * 64).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let seq = AttnSeq {
        q_row: 0,
        n_q: 1,
        start_pos: ctx - 1,
        block_table: &table,
    };
    let pool = ThreadPool::new(2);
    let mut out = vec![0f32; 9 * 64];
    let mut flush = vec![0u8; 96 << 20];
    let mut best = f64::MAX;
    for step in 0..20u8 {
        if std::env::var("ANOFLUSH").is_err() {
            flush
                .iter_mut()
                .step_by(64)
                .for_each(|b| *b = b.wrapping_add(step));
        }
        let t = std::time::Instant::now();
        for l in 0..layers {
            let (k, v) = (l * 2 * lay.block_elems(), (l * 2 + 1) * lay.block_elems());
            paged_attention(
                &pool,
                Isa::active(),
                &p,
                &q,
                9 * 64,
                std::slice::from_ref(&seq),
                &cache[k..],
                &cache[v..],
                &mut out,
                9 * 64,
            )
            .unwrap();
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    eprintln!(
        "{} decode attention, {layers} layers at {ctx} positions: {:.0} us per step (best of 20)",
        Isa::active().name(),
        best * 1e6
    );
}

/// The AVX-512 softmax passes give the portable loops' bits: the lane maxima of scores scaled as
/// `block_scores` stores them against the portable scaling pass, the exponentials and their lane
/// sums, and the normalised probabilities rounded through f16 (NaN and infinities included).
#[test]
fn the_fast_softmax_passes_match_the_portable_ones_bit_for_bit() {
    let isa = Isa::active();
    if isa != Isa::Avx512Vnni {
        eprintln!(
            "SKIPPED: the fast softmax passes need AVX-512 (this CPU runs {}).",
            isa.name()
        );
        return;
    }
    let mut rng = TestRng::new(77);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for len in [0usize, 5, 16, 37, 64, 1000] {
        let mut x: Vec<f32> = (0..len).map(|_| rng.uniform(-20.0, 10.0)).collect();
        if len > 20 {
            x[3] = f32::NAN;
            x[7] = f32::NEG_INFINITY;
            x[11] = f32::INFINITY;
            x[19] = -1e30;
        }
        let whole = len / 16 * 16;
        let scale = 0.125f32 + 1e-3;
        let mut fast: Vec<f32> = x.iter().map(|v| v * scale).collect();
        let mut slow = x.clone();
        let a = task::scale_lane_max(true, &mut fast[..whole], scale);
        let b = task::scale_lane_max(false, &mut slow[..whole], scale);
        assert_eq!(bits(&a), bits(&b), "lane maxima, {len} values");
        assert_eq!(
            bits(&fast[..whole]),
            bits(&slow[..whole]),
            "scaled scores, {len} values"
        );
        let (mut fast, mut slow) = (x.clone(), x.clone());
        let a = task::exp_lane_sums(true, &mut fast[..whole], 1.5);
        let b = task::exp_lane_sums(false, &mut slow[..whole], 1.5);
        assert_eq!(bits(&a), bits(&b), "lane sums, {len} values");
        assert_eq!(bits(&fast), bits(&slow), "exponentials, {len} values");
        let (mut fast, mut slow) = (x.clone(), x);
        task::normalise_through_f16(true, isa, &mut fast, 0.037);
        task::normalise_through_f16(false, isa, &mut slow, 0.037);
        assert_eq!(bits(&fast), bits(&slow), "probabilities, {len} values");
    }
}
