//! `parse` over safetensors images built in memory: a valid one, and each way one can be damaged.

use std::path::Path;

use super::{err, image, Owned};
use crate::safetensors::{parse, MAX_HEADER_BYTES};
use crate::writer::header_bytes;
use crate::Dtype;

fn valid() -> Vec<u8> {
    let owned = Owned::sample();
    let views = owned.views();
    let header = header_bytes(Path::new("t"), &views, &[("format", "pt")]).unwrap();
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&header);
    for t in &views {
        v.extend_from_slice(t.data);
    }
    v
}

#[test]
fn dtype_names_round_trip() {
    for d in Dtype::ALL {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
    }
    assert_eq!(Dtype::BF16.name(), "BF16");
    assert_eq!(Dtype::F8E4M3.name(), "F8_E4M3");
    assert_eq!(Dtype::Bool.name(), "BOOL");
    assert_eq!(Dtype::from_name("bf16"), None);
    assert_eq!(Dtype::C64.size(), 8);
    assert_eq!(Dtype::F8E5M2.size(), 1);
}

#[test]
fn valid_image_parses_in_file_order_with_absolute_offsets() {
    let bytes = valid();
    let ts = parse("m.safetensors", &bytes, 3).unwrap();
    let owned = Owned::sample();
    assert_eq!(ts.len(), owned.0.len());
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(ts[0].start, header_end);
    for (t, (name, dtype, shape, data)) in ts.iter().zip(&owned.0) {
        assert_eq!(&t.name, name);
        assert_eq!(t.dtype, *dtype);
        assert_eq!(&t.shape, shape);
        assert_eq!(t.shard, 3);
        assert_eq!(&bytes[t.start..t.end], data.as_slice());
    }
    assert_eq!(ts.last().unwrap().end, bytes.len());
}

#[test]
fn empty_and_zero_sized_tensors_are_fine() {
    assert!(parse("e", &image("{}", &[]), 0).unwrap().is_empty());
    let h = r#"{"z":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#;
    let ts = parse("z", &image(h, &[0; 4]), 0).unwrap();
    assert_eq!(ts.len(), 2);
    assert_eq!(ts[0].name, "z");
    assert_eq!(ts[1].shape, Vec::<usize>::new());
}

#[test]
fn unknown_tensor_keys_are_ignored() {
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":1}}"#;
    assert_eq!(parse("x", &image(h, &[1, 2]), 0).unwrap().len(), 1);
}

fn damaged(header: &str, data: &[u8]) -> String {
    err(parse("bad.safetensors", &image(header, data), 0))
}

#[test]
fn shorter_than_the_length_field() {
    let e = err(parse("bad.safetensors", &[1, 2, 3], 0));
    assert!(e.starts_with("bad.safetensors: "), "{e}");
    assert!(e.contains("3 bytes long"), "{e}");
    assert!(err(parse("x", &[], 0)).contains("0 bytes long"));
}

#[test]
fn header_length_beyond_the_file() {
    let mut v = image("{}", &[]);
    v[..8].copy_from_slice(&1000u64.to_le_bytes());
    let e = err(parse("bad.safetensors", &v, 0));
    assert!(
        e.contains("header length 1000 runs past the end of the file"),
        "{e}"
    );
}

#[test]
fn header_length_huge() {
    for n in [u64::MAX, MAX_HEADER_BYTES, 1 << 40] {
        let mut v = image("{}", &[]);
        v[..8].copy_from_slice(&n.to_le_bytes());
        let e = err(parse("bad.safetensors", &v, 0));
        assert!(
            e.contains(&format!("header length {n} is not below")),
            "{e}"
        );
    }
}

