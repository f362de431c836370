//! Conformance cases of the paged KV pool: KV writes by slot mapping and paged attention against
//! the CPU backend's paged attention over the same cache contents, and block copies.

use super::{out_rtol, Make, DTYPES};
use crate::common::*;
use npu_backend::{AttnGeometry, Backend, DType, KvSpec, SeqSpan, StepInputs, View, ViewMut};
use npu_backend_cpu::kernels::attention::{self as cpu_attn, AttnParams, AttnSeq, KvLayout};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::threadpool::ThreadPool;
use npu_backend_cuda::MatmulMode;
use npu_model::{Rope, RopeStyle};

/// A step of several sequences over a paged pool, attention checked against the CPU backend's
/// paged attention over the same cache contents.
struct AttnCase {
    spec: KvSpec,
    n_heads: usize,
    /// (start position, new tokens, block table) per sequence.
    seqs: Vec<(usize, usize, Vec<u32>)>,
    layer: usize,
    /// Whether the context is long enough (and the step small enough) to be split.
    split: bool,
    /// Sliding window (positions a query sees, itself included).
    window: Option<u32>,
}

fn run_attention_case(make: Make, case: &AttnCase, dt: DType, seed: u64) {
    let Some(mut b) = make(dt, MatmulMode::Auto) else {
        return;
    };
    let mut rng = Rng::new(seed);
    let s = case.spec;
    let (hd, n_kv) = (s.head_dim, s.n_kv_heads);
    let g = AttnGeometry {
        n_heads: case.n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: hd,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0 / (hd as f32).sqrt(),
        window: case.window,
    };
    b.init_kv(s).unwrap();
    let max_blocks = case.seqs.iter().map(|q| q.2.len()).max().unwrap();
    let kvw = n_kv * hd;
    let lay = KvLayout {
        n_kv_heads: n_kv,
        head_dim: hd,
        block_size: s.block_size,
        block_stride: n_kv * hd * s.block_size,
    };
    // One layer's K blocks, then its V blocks.
    let per_layer = s.num_blocks * lay.block_elems();
    let mut cache = vec![half::f16::ZERO; 2 * per_layer];
    // Two steps: the history (positions 0..start), then the new tokens.
    let make_step = |history: bool| {
        let mut st = StepInputs {
            max_blocks,
            ..Default::default()
        };
        for (i, (start, n_new, table)) in case.seqs.iter().enumerate() {
            let (from, n) = if history {
                (0, *start)
            } else {
                (*start, *n_new)
            };
            if n == 0 {
                continue;
            }
            st.seqs.push(SeqSpan {
                q_row: st.tokens.len() as u32,
                n_q: n as u32,
                start_pos: from as u32,
            });
            let _ = i;
            for p in from..from + n {
                st.tokens.push(0);
                st.positions.push(p as u32);
                st.slot_mapping.push(
                    table[p / s.block_size] * s.block_size as u32 + (p % s.block_size) as u32,
                );
            }
            let mut row = table.clone();
            row.resize(max_blocks, 0);
            st.block_tables.extend(row);
        }
        st
    };
    for history in [true, false] {
        let st = make_step(history);
        let t = st.tokens.len();
        if t == 0 {
            continue;
        }
        b.begin_step(&st).unwrap();
        let kv = rounded(&rng.vec(t * 2 * kvw, -1.5, 1.5), dt);
        let kvb = put(&mut b, dt, &kv, t, 2 * kvw);
        let v = View::rows(&kvb, t, 2 * kvw).unwrap();
        take_launches(&b);
        b.kv_write(
            v.col_range(0, kvw).unwrap(),
            v.col_range(kvw, kvw).unwrap(),
            &g,
            case.layer,
        )
        .unwrap();
        assert_launched(&b, vec![format!("kv_write_{}", dt.name())]);
        cpu_attn::kv_write(
            &lay,
            &kv,
            2 * kvw,
            &kv[kvw..],
            2 * kvw,
            &st.slot_mapping,
            &mut cache,
            0,
            per_layer,
        );
        if history {
            if let Some(w) = case.window {
                poison_blocks_before_the_window(&mut b, case, w as usize, &mut cache, &lay);
            }
            continue;
        }
        let qw = g.q_width();
        let q = rounded(&rng.vec(t * qw, -1.5, 1.5), dt);
        let qb = put(&mut b, dt, &q, t, qw);
        let mut out = b.alloc(dt, t * qw).unwrap();
        b.attention(
            View::rows(&qb, t, qw).unwrap(),
            &g,
            case.layer,
            ViewMut::rows(&mut out, t, qw).unwrap(),
        )
        .unwrap();
        let launched = take_launches(&b).unwrap_or_default();
        if !launched.is_empty() {
            assert_eq!(launched[0], format!("attention_{}", dt.name()));
            let combined = launched.contains(&format!("attention_combine_{}", dt.name()));
            assert_eq!(combined, case.split, "{launched:?}");
        }
        let got = get(&mut b, &out);
        let pool = ThreadPool::new(1);
        let seqs: Vec<AttnSeq> = st
            .seqs
            .iter()
            .enumerate()
            .map(|(i, q)| AttnSeq {
                q_row: q.q_row as usize,
                n_q: q.n_q as usize,
                start_pos: q.start_pos as usize,
                block_table: &st.block_tables[i * max_blocks..(i + 1) * max_blocks],
            })
            .collect();
        let mut want = vec![0f32; t * qw];
        cpu_attn::paged_attention(
            &pool,
            Isa::Scalar,
            &AttnParams {
                lay,
                n_heads: g.n_heads,
                scale: g.scale,
                window: case.window.map(|w| w as usize),
            },
            &q,
            qw,
            &seqs,
            &cache[..per_layer],
            &cache[per_layer..],
            &mut want,
            qw,
        )
        .unwrap();
        // The reference rounds queries and probabilities through f16.
        let e = worst(&got, &want, 3e-3, 3e-3 + out_rtol(dt));
        assert!(
            e <= 1.0,
            "{} ({launched:?}): worst {e}; first values {:?} vs {:?}",
            dt.name(),
            &got[..4],
            &want[..4]
        );
    }
    // The cache K/V of every written block round-trips through host memory.
    let blocks: Vec<u32> = case.seqs.iter().flat_map(|q| q.2.clone()).collect();
    let bb = b.kv_block_bytes();
    let mut host = vec![0u8; blocks.len() * bb];
    b.kv_blocks_to_host(&blocks, &mut host).unwrap();
    let mut back = vec![0u8; host.len()];
    b.kv_blocks_from_host(&host, &blocks).unwrap();
    b.kv_blocks_to_host(&blocks, &mut back).unwrap();
    assert_eq!(host, back);
}

