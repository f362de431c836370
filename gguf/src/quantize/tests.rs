//! Tests of `quantize`: byte-exactness against llama.cpp's reference quantizers (golden SHA-256s
//! and explicit rows from `scripts/quant-golden.sh`), the fast K-quant search against the plain
//! one bit for bit, round-trip error, threading, and errors.

use sha2::{Digest, Sha256};

use super::kquants::{search_dispatched, search_plain, search_portable};
use super::*;
use crate::quants::dequantize_row;

const ROWS: usize = 4096;
const COLS: usize = 256;
const TYPES: [GgmlType; 5] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// The harness's splitmix64 stream.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1), exactly representable.
    fn uni(&mut self) -> f32 {
        (self.next() >> 40) as f32 / 8_388_608.0 - 1.0
    }
}

fn pow2(e: i32) -> f32 {
    2.0f32.powi(e)
}

/// The rows of `scripts/quant-golden.sh`'s harness (its `fill`), in the same order of draws.
fn golden_rows() -> Vec<f32> {
    let mut st = Stream(0x5155_414E_5447_4F4C);
    let mut x = vec![0.0f32; ROWS * COLS];
    for (r, row) in x.chunks_exact_mut(COLS).enumerate() {
        let s = pow2((st.next() % 41) as i32 - 20);
        match r % 12 {
            0 => row.iter_mut().for_each(|v| *v = (st.uni() + st.uni()) * s),
            1 => row.iter_mut().for_each(|v| *v = st.uni() * 1e-30),
            2 => row.iter_mut().for_each(|v| *v = st.uni() * 6e4),
            3 => {}
            4 => {
                row.iter_mut().for_each(|v| *v = st.uni() * 0.01 * s);
                let at = (st.next() % COLS as u64) as usize;
                row[at] = if st.uni() < 0.0 { -50.0 } else { 50.0 } * s;
            }
            5 => row.iter_mut().for_each(|v| *v = -st.uni().abs() * s),
            6 => row.iter_mut().for_each(|v| *v = st.uni().abs() * s),
            7 => {
                for b in row.chunks_exact_mut(32) {
                    let bs = pow2((st.next() % 41) as i32 - 30);
                    b.iter_mut().for_each(|v| *v = st.uni() * bs);
                }
            }
            8 => {
                let c = st.uni() * s;
                row.fill(c);
            }
            9 => row
                .iter_mut()
                .for_each(|v| *v = ((st.next() % 16) as i32 - 8) as f32 * 0.125 * s),
            10 => {
                for v in row.iter_mut() {
                    if st.next().is_multiple_of(8) {
                        *v = st.uni() * s;
                    }
                }
            }
            _ => {
                let t = if r % 24 == 11 { 1e-40f32 } else { 1e20 };
                row.iter_mut().for_each(|v| *v = st.uni() * t);
            }
        }
    }
    x
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// `scripts/quant-golden.sh` on llama.cpp 0.3.36 (llama-cpp-python's vendored copy), x86-64.
const INPUT_SHA256: &str = "91ac78c10d3bffc2133f0a945f7eb36de6ee8dbf1cbf753bbd7740d51db5573e";
const GOLDEN_SHA256: [(GgmlType, &str); 5] = [
    (
        GgmlType::Q8_0,
        "31e1758bd4ceb11fe1ad32fc7b9e4dab1f758911f6d3f6050d331b167f6e5874",
    ),
    (
        GgmlType::Q4_0,
        "07fc9c604d1f9a89b8d5333ad7a1072aedfdc66d8d53c269b4cf67582b1a4233",
    ),
    (
        GgmlType::Q4K,
        "b01a41996a432fe3d1bca264ecb595fa0d7a60bdfa401763c349b459d31384c8",
    ),
    (
        GgmlType::Q5K,
        "60cdcfd46a5831788d1ce9dcac12faf21a6ed1ab5c3feb3e0e0df2b9b9805d3c",
    ),
    (
        GgmlType::Q6K,
        "2b87daa3137bf8e38dd6d5cbdee1ecddba6148a671e1e98f01cd69dcc6044bdf",
    ),
];

/// The explicit row x_i = ((37 i) mod 101 − 50)/64 + i/512 (its first block for Q8_0/Q4_0).
fn explicit_row() -> Vec<f32> {
    (0..256)
        .map(|i| ((37 * i) % 101 - 50) as f32 / 64.0 + i as f32 / 512.0)
        .collect()
}

const EXPLICIT: [(GgmlType, &str); 5] = [
    (GgmlType::Q8_0, "c61e8ae239a2fa52bb136ad32b94ec44ad045cc51d75de359ff64eb70f66d0277fe8"),
    (GgmlType::Q4_0, "b8ae2fca641ea853ec9731db752fb9640da8"),
    (GgmlType::Q4K, "ca164722fffdfdfdbfb7b2707d4d0d7cb0157bc1378de349ae056ac1267cd2389df459bf156bc1278ce348aef46abf16378ce248ae046ac0267bd1379df359bf156ac1268ce248aef469bf157bd1379d9df459bf157bd1378ce348ae046ac0267cd2379df359bf157bc1268ce248aef4056bc1278ce3489ef45ab0167cd2378de349af056bc1268cd2389ef45abf167b"),
    (GgmlType::Q5K, "f5125b22fffafbfabfb6726f692bfa59326c9936cc9366c9b36499324c9926cc9366c9336c99364c9b66cdb366d9336c602be6935e19d6814c09c4813cf7b47f2ae7a26d1ad5935d08c6804bf9b37e3c5d19d5814c08c4803bf7b37f2ae6a26d1ad5915d08c4804cf8b37f3bf7a36e2a2ce7a36f2bd7925e1ac5814d09b5703cf8a36f2bd7a35f1ad6814d09c5813df80ac6824e09c5713df8a4602ce8a35f1bd7824e0ac6813df9b5602ce8a46f1bd7"),
    (GgmlType::Q6K, "e198ef873e862e752cc41bc46bb26a01591e39f3b8e3a8628d420c27fc16d196be793067224900cbf2ad649b561d34ff18e3b7b296616c301b16eae5c0949f63c5a492705f4d2c0af8d7c5a382705f3d2a2a37d5e58290a04d5d5a080815c3c362819e2d4a59e8f514a4b0506c7c0b2827c7d373829e3e4a4af9f605a5b15160904d2a904de7903aa74d3a904d27900ae45239944e29934e249309a44239904e9442259049245209144229944a259249245209944225904a245209245209944251a9b5a6a9a2a39c979a8f8e98868086110d"),
];

fn quantized(ty: GgmlType, x: &[f32], cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / cols * ty.row_bytes(cols).unwrap()];
    quantize_rows(ty, x, cols, &mut out, 2).unwrap();
    out
}

