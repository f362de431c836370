//! aclnn's objects (`libnnopbase.so`): tensors, scalars, int arrays, tensor lists and op
//! executors, plus executor reuse (`aclSetAclOpExecutorRepeatable`, `aclSetInputTensorAddr`,
//! `aclSetOutputTensorAddr`, `aclDestroyAclOpExecutor`) and the leak report.
//!
//! Strictness: a destroyed object used again, or destroyed twice, is refused with
//! ACLNN_ERR_PARAM_INVALID; an executor runs once unless made repeatable (a second launch of a
//! consumed executor is refused); a reused executor's refreshed tensor address must be 32-byte
//! aligned (`aclSetInputTensorAddr` / `aclSetOutputTensorAddr`); objects still alive at `aclFinalize` or process exit are
//! reported on stderr, each with what it was.

use core::ffi::{c_char, c_void};

use npu_ffi::types::*;

use crate::ops::Kernel;
use crate::state::*;
use crate::view::{DType, View};

pub enum Obj {
    Tensor {
        view: View,
        alive: bool,
    },
    /// `float`: created with a floating-point data type (FLOAT, FLOAT16, DOUBLE), which type
    /// promotion with an integer tensor turns into a float result.
    Scalar {
        value: f64,
        float: bool,
        alive: bool,
    },
    IntArray {
        values: Vec<i64>,
        alive: bool,
    },
    TensorList {
        items: Vec<u64>,
        alive: bool,
    },
}