/// Fills every block that lies wholly before the first position a sequence's new tokens see
/// with NaN, on the device and in the reference's cache: windowed attention must not read them
/// (a model may reuse them).
fn poison_blocks_before_the_window(
    b: &mut npu_backend_cuda::CudaBackend,
    case: &AttnCase,
    window: usize,
    cache: &mut [half::f16],
    lay: &KvLayout,
) {
    let bs = case.spec.block_size;
    let per_layer = case.spec.num_blocks * lay.block_elems();
    let bb = b.kv_block_bytes();
    for (start, _, table) in &case.seqs {
        let first_seen = (start + 1).saturating_sub(window);
        let dead: Vec<u32> = table[..first_seen / bs].to_vec();
        if dead.is_empty() {
            continue;
        }
        b.kv_blocks_from_host(&vec![0xff; dead.len() * bb], &dead)
            .unwrap();
        for &blk in &dead {
            let at = blk as usize * lay.block_elems();
            for base in [at, per_layer + at] {
                cache[base..base + lay.block_elems()].fill(half::f16::NAN);
            }
        }
    }
}

pub fn paged_attention_mixes_prefill_chunks_and_decodes_with_gqa(make: Make) {
    let case = AttnCase {
        spec: KvSpec {
            n_layers: 2,
            num_blocks: 32,
            block_size: 16,
            n_kv_heads: 2,
            head_dim: 64,
        },
        n_heads: 6,
        seqs: vec![
            (20, 37, vec![5, 9, 2, 14]),
            (100, 1, vec![0, 1, 3, 4, 6, 7, 8]),
            (3, 1, vec![31]),
            (0, 5, vec![20]),
        ],
        layer: 1,
        split: false,
        window: None,
    };
    for (i, dt) in DTYPES.into_iter().enumerate() {
        run_attention_case(make, &case, dt, 10 + i as u64);
    }
}

