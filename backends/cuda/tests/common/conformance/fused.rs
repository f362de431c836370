//! Conformance case of the folded launches (src/fused.rs): the residual add folded into the next
//! RMS norm (`add_rms_norm`), and the 8-bit activations written by the kernel that produces a
//! quantized product's input (rms_norm, add_rms_norm, swiglu; and reused by the next product of
//! the same rows), against the same ops launched one by one (`set_fuse(false)`, each op checked
//! against the CPU reference by the other cases): the same bits, and the launches named; and the
//! attention output's 8-bit form, written by `attention` or `attention_combine`.

use super::{Make, DTYPES};
use crate::common::*;
use npu_backend::{
    AttnGeometry, Backend, DType, HostSlice, HostTensor, KvSpec, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cuda::{CudaBackend, CudaMatrix, MatmulMode};
use npu_gguf::GgmlType;
use npu_model::{Rope, RopeStyle};

const H: usize = 256;
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

/// The layer-shaped sequence on `b`; every buffer read back, and the launches of each part.
fn run(b: &mut CudaBackend, dt: DType, rows: usize) -> (Vec<Vec<f32>>, Vec<Vec<String>>) {
    let mut rng = Rng::new(40 + rows as u64);
    let x0 = rounded(&rng.vec(rows * H, -2.0, 2.0), dt);
    let y0 = rounded(&rng.vec(rows * H, -2.0, 2.0), dt);
    let wv = rng.vec(H, 0.5, 1.5);
    let gate_up = random_tensor(&mut rng, GgmlType::Q8_0, 2 * FF, H);
    let side = random_tensor(&mut rng, GgmlType::Q4_1, 40, H);
    let down = random_tensor(&mut rng, GgmlType::Q4_0, H, FF);
    let gu_m = matrix(b, GgmlType::Q8_0, &gate_up, 2 * FF, H);
    let side_m = matrix(b, GgmlType::Q4_1, &side, 40, H);
    let down_m = matrix(b, GgmlType::Q4_0, &down, H, FF);
    let w = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: bytemuck::cast_slice(&wv),
            rows: 1,
            cols: H,
        })
        .unwrap();
    let mut x = put(b, dt, &x0, rows, H);
    let y = put(b, dt, &y0, rows, H);
    let mut xn = b.alloc(dt, rows * H).unwrap();
    let mut gu = b.alloc(dt, rows * 2 * FF).unwrap();
    let mut so = b.alloc(dt, rows * 40).unwrap();
    let mut hb = b.alloc(dt, rows * FF).unwrap();
    let mut od = b.alloc(dt, rows * H).unwrap();
    let mut late = b.alloc(dt, rows * 2 * FF).unwrap();
    let mut launched = Vec::new();
    take_launches(b);
    let mut part = |b: &CudaBackend| launched.push(take_launches(b).unwrap_or_default());
    // The residual add and the next norm, then two products of the normed rows.
    b.add_rms_norm(
        ViewMut::rows(&mut x, rows, H).unwrap(),
        View::rows(&y, rows, H).unwrap(),
        &w,
        1e-5,
        ViewMut::rows(&mut xn, rows, H).unwrap(),
    )
    .unwrap();
    part(b);
    b.matmul(
        View::rows(&xn, rows, H).unwrap(),
        &gu_m,
        ViewMut::rows(&mut gu, rows, 2 * FF).unwrap(),
    )
    .unwrap();
    part(b);
    b.matmul(
        View::rows(&xn, rows, H).unwrap(),
        &side_m,
        ViewMut::rows(&mut so, rows, 40).unwrap(),
    )
    .unwrap();
    part(b);
    // SwiGLU of the two halves, then its product.
    let g = View::rows(&gu, rows, 2 * FF).unwrap();
    b.swiglu(
        g.col_range(0, FF).unwrap(),
        g.col_range(FF, FF).unwrap(),
        ViewMut::rows(&mut hb, rows, FF).unwrap(),
    )
    .unwrap();
    part(b);
    b.matmul(
        View::rows(&hb, rows, FF).unwrap(),
        &down_m,
        ViewMut::rows(&mut od, rows, H).unwrap(),
    )
    .unwrap();
    part(b);
    // A norm whose output is then overwritten (an upload) before the product: the product must
    // quantize what is there now, not what the norm wrote.
    b.rms_norm(
        View::rows(&x, rows, H).unwrap(),
        &w,
        1e-5,
        ViewMut::rows(&mut xn, rows, H).unwrap(),
    )
    .unwrap();
    b.upload(
        HostSlice::F32(&y0),
        ViewMut::rows(&mut xn, rows, H).unwrap(),
    )
    .unwrap();
    b.matmul(
        View::rows(&xn, rows, H).unwrap(),
        &gu_m,
        ViewMut::rows(&mut late, rows, 2 * FF).unwrap(),
    )
    .unwrap();
    part(b);
    let values = [&x, &xn, &gu, &so, &hb, &od, &late]
        .into_iter()
        .map(|buf| get(b, buf))
        .collect();
    (values, launched)
}

