//! GGUF reader tests: round trips through `writer`, tensor placement and alignment, and damaged
//! files (truncated anywhere, bad header fields, absurd counts, bad tensor entries), including
//! truncated copies of the real model; each must give the right `GgufError`, never a panic.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::writer::{GgufLayout, GgufWriter, TensorSpec};
use super::*;

/// A fresh directory under the system temp dir, removed on drop.
struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "npu-agent-{tag}-{}-{n}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open_bytes(dir: &TestDir, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

/// Deterministic filler bytes.
fn filler(n: usize, salt: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

fn every_meta_type() -> Vec<(String, MetaValue)> {
    use MetaValue::*;
    let v = vec![
        ("t.u8", U8(250)),
        ("t.i8", I8(-120)),
        ("t.u16", U16(65_000)),
        ("t.i16", I16(-32_000)),
        ("t.u32", U32(4_000_000_000)),
        ("t.i32", I32(-2_000_000_000)),
        ("t.f32", F32(-1.5e-7)),
        ("t.f32_inf", F32(f32::INFINITY)),
        ("t.bool_true", Bool(true)),
        ("t.bool_false", Bool(false)),
        ("t.string", String("héllo ✓ \0 world".into())),
        ("t.empty_string", String(std::string::String::new())),
        ("t.u64", U64(u64::MAX - 1)),
        ("t.i64", I64(i64::MIN)),
        ("t.f64", F64(std::f64::consts::PI)),
        ("t.arr_u8", Array(vec![U8(1), U8(2), U8(3)])),
        ("t.arr_i32", Array(vec![I32(-1), I32(7)])),
        ("t.arr_f32", Array(vec![F32(0.25), F32(-8.0)])),
        ("t.arr_bool", Array(vec![Bool(true), Bool(false)])),
        (
            "t.arr_str",
            Array(vec![String("a".into()), String("".into())]),
        ),
        ("t.arr_u64", Array(vec![U64(1 << 40)])),
        ("t.arr_f64", Array(vec![F64(-0.5)])),
        ("t.arr_i16", Array(vec![I16(-3), I16(4)])),
        ("t.arr_u16", Array(vec![U16(3)])),
        ("t.arr_i8", Array(vec![I8(-3)])),
        ("t.arr_u32", Array(vec![U32(9)])),
        ("t.arr_i64", Array(vec![I64(-9)])),
        ("t.arr_empty", Array(vec![])),
        (
            "t.arr_nested",
            Array(vec![
                Array(vec![Array(vec![U8(1)]), Array(vec![])]),
                Array(vec![Array(vec![U8(2), U8(3)])]),
            ]),
        ),
    ];
    v.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// A small valid file: metadata of every type and tensors of several types and sizes.
fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("llama".into()));
    for (k, v) in every_meta_type() {
        w.add_meta(k, v);
    }
    w.add_tensor("tok_embd", GgmlType::Q8_0, &[64, 4], filler(272, 1));
    w.add_f32_tensor(
        "norm",
        &[64],
        &(0..64).map(|i| i as f32).collect::<Vec<_>>(),
    );
    w.add_tensor("w_q4_1", GgmlType::Q4_1, &[32, 3], filler(60, 2));
    w.add_tensor("w_f16", GgmlType::F16, &[5, 2], filler(20, 3));
    w.add_tensor("w_q4k", GgmlType::Q4K, &[256, 1, 1], filler(144, 4));
    w
}

fn expect_corrupt(r: Result<GgufFile, GgufError>, needle: &str) {
    match r {
        Err(GgufError::Corrupt { what, .. }) => {
            assert!(what.contains(needle), "{what:?} lacks {needle:?}")
        }
        Err(e) => panic!("expected Corrupt({needle}), got {e}"),
        Ok(_) => panic!("expected Corrupt({needle}), file opened"),
    }
}

fn expect_truncated(r: Result<GgufFile, GgufError>, needle: &str) {
    match r {
        Err(GgufError::Truncated { what, .. }) => {
            assert!(what.contains(needle), "{what:?} lacks {needle:?}")
        }
        Err(e) => panic!("expected Truncated({needle}), got {e}"),
        Ok(_) => panic!("expected Truncated({needle}), file opened"),
    }
}

