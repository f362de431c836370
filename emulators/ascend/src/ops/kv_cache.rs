//! Writing new tokens' K/V into the paged cache by slot mapping: ScatterPaKvCache in its "Norm"
//! layout (key/value (T, N, D), caches (blockNum, blockSize, N, D), slotMapping (T) of INT32 or
//! INT64 with every slot in [0, blockNum·blockSize) and no slot twice; scatterMode null or
//! "None", so contiguous key/value), and the older
//! ScatterNdUpdate (`varRef[indices[i]] = updates[i]`), its documented equivalent over a cache
//! viewed as (blockNum·blockSize, N·D) rows. Out-of-range or repeated slots fail the stream.

use core::ffi::{c_char, CStr};

use npu_ffi::types::*;

use super::{dtype_in, invalid, kernel_common, nd, prepare, read, write, Io, Kernel};
use crate::state::*;
use crate::view::{DType, View};

/// Rows `rows` of a view whose first dimension indexes rows, as a view of one row.
fn row_view(v: &View, first_dims: usize, flat_row: i64) -> View {
    // Decompose the flat row index over the first `first_dims` dimensions.
    let mut rem = flat_row;
    let mut offset = v.offset;
    for ax in (0..first_dims).rev() {
        offset += (rem % v.dims[ax]) * v.strides[ax];
        rem /= v.dims[ax];
    }
    View {
        dims: v.dims[first_dims..].to_vec(),
        strides: v.strides[first_dims..].to_vec(),
        offset,
        ..v.clone()
    }
}

fn scatter_rows(
    st: &mut State,
    op: &str,
    src: &View,
    dst: &View,
    dst_row_dims: usize,
    slots: &[i64],
) -> Result<(), Fail> {
    let rows: i64 = dst.dims[..dst_row_dims].iter().product();
    let mut seen = std::collections::HashSet::new();
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 || slot >= rows {
            return fail(
                ACL_ERROR_RT_AICORE_EXCEPTION,
                format!("{op}: slot {slot} of token {t} is outside [0, {rows})"),
            );
        }
        if !seen.insert(slot) {
            return fail(
                ACL_ERROR_RT_AICORE_EXCEPTION,
                format!("{op}: slot {slot} is written twice (slots must not repeat)"),
            );
        }
        let vals = read(st, &row_view(src, 1, t as i64))?;
        write(st, &row_view(dst, dst_row_dims, slot), &vals)?;
    }
    Ok(())
}

#[derive(Clone)]
struct ScatterPa {
    io: Io,
}

impl Kernel for ScatterPa {
    kernel_common!("aclnnScatterPaKvCache");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let slots: Vec<i64> = read(st, &self.io.ins[1])?
            .into_iter()
            .map(|v| v as i64)
            .collect();
        let (k, v) = (self.io.ins[0].clone(), self.io.ins[2].clone());
        let (kc, vc) = (self.io.outs[0].clone(), self.io.outs[1].clone());
        scatter_rows(st, self.name(), &k, &kc, 2, &slots)?;
        scatter_rows(st, self.name(), &v, &vc, 2, &slots)
    }
}