pub fn fused_launches_match_the_unfused_ones(make: Make) {
    for dt in DTYPES {
        for rows in [1usize, 3] {
            let Some(mut fused) = make(dt, MatmulMode::Quantized) else {
                return;
            };
            let Some(mut plain) = make(dt, MatmulMode::Quantized) else {
                return;
            };
            plain.set_fuse(false);
            let (fv, fl) = run(&mut fused, dt, rows);
            let (pv, pl) = run(&mut plain, dt, rows);
            let names = ["x", "xn", "gate/up", "side", "swiglu", "down", "late"];
            for ((name, f), p) in names.iter().zip(&fv).zip(&pv) {
                let fb: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                let pb: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                assert!(
                    fb == pb,
                    "{} {rows} rows: {name} differs when fused",
                    dt.name()
                );
            }
            if fl.iter().all(|l| l.is_empty()) {
                continue; // a real device: no launch list
            }
            let s = dt.name();
            let gemv = |f: &str| format!("gemv_{f}_r{}_{s}", if rows == 1 { 1 } else { 8 });
            let q = format!("quantize_q8_{s}");
            let want_fused: Vec<Vec<String>> = vec![
                vec![format!("add_rms_norm_{s}")],
                vec![gemv("q8_0")],
                vec![gemv("q4_1")],
                vec![format!("swiglu_{s}")],
                vec![gemv("q4_0")],
                vec![format!("rms_norm_{s}"), q.clone(), gemv("q8_0")],
            ];
            let want_plain: Vec<Vec<String>> = vec![
                vec![format!("add_{s}"), format!("rms_norm_{s}")],
                vec![q.clone(), gemv("q8_0")],
                vec![q.clone(), gemv("q4_1")],
                vec![format!("swiglu_{s}")],
                vec![q.clone(), gemv("q4_0")],
                vec![format!("rms_norm_{s}"), q.clone(), gemv("q8_0")],
            ];
            assert_eq!(fl, want_fused, "{s} {rows} rows, fused");
            assert_eq!(pl, want_plain, "{s} {rows} rows, one op a launch");
        }
    }
}

/// One decode over `start` cached positions (4 query heads on 1 KV head of 128): its Q/K/V row
/// through `rope_kv_write` (with `head_norms`, `norm_rope_kv_write`: Q heads normalised by f32
/// weights, K heads by bf16 ones, first), attention, and its output straight into a Q8_0
/// product; the rotated row, the cache, the attention output and the product read back, and the
/// launches of each.
fn attention_run(
    b: &mut CudaBackend,
    dt: DType,
    start: usize,
    rope: (RopeStyle, usize),
    head_norms: bool,
) -> (Vec<Vec<f32>>, Vec<Vec<String>>) {
    let spec = KvSpec {
        n_layers: 1,
        num_blocks: 24,
        block_size: 32,
        n_kv_heads: 1,
        head_dim: 128,
    };
    let (hd, n_heads) = (128, 4);
    let g = AttnGeometry {
        n_heads,
        n_kv_heads: 1,
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
    let mut rng = Rng::new(60 + start as u64);
    let wo = random_tensor(&mut rng, GgmlType::Q8_0, 64, n_heads * hd);
    let wo = matrix(b, GgmlType::Q8_0, &wo, 64, n_heads * hd);
    b.init_kv(spec).unwrap();
    let table: Vec<u32> = (0..22).rev().collect();
    let step = |from: usize, n: usize| StepInputs {
        tokens: vec![0; n],
        positions: (from..from + n).map(|p| p as u32).collect(),
        slot_mapping: (from..from + n)
            .map(|p| table[p / 32] * 32 + (p % 32) as u32)
            .collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: from as u32,
        }],
        block_tables: table.clone(),
        max_blocks: table.len(),
        logit_rows: Vec::new(),
    };
    let mut launched = Vec::new();
    let qw = n_heads * hd;
    let mut out = b.alloc(dt, qw).unwrap();
    let mut o = b.alloc(dt, 64).unwrap();
    b.begin_step(&step(0, start)).unwrap();
    let kv = rounded(&rng.vec(start * 2 * hd, -1.5, 1.5), dt);
    let kvb = put(b, dt, &kv, start, 2 * hd);
    let v = View::rows(&kvb, start, 2 * hd).unwrap();
    b.kv_write(
        v.col_range(0, hd).unwrap(),
        v.col_range(hd, hd).unwrap(),
        &g,
        0,
    )
    .unwrap();
    // The decode token: rope and the KV write of its Q/K/V row, then attention over it all.
    b.begin_step(&step(start, 1)).unwrap();
    let w = qw + 2 * hd;
    let mut qkv = put(b, dt, &rounded(&rng.vec(w, -1.5, 1.5), dt), 1, w);
    if head_norms {
        let wq = rng.vec(hd, 0.5, 1.5);
        let wq = b
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(&wq),
                rows: 1,
                cols: hd,
            })
            .unwrap();
        let wk = rounded(&rng.vec(hd, 0.5, 1.5), DType::BF16);
        let wk = put(b, DType::BF16, &wk, 1, hd);
        take_launches(b);
        b.norm_rope_kv_write(
            ViewMut::rows(&mut qkv, 1, w).unwrap(),
            &wq,
            &wk,
            1e-6,
            &g,
            0,
        )
        .unwrap();
    } else {
        take_launches(b);
        b.rope_kv_write(ViewMut::rows(&mut qkv, 1, w).unwrap(), &g, 0)
            .unwrap();
    }
    launched.push(take_launches(b).unwrap_or_default());
    b.attention(
        View::rows(&qkv, 1, w).unwrap().col_range(0, qw).unwrap(),
        &g,
        0,
        ViewMut::rows(&mut out, 1, qw).unwrap(),
    )
    .unwrap();
    launched.push(take_launches(b).unwrap_or_default());
    b.matmul(
        View::rows(&out, 1, qw).unwrap(),
        &wo,
        ViewMut::rows(&mut o, 1, 64).unwrap(),
    )
    .unwrap();
    launched.push(take_launches(b).unwrap_or_default());
    let mut pool = vec![0u8; table.len() * b.kv_block_bytes()];
    b.kv_blocks_to_host(&table, &mut pool).unwrap();
    let pool: Vec<f32> = pool
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (vec![get(b, &qkv), pool, get(b, &out), get(b, &o)], launched)
}