#[test]
fn golden_inputs_are_the_harness_inputs() {
    let x = golden_rows();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(sha256_hex(&bytes), INPUT_SHA256);
}

#[test]
fn matches_llama_cpp_reference_quantizers_byte_for_byte() {
    let x = golden_rows();
    for (ty, want) in GOLDEN_SHA256 {
        assert_eq!(sha256_hex(&quantized(ty, &x, COLS)), want, "{}", ty.name());
    }
}

#[test]
fn explicit_rows_match_llama_cpp() {
    let x = explicit_row();
    for (ty, want) in EXPLICIT {
        let n = ty.block_len();
        let mut out = vec![0u8; ty.block_bytes()];
        quantize_row(ty, &x[..n], &mut out).unwrap();
        assert_eq!(out, hex(want), "{}", ty.name());
        quantize_row_reference(ty, &x[..n], &mut out).unwrap();
        assert_eq!(out, hex(want), "{} (reference form)", ty.name());
    }
}

#[test]
fn reference_form_matches_golden() {
    // The plain K-quant search over the golden rows gives the golden bytes too.
    let x = golden_rows();
    for (ty, want) in GOLDEN_SHA256 {
        let rb = ty.row_bytes(COLS).unwrap();
        let mut out = vec![0u8; ROWS * rb];
        for (xr, or) in x.chunks_exact(COLS).zip(out.chunks_exact_mut(rb)) {
            quantize_row_reference(ty, xr, or).unwrap();
        }
        assert_eq!(sha256_hex(&out), want, "{}", ty.name());
    }
}

