//! Packing is checked against the reference dequantizer: every format's packed rows decode to the
//! same values, bit for bit, and take no more bytes than the file's rows.

use super::*;
use crate::quant::testing::random_ggml_rows;

const ALL: [GgmlType; 13] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8K,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
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
        assert!(
            !PackFormat::for_type(ty).unwrap().1,
            "{} is exact",
            ty.name()
        );
        let mut want = vec![0f32; k];
        let mut got = vec![0f32; k];
        for r in 0..rows {
            ggml::dequantize_row(ty, &bytes[r * rb..(r + 1) * rb], &mut want).unwrap();
            m.dequantize_row(r, &mut got);
            for j in 0..k {
                assert_eq!(
                    got[j].to_bits(),
                    want[j].to_bits(),
                    "{} row {r} value {j}: packed {} reference {}",
                    ty.name(),
                    got[j],
                    want[j]
                );
            }
        }
    }
}

/// A repack reorders the file's bytes and never widens them: a whole group takes exactly the
/// bytes of its 16 rows in the file.
#[test]
fn packed_matrices_take_the_files_bytes() {
    for ty in ALL {
        let k = 4 * 256;
        let bytes = random_ggml_rows(ty, 48, k, 3);
        let w = WeightMatrix::from_ggml_parts(&[(ty, &bytes, 48)], k).unwrap();
        let file = ty.row_bytes(k).unwrap() * 48;
        // Q8_K keeps one f32 scale per row of each 256 values and drops its 16 sums.
        let want = if ty == GgmlType::Q8K {
            file - 48 * (k / 256) * 32
        } else {
            file
        };
        assert_eq!(w.bytes(), want, "{}", ty.name());
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
    ggml::dequantize_row(GgmlType::Q4_1, &b[3 * rb..4 * rb], &mut want).unwrap();
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
    let WeightMatrix::F32 { n, k, data, acts } =
        WeightMatrix::from_ggml_parts(&[(GgmlType::F16, &bytes, 2)], 32).unwrap()
    else {
        panic!()
    };
    assert_eq!((n, k), (2, 32));
    assert_eq!(data, vals);
    // An f16 matrix takes f16-rounded activations, as llama.cpp's CPU backend gives them.
    assert_eq!(acts, super::FloatActs::F16);
    // Float parts of different types cannot share one activation rounding: not fused.
    let f32_bytes: Vec<u8> = vals[..32].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert!(WeightMatrix::from_ggml_parts(
        &[(GgmlType::F16, &bytes, 2), (GgmlType::F32, &f32_bytes, 1)],
        32
    )
    .is_none());
}

/// The flags line of the `/proc/self/smaps` mapping that holds `addr`.
#[cfg(target_os = "linux")]
fn vm_flags_of(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.to_string());
            }
        }
    }
    None
}

#[test]
fn large_weight_buffers_are_zeroed_aligned_and_ask_for_huge_pages() {
    let small = AlignedBytes::zeroed(1000);
    assert_eq!(small.as_slice().as_ptr() as usize % 64, 0);
    assert!(small.as_slice().iter().all(|&b| b == 0));
    let mut big = AlignedBytes::zeroed(HUGE_PAGE + 12_345);
    let at = big.as_slice().as_ptr() as usize;
    assert_eq!(
        at % HUGE_PAGE,
        0,
        "a weight buffer of 2 MiB or more starts on a huge page"
    );
    assert!(big.as_slice().iter().all(|&b| b == 0));
    big.as_mut_slice()[HUGE_PAGE + 12_344] = 7;
    #[cfg(target_os = "linux")]
    {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("SKIPPED: this kernel has no transparent huge pages");
            return;
        }
        let flags = vm_flags_of(at).expect("the buffer's mapping in /proc/self/smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "MADV_HUGEPAGE not set on the weights' mapping: {flags}"
        );
    }
}
