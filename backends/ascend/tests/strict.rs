//! The emulation refuses what CANN's documentation forbids, with the documented status codes,
//! and reports what was never destroyed. These calls go through the same wrappers and raw
//! function tables the backend uses.

mod common;

use common::*;
use npu_backend_ascend::memory::PinnedBuffer;
use npu_backend_ascend::ops::{Attention, OpRunner};
use npu_backend_ascend::tensor::{DType, Tensor, View};
use npu_backend_ascend::AscendError;
use npu_ffi::types::*;

fn code(e: AscendError) -> (i32, String) {
    match e {
        AscendError::Call { code, message, .. } => (code, message),
        other => panic!("expected a failed call, got {other}"),
    }
}

#[test]
fn misaligned_device_copy_is_refused() {
    let dev = device();
    let mut a = zeros(256);
    let b = zeros(256);
    let e = a.copy_from_async(4, &b, 0, 64, &dev).unwrap_err();
    let (c, msg) = code(e);
    assert_eq!(c, ACL_ERROR_RT_ADDR_UNALIGNED, "{msg}");
    assert!(msg.contains("64-byte aligned"), "{msg}");
    a.copy_from_async(64, &b, 128, 64, &dev).unwrap();
    dev.synchronize().unwrap();
}

fn attention_with_block_size(block_size: i64) -> Result<(), AscendError> {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (heads, d, blocks) = (2i64, 16i64, 4i64);
    let kc = zeros((blocks * block_size * heads * d * 2) as usize);
    let vc = zeros((blocks * block_size * heads * d * 2) as usize);
    let (qb, ob, tb) = (
        upload_f16(&vec![0.5; (heads * d) as usize]),
        zeros((heads * d * 2) as usize),
        upload_i32(&[0, 1]),
    );
    let (qt, ot) = (
        t(&qb, DType::F16, &[1, 1, heads * d]),
        t(&ob, DType::F16, &[1, 1, heads * d]),
    );
    let bt = t(&tb, DType::I32, &[1, 2]);
    let r = ops.attention(&Attention {
        query: &qt,
        out: &ot,
        key_cache: &kc,
        value_cache: &vc,
        cache_view: View::contiguous(DType::F16, &[blocks, block_size, heads * d]),
        block_table: &bt,
        mask: None,
        band: None,
        q_lens: &[1],
        kv_lens: &[3],
        heads,
        kv_heads: heads,
        block_size,
        scale: 0.25,
    });
    dev.synchronize()?;
    r
}