impl Obj {
    fn alive(&self) -> bool {
        match self {
            Obj::Tensor { alive, .. }
            | Obj::Scalar { alive, .. }
            | Obj::IntArray { alive, .. }
            | Obj::TensorList { alive, .. } => *alive,
        }
    }
    fn kill(&mut self) {
        match self {
            Obj::Tensor { alive, .. }
            | Obj::Scalar { alive, .. }
            | Obj::IntArray { alive, .. }
            | Obj::TensorList { alive, .. } => *alive = false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecState {
    /// Returned by a GetWorkspaceSize call, not launched yet.
    Fresh,
    /// Launched (a non-repeatable executor is consumed by its launch).
    Consumed,
    Destroyed,
}

pub struct Executor {
    pub kernel: Box<dyn Kernel>,
    pub repeatable: bool,
    pub state: ExecState,
}

fn lookup(st: &State, h: u64, kind: u64, what: &str) -> Result<(), Fail> {
    if h == 0 {
        return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{what} is a null pointer"));
    }
    match st.handles.get(&h) {
        Some(o) if h >> 48 == kind => {
            if !o.alive() {
                return fail(
                    ACLNN_ERR_PARAM_INVALID,
                    format!(
                        "{what} ({} {h:#x}) was already destroyed and is used again",
                        kind_name(kind)
                    ),
                );
            }
            Ok(())
        }
        _ => fail(
            ACLNN_ERR_PARAM_INVALID,
            format!("{what} ({h:#x}) is not a live {}", kind_name(kind)),
        ),
    }
}

impl State {
    /// A live tensor's description, its storage checked to lie in device memory.
    pub fn tensor(&self, h: *const aclTensor, what: &str) -> Result<View, Fail> {
        let h = h as u64;
        lookup(self, h, KIND_TENSOR, what)?;
        let Some(Obj::Tensor { view, .. }) = self.handles.get(&h) else {
            unreachable!()
        };
        if view.numel() > 0 {
            let bytes = view.storage_bytes();
            self.device_range(view.addr, bytes, what)
                .map_err(|f| Fail {
                    code: ACLNN_ERR_PARAM_INVALID,
                    msg: f.msg,
                })?;
        }
        Ok(view.clone())
    }

    pub fn opt_tensor(&self, h: *const aclTensor, what: &str) -> Result<Option<View>, Fail> {
        if h.is_null() {
            Ok(None)
        } else {
            self.tensor(h, what).map(Some)
        }
    }

    pub fn scalar(&self, h: *const aclScalar, what: &str) -> Result<f64, Fail> {
        self.typed_scalar(h, what).map(|(v, _)| v)
    }

    /// A live scalar's value and whether its data type is a floating-point one.
    pub fn typed_scalar(&self, h: *const aclScalar, what: &str) -> Result<(f64, bool), Fail> {
        lookup(self, h as u64, KIND_SCALAR, what)?;
        let Some(Obj::Scalar { value, float, .. }) = self.handles.get(&(h as u64)) else {
            unreachable!()
        };
        Ok((*value, *float))
    }

    pub fn int_array(&self, h: *const aclIntArray, what: &str) -> Result<Option<Vec<i64>>, Fail> {
        if h.is_null() {
            return Ok(None);
        }
        lookup(self, h as u64, KIND_INT_ARRAY, what)?;
        let Some(Obj::IntArray { values, .. }) = self.handles.get(&(h as u64)) else {
            unreachable!()
        };
        Ok(Some(values.clone()))
    }

    pub fn tensor_list(&self, h: *const aclTensorList, what: &str) -> Result<Vec<View>, Fail> {
        lookup(self, h as u64, KIND_TENSOR_LIST, what)?;
        let Some(Obj::TensorList { items, .. }) = self.handles.get(&(h as u64)) else {
            unreachable!()
        };
        items
            .iter()
            .enumerate()
            .map(|(i, &t)| self.tensor(t as *const aclTensor, &format!("{what}[{i}]")))
            .collect()
    }

    /// Everything still alive, one line each (empty when nothing leaked).
    pub fn leak_report(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut handles: Vec<_> = self.handles.iter().filter(|(_, o)| o.alive()).collect();
        handles.sort_by_key(|(h, _)| **h);
        for (h, o) in handles {
            out.push(match o {
                Obj::Tensor { view, .. } => format!(
                    "aclTensor {h:#x} {} at {:#x} never destroyed (aclDestroyTensor)",
                    view.shape_string(),
                    view.addr
                ),
                Obj::Scalar { value, .. } => {
                    format!("aclScalar {h:#x} ({value}) never destroyed (aclDestroyScalar)")
                }
                Obj::IntArray { values, .. } => {
                    format!("aclIntArray {h:#x} {values:?} never destroyed (aclDestroyIntArray)")
                }
                Obj::TensorList { items, .. } => format!(
                    "aclTensorList {h:#x} of {} tensors never destroyed (aclDestroyTensorList)",
                    items.len()
                ),
            });
        }
        for c in self.hccl_comms.values() {
            out.push(format!("{c} never destroyed (HcclCommDestroy)"));
        }
        out.extend(self.capture_leaks());
        let mut execs: Vec<_> = self.executors.iter().collect();
        execs.sort_by_key(|(h, _)| **h);
        for (h, e) in execs {
            match (e.state, e.repeatable) {
                (ExecState::Fresh, _) => out.push(format!("aclOpExecutor {h:#x} ({}) from GetWorkspaceSize never launched nor destroyed", e.kernel.name())),
                (ExecState::Consumed, true) => out.push(format!("repeatable aclOpExecutor {h:#x} ({}) never destroyed (aclDestroyAclOpExecutor)", e.kernel.name())),
                _ => {}
            }
        }
        for (addr, a) in &self.device_mem {
            out.push(format!(
                "device memory {addr:#x} ({} bytes, device {}) never freed (aclrtFree)",
                a.data.len(),
                a.device
            ));
        }
        for (ptr, h) in &self.host_mem {
            out.push(format!(
                "host memory {ptr:#x} ({} bytes) never freed (aclrtFreeHost)",
                h.layout.size()
            ));
        }
        let defaults: Vec<u64> = self.contexts.values().map(|c| c.default_stream).collect();
        for (s, st) in &self.streams {
            if !defaults.contains(s) {
                out.push(format!(
                    "aclrtStream {s:#x} (device {}) never destroyed (aclrtDestroyStream)",
                    st.device
                ));
            }
        }
        for e in self.events.keys() {
            out.push(format!(
                "aclrtEvent {e:#x} never destroyed (aclrtDestroyEvent)"
            ));
        }
        for (c, ctx) in &self.contexts {
            if !self.devices_set.values().any(|d| d == c) {
                out.push(format!(
                    "aclrtContext {c:#x} (device {}) never destroyed (aclrtDestroyContext)",
                    ctx.device
                ));
            }
        }
        for d in self.devices_set.keys() {
            out.push(format!(
                "device {d} set with aclrtSetDevice and never reset (aclrtResetDevice)"
            ));
        }
        out
    }
}

fn with_state<T>(default: T, f: impl FnOnce(&mut State) -> Result<T, Fail>) -> T {
    let mut st = state();
    match f(&mut st) {
        Ok(v) => v,
        Err(e) => {
            set_error(&e.msg);
            default
        }
    }
}

fn status(f: impl FnOnce(&mut State) -> Result<(), Fail>) -> aclnnStatus {
    let mut st = state();
    finish(f(&mut st))
}

fn destroy(h: u64, kind: u64, what: &str) -> aclnnStatus {
    status(|st| {
        lookup(st, h, kind, what)?;
        st.handles.get_mut(&h).expect("looked up").kill();
        Ok(())
    })
}

fn dims_from(ptr: *const i64, n: u64) -> Option<Vec<i64>> {
    if n > 8 * 1024 {
        return None;
    }
    if n == 0 {
        return Some(Vec::new());
    }
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the caller passes `n` int64 values at `ptr` (the documented contract).
    Some(unsafe { std::slice::from_raw_parts(ptr, n as usize) }.to_vec())
}

/// # Safety
/// Pointer arguments follow aclCreateTensor's documented contract.
#[no_mangle]
pub unsafe extern "C" fn aclCreateTensor(
    viewDims: *const i64,
    viewDimsNum: u64,
    dataType: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storageDims: *const i64,
    storageDimsNum: u64,
    tensorData: *mut c_void,
) -> *mut aclTensor {
    with_state(std::ptr::null_mut(), |st| {
        let bad = |m: String| fail(ACLNN_ERR_PARAM_INVALID, format!("aclCreateTensor: {m}"));
        let Some(dims) = dims_from(viewDims, viewDimsNum) else {
            return bad("viewDims is null".into());
        };
        let Some(strides) = dims_from(stride, viewDimsNum) else {
            return bad("stride is null".into());
        };
        let Some(storage_dims) = dims_from(storageDims, storageDimsNum) else {
            return bad("storageDims is null".into());
        };
        if dims.len() > 8 {
            return bad(format!("{} dimensions (at most 8)", dims.len()));
        }
        let Some(dtype) = DType::from_acl(dataType) else {
            return bad(format!(
                "data type {dataType} is not one this emulation knows"
            ));
        };
        if dims.iter().any(|&d| d < 0)
            || strides.iter().any(|&s| s < 0)
            || offset < 0
            || storage_dims.iter().any(|&d| d < 0)
        {
            return bad(format!(
                "negative dims/strides/offset: dims {dims:?} strides {strides:?} offset {offset}"
            ));
        }
        let view = View {
            dims,
            strides,
            offset,
            dtype,
            format,
            storage_dims,
            addr: tensorData as u64,
        };
        if let Some(max) = view.max_elem() {
            if max as u64 >= view.storage_elems() {
                return bad(format!(
                    "view {:?} strides {:?} offset {} reaches element {max} beyond the storage shape {:?}",
                    view.dims, view.strides, view.offset, view.storage_dims
                ));
            }
        }
        let h = st.new_handle(KIND_TENSOR);
        st.handles.insert(h, Obj::Tensor { view, alive: true });
        Ok(h as *mut aclTensor)
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus {
    destroy(tensor as u64, KIND_TENSOR, "aclDestroyTensor(tensor)")
}

/// # Safety
/// `value` points at one value of `dataType`.
#[no_mangle]
pub unsafe extern "C" fn aclCreateScalar(
    value: *mut c_void,
    dataType: aclDataType,
) -> *mut aclScalar {
    with_state(std::ptr::null_mut(), |st| {
        if value.is_null() {
            return fail(ACLNN_ERR_PARAM_NULLPTR, "aclCreateScalar: value is null");
        }
        // SAFETY: `value` points at one value of `dataType` (documented contract).
        let v = unsafe {
            match dataType {
                ACL_FLOAT => *(value as *const f32) as f64,
                ACL_DOUBLE => *(value as *const f64),
                ACL_FLOAT16 => half::f16::from_bits(*(value as *const u16)).to_f64(),
                ACL_INT32 => *(value as *const i32) as f64,
                ACL_INT64 => *(value as *const i64) as f64,
                _ => {
                    return fail(
                        ACLNN_ERR_PARAM_INVALID,
                        format!("aclCreateScalar: data type {dataType} not emulated"),
                    )
                }
            }
        };
        let h = st.new_handle(KIND_SCALAR);
        st.handles.insert(
            h,
            Obj::Scalar {
                value: v,
                float: matches!(dataType, ACL_FLOAT | ACL_DOUBLE | ACL_FLOAT16),
                alive: true,
            },
        );
        Ok(h as *mut aclScalar)
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus {
    destroy(scalar as u64, KIND_SCALAR, "aclDestroyScalar(scalar)")
}

/// # Safety
/// `value` points at `size` int64 values.
#[no_mangle]
pub unsafe extern "C" fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray {
    with_state(std::ptr::null_mut(), |st| {
        let Some(values) = dims_from(value, size) else {
            return fail(ACLNN_ERR_PARAM_NULLPTR, "aclCreateIntArray: value is null");
        };
        let h = st.new_handle(KIND_INT_ARRAY);
        st.handles.insert(
            h,
            Obj::IntArray {
                values,
                alive: true,
            },
        );
        Ok(h as *mut aclIntArray)
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus {
    destroy(array as u64, KIND_INT_ARRAY, "aclDestroyIntArray(array)")
}

/// # Safety
/// `value` points at `size` tensor handles.
#[no_mangle]
pub unsafe extern "C" fn aclCreateTensorList(
    value: *const *const aclTensor,
    size: u64,
) -> *mut aclTensorList {
    with_state(std::ptr::null_mut(), |st| {
        if value.is_null() || size == 0 || size > 1024 {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                "aclCreateTensorList: null or empty list",
            );
        }
        // SAFETY: `value` points at `size` handles (documented contract).
        let items: Vec<u64> = unsafe { std::slice::from_raw_parts(value, size as usize) }
            .iter()
            .map(|&p| p as u64)
            .collect();
        for (i, &t) in items.iter().enumerate() {
            lookup(
                st,
                t,
                KIND_TENSOR,
                &format!("aclCreateTensorList(value[{i}])"),
            )?;
        }
        let h = st.new_handle(KIND_TENSOR_LIST);
        st.handles.insert(h, Obj::TensorList { items, alive: true });
        Ok(h as *mut aclTensorList)
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyTensorList(array: *const aclTensorList) -> aclnnStatus {
    // Documented: the aclTensors in the list are destroyed with it (and must not be again).
    status(|st| {
        let h = array as u64;
        lookup(st, h, KIND_TENSOR_LIST, "aclDestroyTensorList(array)")?;
        let Some(Obj::TensorList { items, .. }) = st.handles.get(&h) else {
            unreachable!()
        };
        for t in items.clone() {
            lookup(
                st,
                t,
                KIND_TENSOR,
                "aclDestroyTensorList: a tensor of the list",
            )?;
            st.handles.get_mut(&t).expect("looked up").kill();
        }
        st.handles.get_mut(&h).expect("looked up").kill();
        Ok(())
    })
}

fn executor_mut<'a>(st: &'a mut State, h: u64, what: &str) -> Result<&'a mut Executor, Fail> {
    match st.executors.get_mut(&h) {
        None => fail(ACLNN_ERR_PARAM_INVALID, format!("{what}: {h:#x} is not an aclOpExecutor")),
        Some(e) if e.state == ExecState::Destroyed => {
            fail(ACLNN_ERR_PARAM_INVALID, format!("{what}: executor {h:#x} was destroyed and is used again"))
        }
        Some(e) if e.state == ExecState::Consumed && !e.repeatable => fail(
            ACLNN_ERR_PARAM_INVALID,
            format!("{what}: executor {h:#x} already ran once and is not repeatable (aclSetAclOpExecutorRepeatable)"),
        ),
        Some(e) => Ok(e),
    }
}

#[no_mangle]
pub extern "C" fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus {
    status(|st| {
        let e = executor_mut(st, executor as u64, "aclSetAclOpExecutorRepeatable")?;
        if e.state != ExecState::Fresh {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                "aclSetAclOpExecutorRepeatable: set it before the first launch",
            );
        }
        e.repeatable = true;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus {
    status(|st| {
        let h = executor as u64;
        let e = executor_mut(st, h, "aclDestroyAclOpExecutor")?;
        if !e.repeatable {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                "aclDestroyAclOpExecutor: only executors made repeatable are destroyed by the caller",
            );
        }
        e.state = ExecState::Destroyed;
        Ok(())
    })
}

fn set_addr(
    executor: *mut aclOpExecutor,
    output: bool,
    index: usize,
    tensor: *mut aclTensor,
    addr: *mut c_void,
) -> aclnnStatus {
    status(|st| {
        let what = if output {
            "aclSetOutputTensorAddr"
        } else {
            "aclSetInputTensorAddr"
        };
        lookup(st, tensor as u64, KIND_TENSOR, what)?;
        let e = executor_mut(st, executor as u64, what)?;
        if !e.repeatable {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                format!("{what}: the executor is not repeatable"),
            );
        }
        if !(addr as u64).is_multiple_of(32) {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                format!("{what}: address {addr:p} is not 32-byte aligned (the page requires it)"),
            );
        }
        let io = e.kernel.io_mut();
        let list = if output { &mut io.outs } else { &mut io.ins };
        let n = list.len();
        let Some(v) = list.get_mut(index) else {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                format!("{what}: index {index} out of range ({n} tensors)"),
            );
        };
        let mut nv = v.clone();
        nv.addr = addr as u64;
        let bytes = nv.storage_bytes();
        let snapshot = nv.clone();
        *v = nv;
        st.device_range(addr as u64, bytes, what)
            .map_err(|f| Fail {
                code: ACLNN_ERR_PARAM_INVALID,
                msg: f.msg,
            })?;
        if let Some(Obj::Tensor { view, .. }) = st.handles.get_mut(&(tensor as u64)) {
            view.addr = snapshot.addr;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclSetInputTensorAddr(
    executor: *mut aclOpExecutor,
    index: usize,
    tensor: *mut aclTensor,
    addr: *mut c_void,
) -> aclnnStatus {
    set_addr(executor, false, index, tensor, addr)
}

#[no_mangle]
pub extern "C" fn aclSetOutputTensorAddr(
    executor: *mut aclOpExecutor,
    index: usize,
    tensor: *mut aclTensor,
    addr: *mut c_void,
) -> aclnnStatus {
    set_addr(executor, true, index, tensor, addr)
}

/// Emulation-only extension (not part of CANN): writes the current leak report (one object per
/// line, empty when nothing is alive) into `buf` (NUL-terminated, truncated to `len`) and returns
/// the report's full length. Tests use it to see what is still alive.
///
/// # Safety
/// `buf` points at `len` writable bytes (or is null with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn ascendEmulatorLeakReport(buf: *mut c_char, len: usize) -> usize {
    let text = state().leak_report().join("\n");
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: `buf` has `len` bytes; `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

// Compile-time check: every export has the declared prototype of npu-ffi.
const _: () = {
    use npu_ffi::aclnn::base::sig;
    let _: sig::aclCreateTensor = aclCreateTensor;
    let _: sig::aclDestroyTensor = aclDestroyTensor;
    let _: sig::aclCreateScalar = aclCreateScalar;
    let _: sig::aclDestroyScalar = aclDestroyScalar;
    let _: sig::aclCreateIntArray = aclCreateIntArray;
    let _: sig::aclDestroyIntArray = aclDestroyIntArray;
    let _: sig::aclCreateTensorList = aclCreateTensorList;
    let _: sig::aclDestroyTensorList = aclDestroyTensorList;
    let _: sig::aclSetAclOpExecutorRepeatable = aclSetAclOpExecutorRepeatable;
    let _: sig::aclDestroyAclOpExecutor = aclDestroyAclOpExecutor;
    let _: sig::aclSetInputTensorAddr = aclSetInputTensorAddr;
    let _: sig::aclSetOutputTensorAddr = aclSetOutputTensorAddr;
};
