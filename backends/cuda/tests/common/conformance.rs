//! The conformance cases of the CUDA backend: each op (and the KV pool) checked against the CPU
//! backend's reference kernels and the reference dequantization. They take a factory, so the
//! same cases run on the CPU emulation of the kernels (tests/emulation_ops.rs) and on a real GPU
//! (tests/gpu_conformance.rs).

use super::*;
use npu_backend::{
    AttnGeometry, Backend, BackendError, DType, HostSlice, HostSliceMut, HostTensor, KvSpec,
    Layout, Readback, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cpu::kernels::attention::{self as cpu_attn, AttnParams, AttnSeq, KvLayout};
use npu_backend_cpu::kernels::{elementwise as cpu_ew, Isa};
use npu_backend_cpu::quant::QuantizedActs;
use npu_backend_cpu::threadpool::ThreadPool;
use npu_backend_cuda::{CudaBackend, MatmulMode};
use npu_gguf::hparams::{Rope, RopeStyle};
use npu_gguf::GgmlType;

/// Makes a backend computing in a dtype with a matmul mode (`None`: skip, reason printed).
pub type Make<'a> = &'a dyn Fn(DType, MatmulMode) -> Option<CudaBackend>;

/// A conformance case.
pub type Case = fn(Make);

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    (
        "embed_dequantizes_each_table_format_on_lookup",
        embed_dequantizes_each_table_format_on_lookup,
    ),
    (
        "rms_norm_matches_the_reference",
        rms_norm_matches_the_reference,
    ),
    (
        "rope_matches_the_reference_in_both_styles",
        rope_matches_the_reference_in_both_styles,
    ),
    (
        "swiglu_add_and_bias_match_the_reference",
        swiglu_add_and_bias_match_the_reference,
    ),
    (
        "gather_and_argmax_pick_the_right_rows",
        gather_and_argmax_pick_the_right_rows,
    ),
    (
        "paged_attention_mixes_prefill_chunks_and_decodes_with_gqa",
        paged_attention_mixes_prefill_chunks_and_decodes_with_gqa,
    ),
    (
        "paged_attention_splits_long_contexts",
        paged_attention_splits_long_contexts,
    ),
    ("kv_blocks_copy_on_the_device", kv_blocks_copy_on_the_device),
    (
        "matmul_paths_match_their_references",
        matmul_paths_match_their_references,
    ),
    (
        "uploads_and_reads_strided_windows",
        uploads_and_reads_strided_windows,
    ),
    (
        "ops_refuse_bad_shapes_steps_and_foreign_buffers",
        ops_refuse_bad_shapes_steps_and_foreign_buffers,
    ),
];

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Output rounding tolerance of a dtype (relative).
fn out_rtol(dt: DType) -> f32 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        _ => 8e-3,
    }
}

/// A KV pool and a step of `n` tokens: one sequence at positions 0..n.
fn one_seq_step(b: &mut CudaBackend, tokens: Vec<u32>) -> StepInputs {
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 8,
        block_size: 16,
        n_kv_heads: 1,
        head_dim: 32,
    })
    .unwrap();
    let n = tokens.len();
    let s = StepInputs {
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: (0..8).collect(),
        max_blocks: 8,
        logit_rows: vec![],
        tokens,
    };
    b.begin_step(&s).unwrap();
    s
}

pub fn embed_dequantizes_each_table_format_on_lookup(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(1);
        let (vocab, dim) = (50, 96);
        let tokens = vec![3, 49, 0, 17, 3];
        one_seq_step(&mut b, tokens.clone());
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::F16,
            GgmlType::F32,
            GgmlType::BF16,
        ] {
            let data = random_tensor(&mut rng, ty, vocab, dim);
            let table = b
                .load_embedding(HostTensor {
                    ty,
                    data: &data,
                    rows: vocab,
                    cols: dim,
                })
                .unwrap();
            let mut out = b.alloc(dt, tokens.len() * dim).unwrap();
            take_launches(&b);
            b.embed(&table, ViewMut::rows(&mut out, tokens.len(), dim).unwrap())
                .unwrap();
            assert_launched(&b, vec![format!("embed_{}", dt.name())]);
            let all = dequantized(ty, &data, vocab, dim);
            let want: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| all[t as usize * dim..(t as usize + 1) * dim].to_vec())
                .collect();
            assert_eq!(
                get(&mut b, &out),
                rounded(&want, dt),
                "{} {}",
                ty.name(),
                dt.name()
            );
        }
        // A token beyond the table is refused before any kernel runs, and a tensor whose bytes
        // do not match its shape is refused at load.
        let data = random_tensor(&mut rng, GgmlType::Q8_0, 10, dim);
        let small = HostTensor {
            ty: GgmlType::Q8_0,
            data: &data,
            rows: 10,
            cols: dim,
        };
        let table = b.load_embedding(small).unwrap();
        let mut out = b.alloc(dt, tokens.len() * dim).unwrap();
        take_launches(&b);
        let e = b
            .embed(&table, ViewMut::rows(&mut out, tokens.len(), dim).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("token id 49"), "{e}");
        assert!(take_launches(&b).unwrap_or_default().is_empty());
        let e = b
            .load_embedding(HostTensor { rows: 11, ..small })
            .unwrap_err();
        assert!(matches!(e, BackendError::BadArgument { .. }), "{e}");
    }
}