#[test]
fn block_size_24_is_refused_and_16_accepted() {
    let (c, msg) = code(attention_with_block_size(24).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(
        msg.contains("blockSize 24") && msg.contains("multiple of 16"),
        "{msg}"
    );
    attention_with_block_size(16).unwrap();
}

/// One attention call of `q_s` queries over `kv_len` cached positions (block size `bs`) with
/// `mask` (a buffer, its dtype and shape) and `band`.
fn attention_masked(
    q_s: i64,
    kv_len: i64,
    bs: i64,
    mask: Option<(&npu_backend_ascend::memory::DeviceBuffer, DType, &[i64])>,
    band: Option<i64>,
) -> Result<(), AscendError> {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (heads, d, blocks) = (2i64, 16i64, 4i64);
    let kc = zeros((blocks * bs * heads * d * 2) as usize);
    let vc = zeros((blocks * bs * heads * d * 2) as usize);
    let (qb, ob, tb) = (
        upload_f16(&vec![0.5; (q_s * heads * d) as usize]),
        zeros((q_s * heads * d * 2) as usize),
        upload_i32(&[0, 1, 2, 3]),
    );
    let (qt, ot) = (
        t(&qb, DType::F16, &[1, q_s, heads * d]),
        t(&ob, DType::F16, &[1, q_s, heads * d]),
    );
    let bt = t(&tb, DType::I32, &[1, 4]);
    let mt = mask.map(|(b, dt, dims)| t(b, dt, dims));
    let r = ops.attention(&Attention {
        query: &qt,
        out: &ot,
        key_cache: &kc,
        value_cache: &vc,
        cache_view: View::contiguous(DType::F16, &[blocks, bs, heads * d]),
        block_table: &bt,
        mask: mt.as_ref(),
        band,
        q_lens: &[q_s],
        kv_lens: &[kv_len],
        heads,
        kv_heads: heads,
        block_size: bs,
        scale: 0.25,
    });
    dev.synchronize()?;
    r
}

#[test]
fn sliding_window_masks_outside_the_documented_forms_are_refused() {
    let _dev = device();
    let causal: Vec<u8> = (0..2048 * 2048)
        .map(|i| ((i % 2048) > (i / 2048)) as u8)
        .collect();
    let big = upload(&causal);
    let keys = zeros(64);
    // The incremental branch (S = 1): a (B, 1, 1, KV_S) key mask reaching the blocks the KV
    // length needs (2 blocks of 16 for 20 positions) is taken...
    attention_masked(1, 20, 16, Some((&keys, DType::I8, &[1, 1, 1, 32])), None).unwrap();
    // ...one shorter than maxBlockNumPerSeq · blockSize is refused,
    let (c, msg) = code(
        attention_masked(1, 20, 16, Some((&keys, DType::I8, &[1, 1, 1, 16])), None).unwrap_err(),
    );
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("maxBlockNumPerSeq * blockSize"), "{msg}");
    // ...and so are a mask for another batch and the prompt branch's 2048×2048 one.
    let (c, msg) =
        code(attention_masked(1, 20, 16, Some((&keys, DType::I8, &[2, 32])), None).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("(B, 1, 1, KV_S)"), "{msg}");
    let (c, msg) = code(
        attention_masked(1, 20, 16, Some((&big, DType::I8, &[2048, 2048])), None).unwrap_err(),
    );
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    // The prompt branch (S > 1): band mode over the 2048×2048 mask is taken...
    attention_masked(3, 9, 128, Some((&big, DType::I8, &[2048, 2048])), Some(4)).unwrap();
    // ...with preTokens + nextTokens below 0 it is refused,
    let (c, msg) = code(
        attention_masked(3, 9, 128, Some((&big, DType::I8, &[2048, 2048])), Some(-1)).unwrap_err(),
    );
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("preTokens + nextTokens >= 0"), "{msg}");
    // ...and so is a mask of another size.
    let (c, msg) =
        code(attention_masked(3, 9, 128, Some((&keys, DType::I8, &[8, 8])), Some(4)).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("2048"), "{msg}");
}

/// A first phase's status and the emulation's message.
fn first_phase(rc: i32) -> (i32, String) {
    (rc, acl().last_message())
}

#[test]
fn gelu_and_multiply_misuses_are_refused() {
    let _dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let (xb, yb, ib) = (upload_f16(&[0.5; 32]), zeros(128), upload_i32(&[3; 32]));
    let x = t(&xb, DType::F16, &[4, 8]);
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let gelu = ops
        .aclnnGeluV2GetWorkspaceSize
        .expect("the emulation has GeluV2");
    // GeluV2: approximate is 0 (none) or 1 (tanh) only.
    let y = t(&yb, DType::F16, &[4, 8]);
    // SAFETY: live tensors and out-pointers.
    let (c, msg) = first_phase(unsafe { gelu(x.raw(), 2, y.raw(), &mut ws, &mut exec) });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("approximate 2"), "{msg}");
    // y must have x's data type and shape.
    let y32 = t(&yb, DType::F32, &[4, 8]);
    // SAFETY: as above.
    let (c, msg) = first_phase(unsafe { gelu(x.raw(), 1, y32.raw(), &mut ws, &mut exec) });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("one data type"), "{msg}");
    let y_short = t(&yb, DType::F16, &[4, 4]);
    // SAFETY: as above.
    let (c, msg) = first_phase(unsafe { gelu(x.raw(), 1, y_short.raw(), &mut ws, &mut exec) });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    // InplaceMuls: a float scalar cannot scale an INT32 tensor in place (the promoted type
    // does not convert back).
    let muls = ops
        .aclnnInplaceMulsGetWorkspaceSize
        .expect("the emulation has InplaceMuls");
    let ints = t(&ib, DType::I32, &[4, 8]);
    let half = npu_backend_ascend::tensor::Scalar::f32(acl, 0.5).unwrap();
    // SAFETY: live tensor, scalar and out-pointers.
    let (c, msg) = first_phase(unsafe { muls(ints.raw(), half.raw(), &mut ws, &mut exec) });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("cannot be stored back"), "{msg}");
    // InplaceMul: other must broadcast to selfRef's own shape.
    let mul = ops
        .aclnnInplaceMulGetWorkspaceSize
        .expect("the emulation has InplaceMul");
    let (row, wide) = (t(&xb, DType::F16, &[1, 8]), t(&yb, DType::F16, &[8, 8]));
    // SAFETY: live tensors and out-pointers.
    let (c, msg) = first_phase(unsafe { mul(row.raw(), wide.raw(), &mut ws, &mut exec) });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("must broadcast to selfRef"), "{msg}");
}

