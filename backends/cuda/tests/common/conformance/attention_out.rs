//! Conformance case of decode attention with the output projection and the residual add in one
//! launch (`attention_matmul_add`, src/fold_attn.rs): against `attention` then `matmul_add`
//! (`set_fold_attn_out(false)`, each checked against the CPU reference by the other cases) on
//! the same cache, queries, matrix and residual. The attention output is the same bits; the
//! product and the residual are within a few roundings of the dtype (the fused launch adds the
//! product's terms in another order), in f32, f16 and bf16, over steps of several decodes of
//! different lengths, GQA groups and one query head per KV head, a sliding window, unsplit and
//! split contexts (the split merged inside the launch), each quantized weight format. Two fused
//! launches on one backend and one on another give the same bits (the counters go back to 0),
//! and the launches are named (the fused one exactly one kernel). An int8 KV pool falls back.

use super::{out_rtol, Make, DTYPES};
use crate::common::*;
use npu_backend::{
    AttnGeometry, Backend, DType, HostTensor, KvDtype, KvSpec, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cuda::MatmulMode;
use npu_gguf::GgmlType;
use npu_model::{Rope, RopeStyle};

/// Output rows of the projection (more than a block's 256 threads: each thread takes two).
const H: usize = 320;

struct Case {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    block_size: usize,
    /// Each decode's cached positions (its new token comes at that position).
    starts: Vec<usize>,
    window: Option<u32>,
    fmt: GgmlType,
    /// Whether the attention of the unfused run is split (`attention_combine` launched).
    split: bool,
}

/// The step's buffers read back: attention output, product, residual; and the launches of the
/// op under test.
type Out = (Vec<Vec<f32>>, Vec<String>);

/// The cache filled, then `attention_matmul_add` of one decode step `times` times (the residual
/// uploaded afresh each time), on a backend with the fold on or off.
fn run(make: Make, c: &Case, dt: DType, fused: bool, kv_int8: bool, times: usize) -> Vec<Out> {
    let Some(mut b) = make(dt, MatmulMode::Quantized) else {
        return Vec::new();
    };
    b.set_fuse(true);
    b.set_fold_gemv(true);
    b.set_fold_rope(true);
    b.set_fold_attn_out(fused);
    if kv_int8 {
        b.set_kv_dtype(KvDtype::Int8).unwrap();
    }
    let (hd, n_kv, bs) = (c.hd, c.n_kv, c.block_size);
    let g = AttnGeometry {
        n_heads: c.n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        rope: Rope {
            style: RopeStyle::Halves,
            dims: hd,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0 / (hd as f32).sqrt(),
        window: c.window,
    };
    let per_seq = (c.starts.iter().max().unwrap() + 1).div_ceil(bs);
    let num_blocks = per_seq * c.starts.len();
    b.init_kv(KvSpec {
        n_layers: 2,
        num_blocks,
        block_size: bs,
        n_kv_heads: n_kv,
        head_dim: hd,
    })
    .unwrap();
    // Sequence i's blocks: every c.starts.len()-th block from the top, so tables interleave.
    let n = c.starts.len();
    let table = |i: usize| -> Vec<u32> {
        (0..per_seq)
            .map(|j| (num_blocks - 1 - (j * n + i)) as u32)
            .collect()
    };
    let step = |history: bool| {
        let mut st = StepInputs {
            max_blocks: per_seq,
            ..Default::default()
        };
        for (i, &start) in c.starts.iter().enumerate() {
            let (from, count) = if history { (0, start) } else { (start, 1) };
            if count == 0 {
                continue;
            }
            let t = table(i);
            st.seqs.push(SeqSpan {
                q_row: st.tokens.len() as u32,
                n_q: count as u32,
                start_pos: from as u32,
            });
            for p in from..from + count {
                st.tokens.push(0);
                st.positions.push(p as u32);
                st.slot_mapping
                    .push(t[p / bs] * bs as u32 + (p % bs) as u32);
            }
            st.block_tables.extend(t);
        }
        st
    };
    let mut rng = Rng::new(40 + (c.n_heads * hd + n) as u64);
    let kvw = n_kv * hd;
    for history in [true, false] {
        let st = step(history);
        let t = st.tokens.len();
        b.begin_step(&st).unwrap();
        let kv = rounded(&rng.vec(t * 2 * kvw, -1.5, 1.5), dt);
        let kvb = put(&mut b, dt, &kv, t, 2 * kvw);
        let v = View::rows(&kvb, t, 2 * kvw).unwrap();
        b.kv_write(
            v.col_range(0, kvw).unwrap(),
            v.col_range(kvw, kvw).unwrap(),
            &g,
            1,
        )
        .unwrap();
    }
    let qw = g.q_width();
    let q = put(&mut b, dt, &rounded(&rng.vec(n * qw, -1.5, 1.5), dt), n, qw);
    let wo = random_tensor(&mut rng, c.fmt, H, qw);
    let wo = b
        .load_matrix(&[HostTensor {
            ty: c.fmt,
            data: &wo,
            rows: H,
            cols: qw,
        }])
        .unwrap()
        .unwrap();
    let x0 = rounded(&rng.vec(n * H, -2.0, 2.0), dt);
    let mut attn = b.alloc(dt, n * qw).unwrap();
    let mut tmp = b.alloc(dt, n * H).unwrap();
    let mut outs = Vec::new();
    for _ in 0..times {
        let mut x = put(&mut b, dt, &x0, n, H);
        take_launches(&b);
        b.attention_matmul_add(
            View::rows(&q, n, qw).unwrap(),
            &g,
            1,
            ViewMut::rows(&mut attn, n, qw).unwrap(),
            &wo,
            ViewMut::rows(&mut tmp, n, H).unwrap(),
            ViewMut::rows(&mut x, n, H).unwrap(),
        )
        .unwrap();
        let launched = take_launches(&b).unwrap_or_default();
        outs.push((
            vec![get(&mut b, &attn), get(&mut b, &tmp), get(&mut b, &x)],
            launched,
        ));
    }
    outs
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check(make: Make, c: &Case, dt: DType) {
    let fused = run(make, c, dt, true, false, 2);
    let again = run(make, c, dt, true, false, 1);
    let plain = run(make, c, dt, false, false, 1);
    if fused.is_empty() {
        return;
    }
    let s = dt.name();
    let what = format!(
        "{s} {:?} {}/{} heads of {}, starts {:?}, window {:?}",
        c.fmt, c.n_heads, c.n_kv, c.hd, c.starts, c.window
    );
    // Deterministic: a second launch on the same backend (the counters back at 0) and a launch
    // on a fresh backend give the same bits.
    for (name, other) in [
        ("a second launch", &fused[1]),
        ("another backend", &again[0]),
    ] {
        for (i, (a, o)) in fused[0].0.iter().zip(&other.0).enumerate() {
            assert!(bits(a) == bits(o), "{what}: buffer {i} differs in {name}");
        }
    }
    let (f, p) = (&fused[0].0, &plain[0].0);
    assert!(
        bits(&f[0]) == bits(&p[0]),
        "{what}: the attention output differs from `attention`'s"
    );
    // The product: each output a sum of qw / 32 block terms in f32, rounded to the dtype; the
    // order differs, so a value may round one step apart. The residual adds that to values
    // of about 2.
    let scale = p[1].iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    let tol = 2e-5 + 2.0 * out_rtol(dt);
    let e = worst(&f[1], &p[1], tol * scale, tol);
    assert!(e <= 1.0, "{what}: product off by {e} of the tolerance");
    let e = worst(&f[2], &p[2], tol * (scale + 2.0), tol);
    assert!(e <= 1.0, "{what}: residual off by {e} of the tolerance");
    assert!(
        f[1].iter().any(|v| *v != 0.0),
        "{what}: the product is all zeros"
    );
    // The launches: one fused kernel; apart, attention (+ combine), then the folded GEMV.
    if fused[0].1.is_empty() {
        return; // a real device: no launch list
    }
    let fs = match c.fmt {
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        _ => "q8_0",
    };
    assert_eq!(
        fused[0].1,
        vec![format!("attention_out_{fs}_{s}")],
        "{what}: the fused launch"
    );
    let r = if c.starts.len() == 1 { 1 } else { 8 };
    let mut want = vec![format!("attention_{s}")];
    if c.split {
        want.push(format!("attention_combine_{s}"));
    }
    if !(c.hd.is_multiple_of(32)) {
        want.push(format!("quantize_q8_{s}"));
    }
    want.push(format!("gemv_fold_{fs}_r{r}_{s}"));
    assert_eq!(plain[0].1, want, "{what}: the launches apart");
}

pub fn attention_out_fold_matches_the_separate_launches(make: Make) {
    let cases = [
        // Four decodes of different lengths, groups of 4 query heads over 2 KV heads.
        Case {
            n_heads: 8,
            n_kv: 2,
            hd: 64,
            block_size: 16,
            starts: vec![20, 100, 3, 57],
            window: None,
            fmt: GgmlType::Q4_0,
            split: false,
        },
        // One query head per KV head (heads of 32), a window of 7 positions.
        Case {
            n_heads: 3,
            n_kv: 3,
            hd: 32,
            block_size: 16,
            starts: vec![40, 9, 0],
            window: Some(7),
            fmt: GgmlType::Q8_0,
            split: false,
        },
        // Long contexts on few blocks: split, merged inside the launch; the shorter sequence's
        // later splits see nothing.
        Case {
            n_heads: 4,
            n_kv: 2,
            hd: 128,
            block_size: 32,
            starts: vec![699, 300],
            window: None,
            fmt: GgmlType::Q4_1,
            split: true,
        },
        // Heads of 16 in groups of 2 (whole blocks of 32 per group), split through a window.
        Case {
            n_heads: 4,
            n_kv: 2,
            hd: 16,
            block_size: 16,
            starts: vec![600],
            window: Some(200),
            fmt: GgmlType::Q8_0,
            split: true,
        },
    ];
    for c in &cases {
        for dt in DTYPES {
            check(make, c, dt);
        }
    }
    // An int8 KV pool: the separate launches (attention_i8, the folded GEMV).
    let c = &cases[0];
    let fused = run(make, c, DType::F16, true, true, 1);
    let plain = run(make, c, DType::F16, false, true, 1);
    if let (Some(f), Some(p)) = (fused.first(), plain.first()) {
        assert!(f.0.iter().zip(&p.0).all(|(a, b)| bits(a) == bits(b)));
        if !f.1.is_empty() {
            assert_eq!(f.1, vec!["attention_i8_f16", "gemv_fold_q4_0_r8_f16"]);
        }
    }
}
