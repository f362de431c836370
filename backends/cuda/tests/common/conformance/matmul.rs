//! Conformance case of the matrix products: every weight format, activation dtype and matmul
//! mode against ggml's quantized arithmetic (GEMV path) or the exact product (cuBLAS path).

use super::{out_rtol, Make, DTYPES};
use crate::common::*;
use npu_backend::{Backend, DType, HostTensor, Layout, View, ViewMut};
use npu_backend_cpu::quant::QuantizedActs;
use npu_backend_cuda::MatmulMode;
use npu_gguf::GgmlType;

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
                // F32 matrices under f32 activations stay f32 (cuBLAS in every mode); other
                // types without a packed form are kept as F16.
                let f32_dense = ty == GgmlType::F32 && dt == DType::F32;
                if ty == GgmlType::F32 && mode != MatmulMode::Dequantized && !f32_dense {
                    w = rounded(&w, DType::F16);
                }
                let packed = matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
                // 1 row, 5 rows, 13 rows (two GEMV passes, or cuBLAS), a strided view, and 40
                // strided rows (the tiled tensor-core GEMM's ragged tile).
                for (rows, col0, ld) in [
                    (1, 0, k),
                    (5, 0, k),
                    (13, 0, k),
                    (3, 1, k + 3),
                    (40, 2, k + 5),
                ] {
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
                    let gemv_path = !f32_dense
                        && (mode == MatmulMode::Quantized
                            || (mode == MatmulMode::Auto && rows <= 8));
                    let mut acts = QuantizedActs::new();
                    acts.quantize(&xs, rows, k);
                    // The F16-weight GEMV meets f16 weights with f32 activations rounded to f16,
                    // as llama.cpp's CPU build does (f16 and bf16 ones as they are).
                    let xs = if ty == GgmlType::F16 && gemv_path && dt == DType::F32 {
                        rounded(&xs, DType::F16)
                    } else {
                        xs
                    };
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
                    let used_gemv = launched
                        .iter()
                        .any(|l| l.starts_with("gemv_") || l.starts_with("gemm_"));
                    assert_eq!(used_gemv, gemv_path, "{mode:?} rows {rows}: {launched:?}");
                    // More rows than one GEMV pass: the int8 tensor-core GEMM (emulated here).
                    let used_mma = launched.iter().any(|l| l.starts_with("gemm_"));
                    assert_eq!(
                        used_mma,
                        gemv_path && packed && rows > 8,
                        "{mode:?} rows {rows}: {launched:?}"
                    );
                    // From 33 rows the tiled one (kernels/gemm_tiled.cu).
                    let used_tiled = launched.iter().any(|l| l.starts_with("gemm_tiled_"));
                    assert_eq!(
                        used_tiled,
                        used_mma && rows >= 33,
                        "{mode:?} rows {rows}: {launched:?}"
                    );
                    let quantized_acts = launched.iter().any(|l| l.starts_with("quantize_q8"));
                    assert_eq!(quantized_acts, gemv_path && packed, "{launched:?}");
                }
            }
        }
    }
}

/// Quantized products do not depend on how many rows share a step: a step of many rows (the
/// int8 tensor-core GEMMs where the device has them: `gemm_*` from 9 rows, the tiled
/// `gemm_tiled_*` from 33) gives every row the bits a one-row step (the GEMV) gives it. Odd sizes
/// on purpose: outputs not a multiple of either tile (60; 136: two full 64-output tiles and a
/// ragged one), more blocks per row than a warp has lanes (37, an odd count: the tiled kernel's
/// last stage of 2 blocks is half full), fewer (5: lane classes without a block), rows not a
/// multiple of the tiles (9, 17, 37, 100; 64 and 512 fill them).
pub fn quantized_matmul_is_batch_invariant(make: Make) {
    let mut rng = Rng::new(11);
    for (n, k, row_counts) in [
        (60, 32 * 37, &[37, 9, 17, 64, 100, 512][..]),
        (136, 32 * 5, &[9, 37, 64, 100][..]),
    ] {
        batch_invariant_at(make, &mut rng, n, k, row_counts);
    }
}