#[test]
fn host_pointer_used_as_device_pointer_is_refused() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let acl = acl();
    // A host buffer described as a tensor: refused when an operator is given it.
    let mut host = vec![0u8; 64];
    // SAFETY: deliberately breaks `Tensor::at`'s contract (host memory): the emulation must
    // refuse the operator that is given it, before any kernel runs.
    let ht = unsafe {
        Tensor::at(
            acl,
            host.as_mut_ptr().cast(),
            host.len(),
            View::contiguous(DType::F16, &[32]),
        )
    }
    .unwrap();
    let dv = zeros(64);
    let (c, msg) = code(
        ops.inplace_add(&t(&dv, DType::F16, &[32]), &ht)
            .unwrap_err(),
    );
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("not device memory"), "{msg}");
    // A host address as the destination of a host-to-device copy.
    let src = [0u8; 16];
    // SAFETY: both pointers are valid host memory; the emulated runtime refuses the call.
    let rc = unsafe {
        (acl.api.rt.aclrtMemcpy)(
            host.as_mut_ptr().cast(),
            16,
            src.as_ptr().cast(),
            16,
            ACL_MEMCPY_HOST_TO_DEVICE,
        )
    };
    assert_eq!(
        rc,
        ACL_ERROR_RT_INVALID_MEMORY_TYPE,
        "{}",
        acl.last_message()
    );
    drop(ht);
    dev.synchronize().unwrap();
}

#[test]
fn tensor_used_after_destroy_is_refused() {
    let dev = device();
    let acl = acl();
    let buf = zeros(64);
    let x = t(&buf, DType::F16, &[32]);
    let raw = x.raw();
    drop(x); // aclDestroyTensor
    let y = t(&buf, DType::F16, &[32]);
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let s = npu_backend_ascend::tensor::Scalar::f32(acl, 1.0).unwrap();
    // SAFETY: raw handles passed to the emulated API; `raw` is a destroyed handle on purpose.
    let rc = unsafe {
        (acl.api.ops.aclnnInplaceAddGetWorkspaceSize)(y.raw(), raw, s.raw(), &mut ws, &mut exec)
    };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        acl.last_message().contains("already destroyed"),
        "{}",
        acl.last_message()
    );
    // Destroying it a second time is refused too.
    // SAFETY: as above.
    assert_eq!(
        unsafe { (acl.api.base.aclDestroyTensor)(raw) },
        ACLNN_ERR_PARAM_INVALID
    );
    dev.synchronize().unwrap();
}

