//! aclnn's objects as owned values: [`Tensor`] (a strided view over a device buffer, created with
//! `aclCreateTensor`, destroyed on drop), [`IntArray`], [`Scalar`] and [`TensorList`] (which takes
//! its tensors over: `aclDestroyTensorList` destroys them, as documented).

use core::ffi::c_void;

use npu_ffi::types::*;

use crate::error::{AscendError, Result};
use crate::memory::DeviceBuffer;
use crate::runtime::Acl;

/// Element types the backend hands to aclnn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    Bf16,
    I8,
    I4,
    I32,
    I64,
    U8,
    Bool,
}

impl DType {
    pub fn acl(self) -> aclDataType {
        match self {
            Self::F32 => ACL_FLOAT,
            Self::F16 => ACL_FLOAT16,
            Self::Bf16 => ACL_BF16,
            Self::I8 => ACL_INT8,
            Self::I4 => ACL_INT4,
            Self::I32 => ACL_INT32,
            Self::I64 => ACL_INT64,
            Self::U8 => ACL_UINT8,
            Self::Bool => ACL_BOOL,
        }
    }

    pub fn bits(self) -> usize {
        match self {
            Self::I4 => 4,
            Self::I8 | Self::U8 | Self::Bool => 8,
            Self::F16 | Self::Bf16 => 16,
            Self::F32 | Self::I32 => 32,
            Self::I64 => 64,
        }
    }

    /// Bytes of `n` elements.
    pub fn bytes(self, n: usize) -> usize {
        (n * self.bits()).div_ceil(8)
    }
}

/// A strided view: shape, strides and offset in elements.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct View {
    pub dtype: DType,
    pub dims: Vec<i64>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

impl View {
    /// A dense row-major view.
    pub fn contiguous(dtype: DType, dims: &[i64]) -> Self {
        let mut strides = vec![1i64; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        Self {
            dtype,
            dims: dims.to_vec(),
            strides,
            offset: 0,
        }
    }

    pub fn strided(dtype: DType, dims: &[i64], strides: &[i64], offset: i64) -> Self {
        Self {
            dtype,
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            offset,
        }
    }

    /// Elements of storage the view reaches (0 when empty).
    pub fn extent(&self) -> i64 {
        if self.dims.contains(&0) {
            return 0;
        }
        self.offset
            + 1
            + self
                .dims
                .iter()
                .zip(&self.strides)
                .map(|(d, s)| (d - 1) * s)
                .sum::<i64>()
    }

    pub fn describe(&self) -> String {
        format!("{:?}{:?}", self.dtype, self.dims)
    }
}

pub struct Tensor {
    acl: &'static Acl,
    raw: *mut aclTensor,
    view: View,
}

// SAFETY: an aclTensor handle is a descriptor owned uniquely by this value.
unsafe impl Send for Tensor {}

impl Tensor {
    /// A tensor over `buf` with `view`; the view must fit in the buffer.
    pub fn new(acl: &'static Acl, buf: &DeviceBuffer, view: View) -> Result<Tensor> {
        // SAFETY: `buf` is a live device allocation of `buf.bytes()` bytes.
        unsafe { Self::at(acl, buf.ptr(), buf.bytes(), view) }
    }

    /// A tensor over device memory at `addr` holding `bytes` bytes.
    ///
    /// # Safety
    /// `addr` must be device memory of at least `bytes` bytes that outlives every kernel the
    /// tensor is given to (the device reads and writes it through the view).
    pub unsafe fn at(
        acl: &'static Acl,
        addr: *mut c_void,
        bytes: usize,
        view: View,
    ) -> Result<Tensor> {
        if view.dims.len() != view.strides.len()
            || view.dims.iter().chain(&view.strides).any(|&d| d < 0)
            || view.offset < 0
        {
            return Err(AscendError::Invalid(format!("malformed view {view:?}")));
        }
        let extent = view.extent();
        if view.dtype.bytes(extent as usize) > bytes {
            return Err(AscendError::Invalid(format!(
                "view {view:?} reaches past a {bytes}-byte buffer"
            )));
        }
        let storage = [extent];
        // SAFETY: the arrays live across the call and hold `dims.len()` / 1 values.
        let raw = unsafe {
            (acl.api.base.aclCreateTensor)(
                view.dims.as_ptr(),
                view.dims.len() as u64,
                view.dtype.acl(),
                view.strides.as_ptr(),
                view.offset,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                addr,
            )
        };
        if raw.is_null() {
            return Err(AscendError::Call {
                call: "aclCreateTensor",
                code: 0,
                name: "nullptr",
                message: acl.last_message(),
            });
        }
        Ok(Tensor { acl, raw, view })
    }