/// Random super-blocks of many shapes, including ties and repeated values.
/// Block scales are 2^e for e in `low..low + span`.
fn random_blocks(seed: u64, n: usize, low: i32, span: u64) -> Vec<f32> {
    let mut st = Stream(seed);
    let mut x = vec![0.0f32; n * 256];
    for b in x.chunks_exact_mut(256) {
        let kind = st.next() % 4;
        let s = pow2((st.next() % span) as i32 + low);
        for v in b.iter_mut() {
            *v = match kind {
                0 => st.uni() * s,
                1 => ((st.next() % 7) as f32 - 3.0) * s,
                2 => (st.uni() * 0.5 + 0.6) * s,
                _ => st.uni() * st.uni() * st.uni() * s,
            };
        }
    }
    x
}

#[test]
fn lane_search_equals_plain_search_bit_for_bit() {
    let mut x = golden_rows();
    x.extend(random_blocks(7, 2000, -40, 61));
    for q5 in [false, true] {
        for (b, blk) in x.chunks_exact(256).enumerate() {
            let plain = search_plain(q5, blk);
            for (form, got) in [
                ("portable", search_portable(q5, blk)),
                ("dispatched", search_dispatched(q5, blk)),
            ] {
                let bits = |a: [f32; 8]| a.map(f32::to_bits);
                assert_eq!(
                    bits(got.0),
                    bits(plain.0),
                    "{form} scales, block {b} q5={q5}"
                );
                assert_eq!(bits(got.1), bits(plain.1), "{form} mins, block {b} q5={q5}");
                assert_eq!(got.2, plain.2, "{form} levels, block {b} q5={q5}");
            }
        }
    }
}

#[test]
fn round_trip_error_is_within_the_format() {
    // Scales where f16 d and dmin stay normal numbers, as in real weights.
    let x = random_blocks(11, 64, 0, 8);
    // The worst error each format allows, relative to the largest magnitude of its block (32
    // values for Q8_0 and Q4_0, 256 for the K-quants): half a step of amax/127 for Q8_0; a
    // whole step amax/8 for Q4_0, whose levels -8..7 clip the side opposite the largest value;
    // for the K-quants half a step of the sub-block's range plus the 6-/8-bit scale rounding.
    for (ty, tol) in [
        (GgmlType::Q8_0, 0.0045),
        (GgmlType::Q4_0, 0.126),
        (GgmlType::Q4K, 0.10),
        (GgmlType::Q5K, 0.05),
        (GgmlType::Q6K, 0.03),
    ] {
        let bl = ty.block_len();
        let mut q = vec![0u8; ty.row_bytes(256).unwrap()];
        let mut y = vec![0.0f32; 256];
        let mut seen = 0.0f32;
        for blk in x.chunks_exact(256) {
            quantize_row(ty, blk, &mut q).unwrap();
            dequantize_row(ty, &q, &mut y).unwrap();
            for (xb, yb) in blk.chunks_exact(bl).zip(y.chunks_exact(bl)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let worst = xb
                    .iter()
                    .zip(yb)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= tol * amax,
                    "{}: error {worst} against max {amax}",
                    ty.name()
                );
                seen = seen.max(worst / amax);
            }
        }
        eprintln!("{}: worst relative error {seen}", ty.name());
    }
}