pub fn rms_norm_matches_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(2);
        let (rows, cols) = (5, 576);
        let x = rounded(&rng.vec(rows * cols, -3.0, 3.0), dt);
        let w = rng.vec(cols, 0.5, 1.5);
        let xb = put(&mut b, dt, &x, rows, cols);
        let wb = b
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(&w),
                rows: 1,
                cols,
            })
            .unwrap();
        // Output into a strided window (rows 700 apart, from column 3).
        let mut out = b.alloc(dt, rows * 700).unwrap();
        let win = Layout::new(3, rows, cols, 700).unwrap();
        take_launches(&b);
        b.rms_norm(
            View::rows(&xb, rows, cols).unwrap(),
            &wb,
            1e-5,
            ViewMut::new(&mut out, win).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("rms_norm_{}", dt.name())]);
        let mut want = vec![0f32; rows * cols];
        cpu_ew::rms_norm(&x, &w, 1e-5, &mut want);
        let all = get(&mut b, &out);
        let got: Vec<f32> = (0..rows)
            .flat_map(|r| all[r * 700 + 3..r * 700 + 3 + cols].to_vec())
            .collect();
        let e = worst(&got, &want, 1e-6, out_rtol(dt) + 1e-6);
        assert!(e <= 1.0, "{}: worst {e}", dt.name());
    }
}

pub fn rope_matches_the_reference_in_both_styles(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(3);
        let (n_heads, n_kv, hd) = (4, 2, 64);
        let heads = n_heads + n_kv;
        let n = 6;
        let mut s = one_seq_step(&mut b, vec![0; n]);
        // Positions far apart (the reference takes them from the step too).
        s.positions = vec![0, 1, 17, 900, 4095, 33];
        b.begin_step(&s).unwrap();
        for (style, dims, base, freq_scale) in [
            (RopeStyle::Interleaved, 64, 10000.0, 1.0),
            (RopeStyle::Halves, 64, 1_000_000.0, 1.0),
            (RopeStyle::Interleaved, 32, 100000.0, 0.25),
        ] {
            let rope = Rope {
                style,
                dims,
                base,
                freq_scale,
            };
            let g = AttnGeometry {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
                rope,
                scale: 0.125,
            };
            // The q/k heads sit in a wider row (V after them, untouched).
            let ld = (heads + n_kv) * hd;
            let x = rounded(&rng.vec(n * ld, -2.0, 2.0), dt);
            let mut buf = put(&mut b, dt, &x, n, ld);
            take_launches(&b);
            b.rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &g).unwrap();
            assert_launched(&b, vec![format!("rope_{}", dt.name())]);
            let mut want = x.clone();
            let mut cs = vec![0f32; dims];
            for (r, &pos) in s.positions.iter().enumerate() {
                rope.angles(pos, &mut cs);
                cpu_ew::rope_apply(
                    &rope,
                    &mut want[r * ld..r * ld + heads * hd],
                    heads,
                    hd,
                    &cs,
                );
            }
            let got = get(&mut b, &buf);
            let e = worst(&got, &want, 2e-5, out_rtol(dt) + 1e-5);
            assert!(e <= 1.0, "{style:?} dims {dims} {}: worst {e}", dt.name());
        }
    }
}