/// `rope_kv_write` (rope and the KV write in one launch; interleaved pairs over the whole head,
/// then halves over part of it), `norm_rope_kv_write` (Qwen3's per-head Q and K norms too, in
/// the same launch), and the attention output's 8-bit form written by `attention` (one split)
/// or by `attention_combine` (a long context split): the same bits (rotated rows, cache,
/// attention, product) as `rms_norm_heads`, `rope`, `kv_write` and `quantize_q8` launched apart.
pub fn attention_writes_the_output_projections_activations(make: Make) {
    let styles = [(RopeStyle::Interleaved, 128), (RopeStyle::Halves, 64)];
    let cases = [(20usize, false), (699, true)].into_iter().zip(styles);
    let cases: Vec<_> = [false, true]
        .into_iter()
        .flat_map(|norms| cases.clone().map(move |c| (c, norms)))
        .collect();
    for dt in DTYPES {
        for &(((start, split), rope), norms) in &cases {
            let Some(mut fused) = make(dt, MatmulMode::Quantized) else {
                return;
            };
            let Some(mut plain) = make(dt, MatmulMode::Quantized) else {
                return;
            };
            plain.set_fuse(false);
            let (fv, fl) = attention_run(&mut fused, dt, start, rope, norms);
            let (pv, pl) = attention_run(&mut plain, dt, start, rope, norms);
            let s = dt.name();
            let names = ["rotated row", "KV cache", "attention", "product"];
            for (name, (f, p)) in names.iter().zip(fv.iter().zip(&pv)) {
                let fb: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
                let pb: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                assert!(
                    fb == pb,
                    "{s} after {start} (head norms {norms}): the {name} differs when fused"
                );
            }
            if fl.iter().all(|l| l.is_empty()) {
                continue; // a real device: no launch list
            }
            let mut att = vec![format!("attention_{s}")];
            if split {
                att.push(format!("attention_combine_{s}"));
            }
            let gemv = format!("gemv_q8_0_r1_{s}");
            let rope_kv = match norms {
                false => vec![format!("rope_kv_write_{s}")],
                true => vec![format!("norm_rope_kv_write_{s}")],
            };
            assert_eq!(
                fl,
                vec![rope_kv, att.clone(), vec![gemv.clone()]],
                "{s} after {start} (head norms {norms})"
            );
            let mut apart = vec![format!("rope_{s}"), format!("kv_write_{s}")];
            if norms {
                let n = format!("rms_norm_heads_{s}");
                apart.splice(0..0, [n.clone(), n]);
            }
            let q8 = format!("quantize_q8_{s}");
            assert_eq!(
                pl,
                vec![apart, att, vec![q8, gemv]],
                "{s} after {start} (head norms {norms}), one op a launch"
            );
        }
    }
}
