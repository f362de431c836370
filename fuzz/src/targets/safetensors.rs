//! A safetensors image through the strict parser (`npu_hf::safetensors::parse`): the header
//! length, the JSON header, every tensor's dtype, shape and offsets, and the tiling of the data
//! region. What it accepts must hold what it promises (every tensor's bytes inside the image,
//! its length its shape times its type's size, no two tensors overlapping): a broken promise is
//! a finding, as is a panic or an allocation past the input's size.

use npu_hf::safetensors::parse;

pub fn run(data: &[u8]) {
    let Ok(mut tensors) = parse("fuzz.safetensors", data, 0) else {
        return;
    };
    tensors.sort_by_key(|t| (t.start, t.end));
    let mut end = 8;
    for t in &tensors {
        assert!(
            t.start <= t.end && t.end <= data.len(),
            "{t:?} outside the image"
        );
        assert!(
            t.start >= end,
            "{t:?} overlaps the header or the tensor before it"
        );
        let elems: usize = t.shape.iter().product();
        assert_eq!(elems * t.dtype.size(), t.end - t.start, "{t:?} length");
        end = t.end;
    }
}
