//! The emulation refuses the tensor layouts and widths CANN's operator pages rule out, as CANN's
//! first phase does (ACLNN_ERR_PARAM_INVALID): non-contiguous tensors where the page's
//! "非连续Tensor" column says × (FusedInferAttentionScoreV2's query/key/value/attentionOut,
//! RotaryPositionEmbedding's out, SwiGlu's x and out, ScatterPaKvCache's key/value in scatter
//! mode "None"), and ApplyRotaryPosEmb with a last dimension other than 128. Each test also
//! shows the allowed form passing.

mod common;

use common::*;
use npu_backend_ascend::ops::{Attention, OpRunner};
use npu_backend_ascend::tensor::{DType, IntArray, Tensor, View};
use npu_backend_ascend::AscendError;
use npu_ffi::types::*;

fn code(e: AscendError) -> (i32, String) {
    match e {
        AscendError::Call { code, message, .. } => (code, message),
        other => panic!("expected a failed call, got {other}"),
    }
}

/// A strided view over `b`.
fn sv(b: &npu_backend_ascend::memory::DeviceBuffer, dims: &[i64], strides: &[i64]) -> Tensor {
    Tensor::new(acl(), b, View::strided(DType::F16, dims, strides, 0)).unwrap()
}

/// One decode-branch attention call over two entries whose queries and outputs are rows
/// `q_stride` / `o_stride` apart (H = 32 values per row).
fn decode_attention(q_stride: i64, o_stride: i64) -> Result<(), AscendError> {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (heads, d, blocks, bs) = (2i64, 16i64, 4i64, 16i64);
    let h = heads * d;
    let kc = zeros((blocks * bs * h * 2) as usize);
    let vc = zeros((blocks * bs * h * 2) as usize);
    let (qb, ob, tb) = (
        upload_f16(&vec![0.5; (2 * q_stride) as usize]),
        zeros((2 * o_stride * 2) as usize),
        upload_i32(&[0, 1, 2, 3]),
    );
    let q = sv(&qb, &[2, 1, h], &[q_stride, q_stride, 1]);
    let o = sv(&ob, &[2, 1, h], &[o_stride, o_stride, 1]);
    let bt = t(&tb, DType::I32, &[2, 2]);
    let r = ops.attention(&Attention {
        query: &q,
        out: &o,
        key_cache: &kc,
        value_cache: &vc,
        cache_view: View::contiguous(DType::F16, &[blocks, bs, h]),
        block_table: &bt,
        mask: None,
        band: None,
        q_lens: &[1, 1],
        kv_lens: &[3, 5],
        heads,
        kv_heads: heads,
        block_size: bs,
        scale: 0.25,
    });
    dev.synchronize()?;
    r
}

