//! Properties of `parse`: it never panics, on arbitrary bytes or on mutations of valid files,
//! and what the writer writes it reads back.

use std::path::Path;

use proptest::prelude::*;

use crate::safetensors::parse;
use crate::writer::{header_bytes, WriteTensor};
use crate::Dtype;

fn file(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<WriteTensor> = tensors
        .iter()
        .map(|(n, d, s, data)| WriteTensor {
            name: n,
            dtype: *d,
            shape: s,
            data,
        })
        .collect();
    let header = header_bytes(Path::new("p"), &views, &[("format", "pt")]).unwrap();
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(&header);
    for t in &views {
        v.extend_from_slice(t.data);
    }
    v
}

fn tensors() -> impl Strategy<Value = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>> {
    let one = (
        "[a-z.]{1,12}",
        0..Dtype::ALL.len(),
        proptest::collection::vec(0usize..4, 0..3),
    )
        .prop_map(|(name, d, shape)| {
            let dtype = Dtype::ALL[d];
            let len = shape.iter().product::<usize>() * dtype.size();
            let data = (0..len).map(|i| i as u8).collect();
            (name, dtype, shape, data)
        });
    proptest::collection::vec(one, 0..5).prop_map(|mut v| {
        let mut seen = std::collections::HashSet::new();
        v.retain(|t| seen.insert(t.0.clone()));
        v
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse("fuzz", &bytes, 0);
    }

    #[test]
    fn arbitrary_header_never_panics(header in "\\PC{0,80}", data in proptest::collection::vec(any::<u8>(), 0..16)) {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(&data);
        let _ = parse("fuzz", &v, 0);
    }

    #[test]
    fn written_files_read_back(ts in tensors()) {
        let bytes = file(&ts);
        let got = parse("rt", &bytes, 0).unwrap();
        prop_assert_eq!(got.len(), ts.len());
        for (name, dtype, shape, data) in &ts {
            let t = got.iter().find(|t| &t.name == name).unwrap();
            prop_assert_eq!(t.dtype, *dtype);
            prop_assert_eq!(&t.shape, shape);
            prop_assert_eq!(&bytes[t.start..t.end], data.as_slice());
        }
    }

    #[test]
    fn mutated_valid_files_never_panic(
        ts in tensors(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = file(&ts);
        for (i, b) in flips {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        let _ = parse("fuzz", &bytes, 0);
    }

    #[test]
    fn digits_of_the_header_mutated_never_panic(ts in tensors(), pos in any::<prop::sample::Index>(), d in b'0'..=b'9') {
        // Changing digits in the header moves offsets and shapes while keeping it JSON.
        let mut bytes = file(&ts);
        let digits: Vec<usize> = (8..bytes.len()).filter(|&i| bytes[i].is_ascii_digit()).collect();
        if !digits.is_empty() {
            let i = digits[pos.index(digits.len())];
            bytes[i] = d;
        }
        let _ = parse("fuzz", &bytes, 0);
    }
}