pub fn swiglu_add_and_bias_match_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(4);
        let (rows, ff) = (3, 300);
        // gate | up in one row, as the fused projection writes them.
        let gu = rounded(&rng.vec(rows * 2 * ff, -6.0, 6.0), dt);
        let gub = put(&mut b, dt, &gu, rows, 2 * ff);
        let mut out = b.alloc(dt, rows * ff).unwrap();
        let v = View::rows(&gub, rows, 2 * ff).unwrap();
        take_launches(&b);
        b.swiglu(
            v.col_range(0, ff).unwrap(),
            v.col_range(ff, ff).unwrap(),
            ViewMut::rows(&mut out, rows, ff).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("swiglu_{}", dt.name())]);
        let mut want = vec![0f32; rows * ff];
        cpu_ew::swiglu(Isa::Scalar, &gu, ff, &mut want);
        let got = get(&mut b, &out);
        assert!(worst(&got, &want, 1e-5, out_rtol(dt) + 1e-5) <= 1.0);

        // x += y, then x += bias (a bf16 bias vector: vectors may be of any float dtype).
        let x = rounded(&rng.vec(rows * ff, -1.0, 1.0), dt);
        let y = rounded(&rng.vec(rows * ff, -1.0, 1.0), dt);
        let bias = rounded(&rng.vec(ff, -1.0, 1.0), DType::BF16);
        let mut xb = put(&mut b, dt, &x, rows, ff);
        let yb = put(&mut b, dt, &y, rows, ff);
        let bb = put(&mut b, DType::BF16, &bias, 1, ff);
        b.add(
            ViewMut::rows(&mut xb, rows, ff).unwrap(),
            View::rows(&yb, rows, ff).unwrap(),
        )
        .unwrap();
        b.add_bias(ViewMut::rows(&mut xb, rows, ff).unwrap(), &bb)
            .unwrap();
        assert_launched(
            &b,
            vec![
                format!("add_{}", dt.name()),
                format!("add_bias_{}", dt.name()),
            ],
        );
        let want: Vec<f32> = (0..rows * ff)
            .map(|i| {
                let s = rounded(&[x[i] + y[i]], dt)[0];
                s + bias[i % ff]
            })
            .collect();
        let got = get(&mut b, &xb);
        assert!(
            worst(&got, &want, 1e-6, out_rtol(dt)) <= 1.0,
            "{}",
            dt.name()
        );
    }
}

pub fn gather_and_argmax_pick_the_right_rows(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(5);
        let (n, cols) = (7, 1000);
        let mut s = one_seq_step(&mut b, vec![1; n]);
        s.logit_rows = vec![6, 0, 3];
        b.begin_step(&s).unwrap();
        let x = rounded(&rng.vec(n * cols, -4.0, 4.0), dt);
        let xb = put(&mut b, dt, &x, n, cols);
        let mut g = b.alloc(dt, 3 * cols).unwrap();
        b.gather_logit_rows(
            View::rows(&xb, n, cols).unwrap(),
            ViewMut::rows(&mut g, 3, cols).unwrap(),
        )
        .unwrap();
        let got = get(&mut b, &g);
        for (i, &r) in s.logit_rows.iter().enumerate() {
            assert_eq!(
                &got[i * cols..(i + 1) * cols],
                &x[r as usize * cols..(r as usize + 1) * cols]
            );
        }
        // Argmax: a tie (first index wins), a NaN (counts as -inf), an all -inf row.
        let mut l = rounded(&rng.vec(4 * cols, -4.0, 4.0), dt);
        l[17] = 50.0;
        l[900] = 50.0;
        l[cols + 5] = f32::NAN;
        l[cols + 600] = 9.0;
        for v in &mut l[2 * cols..3 * cols] {
            *v = f32::NEG_INFINITY;
        }
        l[3 * cols + cols - 1] = 99.0;
        let lb = put(&mut b, dt, &l, 4, cols);
        let mut ids = b.alloc(DType::I32, 4).unwrap();
        take_launches(&b);
        let ran = b
            .argmax_rows(
                View::rows(&lb, 4, cols).unwrap(),
                ViewMut::rows(&mut ids, 4, 1).unwrap(),
            )
            .unwrap();
        assert!(ran, "the CUDA backend has a device argmax");
        assert_launched(&b, vec![format!("argmax_{}", dt.name())]);
        let mut out = [0i32; 4];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, 4, 1).unwrap(),
            dst: HostSliceMut::I32(&mut out),
        }])
        .unwrap();
        assert_eq!(out, [17, 600, 0, cols as i32 - 1], "{}", dt.name());
    }
}

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
        },
        scale: 1.0 / (hd as f32).sqrt(),
    };
    b.init_kv(s).unwrap();
    let max_blocks = case.seqs.iter().map(|q| q.2.len()).max().unwrap();
    let kvw = n_kv * hd;
    let lay = KvLayout {
        n_kv_heads: n_kv,
        head_dim: hd,
        block_size: s.block_size,
    };
    let per_layer = s.num_blocks * lay.block_elems();
    let mut k_cache = vec![half::f16::ZERO; per_layer];
    let mut v_cache = vec![half::f16::ZERO; per_layer];
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
            0,
            kvw,
            &st.slot_mapping,
            &mut k_cache,
            &mut v_cache,
        );
        if history {
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
            },
            &q,
            qw,
            &seqs,
            &k_cache,
            &v_cache,
            &mut want,
            qw,
        );
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
    };
    run_attention_case(make, &case, DType::F16, 21);
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