#[test]
fn rows_equal_row_by_row_for_any_thread_count() {
    let x = random_blocks(3, 21, -40, 61); // 21 rows of 256, an odd count
    for ty in TYPES {
        let rb = ty.row_bytes(256).unwrap();
        let mut want = vec![0u8; 21 * rb];
        for (xr, or) in x.chunks_exact(256).zip(want.chunks_exact_mut(rb)) {
            quantize_row(ty, xr, or).unwrap();
        }
        for threads in [0, 1, 2, 3, 4, 7, 21, 64] {
            let mut got = vec![0xAAu8; 21 * rb];
            quantize_rows(ty, &x, 256, &mut got, threads).unwrap();
            assert!(got == want, "{} with {threads} threads", ty.name());
        }
    }
    // No rows at all is fine.
    quantize_rows(GgmlType::Q8_0, &[], 32, &mut [], 4).unwrap();
}

#[test]
fn bad_lengths_and_inputs_are_errors() {
    let x = vec![0.5f32; 256];
    let mut out = vec![0u8; 1000];
    let e = quantize_row(GgmlType::Q4K, &x[..100], &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            QuantizeError::NotWholeBlocks {
                ty: GgmlType::Q4K,
                values: 100
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("Q4_K") && e.to_string().contains("256"));
    let e = quantize_row(GgmlType::Q8_0, &x[..64], &mut out[..67]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a row of 64 values quantized to Q8_0 takes 68 bytes, but the output has 67"
    );
    let e = quantize_row(GgmlType::Q4_1, &x[..32], &mut out[..20]).unwrap_err();
    assert!(e.to_string().contains("Q4_1"), "{e}");
    let mut y = x.clone();
    y[77] = f32::NAN;
    let e = quantize_row(GgmlType::Q6K, &y, &mut out[..210]).unwrap_err();
    assert!(
        matches!(e, QuantizeError::NonFinite { index: 77, .. }),
        "{e}"
    );
    let mut two = x.clone();
    two.extend_from_slice(&y);
    let e = quantize_rows(GgmlType::Q6K, &two, 256, &mut out[..420], 2).unwrap_err();
    assert!(
        matches!(e, QuantizeError::NonFinite { index: 333, .. }),
        "{e}"
    );
    let e = quantize_rows(GgmlType::Q8_0, &x, 0, &mut out, 2).unwrap_err();
    assert!(
        matches!(e, QuantizeError::NotWholeRows { cols: 0, .. }),
        "{e}"
    );
    let e = quantize_rows(GgmlType::Q8_0, &x[..96], 64, &mut out, 2).unwrap_err();
    assert!(matches!(e, QuantizeError::NotWholeRows { .. }), "{e}");
    let e = quantize_rows(GgmlType::Q8_0, &x[..64], 64, &mut out, 2).unwrap_err();
    assert!(
        matches!(e, QuantizeError::OutputLength { need: 68, .. }),
        "{e}"
    );
    let e = quantize_rows(GgmlType::Q4K, &x[..128], 64, &mut out, 2).unwrap_err();
    assert!(
        matches!(e, QuantizeError::NotWholeBlocks { values: 64, .. }),
        "{e}"
    );
}

#[test]
fn any_lengths_never_panic() {
    let x: Vec<f32> = (0..600).map(|i| i as f32 - 300.0).collect();
    let mut out = vec![0u8; 800];
    for ty in TYPES.into_iter().chain([GgmlType::F16, GgmlType::IQ4XS]) {
        for n in [0, 1, 31, 32, 33, 255, 256, 257, 512] {
            for m in [0, 17, 18, 34, 144, 176, 210, 288, 800] {
                let _ = quantize_row(ty, &x[..n], &mut out[..m]);
                let _ = quantize_rows(ty, &x[..n], 32, &mut out[..m], 3);
            }
        }
    }
}

#[test]
fn extreme_finite_values_do_not_panic() {
    for v in [f32::MAX, -f32::MAX, f32::MIN_POSITIVE, 1e-45, 3e38] {
        let mut x = vec![1.0f32; 256];
        x[5] = v;
        for ty in TYPES {
            let mut out = vec![0u8; ty.row_bytes(256).unwrap()];
            quantize_row(ty, &x, &mut out).unwrap();
        }
    }
}

#[test]
fn fp16_rounding_is_round_to_nearest_even() {
    let mut st = Stream(5);
    let check = |f: f32| {
        assert_eq!(
            fp16_bits(f),
            half::f16::from_f32(f).to_bits(),
            "{f:e} ({:#x})",
            f.to_bits()
        );
    };
    for v in [
        0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e10, 5.96e-8, 2.98e-8, 2.99e-8, 1e-30,
    ] {
        check(v);
        check(-v);
    }
    for _ in 0..200_000 {
        let f = f32::from_bits(st.next() as u32);
        if f.is_finite() {
            check(f);
        }
    }
    assert_eq!(fp16_bits(f32::NAN), 0x7E00);
}

#[test]
fn nearest_int_rounds_ties_to_even() {
    for (v, want) in [
        (0.5, 0),
        (1.5, 2),
        (2.5, 2),
        (-0.5, 0),
        (-1.5, -2),
        (3.49, 3),
        (-7.51, -8),
    ] {
        assert_eq!(nearest_int(v), want, "{v}");
    }
}

#[test]
fn float_rows_convert_and_others_are_refused() {
    let vals = [1.5f32, -2.25, 0.0, 65504.0];
    let f16: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let bf16: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = [0.0f32; 4];
    for (ty, b) in [(GgmlType::F16, &f16), (GgmlType::F32, &f32b)] {
        float_row_to_f32(ty, b, &mut out).unwrap();
        assert_eq!(out, vals, "{}", ty.name());
    }
    float_row_to_f32(GgmlType::BF16, &bf16, &mut out).unwrap();
    assert_eq!(out, [1.5, -2.25, 0.0, 65536.0]);
    assert!(matches!(
        float_row_to_f32(GgmlType::Q8_0, &[0; 34], &mut [0.0; 32]),
        Err(QuantizeError::NotFloat(GgmlType::Q8_0))
    ));
    let e = float_row_to_f32(GgmlType::F16, &f16[..7], &mut out).unwrap_err();
    assert!(e.to_string().contains("F16"), "{e}");
}

type RowFn = fn(GgmlType, &[f32], &mut [u8]) -> Result<(), QuantizeError>;

fn portable_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantizeError> {
    super::kquants::k_row_portable(ty == GgmlType::Q5K, x, out);
    Ok(())
}

/// Single-thread speed per type, MB/s of f32 input (`cargo test --release -p npu-gguf
/// quantize_speed -- --ignored --nocapture`).
#[test]
#[ignore = "a measurement, not a check: run in release"]
fn quantize_speed() {
    let x = random_blocks(13, 4096, -4, 8); // 4 MiB of f32
    let mb = (x.len() * 4) as f64 / 1e6;
    for ty in TYPES {
        let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        let forms: &[(&str, RowFn)] = match ty {
            GgmlType::Q4K | GgmlType::Q5K => &[
                ("fast", quantize_row),
                ("portable", portable_row),
                ("reference", quantize_row_reference),
            ],
            _ => &[("fast", quantize_row)],
        };
        for (form, f) in forms {
            // Best of 3 (the machine may be shared).
            let mut s = f64::INFINITY;
            for _ in 0..3 {
                let t = std::time::Instant::now();
                f(ty, &x, &mut out).unwrap();
                s = s.min(t.elapsed().as_secs_f64());
            }
            eprintln!("{} {form}: {:.0} MB/s", ty.name(), mb / s);
        }
    }
}