#[test]
fn attention_refuses_query_rows_of_a_wider_buffer() {
    // The token-wise path's query as it was: the Q columns of fused QKV rows (96 wide).
    let (c, msg) = code(decode_attention(96, 32).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(
        msg.contains("query") && msg.contains("not contiguous"),
        "{msg}"
    );
    // A strided attentionOut is refused as well.
    let (c, msg) = code(decode_attention(32, 64).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("attentionOut"), "{msg}");
    decode_attention(32, 32).unwrap();
}

#[test]
fn rotary_position_embedding_refuses_a_strided_out_but_takes_a_strided_x() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (tokens, heads, d, row) = (3i64, 2i64, 16i64, 64i64);
    let xb = upload_f16(&rand_vec(3, (tokens * row) as usize, 1.0));
    let cs = upload_f16(&vec![0.5; (tokens * d) as usize]);
    let ob = zeros((tokens * heads * d * 2) as usize);
    // (1, T, heads, d) over rows `row` apart: x may be, out may not.
    let strided = sv(&xb, &[1, tokens, heads, d], &[tokens * row, row, d, 1]);
    let cos = t(&cs, DType::F16, &[1, tokens, 1, d]);
    let (c, msg) = code(ops.rope(&strided, &cos, &cos, 0, &strided).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(
        msg.contains("out") && msg.contains("not contiguous"),
        "{msg}"
    );
    let dense = t(&ob, DType::F16, &[1, tokens, heads, d]);
    ops.rope(&strided, &cos, &cos, 0, &dense).unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn apply_rotary_pos_emb_takes_only_a_last_dimension_of_128() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    for (d, ok) in [(64i64, false), (128, true)] {
        let (tokens, heads) = (2i64, 2i64);
        let qb = upload_f16(&vec![0.25; (tokens * heads * d) as usize]);
        let kb = upload_f16(&vec![0.25; (tokens * d) as usize]);
        let cb = upload_f16(&vec![0.5; (tokens * d) as usize]);
        let q = t(&qb, DType::F16, &[1, tokens, heads, d]);
        let k = t(&kb, DType::F16, &[1, tokens, 1, d]);
        let c = t(&cb, DType::F16, &[1, tokens, 1, d]);
        let r = ops.apply_rope(&q, &k, &c, &c);
        if ok {
            r.unwrap();
            // The queued rotation still reads these buffers.
            dev.synchronize().unwrap();
        } else {
            let (code_, msg) = code(r.unwrap_err());
            assert_eq!(code_, ACLNN_ERR_PARAM_INVALID, "{msg}");
            assert!(msg.contains("D = 64") && msg.contains("128"), "{msg}");
        }
    }
}

#[test]
fn swiglu_refuses_halves_of_a_wider_row_and_a_strided_out() {
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (rows, ff) = (3i64, 16i64);
    let xb = upload_f16(&rand_vec(5, (rows * 3 * ff) as usize, 1.0));
    let ob = zeros((rows * 2 * ff * 2) as usize);
    // Gate and up side by side, but rows 3·ff apart: not contiguous.
    let x = sv(&xb, &[rows, 2 * ff], &[3 * ff, 1]);
    let out = t(&ob, DType::F16, &[rows, ff]);
    let (c, msg) = code(ops.swiglu(&x, -1, &out).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(
        msg.contains("x ") && msg.contains("not contiguous"),
        "{msg}"
    );
    let dense = t(&xb, DType::F16, &[rows, 2 * ff]);
    let out_strided = sv(&ob, &[rows, ff], &[2 * ff, 1]);
    let (c, msg) = code(ops.swiglu(&dense, -1, &out_strided).unwrap_err());
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("out"), "{msg}");
    ops.swiglu(&dense, -1, &out).unwrap();
    dev.synchronize().unwrap();
}

/// One ScatterPaKvCache first phase with scatter mode "None", strides {1, 1} and offsets
/// {0, 0} (torch_npu's defaults), key/value rows `row` apart.
fn scatter_none(row: i64) -> (i32, String) {
    let _dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let (tokens, n, d, blocks, bs) = (2i64, 2i64, 16i64, 2i64, 16i64);
    let src = upload_f16(&vec![0.5; (tokens * row) as usize]);
    let cache = zeros((blocks * bs * n * d * 2) as usize);
    let cache2 = zeros((blocks * bs * n * d * 2) as usize);
    let slots = upload_i32(&[3, 7]);
    let k = sv(&src, &[tokens, n, d], &[row, d, 1]);
    let kc = t(&cache, DType::F16, &[blocks, bs, n, d]);
    let vc = t(&cache2, DType::F16, &[blocks, bs, n, d]);
    let sm = t(&slots, DType::I32, &[tokens]);
    let strides = IntArray::new(acl, &[1, 1]).unwrap();
    let offsets = IntArray::new(acl, &[0, 0]).unwrap();
    let (mut norm, mut none) = (*b"Norm\0", *b"None\0");
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let prep = ops
        .aclnnScatterPaKvCacheGetWorkspaceSize
        .expect("the emulation has ScatterPaKvCache");
    // SAFETY: live tensors and arrays, NUL-terminated modes, valid out-pointers.
    let rc = unsafe {
        prep(
            k.raw(),
            kc.raw(),
            sm.raw(),
            k.raw(),
            vc.raw(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            norm.as_mut_ptr().cast(),
            none.as_mut_ptr().cast(),
            strides.raw(),
            offsets.raw(),
            &mut ws,
            &mut exec,
        )
    };
    let msg = acl.last_message();
    if rc == ACL_SUCCESS {
        // Never launched: made repeatable, so that the caller may destroy it.
        let base = &acl.api.base;
        // SAFETY: `exec` is the live executor the first phase just made (never launched).
        unsafe {
            assert_eq!(
                (base.aclSetAclOpExecutorRepeatable.expect("emulated"))(exec),
                0
            );
            assert_eq!((base.aclDestroyAclOpExecutor.expect("emulated"))(exec), 0);
        }
    }
    (rc, msg)
}

#[test]
fn scatter_pa_kv_cache_in_mode_none_refuses_strided_key_and_value() {
    // K/V as column ranges of fused QKV rows (96 wide): the "None" mode takes them contiguous.
    let (c, msg) = scatter_none(96);
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(
        msg.contains("key") && msg.contains("not contiguous"),
        "{msg}"
    );
    let (c, msg) = scatter_none(32);
    assert_eq!(c, ACL_SUCCESS, "{msg}");
}
