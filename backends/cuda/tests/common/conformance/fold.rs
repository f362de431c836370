//! Conformance case of the GEMVs with their neighbours folded in (src/fold.rs): an RMS norm into
//! the next product, the residual add into the product before it, SwiGLU into the gate/up
//! product (with the down product's 8-bit activations), against the same ops launched one by
//! one (`set_fuse(false)`, each op checked against the CPU reference by the other cases) and
//! against the elementwise folds alone (`set_fold_gemv(false)`): every buffer the same bits, in
//! f32, f16 and bf16, for 1, 3 and 8 rows, rows of 256 and 320 values (the norm's block of 256
//! threads going round once and twice), each quantized weight format; and the launches named.
//! Also the rope and KV write folded into the Q/K/V product (`rms_norm_matmul_rope_kv_write`,
//! with and without Qwen3's head norms): the rotated rows, the normalised rows and the whole KV
//! pool the same bits.

use super::{Make, DTYPES};
use crate::common::*;
use npu_backend::{
    AttnGeometry, Backend, DType, HostTensor, KvSpec, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cuda::{CudaBackend, CudaMatrix, MatmulMode};
use npu_gguf::GgmlType;
use npu_model::{Rope, RopeStyle};

/// The Q/K/V-like product's outputs (not a multiple of 32: a partial last block); the output
/// product takes the first `AO` of them.
const A: usize = 72;
const AO: usize = 64;
/// The FFN width (gate/up pairs): three blocks of 32.
const FF: usize = 96;

fn matrix(b: &mut CudaBackend, ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> CudaMatrix {
    b.load_matrix(&[HostTensor {
        ty,
        data,
        rows,
        cols,
    }])
    .unwrap()
    .expect("one part always makes a matrix")
}

/// A decode layer's folded sequence on `b` (rows of `h` values): every buffer read back, and
/// the launches of each part.
fn run(b: &mut CudaBackend, dt: DType, rows: usize, h: usize) -> (Vec<Vec<f32>>, Vec<Vec<String>>) {
    let mut rng = Rng::new(70 + (rows * h) as u64);
    let x0 = rounded(&rng.vec(rows * h, -2.0, 2.0), dt);
    let qkv = random_tensor(&mut rng, GgmlType::Q8_0, A, h);
    let wo = random_tensor(&mut rng, GgmlType::Q4_0, h, AO);
    let gate_up = random_tensor(&mut rng, GgmlType::Q4_1, 2 * FF, h);
    let down = random_tensor(&mut rng, GgmlType::Q8_0, h, FF);
    let qkv_m = matrix(b, GgmlType::Q8_0, &qkv, A, h);
    let wo_m = matrix(b, GgmlType::Q4_0, &wo, h, AO);
    let gu_m = matrix(b, GgmlType::Q4_1, &gate_up, 2 * FF, h);
    let down_m = matrix(b, GgmlType::Q8_0, &down, h, FF);
    // The attention norm's weights in f32, the FFN norm's in bf16.
    let wa = put(b, DType::F32, &rng.vec(h, 0.5, 1.5), 1, h);
    let wf = rounded(&rng.vec(h, 0.5, 1.5), DType::BF16);
    let wf = put(b, DType::BF16, &wf, 1, h);
    let mut x = put(b, dt, &x0, rows, h);
    let mut xn = b.alloc(dt, rows * h).unwrap();
    let mut a = b.alloc(dt, rows * A).unwrap();
    let mut tmp = b.alloc(dt, rows * h).unwrap();
    let mut gu = b.alloc(dt, rows * 2 * FF).unwrap();
    let mut hb = b.alloc(dt, rows * FF).unwrap();
    let mut launched = Vec::new();
    take_launches(b);
    let mut part = |b: &CudaBackend| launched.push(take_launches(b).unwrap_or_default());
    b.rms_norm_matmul(
        View::rows(&x, rows, h).unwrap(),
        &wa,
        1e-5,
        ViewMut::rows(&mut xn, rows, h).unwrap(),
        &qkv_m,
        ViewMut::rows(&mut a, rows, A).unwrap(),
    )
    .unwrap();
    part(b);
    b.matmul_add(
        View::rows(&a, rows, A).unwrap().col_range(0, AO).unwrap(),
        &wo_m,
        ViewMut::rows(&mut tmp, rows, h).unwrap(),
        ViewMut::rows(&mut x, rows, h).unwrap(),
    )
    .unwrap();
    part(b);
    b.rms_norm_matmul_swiglu(
        View::rows(&x, rows, h).unwrap(),
        &wf,
        1e-6,
        ViewMut::rows(&mut xn, rows, h).unwrap(),
        &gu_m,
        ViewMut::rows(&mut gu, rows, 2 * FF).unwrap(),
        ViewMut::rows(&mut hb, rows, FF).unwrap(),
    )
    .unwrap();
    part(b);
    b.matmul_add(
        View::rows(&hb, rows, FF).unwrap(),
        &down_m,
        ViewMut::rows(&mut tmp, rows, h).unwrap(),
        ViewMut::rows(&mut x, rows, h).unwrap(),
    )
    .unwrap();
    part(b);
    let values = [&x, &xn, &a, &tmp, &gu, &hb]
        .into_iter()
        .map(|buf| get(b, buf))
        .collect();
    (values, launched)
}

pub fn gemv_folds_match_the_unfused_ones(make: Make) {
    for dt in DTYPES {
        for h in [256usize, 320] {
            for rows in [1usize, 3, 8] {
                let mut runs = Vec::new();
                for (fuse, fold) in [(true, true), (true, false), (false, false)] {
                    let Some(mut b) = make(dt, MatmulMode::Quantized) else {
                        return;
                    };
                    b.set_fuse(fuse);
                    b.set_fold_gemv(fold);
                    runs.push(run(&mut b, dt, rows, h));
                }
                let s = dt.name();
                let names = ["x", "xn", "a", "tmp", "gate/up", "swiglu"];
                for (what, (v, _)) in ["elementwise folds", "one op a launch"]
                    .iter()
                    .zip(&runs[1..])
                {
                    for ((name, f), p) in names.iter().zip(&runs[0].0).zip(v) {
                        let fb: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                        let pb: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                        assert!(
                            fb == pb,
                            "{s} {rows} rows of {h}: {name} differs between the GEMV folds and \
                             {what}"
                        );
                    }
                }
                let fl = &runs[0].1;
                if fl.iter().all(|l| l.is_empty()) {
                    continue; // a real device: no launch list
                }
                let r = if rows == 1 { 1 } else { 8 };
                let fold = |f: &str| format!("gemv_fold_{f}_r{r}_{s}");
                let gemv = |f: &str| format!("gemv_{f}_r{r}_{s}");
                let q = format!("quantize_q8_{s}");
                let want: Vec<Vec<String>> = vec![
                    vec![fold("q8_0")],
                    vec![q.clone(), fold("q4_0")],
                    vec![fold("q4_1")],
                    vec![fold("q8_0")],
                ];
                assert_eq!(fl, &want, "{s} {rows} rows of {h}, folded");
                let want_plain: Vec<Vec<String>> = vec![
                    vec![format!("rms_norm_{s}"), q.clone(), gemv("q8_0")],
                    vec![q.clone(), gemv("q4_0"), format!("add_{s}")],
                    vec![
                        format!("rms_norm_{s}"),
                        q.clone(),
                        gemv("q4_1"),
                        format!("swiglu_{s}"),
                    ],
                    vec![q.clone(), gemv("q8_0"), format!("add_{s}")],
                ];
                assert_eq!(
                    runs[2].1, want_plain,
                    "{s} {rows} rows of {h}, one op a launch"
                );
            }
        }
    }
}

/// One step of `rows` tokens after `start` cached ones through `rms_norm_matmul_rope_kv_write`
/// into layer 1 of a two-layer pool (4 query heads, 2 KV heads of 32; `rope` its style and
/// rotary dimensions): the Q/K/V rows, the normalised rows and the pool read back, and the
/// launches.
fn rope_run(
    b: &mut CudaBackend,
    dt: DType,
    rows: usize,
    start: usize,
    rope: (RopeStyle, usize),
    norms: bool,
) -> (Vec<Vec<f32>>, Vec<String>) {
    let (h, hd, n_heads, n_kv) = (256usize, 32usize, 4usize, 2usize);
    let w = (n_heads + 2 * n_kv) * hd;
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        rope: Rope {
            style: rope.0,
            dims: rope.1,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
    };
    b.init_kv(KvSpec {
        n_layers: 2,
        num_blocks: 8,
        block_size: 16,
        n_kv_heads: n_kv,
        head_dim: hd,
    })
    .unwrap();
    let table: Vec<u32> = (0..8).rev().collect();
    b.begin_step(&StepInputs {
        tokens: vec![0; rows],
        positions: (start..start + rows).map(|p| p as u32).collect(),
        slot_mapping: (start..start + rows)
            .map(|p| table[p / 16] * 16 + (p % 16) as u32)
            .collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: rows as u32,
            start_pos: start as u32,
        }],
        block_tables: table.clone(),
        max_blocks: table.len(),
        logit_rows: Vec::new(),
    })
    .unwrap();
    let mut rng = Rng::new(90 + (rows + start) as u64);
    let x = put(b, dt, &rounded(&rng.vec(rows * h, -2.0, 2.0), dt), rows, h);
    let wn = put(b, DType::F32, &rng.vec(h, 0.5, 1.5), 1, h);
    let m = random_tensor(&mut rng, GgmlType::Q4_1, w, h);
    let m = matrix(b, GgmlType::Q4_1, &m, w, h);
    let mut xn = b.alloc(dt, rows * h).unwrap();
    let mut qkv = b.alloc(dt, rows * w).unwrap();
    // Qwen3's head norms: the query heads' weights in f32, the key heads' in bf16.
    let qn = put(b, DType::F32, &rng.vec(hd, 0.5, 1.5), 1, hd);
    let kn = rounded(&rng.vec(hd, 0.5, 1.5), DType::BF16);
    let kn = put(b, DType::BF16, &kn, 1, hd);
    take_launches(b);
    b.rms_norm_matmul_rope_kv_write(
        View::rows(&x, rows, h).unwrap(),
        &wn,
        1e-5,
        ViewMut::rows(&mut xn, rows, h).unwrap(),
        &m,
        ViewMut::rows(&mut qkv, rows, w).unwrap(),
        &g,
        1,
        norms.then_some((&qn, &kn)),
    )
    .unwrap();
    let launched = take_launches(b).unwrap_or_default();
    let mut pool = vec![0u8; table.len() * b.kv_block_bytes()];
    b.kv_blocks_to_host(&table, &mut pool).unwrap();
    let pool: Vec<f32> = pool
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (vec![get(b, &qkv), get(b, &xn), pool], launched)
}