#[test]
fn short_workspace_and_spent_executor_are_refused() {
    let dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let (kc, vc) = (zeros(128 * 32 * 2), zeros(128 * 32 * 2));
    let (qb, ob, tb) = (upload_f16(&[0.1; 32]), zeros(64), upload_i32(&[0]));
    let q = t(&qb, DType::F16, &[1, 1, 32]);
    let o = t(&ob, DType::F16, &[1, 1, 32]);
    let bt = t(&tb, DType::I32, &[1, 1]);
    let kl =
        npu_backend_ascend::tensor::TensorList::new(acl, vec![t(&kc, DType::F16, &[1, 128, 32])])
            .unwrap();
    let vl =
        npu_backend_ascend::tensor::TensorList::new(acl, vec![t(&vc, DType::F16, &[1, 128, 32])])
            .unwrap();
    let kv = npu_backend_ascend::tensor::IntArray::new(acl, &[4]).unwrap();
    let mut layout = *b"BSH\0";
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let null = std::ptr::null::<aclTensor>();
    // SAFETY: live handles and out-pointers.
    let rc = unsafe {
        (ops.aclnnFusedInferAttentionScoreV2GetWorkspaceSize)(
            q.raw(),
            kl.raw(),
            vl.raw(),
            null,
            null,
            std::ptr::null(),
            kv.raw(),
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            bt.raw(),
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            std::ptr::null(),
            2,
            0.25,
            65535,
            0,
            layout.as_mut_ptr().cast(),
            2,
            0,
            0,
            128,
            0,
            false,
            0,
            0,
            o.raw(),
            null,
            &mut ws,
            &mut exec,
        )
    };
    assert_eq!(rc, 0, "{}", acl.last_message());
    assert!(ws > 0);
    let small = zeros(ws as usize / 2);
    // SAFETY: a live executor and a device workspace (deliberately too small).
    let rc =
        unsafe { (ops.aclnnFusedInferAttentionScoreV2)(small.ptr(), ws / 2, exec, dev.stream()) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        acl.last_message().contains("smaller than"),
        "{}",
        acl.last_message()
    );
    let full = zeros(ws as usize);
    // SAFETY: as above, with the size asked for.
    let rc = unsafe { (ops.aclnnFusedInferAttentionScoreV2)(full.ptr(), ws, exec, dev.stream()) };
    assert_eq!(rc, 0, "{}", acl.last_message());
    // A non-repeatable executor is spent by its launch.
    // SAFETY: as above.
    let rc = unsafe { (ops.aclnnFusedInferAttentionScoreV2)(full.ptr(), ws, exec, dev.stream()) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        acl.last_message().contains("not repeatable"),
        "{}",
        acl.last_message()
    );
    dev.synchronize().unwrap();
}

#[test]
fn a_reused_executors_new_address_must_be_32_byte_aligned() {
    let dev = device();
    let acl = acl();
    let (ops, base) = (acl.api.ops, acl.api.base);
    let (a, b, out) = (
        upload_f16(&[1.0; 32]),
        upload_f16(&[2.0; 32]),
        zeros(64 + 64),
    );
    let (at, bt, ot) = (
        t(&a, DType::F16, &[16]),
        t(&b, DType::F16, &[16]),
        t(&out, DType::F16, &[16]),
    );
    let alpha = npu_backend_ascend::tensor::Scalar::f32(acl, 1.0).unwrap();
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    // SAFETY: live handles and out-pointers.
    let rc = unsafe {
        (ops.aclnnAddGetWorkspaceSize)(
            at.raw(),
            bt.raw(),
            alpha.raw(),
            ot.raw(),
            &mut ws,
            &mut exec,
        )
    };
    assert_eq!(rc, 0, "{}", acl.last_message());
    let repeatable = base.aclSetAclOpExecutorRepeatable.unwrap();
    let set_out = base.aclSetOutputTensorAddr.unwrap();
    let set_in = base.aclSetInputTensorAddr.unwrap();
    // SAFETY: a live executor from the first phase above.
    assert_eq!(unsafe { repeatable(exec) }, 0, "{}", acl.last_message());
    // 16 bytes into the output buffer: inside it, but not 32-byte aligned.
    // SAFETY: a live executor and tensor; the address lies in a live allocation.
    let rc = unsafe { set_out(exec, 0, ot.raw(), out.ptr().cast::<u8>().add(16).cast()) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        acl.last_message().contains("32-byte aligned"),
        "{}",
        acl.last_message()
    );
    // SAFETY: as above, 64 bytes in (aligned) and an input at its allocation's start.
    let rc = unsafe { set_out(exec, 0, ot.raw(), out.ptr().cast::<u8>().add(64).cast()) };
    assert_eq!(rc, 0, "{}", acl.last_message());
    // SAFETY: as above.
    assert_eq!(unsafe { set_in(exec, 1, bt.raw(), a.ptr()) }, 0);
    // SAFETY: a repeatable executor made by this test, destroyed once.
    assert_eq!(unsafe { base.aclDestroyAclOpExecutor.unwrap()(exec) }, 0);
    dev.synchronize().unwrap();
}