#[test]
fn metadata_of_every_type_round_trips() {
    let dir = TestDir::new("gguf-meta");
    for version in [2, 3] {
        let mut w = sample_writer();
        w.version = version;
        let f = open_bytes(&dir, &w.to_bytes().unwrap()).unwrap();
        assert_eq!(f.version, version);
        let keys: Vec<&str> = w.metadata.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(f.keys(), keys.as_slice(), "keys keep file order");
        for (k, v) in &w.metadata {
            assert_eq!(f.get(k), Some(v), "key {k}");
        }
        assert_eq!(f.get_str("general.architecture"), Some("llama"));
        assert_eq!(f.get_u64("t.u32"), Some(4_000_000_000));
        assert_eq!(f.get_u64("t.i8"), None, "negative is not a u64");
        assert_eq!(f.get_f64("t.f64"), Some(std::f64::consts::PI));
        assert_eq!(f.get_bool("t.bool_true"), Some(true));
        assert_eq!(f.get_str_array("t.arr_str").unwrap(), Some(vec!["a", ""]));
    }
}

#[test]
fn accessors_report_missing_and_wrong_types() {
    let dir = TestDir::new("gguf-access");
    let f = open_bytes(&dir, &sample_writer().to_bytes().unwrap()).unwrap();
    assert!(matches!(f.require_u64("nope"), Err(GgufError::MissingKey(k)) if k == "nope"));
    assert!(matches!(
        f.require_u64("t.string"),
        Err(GgufError::WrongType {
            found: "string",
            ..
        })
    ));
    assert_eq!(f.require_u64("t.u16").unwrap(), 65_000);
    assert!(matches!(
        f.get_str_array("t.arr_u8"),
        Err(GgufError::WrongType { found: "array", .. })
    ));
    assert!(matches!(
        f.get_str_array("t.u8"),
        Err(GgufError::WrongType { found: "u8", .. })
    ));
    assert_eq!(f.get_str_array("nope").unwrap(), None);
    assert!(matches!(f.tensor("nope"), Err(GgufError::MissingTensor(n)) if n == "nope"));
    let missing = GgufFile::open(dir.path().join("absent.gguf"));
    assert!(matches!(missing, Err(GgufError::Open { .. })));
}

fn check_tensors(f: &GgufFile, w: &GgufWriter, layout: &GgufLayout, alignment: u64) {
    assert_eq!(f.tensors().len(), w.tensors.len());
    assert_eq!(layout.data_start % alignment, 0);
    for (i, spec) in w.tensors.iter().enumerate() {
        let info = f.tensor_info(&spec.name).unwrap();
        assert_eq!(info.dims, spec.dims);
        assert_eq!(info.ty.id(), spec.type_id);
        assert_eq!(info.offset, layout.tensor_data[i]);
        assert_eq!(info.offset % alignment, 0, "{} misaligned", spec.name);
        assert_eq!(info.n_bytes, spec.data.len() as u64);
        assert_eq!(f.tensor_data(info), spec.data.as_slice());
        let (_, bytes) = f.tensor(&spec.name).unwrap();
        assert_eq!(bytes, spec.data.as_slice());
    }
}

#[test]
fn tensors_are_placed_aligned_with_exact_sizes() {
    let dir = TestDir::new("gguf-tensors");
    let w = sample_writer();
    let (bytes, layout) = w.to_bytes_with_layout().unwrap();
    let f = open_bytes(&dir, &bytes).unwrap();
    check_tensors(&f, &w, &layout, 32);
    assert_eq!(f.file_len(), bytes.len() as u64);
    let q8 = f.tensor_info("tok_embd").unwrap();
    assert_eq!((q8.n_elements(), q8.row_len(), q8.n_rows()), (256, 64, 4));
    assert_eq!(q8.ty, GgmlType::Q8_0);
    let q4k = f.tensor_info("w_q4k").unwrap();
    assert_eq!((q4k.row_len(), q4k.n_rows()), (256, 1));

    for alignment in [1u32, 8, 64, 4096] {
        let mut w = sample_writer();
        w.set_alignment(alignment);
        let (bytes, layout) = w.to_bytes_with_layout().unwrap();
        let f = open_bytes(&dir, &bytes).unwrap();
        assert_eq!(f.get_u64("general.alignment"), Some(alignment as u64));
        check_tensors(&f, &w, &layout, alignment as u64);
    }

    // Explicit (aligned, out of order) offsets are honoured.
    let mut w = GgufWriter::new();
    w.add_tensor_spec(TensorSpec {
        name: "late".into(),
        dims: vec![8],
        type_id: GgmlType::F32.id(),
        data: filler(32, 9),
        offset: Some(96),
    });
    w.add_tensor_spec(TensorSpec {
        name: "early".into(),
        dims: vec![8],
        type_id: GgmlType::F32.id(),
        data: filler(32, 10),
        offset: Some(0),
    });
    let (bytes, layout) = w.to_bytes_with_layout().unwrap();
    let f = open_bytes(&dir, &bytes).unwrap();
    check_tensors(&f, &w, &layout, 32);
    assert_eq!(
        f.tensor_info("late").unwrap().offset,
        layout.data_start + 96
    );
}