    pub fn raw(&self) -> *mut aclTensor {
        self.raw
    }

    pub fn view(&self) -> &View {
        &self.view
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: owned handle, destroyed once.
            unsafe { (self.acl.api.base.aclDestroyTensor)(self.raw) };
        }
    }
}

pub struct IntArray {
    acl: &'static Acl,
    raw: *mut aclIntArray,
    pub values: Vec<i64>,
}

impl IntArray {
    pub fn new(acl: &'static Acl, values: &[i64]) -> Result<IntArray> {
        // SAFETY: `values` is live for the call; the array is copied by aclCreateIntArray.
        let raw = unsafe { (acl.api.base.aclCreateIntArray)(values.as_ptr(), values.len() as u64) };
        if raw.is_null() {
            return Err(AscendError::Call {
                call: "aclCreateIntArray",
                code: 0,
                name: "nullptr",
                message: acl.last_message(),
            });
        }
        Ok(IntArray {
            acl,
            raw,
            values: values.to_vec(),
        })
    }

    pub fn raw(&self) -> *const aclIntArray {
        self.raw
    }
}

impl Drop for IntArray {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { (self.acl.api.base.aclDestroyIntArray)(self.raw) };
    }
}

pub struct Scalar {
    acl: &'static Acl,
    raw: *mut aclScalar,
}

// SAFETY: an aclScalar handle is a host object owned uniquely by this value.
unsafe impl Send for Scalar {}

impl Scalar {
    pub fn f32(acl: &'static Acl, mut v: f32) -> Result<Scalar> {
        // SAFETY: `v` is a live f32 the call copies.
        let raw = unsafe { (acl.api.base.aclCreateScalar)((&mut v as *mut f32).cast(), ACL_FLOAT) };
        if raw.is_null() {
            return Err(AscendError::Call {
                call: "aclCreateScalar",
                code: 0,
                name: "nullptr",
                message: acl.last_message(),
            });
        }
        Ok(Scalar { acl, raw })
    }

    pub fn raw(&self) -> *const aclScalar {
        self.raw
    }
}

impl Drop for Scalar {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { (self.acl.api.base.aclDestroyScalar)(self.raw) };
    }
}

pub struct TensorList {
    acl: &'static Acl,
    raw: *mut aclTensorList,
    pub views: Vec<View>,
}

impl TensorList {
    /// Takes `tensors` over: the list destroys them.
    pub fn new(acl: &'static Acl, tensors: Vec<Tensor>) -> Result<TensorList> {
        let raws: Vec<*const aclTensor> =
            tensors.iter().map(|t| t.raw as *const aclTensor).collect();
        // SAFETY: `raws` holds live tensor handles for the call.
        let raw = unsafe { (acl.api.base.aclCreateTensorList)(raws.as_ptr(), raws.len() as u64) };
        if raw.is_null() {
            return Err(AscendError::Call {
                call: "aclCreateTensorList",
                code: 0,
                name: "nullptr",
                message: acl.last_message(),
            });
        }
        let views = tensors.iter().map(|t| t.view.clone()).collect();
        // The list owns its tensors now: aclDestroyTensorList destroys them.
        tensors.into_iter().for_each(std::mem::forget);
        Ok(TensorList { acl, raw, views })
    }

    pub fn raw(&self) -> *const aclTensorList {
        self.raw
    }
}

impl Drop for TensorList {
    fn drop(&mut self) {
        // SAFETY: owned handle (and its tensors), destroyed once.
        unsafe { (self.acl.api.base.aclDestroyTensorList)(self.raw) };
    }
}