pub fn paged_attention_splits_long_contexts(make: Make) {
    // One decode over 700 positions: few blocks, so the context is split and combined.
    let case = AttnCase {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 24,
            block_size: 32,
            n_kv_heads: 1,
            head_dim: 128,
        },
        n_heads: 4,
        seqs: vec![(699, 1, (0..22).rev().collect())],
        layer: 0,
        split: true,
        window: None,
    };
    for (i, dt) in DTYPES.into_iter().enumerate() {
        run_attention_case(make, &case, dt, 20 + i as u64);
    }
    // Odd head size and block size not a multiple of the tile, multi-head (group 1).
    let case = AttnCase {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 12,
            block_size: 5,
            n_kv_heads: 3,
            head_dim: 80,
        },
        n_heads: 3,
        seqs: vec![(41, 9, (0..10).collect()), (7, 1, vec![11, 10])],
        layer: 0,
        split: false,
        window: None,
    };
    run_attention_case(make, &case, DType::F16, 21);
}

/// Sliding-window attention (Gemma 3's local layers): prefill chunks longer than the window mixed
/// with decodes far past it, windows starting inside a tile and a block, split contexts whose
/// first split starts at the window's tile, and a window wider than the context (no masking).
pub fn paged_attention_slides_a_window(make: Make) {
    let mixed = AttnCase {
        spec: KvSpec {
            n_layers: 2,
            num_blocks: 32,
            block_size: 16,
            n_kv_heads: 2,
            head_dim: 64,
        },
        n_heads: 6,
        seqs: vec![
            (20, 37, vec![5, 9, 2, 14]),
            (100, 1, vec![0, 1, 3, 4, 6, 7, 8]),
            (3, 1, vec![31]),
            (0, 5, vec![20]),
        ],
        layer: 1,
        split: false,
        window: Some(7),
    };
    for (i, dt) in DTYPES.into_iter().enumerate() {
        run_attention_case(make, &mixed, dt, 30 + i as u64);
    }
    // One decode over 700 positions seeing the last 200: two splits of four tiles, from the
    // window's first tile. Then a window wider than the context.
    let mut long = AttnCase {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 24,
            block_size: 32,
            n_kv_heads: 1,
            head_dim: 128,
        },
        n_heads: 4,
        seqs: vec![(699, 1, (0..22).rev().collect())],
        layer: 0,
        split: true,
        window: Some(200),
    };
    run_attention_case(make, &long, DType::F32, 33);
    long.window = Some(1000);
    run_attention_case(make, &long, DType::F16, 34);
    // A prefill chunk of 8 past 300 positions through a window of 250, split in two: every
    // token's window starts in the first split, at a different position.
    let chunk = AttnCase {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 24,
            block_size: 16,
            n_kv_heads: 1,
            head_dim: 64,
        },
        n_heads: 2,
        seqs: vec![(300, 8, (0..20).collect())],
        layer: 0,
        split: true,
        window: Some(250),
    };
    run_attention_case(make, &chunk, DType::BF16, 35);
    // Odd head and block sizes, a window of 6 starting mid-block, 8 tokens per attention block.
    let odd = AttnCase {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 12,
            block_size: 5,
            n_kv_heads: 3,
            head_dim: 80,
        },
        n_heads: 3,
        seqs: vec![(41, 9, (0..10).collect()), (7, 1, vec![11, 10])],
        layer: 0,
        split: false,
        window: Some(6),
    };
    run_attention_case(make, &odd, DType::F32, 36);
}

pub fn kv_blocks_copy_on_the_device(make: Make) {
    let Some(mut b) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    b.init_kv(KvSpec {
        n_layers: 3,
        num_blocks: 6,
        block_size: 4,
        n_kv_heads: 2,
        head_dim: 8,
    })
    .unwrap();
    let bb = b.kv_block_bytes();
    assert_eq!(bb, 3 * 2 * 2 * 4 * 8 * 2);
    let src: Vec<u8> = (0..2 * bb).map(|i| (i % 251) as u8).collect();
    b.kv_blocks_from_host(&src, &[4, 1]).unwrap();
    b.kv_copy_blocks(&[(4, 0), (1, 5)]).unwrap();
    let mut out = vec![0u8; 2 * bb];
    b.kv_blocks_to_host(&[0, 5], &mut out).unwrap();
    assert_eq!(out, src);
    assert!(b.kv_copy_blocks(&[(6, 0)]).is_err());
    assert!(b.kv_blocks_to_host(&[0], &mut out).is_err(), "wrong length");
}