#[test]
fn a_file_without_tensors_opens() {
    let dir = TestDir::new("gguf-empty");
    let mut w = GgufWriter::new();
    w.add_meta("a", MetaValue::U8(1));
    let f = open_bytes(&dir, &w.to_bytes().unwrap()).unwrap();
    assert!(f.tensors().is_empty());
    let f = open_bytes(&dir, &GgufWriter::new().to_bytes().unwrap()).unwrap();
    assert!(f.keys().is_empty());
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    let dir = TestDir::new("gguf-trunc");
    let (bytes, layout) = sample_writer().to_bytes_with_layout().unwrap();
    for cut in 0..bytes.len() {
        let r = open_bytes(&dir, &bytes[..cut]);
        let cut = cut as u64;
        match r {
            Err(GgufError::Truncated { end, len, .. }) => {
                assert_eq!(len, cut);
                assert!(end > len, "cut {cut}: end {end}");
            }
            // Inside the metadata an array's element count is checked against what is left.
            Err(GgufError::Corrupt { what, .. })
                if cut >= 24 && cut < layout.tensor_infos_start && what.contains("cannot fit") => {}
            Err(e) => panic!("cut at {cut}: unexpected {e}"),
            Ok(_) => panic!("cut at {cut} of {} opened", bytes.len()),
        }
    }
    assert!(open_bytes(&dir, &bytes).is_ok());
}

#[test]
fn bad_magic_and_version_are_refused() {
    let dir = TestDir::new("gguf-header");
    let bytes = sample_writer().to_bytes().unwrap();
    let mut bad = bytes.clone();
    bad[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        open_bytes(&dir, &bad),
        Err(GgufError::BadMagic { found, .. }) if &found == b"GGML"
    ));
    assert!(matches!(
        open_bytes(&dir, b"\x7fELF\x02\x01\x01\0"),
        Err(GgufError::BadMagic { .. })
    ));
    for version in [0u32, 1, 4, u32::MAX] {
        let mut w = sample_writer();
        w.version = version;
        assert!(matches!(
            open_bytes(&dir, &w.to_bytes().unwrap()),
            Err(GgufError::BadVersion { version: v, .. }) if v == version
        ));
    }
}

#[test]
fn absurd_counts_are_corrupt() {
    let dir = TestDir::new("gguf-counts");
    let bytes = sample_writer().to_bytes().unwrap();
    for (field, value) in [
        (8usize, u64::MAX),
        (8, 1 << 40),
        (16, u64::MAX),
        (16, 1 << 21),
    ] {
        let mut bad = bytes.clone();
        bad[field..field + 8].copy_from_slice(&value.to_le_bytes());
        expect_corrupt(open_bytes(&dir, &bad), "implausible counts");
    }
    // Plausible but wrong counts run off the end of the file.
    let mut more_keys = bytes.clone();
    more_keys[16..24].copy_from_slice(&1000u64.to_le_bytes());
    assert!(matches!(
        open_bytes(&dir, &more_keys),
        Err(GgufError::Truncated { .. } | GgufError::Corrupt { .. })
    ));
}