#[test]
fn bad_json_header() {
    let e = damaged(r#"{"a": {"dtype": "F32",}"#, &[]);
    assert!(e.contains("not valid JSON (line 1, column"), "{e}");
    let e = damaged("[1, 2]", &[]);
    assert!(e.contains("does not start with '{'"), "{e}");
    let e = damaged(r#"{"a": 1}"#, &[]);
    assert!(
        e.contains("tensor \"a\": entry is a number, not an object"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_name() {
    let h = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let e = damaged(h, &[0, 0]);
    assert!(
        e.contains("tensor \"a\": the header names this key twice"),
        "{e}"
    );
}

#[test]
fn unknown_and_sub_byte_dtypes() {
    let e = damaged(
        r#"{"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(
        e.contains("tensor \"w\": unknown dtype \"Q4_K\" (known: F64"),
        "{e}"
    );
    let e = damaged(
        r#"{"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(
        e.contains("dtype F4 (a sub-byte type) is not supported"),
        "{e}"
    );
    let e = damaged(
        r#"{"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(e.contains("\"dtype\" is a number, not a string"), "{e}");
}

#[test]
fn missing_and_malformed_fields() {
    let e = damaged(r#"{"w":{"shape":[1],"data_offsets":[0,1]}}"#, &[0]);
    assert!(e.contains("tensor \"w\": no \"dtype\""), "{e}");
    let e = damaged(r#"{"w":{"dtype":"U8","data_offsets":[0,1]}}"#, &[0]);
    assert!(e.contains("no \"shape\""), "{e}");
    let e = damaged(r#"{"w":{"dtype":"U8","shape":[1]}}"#, &[0]);
    assert!(e.contains("no \"data_offsets\""), "{e}");
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(
        e.contains("\"shape\" holds -1, not a non-negative integer"),
        "{e}"
    );
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}"#,
        &[0],
    );
    assert!(e.contains("holds 1.5"), "{e}");
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}}"#,
        &[0],
    );
    assert!(e.contains("not an array of two integers"), "{e}");
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,-1]}}"#,
        &[0],
    );
    assert!(e.contains("are not two non-negative integers"), "{e}");
}

#[test]
fn shape_and_size_disagree() {
    let e = damaged(
        r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#,
        &[0; 20],
    );
    assert!(
        e.contains(
            "tensor \"w\": shape [2, 3] of F32 takes 24 bytes, but data_offsets [0, 20] hold 20"
        ),
        "{e}"
    );
    let h = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{},4],"data_offsets":[0,4]}}}}"#,
        usize::MAX / 2
    );
    let e = damaged(&h, &[0; 4]);
    assert!(e.contains("the byte count overflows"), "{e}");
}

#[test]
fn offsets_out_of_range() {
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
        &[0; 4],
    );
    assert!(
        e.contains("data_offsets [0, 8] run past the data region (4 bytes after the header"),
        "{e}"
    );
    let e = damaged(
        r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}}"#,
        &[0; 4],
    );
    assert!(e.contains("the begin is past the end"), "{e}");
    let h = format!(
        r#"{{"w":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}}}}"#,
        u64::MAX - 1,
        u64::MAX
    );
    assert!(damaged(&h, &[0]).contains("run past the data region"));
}

#[test]
fn overlapping_offsets() {
    let h = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    let e = damaged(h, &[0; 6]);
    assert!(
        e.contains("tensor \"b\": its data_offsets [2, 6] overlap tensor \"a\"'s, which end at 4"),
        "{e}"
    );
}

#[test]
fn offsets_leaving_a_hole() {
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    let e = damaged(h, &[0; 6]);
    assert!(
        e.contains(
            "tensor \"b\": its data begin at 4, leaving a hole of 2 bytes after tensor \"a\""
        ),
        "{e}"
    );
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
    let e = damaged(h, &[0; 4]);
    assert!(
        e.contains("hole of 2 bytes at the start of the data region"),
        "{e}"
    );
}

#[test]
fn bytes_after_the_last_tensor() {
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let e = damaged(h, &[0; 5]);
    assert!(
        e.contains("3 bytes of the data region belong to no tensor"),
        "{e}"
    );
    assert!(damaged("{}", &[1]).contains("no tensor is in the header"));
}

#[test]
fn truncated_file() {
    let bytes = valid();
    let e = err(parse("cut.safetensors", &bytes[..bytes.len() - 1], 0));
    assert!(
        e.contains("cut.safetensors: tensor \"lm_head.weight\""),
        "{e}"
    );
    assert!(e.contains("run past the data region"), "{e}");
    let e = err(parse("cut.safetensors", &bytes[..20], 0));
    assert!(e.contains("runs past the end of the file"), "{e}");
}

#[test]
fn metadata_must_map_strings_to_strings() {
    let e = damaged(r#"{"__metadata__":{"format":1}}"#, &[]);
    assert!(
        e.contains("\"__metadata__\" key \"format\" is a number, not a string"),
        "{e}"
    );
    let e = damaged(r#"{"__metadata__":["pt"]}"#, &[]);
    assert!(
        e.contains("\"__metadata__\" is an array, not an object of strings"),
        "{e}"
    );
    assert!(parse("ok", &image(r#"{"__metadata__":{"format":"pt"}}"#, &[]), 0).is_ok());
}

#[test]
fn header_padding_is_accepted() {
    let h = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}      ";
    assert_eq!(
        parse("p", &image(h, &[9]), 0).unwrap()[0].start,
        8 + h.len()
    );
}