#[test]
fn results_cannot_be_read_before_the_stream_is_synchronized() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (a, b) = (upload_f16(&[1.0; 32]), upload_f16(&[2.0; 32]));
    ops.inplace_add(&t(&a, DType::F16, &[32]), &t(&b, DType::F16, &[32]))
        .unwrap();
    // A synchronous read of memory a queued kernel writes is refused...
    let mut out = vec![0u8; 64];
    let (c, msg) = code(a.download(0, &mut out).unwrap_err());
    assert_eq!(c, ACL_ERROR_INVALID_PARAM, "{msg}");
    assert!(msg.contains("synchronize"), "{msg}");
    // ...and an asynchronous download holds poison until the stream runs.
    let mut pinned = PinnedBuffer::alloc(acl(), 64).unwrap();
    a.download_async(0, &mut pinned, 0, 64, &dev).unwrap();
    assert!(
        pinned.as_slice().iter().all(|&x| x == 0xff),
        "result visible before synchronization"
    );
    dev.synchronize().unwrap();
    let vals: Vec<f32> = pinned
        .as_slice()
        .chunks(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(vals, vec![3.0; 32]);
    // Async copies need pinned host memory.
    let mut host = vec![0u8; 64];
    // SAFETY: valid pointers; the emulated runtime refuses pageable host memory for async copies.
    let rc = unsafe {
        (acl().api.rt.aclrtMemcpyAsync)(
            host.as_mut_ptr().cast(),
            64,
            a.ptr(),
            64,
            ACL_MEMCPY_DEVICE_TO_HOST,
            dev.stream(),
        )
    };
    assert!(
        rc == ACL_ERROR_RT_INVALID_MEMORY_TYPE || rc == ACL_ERROR_RT_ADDR_UNALIGNED,
        "{rc}"
    );
}

#[test]
fn leaked_tensor_is_reported() {
    let dev = device();
    let buf = zeros(64);
    let leaked = t(&buf, DType::F16, &[7, 4]);
    let raw = leaked.raw() as u64;
    std::mem::forget(leaked); // never aclDestroyTensor'd
    let report = leak_report();
    let line = report
        .lines()
        .find(|l| l.contains(&format!("{raw:#x}")))
        .unwrap_or_else(|| panic!("no report of {raw:#x} in:\n{report}"));
    assert!(
        line.contains("aclTensor")
            && line.contains("FLOAT16[7, 4]")
            && line.contains("never destroyed"),
        "{line}"
    );
    // SAFETY: destroying the handle forgotten above, once.
    assert_eq!(
        unsafe { (acl().api.base.aclDestroyTensor)(raw as *const aclTensor) },
        0
    );
    assert!(!leak_report().contains(&format!("{raw:#x}")));
    dev.synchronize().unwrap();
}

#[test]
fn missing_library_is_named_with_set_env_hint() {
    let empty = std::env::temp_dir().join(format!("no-cann-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let e = npu_ffi::AscendApi::load(&npu_ffi::SearchPaths::root(&empty))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("libascendcl.so") && e.contains("set_env.sh"),
        "{e}"
    );
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn device_selection_respects_the_visible_count() {
    let acl = acl();
    assert_eq!(
        npu_backend_ascend::device::select_device(acl, 2, 3).unwrap(),
        5
    );
    let e = npu_backend_ascend::device::select_device(acl, 6, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("device 8") && e.contains("start_device_id 6"),
        "{e}"
    );
}

#[test]
fn version_is_read_from_the_install() {
    assert_eq!(acl().version.to_string(), "8.3.RC1");
    // 8.3 has no aclsysGetVersionStr (added in 8.5): the emulation answers "not supported" and
    // the version above came through the older entry point.
    let get = acl().api.rt.aclsysGetVersionStr.unwrap();
    let mut pkg = *b"runtime\0";
    let mut buf = [0 as std::ffi::c_char; ACL_PKG_VERSION_MAX_SIZE];
    // SAFETY: a NUL-terminated name and a buffer of the documented size.
    let rc = unsafe { get(pkg.as_mut_ptr().cast(), buf.as_mut_ptr()) };
    assert_eq!(rc, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
}