/// The CPU backend's quantized product of one activation row with one weight row: activations
/// quantized to 8 bits per block of 32, integer dot products, `(dot - offset isum) dw dx`
/// accumulated block by block, plus `mw sx` for Q4_1 (ggml's arithmetic).
fn quantized_dot(ty: GgmlType, w_row: &[u8], acts: &QuantizedActs, r: usize) -> f32 {
    let nb = acts.k / 32;
    let bb = ty.block_bytes();
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &w_row[b * bb..(b + 1) * bb];
        let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let xq = &acts.qs[r * acts.k + b * 32..r * acts.k + (b + 1) * 32];
        let (dot, min) = match ty {
            GgmlType::Q8_0 => (
                (0..32)
                    .map(|j| blk[2 + j] as i8 as i32 * xq[j] as i32)
                    .sum::<i32>(),
                None,
            ),
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let qs = if ty == GgmlType::Q4_0 {
                    &blk[2..18]
                } else {
                    &blk[4..20]
                };
                let mut dot = 0i32;
                for j in 0..16 {
                    dot += (qs[j] & 15) as i32 * xq[j] as i32;
                    dot += (qs[j] >> 4) as i32 * xq[j + 16] as i32;
                }
                if ty == GgmlType::Q4_0 {
                    (dot - 8 * acts.isum[r * nb + b], None)
                } else {
                    (
                        dot,
                        Some(half::f16::from_le_bytes([blk[2], blk[3]]).to_f32()),
                    )
                }
            }
            _ => unreachable!(),
        };
        acc = (dot as f32).mul_add(d * acts.d[r * nb + b], acc);
        if let Some(m) = min {
            acc = m.mul_add(acts.s[r * nb + b], acc);
        }
    }
    acc
}

pub fn matmul_paths_match_their_references(make: Make) {
    let mut rng = Rng::new(7);
    let (n, k) = (72, 160);
    for dt in DTYPES {
        for mode in [
            MatmulMode::Quantized,
            MatmulMode::Auto,
            MatmulMode::Dequantized,
        ] {
            let Some(mut b) = make(dt, mode) else {
                return;
            };
            for ty in [
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q8_0,
                GgmlType::F16,
                GgmlType::F32,
            ] {
                // Two stacked parts, as Q/K/V or gate/up are fused.
                let d1 = random_tensor(&mut rng, ty, 40, k);
                let d2 = random_tensor(&mut rng, ty, n - 40, k);
                let m = b
                    .load_matrix(&[
                        HostTensor {
                            ty,
                            data: &d1,
                            rows: 40,
                            cols: k,
                        },
                        HostTensor {
                            ty,
                            data: &d2,
                            rows: n - 40,
                            cols: k,
                        },
                    ])
                    .unwrap()
                    .expect("one type stacks");
                let mut raw = d1.clone();
                raw.extend(&d2);
                let mut w = dequantized(ty, &raw, n, k);
                if ty == GgmlType::F32 && mode != MatmulMode::Dequantized {
                    // Types without a packed form are kept as F16.
                    w = rounded(&w, DType::F16);
                }
                let packed = matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
                // 1 row, 5 rows, 13 rows (two GEMV passes, or cuBLAS), and a strided view.
                for (rows, col0, ld) in [(1, 0, k), (5, 0, k), (13, 0, k), (3, 1, k + 3)] {
                    let x = rounded(&rng.vec(rows * ld, -1.0, 1.0), dt);
                    let xb = put(&mut b, dt, &x, rows, ld);
                    let xv = View::new(&xb, Layout::new(col0, rows, k, ld).unwrap()).unwrap();
                    let mut out = b.alloc(dt, rows * (n + 2)).unwrap();
                    take_launches(&b);
                    b.matmul(
                        xv,
                        &m,
                        ViewMut::new(&mut out, Layout::new(1, rows, n, n + 2).unwrap()).unwrap(),
                    )
                    .unwrap();
                    let launched = take_launches(&b).unwrap_or_default();
                    let all = get(&mut b, &out);
                    let xs: Vec<f32> = (0..rows)
                        .flat_map(|r| x[r * ld + col0..r * ld + col0 + k].to_vec())
                        .collect();
                    let gemv_path =
                        mode == MatmulMode::Quantized || (mode == MatmulMode::Auto && rows <= 8);
                    let mut acts = QuantizedActs::new();
                    acts.quantize(&xs, rows, k);
                    let rb = ty.row_bytes(k).unwrap();
                    let mut worst_e = 0f32;
                    for r in 0..rows {
                        for o in 0..n {
                            let xr = &xs[r * k..(r + 1) * k];
                            let wr = &w[o * k..(o + 1) * k];
                            let mag: f64 =
                                xr.iter().zip(wr).map(|(&a, &c)| (a * c).abs() as f64).sum();
                            let (want, tol) = if packed && gemv_path {
                                // ggml's arithmetic: only the summation order may differ.
                                let q = quantized_dot(ty, &raw[o * rb..(o + 1) * rb], &acts, r);
                                (
                                    q as f64,
                                    1e-5 * mag + out_rtol(dt) as f64 * (q.abs() as f64),
                                )
                            } else {
                                let e: f64 =
                                    xr.iter().zip(wr).map(|(&a, &c)| a as f64 * c as f64).sum();
                                (e, (1e-5 + 2.0 * out_rtol(dt) as f64) * mag)
                            };
                            let got = all[r * (n + 2) + 1 + o] as f64;
                            worst_e = worst_e.max(((got - want).abs() / (tol + 1e-6)) as f32);
                        }
                    }
                    assert!(
                        worst_e <= 1.0,
                        "{} {} {:?} rows {rows}: worst {worst_e} ({launched:?})",
                        ty.name(),
                        dt.name(),
                        mode
                    );
                    if launched.is_empty() {
                        continue; // a real device: launches are not recorded
                    }
                    let used_gemv = launched.iter().any(|l| l.starts_with("gemv_"));
                    assert_eq!(used_gemv, gemv_path, "{mode:?} rows {rows}: {launched:?}");
                    let quantized_acts = launched.iter().any(|l| l.starts_with("quantize_q8"));
                    assert_eq!(quantized_acts, gemv_path && packed, "{launched:?}");
                }
            }
        }
    }
}