#[test]
fn bad_strings_are_refused() {
    let dir = TestDir::new("gguf-strings");
    let (bytes, layout) = sample_writer().to_bytes_with_layout().unwrap();
    let at = layout.metadata_entries[0] as usize;
    let mut beyond = bytes.clone();
    beyond[at..at + 8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    expect_truncated(open_bytes(&dir, &beyond), "metadata key #0");
    let mut huge = bytes.clone();
    huge[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_corrupt(open_bytes(&dir, &huge), "implausible");
    // A tensor name running past the end.
    let t = layout.tensor_infos[0] as usize;
    let mut name = bytes.clone();
    name[t..t + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    expect_corrupt(open_bytes(&dir, &name), "name of tensor #0");
    let mut name = bytes;
    name[t..t + 8].copy_from_slice(&1_000_000u64.to_le_bytes());
    expect_truncated(open_bytes(&dir, &name), "name of tensor #0");
}

#[test]
fn bad_metadata_values_are_corrupt() {
    let dir = TestDir::new("gguf-values");
    // Unknown value type: patch the type id of the first entry (after its key).
    let mut w = GgufWriter::new();
    w.add_meta("k", MetaValue::U32(5));
    let mut bytes = w.to_bytes().unwrap();
    let ty_at = 24 + 8 + 1;
    bytes[ty_at..ty_at + 4].copy_from_slice(&13u32.to_le_bytes());
    expect_corrupt(open_bytes(&dir, &bytes), "unknown value type 13");

    // Arrays nested four deep.
    use MetaValue::Array;
    let mut w = GgufWriter::new();
    w.add_meta("deep", Array(vec![Array(vec![Array(vec![Array(vec![])])])]));
    expect_corrupt(
        open_bytes(&dir, &w.to_bytes().unwrap()),
        "nested too deeply",
    );

    // An array count larger than the bytes left.
    let mut w = GgufWriter::new();
    w.add_meta("arr", Array(vec![MetaValue::U8(1); 4]));
    let mut bytes = w.to_bytes().unwrap();
    let count_at = 24 + 8 + 3 + 4 + 4;
    bytes[count_at..count_at + 8].copy_from_slice(&1_000_000u64.to_le_bytes());
    expect_corrupt(open_bytes(&dir, &bytes), "cannot fit");
    // Unknown array element type.
    let mut bytes = w.to_bytes().unwrap();
    bytes[count_at - 4..count_at].copy_from_slice(&77u32.to_le_bytes());
    expect_corrupt(open_bytes(&dir, &bytes), "unknown value type 77");

    for bad in [0u32, 3, 48] {
        let mut w = sample_writer();
        w.add_meta("general.alignment", MetaValue::U32(bad));
        expect_corrupt(
            open_bytes(&dir, &w.to_bytes().unwrap()),
            "not a power of two",
        );
    }
    let mut w = sample_writer();
    w.add_meta("general.alignment", MetaValue::String("32".into()));
    expect_corrupt(
        open_bytes(&dir, &w.to_bytes().unwrap()),
        "not a power of two",
    );
}

fn one_tensor(spec: TensorSpec) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String("llama".into()));
    w.add_f32_tensor("ok", &[4], &[1.0, 2.0, 3.0, 4.0]);
    w.add_tensor_spec(spec);
    w
}

fn f32_spec(name: &str, dims: &[u64], offset: Option<u64>) -> TensorSpec {
    // Sizes of absurd dims are capped: those tests are about the directory, not the data.
    let n: u64 = dims
        .iter()
        .fold(1u64, |a, &d| a.saturating_mul(d))
        .min(1024);
    TensorSpec {
        name: name.into(),
        dims: dims.to_vec(),
        type_id: GgmlType::F32.id(),
        data: filler(n as usize * 4, 5),
        offset,
    }
}

#[test]
fn bad_tensor_entries_are_refused() {
    let dir = TestDir::new("gguf-bad-tensors");
    let open = |w: GgufWriter| open_bytes(&dir, &w.to_bytes().unwrap());

    // Offset beyond the file (no data written there).
    let mut far = f32_spec("far", &[8], Some(1 << 20));
    far.data.clear();
    expect_truncated(open(one_tensor(far)), "data of tensor \"far\"");
    // Data shorter than the dims say.
    let mut short = f32_spec("short", &[8], None);
    short.data.truncate(20);
    expect_truncated(open(one_tensor(short)), "data of tensor \"short\"");
    // Offsets so large that start + size overflows.
    let mut wrap = f32_spec("wrap", &[8], Some(u64::MAX - 31));
    wrap.data.clear();
    assert!(matches!(
        open(one_tensor(wrap)),
        Err(GgufError::Truncated { .. } | GgufError::Corrupt { .. })
    ));

    expect_corrupt(
        open(one_tensor(f32_spec("odd", &[8], Some(36)))),
        "not aligned",
    );

    let q4 = TensorSpec {
        name: "q4".into(),
        dims: vec![33, 2],
        type_id: GgmlType::Q4_1.id(),
        data: filler(40, 6),
        offset: None,
    };
    expect_corrupt(
        open(one_tensor(q4)),
        "not a multiple of the Q4_1 block size 32",
    );
    let q4k = TensorSpec {
        name: "q4k".into(),
        dims: vec![128],
        type_id: GgmlType::Q4K.id(),
        data: filler(144, 6),
        offset: None,
    };
    expect_corrupt(open(one_tensor(q4k)), "block size 256");

    let mut unknown = f32_spec("mystery", &[4], None);
    unknown.type_id = 99;
    let err = open(one_tensor(unknown.clone()));
    assert!(matches!(
        &err,
        Err(GgufError::UnsupportedType { type_id: 99, name, .. }) if name == "mystery"
    ));
    let text = err.err().unwrap().to_string();
    assert!(
        text.contains("type id 99") && text.contains("IQ4_XS"),
        "{text}"
    );
    // A type ggml has but this build does not read is named.
    unknown.type_id = 16;
    let text = open(one_tensor(unknown.clone())).err().unwrap().to_string();
    assert!(text.contains("IQ2_XXS (type id 16)"), "{text}");

    expect_corrupt(
        open(one_tensor(f32_spec("ok", &[4], None))),
        "appears twice",
    );

    let mut no_dims = f32_spec("scalar", &[], None);
    no_dims.data = filler(4, 1);
    expect_corrupt(open(one_tensor(no_dims)), "0 dimensions");
    expect_corrupt(
        open(one_tensor(f32_spec("five", &[1, 1, 1, 1, 2], None))),
        "5 dimensions",
    );
    let mut zero = f32_spec("zero", &[4, 0], None);
    zero.data = filler(16, 1);
    expect_corrupt(open(one_tensor(zero)), "bad dimensions");
    let mut huge = f32_spec("huge", &[1 << 30, 1 << 30], None);
    huge.data = filler(16, 1);
    expect_corrupt(open(one_tensor(huge)), "bad dimensions");
}

#[test]
fn writer_refuses_what_it_cannot_encode() {
    let mut w = GgufWriter::new();
    w.add_meta(
        "mixed",
        MetaValue::Array(vec![MetaValue::U8(1), MetaValue::U16(2)]),
    );
    assert_eq!(
        w.to_bytes().unwrap_err().kind(),
        std::io::ErrorKind::InvalidInput
    );
    let mut w = GgufWriter::new();
    w.alignment = 24;
    assert!(w.to_bytes().is_err());
}

mod damaged_files {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

        /// Random byte flips and truncation of a small valid file never panic.
        #[test]
        fn flips_and_truncation_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let dir = TestDir::new("gguf-prop");
            let mut bytes = sample_writer().to_bytes().unwrap();
            for (at, b) in flips {
                let i = at.index(bytes.len());
                bytes[i] ^= b;
            }
            if let Some(c) = cut {
                let n = c.index(bytes.len());
                bytes.truncate(n);
            }
            if let Ok(f) = open_bytes(&dir, &bytes) {
                // Whatever opened must hand out in-bounds tensor data.
                for t in f.tensors() {
                    prop_assert!(t.offset + t.n_bytes <= f.file_len());
                    let _ = f.tensor_data(t);
                }
            }
        }
    }
}