/// The rope and KV write folded into the Q/K/V product (each block one head): the same bits as
/// the norm, the product, `rope_kv_write` (elementwise folds), and as `rope` and `kv_write`
/// (one op a launch); interleaved pairs over the whole head and halves over part of it, 1 and 3
/// tokens, a step crossing a cache block.
pub fn gemv_rope_fold_matches_the_unfused_ones(make: Make) {
    for dt in DTYPES {
        for (rows, start) in [(1usize, 5usize), (3, 14)] {
            let cases = [(RopeStyle::Interleaved, 32), (RopeStyle::Halves, 16)]
                .into_iter()
                .flat_map(|rope| [(rope, false), (rope, true)]);
            for (rope, norms) in cases {
                let mut runs = Vec::new();
                for (fuse, fold) in [(true, true), (true, false), (false, false)] {
                    let Some(mut b) = make(dt, MatmulMode::Quantized) else {
                        return;
                    };
                    b.set_fuse(fuse);
                    b.set_fold_gemv(fold);
                    b.set_fold_rope(fold);
                    runs.push(rope_run(&mut b, dt, rows, start, rope, norms));
                }
                let s = dt.name();
                for (what, (v, _)) in ["elementwise folds", "one op a launch"]
                    .iter()
                    .zip(&runs[1..])
                {
                    for ((name, f), p) in ["qkv", "xn", "KV pool"].iter().zip(&runs[0].0).zip(v) {
                        let fb: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                        let pb: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                        assert!(
                            fb == pb,
                            "{s} {rows} rows {rope:?} (head norms {norms}): {name} differs \
                             between the GEMV folds and {what}"
                        );
                    }
                }
                if runs[0].1.is_empty() {
                    continue; // a real device: no launch list
                }
                let r = if rows == 1 { 1 } else { 8 };
                assert_eq!(
                    runs[0].1,
                    vec![format!("gemv_fold_q4_1_r{r}_{s}")],
                    "{s} {rows} rows, folded"
                );
                let mut plain = vec![
                    format!("rms_norm_{s}"),
                    format!("quantize_q8_{s}"),
                    format!("gemv_q4_1_r{r}_{s}"),
                ];
                if norms {
                    plain.extend([format!("rms_norm_heads_{s}"), format!("rms_norm_heads_{s}")]);
                }
                plain.extend([format!("rope_{s}"), format!("kv_write_{s}")]);
                assert_eq!(runs[2].1, plain, "{s} {rows} rows, one op a launch");
            }
        }
    }
}
