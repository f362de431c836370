//! The int8 cache's attention against a dense reference over the dequantized values, every
//! instruction set against the portable path bit for bit, and against the f16 cache.

use super::super::*;
use super::*;
use crate::quant::testing::TestRng;

/// Dense attention in f64 of one query row over `keys`/`vals` positions `lo..=pos` (the query
/// rounded through f16, as the kernels take it).
fn dense(
    q: &[f32],
    keys: &[Vec<f32>],
    vals: &[Vec<f32>],
    (lo, pos): (usize, usize),
    scale: f32,
) -> Vec<f64> {
    let hd = q.len();
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
                .sum::<f64>()
        })
        .collect()
}

struct Shape {
    nkv: usize,
    hd: usize,
    bs: usize,
    n_heads: usize,
}

/// Largest differences seen: against the dense reference over the dequantized values, and
/// against the dense reference over the f16 values (what an f16 cache holds).
#[derive(Debug, Default)]
struct Errors {
    vs_dequantized: f64,
    vs_f16: f64,
}

/// Builds an int8 cache (two layers interleaved block by block, the second used) for `shapes`
/// as (history, new tokens), runs attention on every instruction set, checks each against the
/// dense reference over the dequantized values (2e-3) and that every instruction set gives the
/// portable path's bits; returns the largest errors.
fn check(sh: &Shape, shapes: &[(usize, usize)], window: Option<usize>, outliers: bool) -> Errors {
    let pool = ThreadPool::new(2);
    let Shape {
        nkv,
        hd,
        bs,
        n_heads,
    } = *sh;
    let be = nkv * hd * bs;
    let lay = KvLayout {
        n_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        block_stride: 4 * be,
    };
    let slay = KvLayout {
        n_kv_heads: nkv,
        head_dim: 1,
        block_size: bs,
        block_stride: 4 * nkv * bs,
    };
    let num_blocks: usize = shapes
        .iter()
        .map(|s| (s.0 + s.1).div_ceil(bs))
        .sum::<usize>()
        + 3;
    let mut q8 = vec![0i8; num_blocks * lay.block_stride];
    let mut sc = vec![f16::ZERO; num_blocks * slay.block_stride];
    let (k_base, v_base) = (2 * be, 3 * be);
    let (ks_base, vs_base) = (2 * nkv * bs, 3 * nkv * bs);
    let mut rng = TestRng::new(11);
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    free.sort_by_key(|b| (b * 7919) % 61);
    let ld = n_heads * hd;
    let total_new: usize = shapes.iter().map(|s| s.1).sum();
    let mut q = vec![0f32; total_new * ld];
    let mut tables = Vec::new();
    // Per sequence, per KV head, per position: (dequantized, f16) keys and values.
    let mut kv_deq = Vec::new();
    let mut kv_f16 = Vec::new();
    let mut row = 0;
    let mut qrow = vec![0i8; hd];
    for &(hist, new) in shapes {
        let len = hist + new;
        let table: Vec<u32> = (0..len.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
        let mut deq = vec![(vec![vec![0f32; hd]; len], vec![vec![0f32; hd]; len]); nkv];
        let mut f16s = deq.clone();
        for pos in 0..len {
            let (blk, t) = (table[pos / bs] as usize, pos % bs);
            for h in 0..nkv {
                let mut k: Vec<f32> = (0..hd).map(|_| rng.uniform(-1.0, 1.0)).collect();
                let v: Vec<f32> = (0..hd).map(|_| rng.uniform(-1.0, 1.0)).collect();
                if outliers {
                    // A few large key channels, as Llama's keys have.
                    k[1] *= 12.0;
                    k[hd / 2] *= 8.0;
                }
                let s = quantize_row_i8(&k, &mut qrow);
                for d in 0..hd {
                    q8[k_base + lay.k_at(blk, h, d, t)] = qrow[d];
                }
                sc[ks_base + slay.k_at(blk, h, 0, t)] = s;
                dequantize_row_i8(&qrow, s, &mut deq[h].0[pos]);
                let at = v_base + lay.v_at(blk, h, t, 0);
                let s = quantize_row_i8(&v, &mut q8[at..at + hd]);
                sc[vs_base + slay.v_at(blk, h, t, 0)] = s;
                dequantize_row_i8(&q8[at..at + hd], s, &mut deq[h].1[pos]);
                for d in 0..hd {
                    f16s[h].0[pos][d] = f16::from_f32(k[d]).to_f32();
                    f16s[h].1[pos][d] = f16::from_f32(v[d]).to_f32();
                }
            }
            if pos >= hist {
                let r = row + pos - hist;
                for x in &mut q[r * ld..(r + 1) * ld] {
                    *x = rng.uniform(-2.0, 2.0);
                }
            }
        }
        tables.push(table);
        kv_deq.push(deq);
        kv_f16.push(f16s);
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
        lay,
        n_heads,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    };
    let cache = KvCache::I8(I8Cache {
        k: &q8[k_base..],
        v: &q8[v_base..],
        ks: &sc[ks_base..],
        vs: &sc[vs_base..],
        slay,
    });
    let mut errors = Errors::default();
    let mut outs = Vec::new();
    for isa in Isa::available() {
        let mut out = vec![0f32; total_new * ld];
        paged_attention_kv(&pool, isa, &p, &q, ld, &seqs, cache, &mut out, ld).unwrap();
        for (i, s) in seqs.iter().enumerate() {
            for tq in 0..s.n_q {
                let r = s.q_row + tq;
                let lo = window.map_or(0, |w| (s.start_pos + tq + 1).saturating_sub(w));
                for h in 0..n_heads {
                    let kvh = h / (n_heads / nkv);
                    let qh = &q[r * ld + h * hd..r * ld + (h + 1) * hd];
                    let span = (lo, s.start_pos + tq);
                    let (dk, dv) = &kv_deq[i][kvh];
                    let want = dense(qh, dk, dv, span, p.scale);
                    let (fk, fv) = &kv_f16[i][kvh];
                    let f16_want = dense(qh, fk, fv, span, p.scale);
                    for d in 0..hd {
                        let g = out[r * ld + h * hd + d] as f64;
                        let e = (g - want[d]).abs();
                        assert!(
                            e < 2e-3,
                            "{} seq {i} token {tq} head {h} dim {d}: {g} vs {}",
                            isa.name(),
                            want[d]
                        );
                        errors.vs_dequantized = errors.vs_dequantized.max(e);
                        errors.vs_f16 = errors.vs_f16.max((g - f16_want[d]).abs());
                    }
                }
            }
        }
        outs.push((isa, out));
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let (_, scalar) = outs.iter().find(|(i, _)| *i == Isa::Scalar).unwrap();
    for (isa, out) in &outs {
        assert!(
            bits(out) == bits(scalar),
            "{} and scalar int8 attention differ",
            isa.name()
        );
    }
    errors
}

const LLAMA_LIKE: Shape = Shape {
    nkv: 3,
    hd: 64,
    bs: 16,
    n_heads: 9,
};

/// Prefill chunks, decode tokens alone and batched, long histories split over the KV: within
/// 2e-3 of dense attention over the dequantized values, the same bits on every instruction
/// set; and within 0.03 of dense attention over the f16 values (what the f16 cache computes),
/// with outlier key channels.
#[test]
fn int8_attention_matches_dense_and_every_isa_gives_the_same_bits() {
    for outliers in [false, true] {
        let e = check(
            &LLAMA_LIKE,
            &[(0, 5), (37, 1), (16, 20), (100, 1), (2100, 1), (1100, 5)],
            None,
            outliers,
        );
        eprintln!("outliers {outliers}: {e:?}");
        assert!(e.vs_f16 < 0.03, "{e:?}");
    }
    // A decoding batch (one task per sequence for all its KV heads).
    let batch: Vec<_> = [0usize, 5, 15, 16, 17, 40, 63, 150, 300, 9, 20, 31]
        .iter()
        .map(|&h| (h, 1))
        .collect();
    check(&LLAMA_LIKE, &batch, None, false);
    // One sequence decoding at a long context with the default model's heads (3 KV heads of 64,
    // 9 query heads): its KV parts each one job over every KV head, the first asking for all
    // the heads' blocks.
    let smol = Shape {
        nkv: 3,
        hd: 64,
        bs: 16,
        n_heads: 9,
    };
    check(&smol, &[(4200, 1)], None, false);
}

#[test]
fn int8_attention_with_a_sliding_window() {
    for window in [5, 16, 37] {
        check(
            &LLAMA_LIKE,
            &[(0, 40), (37, 1), (16, 20), (300, 1)],
            Some(window),
            false,
        );
    }
}

/// Head dims and blocks off the AVX-512 kernels' multiples of 16: the AVX2 kernels (multiples
/// of 8) and the portable path, still the same bits; wide heads (128) and long blocks.
#[test]
fn int8_attention_on_other_shapes() {
    let shapes = [(0, 9), (21, 1), (50, 3), (130, 1)];
    for sh in [
        Shape {
            nkv: 2,
            hd: 24,
            bs: 8,
            n_heads: 4,
        },
        Shape {
            nkv: 1,
            hd: 20,
            bs: 5,
            n_heads: 3,
        },
        Shape {
            nkv: 2,
            hd: 128,
            bs: 16,
            n_heads: 8,
        },
        Shape {
            nkv: 1,
            hd: 32,
            bs: 128,
            n_heads: 2,
        },
    ] {
        check(&sh, &shapes, None, false);
    }
}

#[test]
fn a_row_is_quantized_within_half_a_step() {
    let mut rng = TestRng::new(3);
    let mut q = vec![0i8; 64];
    let mut back = vec![0f32; 64];
    for scale_in in [1e-3f32, 1.0, 300.0] {
        let x: Vec<f32> = (0..64).map(|_| rng.uniform(-scale_in, scale_in)).collect();
        let s = quantize_row_i8(&x, &mut q);
        dequantize_row_i8(&q, s, &mut back);
        let step = s.to_f32();
        for (a, b) in x.iter().zip(&back) {
            assert!(
                (a - b).abs() <= 0.5 * step * 1.001,
                "{a} vs {b} step {step}"
            );
        }
        assert!(q.iter().any(|v| v.abs() >= 126));
    }
    let s = quantize_row_i8(&[0.0; 8], &mut q[..8]);
    assert_eq!((s, &q[..8]), (f16::ZERO, &[0i8; 8][..]));
}
