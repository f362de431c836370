//! Conformance case of the packed Q4_K GEMV (`NPU_SERVING_CUDA_KQUANTS=packed`): against the
//! F16-dequantized path (the default) and against Q4_K's 8-bit-activation arithmetic computed on
//! the host; the packed matrix holds exactly the file's bytes.

use super::{out_rtol, Make, DTYPES};
use crate::common::*;
use npu_backend::{Backend, HostTensor, Layout, View, ViewMut};
use npu_backend_cpu::quant::QuantizedActs;
use npu_backend_cuda::weights::MatrixKind;
use npu_backend_cuda::{KQuants, MatmulMode};
use npu_gguf::GgmlType;

/// Random Q4_K rows: random values quantized by the reference quantizer.
fn q4k_rows(rng: &mut Rng, rows: usize, k: usize) -> Vec<u8> {
    let rb = GgmlType::Q4K.row_bytes(k).unwrap();
    let mut out = vec![0u8; rows * rb];
    for r in 0..rows {
        let x = rng.vec(k, -1.0, 1.0);
        npu_gguf::quantize::quantize_row(GgmlType::Q4K, &x, &mut out[r * rb..(r + 1) * rb])
            .unwrap();
    }
    out
}

/// Q4_K times 8-bit activations as the kernel computes it, in f64: per sub-block of 32,
/// dx * sum_i w_i qx_i with w_i the dequantized weight (= d sc q - dmin m).
fn q4k_reference(w: &[f32], acts: &QuantizedActs, rows: usize, n: usize, k: usize) -> Vec<f32> {
    let nb = k / 32;
    let mut out = vec![0f32; rows * n];
    for r in 0..rows {
        for o in 0..n {
            let mut acc = 0f64;
            for b in 0..nb {
                let dot: f64 = (0..32)
                    .map(|i| w[o * k + b * 32 + i] as f64 * acts.qs[r * k + b * 32 + i] as f64)
                    .sum();
                acc += dot * acts.d[r * nb + b] as f64;
            }
            out[r * n + o] = acc as f32;
        }
    }
    out
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len().max(1) as f32).sqrt()
}

/// The packed Q4_K GEMV against the default F16 form and the host arithmetic, for f32, f16 and
/// bf16 activations, 1, 3, 8 and 11 rows (two launches), k = 768 and 45 outputs from two stacked
/// parts; device bytes equal the file's.
///
/// Tolerances: against the host's 8-bit-activation arithmetic, 1e-4 of the outputs' RMS plus
/// the output dtype's rounding (the kernel sums in f32 in another order); against the F16 path,
/// 2% of the outputs' RMS plus 2% relative (8-bit activations against f16/bf16 ones).
pub fn packed_q4k_gemv_matches_the_f16_path(make: Make) {
    let mut rng = Rng::new(51);
    let (k, n1, n2) = (768, 20, 25);
    let n = n1 + n2;
    let d1 = q4k_rows(&mut rng, n1, k);
    let d2 = q4k_rows(&mut rng, n2, k);
    let mut raw = d1.clone();
    raw.extend(&d2);
    let w = dequantized(GgmlType::Q4K, &raw, n, k);
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Quantized) else {
            return;
        };
        let parts = [
            HostTensor {
                ty: GgmlType::Q4K,
                data: &d1,
                rows: n1,
                cols: k,
            },
            HostTensor {
                ty: GgmlType::Q4K,
                data: &d2,
                rows: n2,
                cols: k,
            },
        ];
        // The default keeps F16.
        let f16m = b.load_matrix(&parts).unwrap().expect("one type stacks");
        assert_eq!(
            f16m.kind(),
            MatrixKind::Packed(npu_backend_cuda::kernels::WeightFormat::F16)
        );
        assert_eq!(b.matrix_bytes(&f16m), Some((n * k * 2) as u64));
        b.set_kquants(KQuants::Packed);
        let q4k = b.load_matrix(&parts).unwrap().expect("one type stacks");
        assert_eq!(q4k.kind(), MatrixKind::Q4K);
        assert_eq!(
            b.matrix_bytes(&q4k),
            Some(raw.len() as u64),
            "the file's bytes"
        );
        let s = npu_backend_cuda::kernels::act_suffix(dt).unwrap();
        for rows in [1, 3, 8, 11] {
            let x = rounded(&rng.vec(rows * k, -1.0, 1.0), dt);
            let xb = put(&mut b, dt, &x, rows, k);
            let xv = || View::new(&xb, Layout::new(0, rows, k, k).unwrap()).unwrap();
            let mut out_p = b.alloc(dt, rows * n).unwrap();
            let mut out_f = b.alloc(dt, rows * n).unwrap();
            take_launches(&b);
            b.matmul(xv(), &q4k, ViewMut::rows(&mut out_p, rows, n).unwrap())
                .unwrap();
            if let Some(got) = take_launches(&b) {
                let mut want = vec![format!("quantize_q8_{s}")];
                let mut left = rows;
                while left > 0 {
                    let r = if rows > 1 { 8 } else { 1 };
                    want.push(format!("gemv_q4_k_r{r}_{s}"));
                    left -= left.min(r);
                }
                assert_eq!(got, want, "{dt:?} {rows} rows");
            }
            b.matmul(xv(), &f16m, ViewMut::rows(&mut out_f, rows, n).unwrap())
                .unwrap();
            let got = get(&mut b, &out_p);
            let f16_path = get(&mut b, &out_f);
            let mut acts = QuantizedActs::new();
            acts.quantize(&x, rows, k);
            let host = q4k_reference(&w, &acts, rows, n, k);
            let scale = rms(&host);
            let e = worst(&got, &host, 1e-4 * scale, out_rtol(dt));
            assert!(
                e <= 1.0,
                "{dt:?} {rows} rows: packed Q4_K vs host arithmetic {e}"
            );
            let e = worst(&got, &f16_path, 0.02 * scale, 0.02);
            assert!(
                e <= 1.0,
                "{dt:?} {rows} rows: packed Q4_K vs the F16 path {e}"
            );
        }
    }
}