fn opt_str(p: *mut c_char) -> Option<String> {
    // SAFETY: a non-null mode is a NUL-terminated string (documented contract).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// # Safety
/// Pointer arguments follow the documented contract.
#[no_mangle]
pub unsafe extern "C" fn aclnnScatterPaKvCacheGetWorkspaceSize(
    key: *const aclTensor,
    keyCacheRef: *mut aclTensor,
    slotMapping: *const aclTensor,
    value: *const aclTensor,
    valueCacheRef: *mut aclTensor,
    compressLensOptional: *const aclTensor,
    compressSeqOffsetOptional: *const aclTensor,
    seqLensOptional: *const aclTensor,
    cacheModeOptional: *mut c_char,
    scatterModeOptional: *mut c_char,
    stridesOptional: *const aclIntArray,
    offsetsOptional: *const aclIntArray,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    let cache_mode = opt_str(cacheModeOptional);
    let scatter_mode = opt_str(scatterModeOptional);
    prepare("aclnnScatterPaKvCache", workspaceSize, executor, |st| {
        let op = "aclnnScatterPaKvCache";
        let k = st.tensor(key, "key")?;
        let kc = st.tensor(keyCacheRef, "keyCacheRef")?;
        let sm = st.tensor(slotMapping, "slotMapping")?;
        let v = st.tensor(value, "value")?;
        let vc = st.tensor(valueCacheRef, "valueCacheRef")?;
        if !compressLensOptional.is_null()
            || !compressSeqOffsetOptional.is_null()
            || !seqLensOptional.is_null()
        {
            return invalid(
                op,
                "the compressed scenarios are not implemented by this emulation",
            );
        }
        // strides / offsets: two values each (key's, value's), read only in "Nct" mode; with
        // "None" they are the defaults torch_npu passes ({1, 1} and {0, 0}).
        for (name, p) in [
            ("stridesOptional", stridesOptional),
            ("offsetsOptional", offsetsOptional),
        ] {
            if let Some(a) = st.int_array(p, name)? {
                if a.len() != 2 {
                    return invalid(
                        op,
                        format!("{name} must hold 2 values (key's and value's), got {a:?}"),
                    );
                }
            }
        }
        if !matches!(cache_mode.as_deref(), None | Some("Norm")) {
            return invalid(
                op,
                format!(
                    "cacheMode {cache_mode:?} is not implemented by this emulation (\"Norm\" is)"
                ),
            );
        }
        if !matches!(scatter_mode.as_deref(), None | Some("None")) {
            return invalid(op, format!("scatterMode {scatter_mode:?} is not implemented by this emulation (\"None\" is)"));
        }
        // Null or "None": the new key and value are documented as contiguous (strided ones take
        // the "Nct" mode with their strides); the caches are non-contiguous nowhere.
        for (w, t) in [("key", &k), ("value", &v)] {
            if !t.is_contiguous() {
                return invalid(op, format!("{w} {:?} with strides {:?} is not contiguous; scatterMode {scatter_mode:?} takes contiguous key and value (\"Nct\" is the documented mode for strided ones)", t.dims, t.strides));
            }
        }
        super::contiguity::check(op, &[("keyCacheRef", &kc), ("valueCacheRef", &vc)])?;
        for (w, t) in [
            ("key", &k),
            ("keyCacheRef", &kc),
            ("value", &v),
            ("valueCacheRef", &vc),
        ] {
            dtype_in(op, w, t, &[DType::F16, DType::Bf16, DType::I8])?;
            nd(op, w, t)?;
            if t.dtype != k.dtype {
                return invalid(
                    op,
                    "key, keyCacheRef, value and valueCacheRef must share one data type",
                );
            }
        }
        dtype_in(op, "slotMapping", &sm, &[DType::I32, DType::I64])?;
        if k.rank() != 3 || v.rank() != 3 || kc.rank() != 4 || vc.rank() != 4 || sm.rank() != 1 {
            return invalid(op, format!("Norm scenario: key/value (T, N, D), caches (blockNum, blockSize, N, D), slotMapping (T); got key {:?} value {:?} keyCache {:?} valueCache {:?} slotMapping {:?}", k.dims, v.dims, kc.dims, vc.dims, sm.dims));
        }
        if k.dims[..2] != v.dims[..2] || sm.dims[0] != k.dims[0] {
            return invalid(
                op,
                "key, value and slotMapping must agree on T (and key/value on N)",
            );
        }
        if kc.dims[2..] != k.dims[1..]
            || vc.dims[2..] != v.dims[1..]
            || kc.dims[..2] != vc.dims[..2]
        {
            return invalid(
                op,
                format!(
                    "caches {:?}/{:?} do not hold rows of key {:?}/value {:?}",
                    kc.dims, vc.dims, k.dims, v.dims
                ),
            );
        }
        Ok(Box::new(ScatterPa {
            io: Io {
                ins: vec![k, sm, v],
                outs: vec![kc, vc],
            },
        }))
    })
}

#[derive(Clone)]
struct ScatterNd {
    io: Io,
}

impl Kernel for ScatterNd {
    kernel_common!("aclnnScatterNdUpdate");
    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (idx, upd, var) = (
            &self.io.ins[0],
            self.io.ins[1].clone(),
            self.io.outs[0].clone(),
        );
        let q = idx.dims[1] as usize;
        let raw: Vec<i64> = read(st, idx)?.into_iter().map(|v| v as i64).collect();
        let mut slots = Vec::with_capacity(idx.dims[0] as usize);
        for (t, ix) in raw.chunks(q).enumerate() {
            let mut flat = 0;
            for (a, &i) in ix.iter().enumerate() {
                if i < 0 || i >= var.dims[a] {
                    return fail(
                        ACL_ERROR_RT_AICORE_EXCEPTION,
                        format!(
                            "aclnnScatterNdUpdate: index {i} of row {t} is outside [0, {})",
                            var.dims[a]
                        ),
                    );
                }
                flat = flat * var.dims[a] + i;
            }
            slots.push(flat);
        }
        scatter_rows(st, self.name(), &upd, &var, q, &slots)
    }
}

/// # Safety
/// Out-pointers valid (documented contract).
#[no_mangle]
pub unsafe extern "C" fn aclnnScatterNdUpdateGetWorkspaceSize(
    varRef: *mut aclTensor,
    indices: *const aclTensor,
    updates: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    prepare("aclnnScatterNdUpdate", workspaceSize, executor, |st| {
        let op = "aclnnScatterNdUpdate";
        let var = st.tensor(varRef, "varRef")?;
        let idx = st.tensor(indices, "indices")?;
        let upd = st.tensor(updates, "updates")?;
        dtype_in(
            op,
            "varRef",
            &var,
            &[
                DType::F16,
                DType::F32,
                DType::Bf16,
                DType::I8,
                DType::Bool,
                DType::I64,
            ],
        )?;
        dtype_in(op, "indices", &idx, &[DType::I32, DType::I64])?;
        if upd.dtype != var.dtype {
            return invalid(op, "updates must have varRef's data type");
        }
        if idx.rank() != 2 || idx.dims[1] < 1 || idx.dims[1] as usize > var.rank() {
            return invalid(
                op,
                format!(
                    "indices {:?} must be (T, q) with 1 <= q <= rank(varRef) = {}",
                    idx.dims,
                    var.rank()
                ),
            );
        }
        let q = idx.dims[1] as usize;
        let mut want = vec![idx.dims[0]];
        want.extend_from_slice(&var.dims[q..]);
        if upd.dims != want {
            return invalid(op, format!("updates shape {:?} must be {want:?}", upd.dims));
        }
        Ok(Box::new(ScatterNd {
            io: Io {
                ins: vec![idx, upd],
                outs: vec![var],
            },
        }))
    })
}

const _: () = {
    use npu_ffi::aclnn::ops::sig;
    let _: sig::aclnnScatterPaKvCacheGetWorkspaceSize = aclnnScatterPaKvCacheGetWorkspaceSize;
    let _: sig::aclnnScatterNdUpdateGetWorkspaceSize = aclnnScatterNdUpdateGetWorkspaceSize;
};