/// Counts in a header are checked against what the rest of the file can hold before anything
/// is sized by them (a fuzzer's 1 MB table in a 24-byte file, a 2^40-element u64 array).
#[test]
fn counts_the_file_cannot_hold_are_refused_before_allocating() {
    let mut head = b"GGUF".to_vec();
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&1000u64.to_le_bytes()); // tensors
    head.extend_from_slice(&(1u64 << 19).to_le_bytes()); // metadata keys
    match GgufFile::from_bytes("counts.gguf", &head) {
        Err(GgufError::Truncated { what, len, .. }) => {
            assert!(
                what.contains("524288 keys") && what.contains("1000 tensors"),
                "{what}"
            );
            assert_eq!(len, 24);
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // One key: an array of 2^40 u64 values declared in a few bytes.
    let mut f = b"GGUF".to_vec();
    f.extend_from_slice(&3u32.to_le_bytes());
    f.extend_from_slice(&0u64.to_le_bytes());
    f.extend_from_slice(&1u64.to_le_bytes());
    f.extend_from_slice(&1u64.to_le_bytes());
    f.push(b'k');
    f.extend_from_slice(&9u32.to_le_bytes()); // array
    f.extend_from_slice(&10u32.to_le_bytes()); // of u64
    f.extend_from_slice(&(1u64 << 40).to_le_bytes());
    f.extend_from_slice(&[0u8; 64]);
    match GgufFile::from_bytes("array.gguf", &f) {
        Err(GgufError::Corrupt { what, .. }) => assert!(what.contains("cannot fit"), "{what}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Eight u64 values do fit in those 64 bytes.
    let at = f.len() - 72;
    f[at..at + 8].copy_from_slice(&8u64.to_le_bytes());
    let file = GgufFile::from_bytes("array.gguf", &f).unwrap();
    assert_eq!(
        file.get("k").and_then(|v| v.as_array()).map(|a| a.len()),
        Some(8)
    );
}
