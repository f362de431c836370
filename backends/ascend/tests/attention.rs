//! Paged attention and KV blocks of `AscendBackend` on the emulated CANN against a plain Rust
//! reference (tolerances as in `backend.rs`: 5e-3 absolute for attention outputs, exact copies),
//! and the block sizes the attention operator refuses.

mod common;

use common::seam::*;
use common::*;
use half::f16;
use npu_backend::*;
use npu_backend_ascend::AscendBackend;
use npu_model::{Rope, RopeStyle};

/// One sequence's K/V history on the host, for the reference.
#[derive(Default, Clone)]
struct Hist {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Attention of `q` over the history's positions `from..upto`.
fn attention_ref(
    q: &[f32],
    hist: &Hist,
    (from, upto): (usize, usize),
    heads: usize,
    kvh: usize,
    d: usize,
) -> Vec<f32> {
    let (kvd, group) = (kvh * d, heads / kvh);
    let mut out = vec![0f32; heads * d];
    for hh in 0..heads {
        let kh = hh / group;
        let s: Vec<f32> = (from..upto)
            .map(|j| {
                (0..d)
                    .map(|c| q[hh * d + c] * hist.k[j * kvd + kh * d + c])
                    .sum::<f32>()
                    * 0.25
            })
            .collect();
        let mx = s.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
        let sum: f32 = e.iter().sum();
        for c in 0..d {
            out[hh * d + c] = (from..upto)
                .map(|j| e[j - from] / sum * hist.v[j * kvd + kh * d + c])
                .sum();
        }
    }
    out
}

/// Runs steps of (sequence, new tokens) through kv_write + attention on layer 1 with block
/// size `bs`, checking every output row against the reference over each sequence's history
/// (the last `windows[step]` positions of it when that step's layer has a sliding window).
fn attention_case(bs: usize, steps: &[Vec<(usize, u32)>], seed: u64) -> AscendBackend {
    attention_case_windowed(bs, steps, &[], seed)
}

fn attention_case_windowed(
    bs: usize,
    steps: &[Vec<(usize, u32)>],
    windows: &[Option<u32>],
    seed: u64,
) -> AscendBackend {
    let mut b = default_backend();
    b.init_kv(kv_spec(bs, 12)).unwrap();
    let (heads, kvh, d) = (4usize, 2usize, 16usize);
    let g = AttnGeometry {
        n_heads: heads,
        n_kv_heads: kvh,
        head_dim: d,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: d,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 0.25,
        window: None,
    };
    let tables: [Vec<u32>; 3] = [vec![3, 7, 1], vec![0, 5, 9], vec![11, 2, 4]];
    let mut hist = vec![Hist::default(); 3];
    let (qd, kvd) = (heads * d, kvh * d);
    let w = qd + 2 * kvd;
    for (si, step) in steps.iter().enumerate() {
        let window = windows.get(si).copied().flatten();
        let g = AttnGeometry { window, ..g };
        let seqs: Vec<(u32, u32, Vec<u32>)> = step
            .iter()
            .map(|&(s, n)| ((hist[s].k.len() / kvd) as u32, n, tables[s].clone()))
            .collect();
        let inputs = step_of(&seqs, bs as u32, &[1]);
        b.begin_step(&inputs).unwrap();
        let t = inputs.tokens.len();
        let qkv = h(&rand_vec(seed + si as u64, t * w, 1.0));
        let buf = up(&mut b, &qkv, w);
        b.kv_write(
            View::new(&buf, Layout::new(qd, t, kvd, w).unwrap()).unwrap(),
            View::new(&buf, Layout::new(qd + kvd, t, kvd, w).unwrap()).unwrap(),
            &g,
            1,
        )
        .unwrap();
        // Odd steps write rows of a wider output (as the fused attention output of a layer
        // with extra columns would be): the backend writes them through a dense scratch.
        let ow = if si % 2 == 1 { qd + 8 } else { qd };
        let mut out = b.alloc(DType::F16, t * ow).unwrap();
        b.attention(
            View::new(&buf, Layout::new(0, t, qd, w).unwrap()).unwrap(),
            &g,
            1,
            ViewMut::new(&mut out, Layout::new(0, t, qd, ow).unwrap()).unwrap(),
        )
        .unwrap();
        let got = down(&mut b, &out, Layout::contiguous(t, ow));
        let got: Vec<f32> = (0..t).flat_map(|r| got[r * ow..][..qd].to_vec()).collect();
        let mut row = 0;
        for &(s, n) in step {
            for j in 0..n as usize {
                let r = &qkv[(row + j) * w..(row + j + 1) * w];
                hist[s].k.extend_from_slice(&r[qd..qd + kvd]);
                hist[s].v.extend_from_slice(&r[qd + kvd..]);
            }
            let len = hist[s].k.len() / kvd;
            for j in 0..n as usize {
                let q = &qkv[(row + j) * w..(row + j) * w + qd];
                let upto = len - n as usize + j + 1;
                let from = window.map_or(0, |w| upto.saturating_sub(w as usize));
                let want = attention_ref(q, &hist[s], (from, upto), heads, kvh, d);
                let got_row = &got[(row + j) * qd..(row + j + 1) * qd];
                for (c, (g, wv)) in got_row.iter().zip(&want).enumerate() {
                    assert!(
                        (g - wv).abs() < 5e-3,
                        "block size {bs}, window {window:?}, step {si}, sequence {s}, query {j}, column {c}: got {g}, want {wv}"
                    );
                }
            }
            row += n as usize;
        }
    }
    b
}

#[test]
fn attention_matches_reference_on_both_paths() {
    let _g = serial();
    let steps = vec![
        // Prefill chunks of two sequences.
        vec![(0, 5), (1, 3)],
        // A chunk after cached tokens with a decode token and a new sequence's prompt.
        vec![(0, 3), (1, 1), (2, 20)],
        // Decode only.
        vec![(0, 1), (1, 1), (2, 1)],
    ];
    // Block size 16: every step token-wise through the incremental branch.
    let b = attention_case(16, &steps, 40);
    drop(b);
    // Block size 128: steps with chunks through the prompt branch (padded batch, causal mask).
    let b = attention_case(128, &steps, 50);
    drop(b);
}

#[test]
fn sliding_windows_match_reference_on_both_paths() {
    let _g = serial();
    let steps = vec![
        // Prompts longer than the window.
        vec![(0, 12), (1, 3)],
        // A chunk and decode tokens past it, a new sequence's prompt.
        vec![(0, 9), (1, 1), (2, 20)],
        // Decode only, with the window met before (its key mask goes up with the step).
        vec![(0, 1), (1, 1), (2, 1)],
        // A window met for the first time mid-run (its mask is uploaded on its own), then
        // decode with no window (a global layer) and with one wider than every sequence.
        vec![(0, 1), (2, 1)],
        vec![(0, 1), (1, 1), (2, 1)],
        vec![(0, 1), (1, 1), (2, 1)],
    ];
    let windows = [Some(7), Some(7), Some(7), Some(5), None, Some(100)];
    // Block size 16: token-wise, windows as key masks of the incremental branch.
    drop(attention_case_windowed(16, &steps, &windows, 60));
    // Block size 128: chunked steps through the prompt branch's band mode.
    drop(attention_case_windowed(128, &steps, &windows, 70));
}

#[test]
fn a_window_of_zero_positions_is_refused() {
    let _g = serial();
    let mut b = default_backend();
    b.init_kv(kv_spec(16, 4)).unwrap();
    let g = AttnGeometry {
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 16,
        rope: Rope::plain(RopeStyle::Halves, 16, 10000.0, 1.0),
        scale: 0.25,
        window: Some(0),
    };
    b.begin_step(&step_of(&[(0, 2, vec![1])], 16, &[1]))
        .unwrap();
    let q = up(&mut b, &[0.5; 64], 32);
    let mut o = b.alloc(DType::F16, 64).unwrap();
    let e = b
        .attention(
            View::rows(&q, 2, 32).unwrap(),
            &g,
            0,
            ViewMut::rows(&mut o, 2, 32).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("window of 0"), "{e}");
}

#[test]
fn kv_blocks_move_between_device_and_host() {
    let _g = serial();
    let mut b = default_backend();
    let spec = kv_spec(16, 8);
    b.init_kv(spec).unwrap();
    let bb = b.kv_block_bytes();
    assert_eq!(bb, 2 * 2 * 16 * 2 * 16 * 2);
    let (qd, kvd) = (64usize, 32usize);
    let g = AttnGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: 16,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 0.25,
        window: None,
    };
    // 10 tokens of one sequence in block 2, both layers.
    let step = step_of(&[(0, 10, vec![2])], 16, &[1]);
    b.begin_step(&step).unwrap();
    let w = qd + 2 * kvd;
    let qkv = h(&rand_vec(60, 10 * w, 1.0));
    let buf = up(&mut b, &qkv, w);
    for layer in 0..2 {
        b.kv_write(
            View::new(&buf, Layout::new(qd, 10, kvd, w).unwrap()).unwrap(),
            View::new(&buf, Layout::new(qd + kvd, 10, kvd, w).unwrap()).unwrap(),
            &g,
            layer,
        )
        .unwrap();
    }
    let mut host = vec![0u8; bb];
    b.kv_blocks_to_host(&[2], &mut host).unwrap();
    // Layer 0's keys lead the block: token 3's key is at row 3.
    let key3: Vec<f32> = host[3 * kvd * 2..4 * kvd * 2]
        .chunks(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(key3, qkv[3 * w + qd..3 * w + qd + kvd].to_vec());
    // Back into block 5, and device-to-device into block 6: all three read the same.
    b.kv_blocks_from_host(&host, &[5]).unwrap();
    b.kv_copy_blocks(&[(2, 6)]).unwrap();
    let mut again = vec![0u8; 3 * bb];
    b.kv_blocks_to_host(&[5, 6, 2], &mut again).unwrap();
    for i in 0..3 {
        assert!(
            again[i * bb..(i + 1) * bb] == host[..],
            "block copy {i} differs"
        );
    }
    // Attention over block 6 equals attention over block 2.
    let mut outs = Vec::new();
    for block in [2u32, 6] {
        let mut s = step_of(&[(9, 1, vec![block])], 16, &[1]);
        s.slot_mapping = vec![block * 16 + 9];
        b.begin_step(&s).unwrap();
        let q = up(&mut b, &qkv[9 * w..9 * w + qd], qd);
        let mut out = b.alloc(DType::F16, qd).unwrap();
        b.attention(
            View::rows(&q, 1, qd).unwrap(),
            &g,
            1,
            ViewMut::rows(&mut out, 1, qd).unwrap(),
        )
        .unwrap();
        outs.push(down(&mut b, &out, Layout::contiguous(1, qd)));
    }
    assert_eq!(outs[0], outs[1]);
    // Wrong sizes and blocks are refused.
    assert!(b.kv_blocks_to_host(&[2], &mut vec![0u8; bb - 1]).is_err());
    assert!(b.kv_copy_blocks(&[(2, 8)]).is_err());
}

#[test]
fn block_sizes_the_attention_operator_refuses_are_refused_at_init() {
    let _g = serial();
    let mut b = default_backend();
    let e = b.init_kv(kv_spec(24, 8)).unwrap_err().to_string();
    assert!(e.contains("pa_config.block_size = 24"), "{e}");
    b.init_kv(kv_spec(16, 8)).unwrap();
}