fn batch_invariant_at(make: Make, rng: &mut Rng, n: usize, k: usize, row_counts: &[usize]) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Quantized) else {
            return;
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let data = random_tensor(rng, ty, n, k);
            let m = b
                .load_matrix(&[HostTensor {
                    ty,
                    data: &data,
                    rows: n,
                    cols: k,
                }])
                .unwrap()
                .expect("one part");
            for &rows in row_counts {
                let x = rounded(&rng.vec(rows * k, -2.0, 2.0), dt);
                let xb = put(&mut b, dt, &x, rows, k);
                let mut all = b.alloc(dt, rows * n).unwrap();
                take_launches(&b);
                b.matmul(
                    View::new(&xb, Layout::new(0, rows, k, k).unwrap()).unwrap(),
                    &m,
                    ViewMut::new(&mut all, Layout::new(0, rows, n, n).unwrap()).unwrap(),
                )
                .unwrap();
                if let Some(l) = take_launches(&b) {
                    let want = if rows >= 33 { "gemm_tiled_" } else { "gemm_q" };
                    assert!(
                        l.iter().any(|l| l.starts_with(want)),
                        "{rows} rows did not take {want}*: {l:?}"
                    );
                }
                let many = get(&mut b, &all);
                for r in 0..rows {
                    let mut one = b.alloc(dt, n).unwrap();
                    b.matmul(
                        View::new(&xb, Layout::new(r * k, 1, k, k).unwrap()).unwrap(),
                        &m,
                        ViewMut::new(&mut one, Layout::new(0, 1, n, n).unwrap()).unwrap(),
                    )
                    .unwrap();
                    let single = get(&mut b, &one);
                    for o in 0..n {
                        assert_eq!(
                            many[r * n + o].to_bits(),
                            single[o].to_bits(),
                            "{} {} rows {rows}: row {r} output {o}: {} in a step of {rows} rows, \
                             {} alone",
                            ty.name(),
                            dt.name(),
                            many[r * n + o],
                            single[o]
                        );
                    }
                }
            }
        }
    }
}

/// The wide GEMV (`gemv_wide_*`, `NPU_SERVING_CUDA_GEMV=wide`) gives the plain one's bits: every
/// quantized format, activation dtype, 1..8 rows (both row variants), and block counts per row
/// that leave each lane's last group of four short in different ways (5: every lane in the
/// tail; 37; 128: whole groups only; 131: one tail block on lanes 0..2; 300: two groups and one
/// or two tail blocks), 9 outputs (a partly idle block of warps).
pub fn wide_gemv_matches_the_plain_one(make: Make) {
    use npu_backend_cuda::GemvVariant;
    let mut rng = Rng::new(29);
    let n = 9;
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Quantized) else {
            return;
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for nb in [5, 37, 128, 131, 300] {
                let k = 32 * nb;
                let data = random_tensor(&mut rng, ty, n, k);
                let m = b
                    .load_matrix(&[HostTensor {
                        ty,
                        data: &data,
                        rows: n,
                        cols: k,
                    }])
                    .unwrap()
                    .expect("one part");
                for rows in 1..=8 {
                    let x = rounded(&rng.vec(rows * k, -2.0, 2.0), dt);
                    let xb = put(&mut b, dt, &x, rows, k);
                    let mut outs = Vec::new();
                    for v in [GemvVariant::Plain, GemvVariant::Wide] {
                        b.set_gemv_variant(v);
                        let mut out = b.alloc(dt, rows * n).unwrap();
                        take_launches(&b);
                        b.matmul(
                            View::new(&xb, Layout::new(0, rows, k, k).unwrap()).unwrap(),
                            &m,
                            ViewMut::new(&mut out, Layout::new(0, rows, n, n).unwrap()).unwrap(),
                        )
                        .unwrap();
                        if let Some(l) = take_launches(&b) {
                            let wide = l.iter().any(|l| l.starts_with("gemv_wide_"));
                            assert_eq!(wide, v == GemvVariant::Wide, "{v:?}: {l:?}");
                        }
                        outs.push(get(&mut b, &out));
                    }
                    b.set_gemv_variant(GemvVariant::Plain);
                    for (i, (p, w)) in outs[0].iter().zip(&outs[1]).enumerate() {
                        assert_eq!(
                            p.to_bits(),
                            w.to_bits(),
                            "{} {} k {k} rows {rows}: element {i}: plain {p}, wide {w}",
                            ty.name(),
                            dt.name()
                        );
                    }
                }
            }
        }
    }
}
