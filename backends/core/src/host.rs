//! The plain host-side data of the seam: device memory figures, weights as the file stores them
//! (`HostTensor`), host data for uploads (`HostSlice`) and for read-backs (`HostSliceMut`,
//! `Readback`).

use crate::view::{DeviceBuffer, View};
use npu_gguf::GgmlType;

/// Free and total memory of the device (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// A tensor as the model file stores it: `rows` rows of `cols` values of GGUF type `ty`
/// (for a weight matrix, `rows` outputs of `cols` inputs; ggml order is `[cols, rows]`).
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

/// Host data for `upload`.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    F32(&'a [f32]),
    I32(&'a [i32]),
}

impl HostSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::I32(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host memory that `read_back` fills (f32 values are converted from the buffer's dtype).
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    F32(&'a mut [f32]),
    I32(&'a mut [i32]),
}

impl HostSliceMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::I32(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One device→host read of `read_back`: `src`'s elements, row by row, into `dst`
/// (`dst.len() == src.layout().elements()`).
pub struct Readback<'a, B: DeviceBuffer + ?Sized> {
    pub src: View<'a, B>,
    pub dst: HostSliceMut<'a>,
}
