//! Packing is checked against the reference dequantizer: every format's packed rows decode to the
//! same values (exactly for the lossless formats, within the 8-bit step for re-quantized ones).

use super::*;
use crate::quant::testing::random_ggml_rows;

const ALL: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

#[test]
fn packed_rows_decode_like_the_reference() {
    for ty in ALL {
        let k = 2 * 256;
        let rows = 21; // one full group and a partial one
        let bytes = random_ggml_rows(ty, rows, k, 11);
        let rb = ty.row_bytes(k).unwrap();
        let WeightMatrix::Packed(m) =
            WeightMatrix::from_ggml_parts(&[(ty, &bytes, rows)], k).unwrap()
        else {
            panic!("{} should pack", ty.name());
        };
        let lossy = PackFormat::for_type(ty).unwrap().1;
        assert_eq!(m.lossy, lossy);
        let mut want = vec![0f32; k];
        let mut got = vec![0f32; k];
        for r in 0..rows {
            ggml::dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut want);
            m.dequantize_row(r, &mut got);
            for b in 0..k / 32 {
                let blk = &want[b * 32..b * 32 + 32];
                let range = blk.iter().fold(0f32, |a, v| a.max(*v))
                    - blk.iter().fold(0f32, |a, v| a.min(*v));
                for j in 0..32 {
                    let (g, w) = (got[b * 32 + j], want[b * 32 + j]);
                    let tol = if lossy {
                        range / 255.0 * 0.51 + 1e-6
                    } else if m.format.f16_scales {
                        0.0
                    } else {
                        1e-6 * w.abs().max(1e-3)
                    };
                    assert!(
                        (g - w).abs() <= tol,
                        "{} row {r} value {}: packed {g} reference {w}",
                        ty.name(),
                        b * 32 + j
                    );
                }
            }
        }
    }
}

#[test]
fn fused_parts_stack_rows() {
    let k = 64;
    let a = random_ggml_rows(GgmlType::Q4_1, 32, k, 1);
    let b = random_ggml_rows(GgmlType::Q4_1, 16, k, 2);
    let WeightMatrix::Packed(m) =
        WeightMatrix::from_ggml_parts(&[(GgmlType::Q4_1, &a, 32), (GgmlType::Q4_1, &b, 16)], k)
            .unwrap()
    else {
        panic!()
    };
    assert_eq!(m.n, 48);
    let rb = GgmlType::Q4_1.row_bytes(k).unwrap();
    let mut want = vec![0f32; k];
    let mut got = vec![0f32; k];
    ggml::dequantize_row(GgmlType::Q4_1, &b[3 * rb..4 * rb], &mut want);
    m.dequantize_row(35, &mut got);
    assert_eq!(got, want);
    // Different formats cannot share a layout.
    let c = random_ggml_rows(GgmlType::Q8_0, 16, k, 3);
    assert!(WeightMatrix::from_ggml_parts(
        &[(GgmlType::Q4_1, &a, 32), (GgmlType::Q8_0, &c, 16)],
        k
    )
    .is_none());
}

#[test]
fn float_tensors_become_f32() {
    let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.25).collect();
    let bytes: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let WeightMatrix::F32 { n, k, data } =
        WeightMatrix::from_ggml_parts(&[(GgmlType::F16, &bytes, 2)], 32).unwrap()
    else {
        panic!()
    };
    assert_eq!((n, k), (2, 32));
    assert_eq!(data, vals);
}
