//! Dequantization checked against an independent oracle: random blocks of every k-quant and
//! legacy format, decoded by the `gguf` Python package (llama.cpp's gguf-py) into
//! tests/data/dequant_oracle.json.

use super::*;

fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ty_named(name: &str) -> GgmlType {
    [
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
    ]
    .into_iter()
    .find(|t| t.name() == name)
    .unwrap_or_else(|| panic!("unknown type {name}"))
}

#[test]
fn matches_gguf_py_oracle() {
    let text = include_str!("../../tests/data/dequant_oracle.json");
    let cases: serde_json::Value = serde_json::from_str(text).unwrap();
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 10);
    for case in cases {
        let ty = ty_named(case["type"].as_str().unwrap());
        let bytes = from_hex(case["hex"].as_str().unwrap());
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0f32; want.len()];
        dequantize_row(ty, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let tol = 1e-6 * w.abs().max(1e-3);
            assert!(
                (g - w).abs() <= tol,
                "{}: element {i}: got {g}, oracle {w}",
                ty.name()
            );
        }
    }
}

#[test]
fn plain_float_types() {
    let vals = [1.5f32, -2.25, 0.0, 65504.0];
    let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16b: Vec<u8> = vals
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    let bf16b: Vec<u8> = vals
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect();
    let mut out = [0f32; 4];
    dequantize_row(GgmlType::F32, &f32b, &mut out).unwrap();
    assert_eq!(out, vals);
    dequantize_row(GgmlType::F16, &f16b, &mut out).unwrap();
    assert_eq!(out, vals);
    dequantize_row(GgmlType::BF16, &bf16b, &mut out).unwrap();
    assert_eq!(&out[..3], &vals[..3]);
}

#[test]
fn q8_k_block() {
    let mut b = vec![0u8; 292];
    b[0..4].copy_from_slice(&0.5f32.to_le_bytes());
    for j in 0..256 {
        b[4 + j] = (j as i32 - 128) as i8 as u8;
    }
    let mut out = vec![0f32; 256];
    dequantize_row(GgmlType::Q8K, &b, &mut out).unwrap();
    for (j, v) in out.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 128.0) * 0.5);
    }
}

/// IQ4_NL: an f16 scale, then 16 bytes whose low nibbles index values 0..16 and high nibbles
/// values 16..32 in the fixed table.
#[test]
fn iq4_nl_block() {
    let mut b = vec![0u8; 18];
    b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
    for j in 0..16 {
        b[2 + j] = (j as u8) | (((15 - j) as u8) << 4);
    }
    let mut out = vec![0f32; 32];
    dequantize_row(GgmlType::IQ4NL, &b, &mut out).unwrap();
    let table = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    for j in 0..16 {
        assert_eq!(out[j], table[j] as f32 * 0.25, "value {j}");
        assert_eq!(out[16 + j], table[15 - j] as f32 * 0.25, "value {}", 16 + j);
    }
}

/// IQ4_XS: f16 `d`, the scales' high 2 bits (16 bits, 2 per sub-block), their low 4 bits (a
/// nibble per sub-block), then 8 sub-blocks of 16 bytes laid out as IQ4_NL's; each sub-block's
/// values are `d (scale - 32) table[index]`.
#[test]
fn iq4_xs_block() {
    let mut b = vec![0u8; 136];
    b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    // Sub-block j's 6-bit scale: 0, 9, 18, .., 63 (high bits j-dependent too).
    let scales: [u8; 8] = std::array::from_fn(|j| (9 * j) as u8);
    let mut high = 0u16;
    for (j, &s) in scales.iter().enumerate() {
        b[4 + j / 2] |= (s & 15) << (4 * (j % 2));
        high |= ((s >> 4) as u16) << (2 * j);
    }
    b[2..4].copy_from_slice(&high.to_le_bytes());
    for (i, q) in b[8..].iter_mut().enumerate() {
        *q = ((i * 7) % 16) as u8 | ((((i * 3) + 5) % 16) as u8) << 4;
    }
    let mut out = vec![0f32; 256];
    dequantize_row(GgmlType::IQ4XS, &b, &mut out).unwrap();
    let table = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    for j in 0..8 {
        let dl = 0.5 * (scales[j] as i32 - 32) as f32;
        for t in 0..16 {
            let i = 16 * j + t;
            assert_eq!(
                out[32 * j + t],
                dl * table[(i * 7) % 16] as f32,
                "sub-block {j}"
            );
            let hi = table[((i * 3) + 5) % 16] as f32;
            assert_eq!(out[32 * j + 16 + t], dl * hi, "sub-block {j}");
        }
    }
}

/// Bytes that are not a row of the asked length are an error naming the type and both lengths,
/// and leave the output untouched.
#[test]
fn wrong_lengths_are_errors() {
    let mut out = [7f32; 32];
    let e = dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a row of 32 Q8_0 values takes 34 bytes, not 33"
    );
    assert_eq!(out, [7.0; 32]);
    let e = dequantize_row(GgmlType::Q4K, &[0u8; 144], &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a whole number of its 256-value blocks"),
        "{e}"
    );
    let e = dequantize_row(GgmlType::F16, &[0u8; 3], &mut out[..1]).unwrap_err();
    assert!(e.to_string().contains("takes 2 bytes, not 3"), "{e}");
}