pub fn uploads_and_reads_strided_windows(make: Make) {
    let Some(mut b) = make(DType::BF16, MatmulMode::Auto) else {
        return;
    };
    let mut buf = b.alloc(DType::F32, 20).unwrap();
    let win = Layout::new(2, 3, 4, 6).unwrap();
    let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
    b.upload(HostSlice::F32(&v), ViewMut::new(&mut buf, win).unwrap())
        .unwrap();
    let all = get(&mut b, &buf);
    assert_eq!(&all[2..6], &v[0..4]);
    assert_eq!(&all[6..8], &[0.0, 0.0]);
    assert_eq!(&all[8..12], &v[4..8]);
    let mut back = vec![0f32; 12];
    b.read_back(&mut [Readback {
        src: View::new(&buf, win).unwrap(),
        dst: HostSliceMut::F32(&mut back),
    }])
    .unwrap();
    assert_eq!(back, v);
    // Wrong kinds and lengths are refused with the op's name.
    let mut ib = b.alloc(DType::I32, 4).unwrap();
    let e = b
        .upload(
            HostSlice::F32(&v[..4]),
            ViewMut::rows(&mut ib, 1, 4).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("upload"), "{e}");
    let e = b
        .upload(HostSlice::F32(&v), ViewMut::rows(&mut buf, 1, 4).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("upload"), "{e}");
}

pub fn ops_refuse_bad_shapes_steps_and_foreign_buffers(make: Make) {
    let Some(mut b) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let Some(mut other) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let x = b.alloc(DType::F16, 64).unwrap();
    let mut y = b.alloc(DType::F16, 64).unwrap();
    let foreign = other.alloc(DType::F16, 64).unwrap();
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&foreign, 2, 32).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("another backend"), "{e}");
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&x, 4, 16).unwrap(),
        )
        .unwrap_err();
    assert!(
        matches!(e, BackendError::BadArgument { op: "add", .. }),
        "{e}"
    );
    let f = b.alloc(DType::F32, 64).unwrap();
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&f, 2, 32).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("one dtype"), "{e}");
    // Ops that read the step need one, and a KV pool.
    let e = b.begin_step(&StepInputs::default()).unwrap_err();
    assert!(e.to_string().contains("KV pool"), "{e}");
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 2,
        block_size: 4,
        n_kv_heads: 1,
        head_dim: 8,
    })
    .unwrap();
    let bad = StepInputs {
        tokens: vec![1],
        positions: vec![0],
        slot_mapping: vec![8],
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: 1,
            start_pos: 0,
        }],
        block_tables: vec![0],
        max_blocks: 1,
        logit_rows: vec![0],
    };
    let e = b.begin_step(&bad).unwrap_err();
    assert!(matches!(e, BackendError::BadStep(_)), "{e}");
    drop(other);
}
