//! FusedInferAttentionScoreV2 over INT8 paged caches on the emulation: keyAntiquantMode =
//! valueAntiquantMode = 5 (one FLOAT32 scale per block, KV head and slot, (blockNum, KV_N,
//! blockSize)) reads each cached value as `int8 · scale`, so it gives what the f16 operator
//! gives over a cache holding those values; and the emulation refuses what the page forbids
//! (mode 5 with Q_S > 1, scales of another shape or type, f16 caches with scales, INT8 caches
//! without them, blocks not a multiple of 32, one scale without the other, modes that differ).

mod common;

use common::*;
use npu_backend_ascend::device::Device;
use npu_backend_ascend::memory::DeviceBuffer;
use npu_backend_ascend::tensor::{DType, IntArray, Tensor, TensorList};
use npu_ffi::types::*;

const N: i64 = 4;
const KV_N: i64 = 2;
const D: i64 = 32;
const BS: i64 = 32;
const BLOCKS: i64 = 5;

/// One call's inputs beyond the caches.
struct Call<'a> {
    q: &'a Tensor,
    out: &'a Tensor,
    key: Tensor,
    value: Tensor,
    scales: Option<(Tensor, Tensor)>,
    modes: (i64, i64),
    table: &'a Tensor,
    kv_lens: &'a [i64],
    block_size: i64,
}

/// GetWorkspaceSize then the launch; the refusal's status and message when it is refused.
fn run(dev: &Device, c: Call<'_>) -> Result<(), (i32, String)> {
    let acl = acl();
    let ops = acl.api.ops;
    let kl = TensorList::new(acl, vec![c.key]).unwrap();
    let vl = TensorList::new(acl, vec![c.value]).unwrap();
    let kv = IntArray::new(acl, c.kv_lens).unwrap();
    let null = std::ptr::null::<aclTensor>();
    let (ks, vs) = match &c.scales {
        Some((k, v)) => (k.raw().cast_const(), v.raw().cast_const()),
        None => (null, null),
    };
    let mut layout = *b"BSH\0";
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    // SAFETY: live handles and out-pointers, the documented argument order.
    let rc = unsafe {
        (ops.aclnnFusedInferAttentionScoreV2GetWorkspaceSize)(
            c.q.raw(),
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
            c.table.raw(),
            null,
            null,
            ks,
            null,
            vs,
            null,
            null,
            null,
            std::ptr::null(),
            N,
            1.0 / (D as f64).sqrt(),
            65535,
            0,
            layout.as_mut_ptr().cast(),
            KV_N,
            0,
            0,
            c.block_size,
            0,
            false,
            c.modes.0,
            c.modes.1,
            c.out.raw(),
            null,
            &mut ws,
            &mut exec,
        )
    };
    if rc != 0 {
        return Err((rc, acl.last_message()));
    }
    let work = zeros(ws.max(1) as usize);
    // SAFETY: the executor just made and a workspace of the size it asked for.
    let rc = unsafe { (ops.aclnnFusedInferAttentionScoreV2)(work.ptr(), ws, exec, dev.stream()) };
    assert_eq!(rc, 0, "{}", acl.last_message());
    dev.synchronize().unwrap();
    Ok(())
}

/// Random INT8 caches (K, V), distinct scales per (block, KV head, slot) for K and V, and the
/// f16 caches holding `f16(int8 · scale)`.
struct Caches {
    k8: DeviceBuffer,
    v8: DeviceBuffer,
    ks: DeviceBuffer,
    vs: DeviceBuffer,
    k16: DeviceBuffer,
    v16: DeviceBuffer,
}

fn caches() -> Caches {
    let row = (KV_N * D) as usize;
    let slots = (BLOCKS * BS) as usize;
    let ints = |seed: u64| -> Vec<i8> {
        rand_vec(seed, slots * row, 127.0)
            .iter()
            .map(|x| x.round() as i8)
            .collect()
    };
    // scale[(blk · KV_N + h) · BS + slot]
    let scales = |seed: u64| -> Vec<f32> {
        rand_vec(seed, (BLOCKS * KV_N * BS) as usize, 1.0)
            .iter()
            .map(|x| 0.004 + 0.003 * (x + 1.0))
            .collect()
    };
    let (k, v, sk, sv) = (ints(1), ints(2), scales(3), scales(4));
    let dequant = |q: &[i8], s: &[f32]| -> Vec<f32> {
        let mut out = vec![0.0; q.len()];
        for slot in 0..slots {
            let (blk, pos) = (slot / BS as usize, slot % BS as usize);
            for c in 0..row {
                let h = c / D as usize;
                let sc = s[(blk * KV_N as usize + h) * BS as usize + pos];
                out[slot * row + c] = q[slot * row + c] as f32 * sc;
            }
        }
        out
    };
    let bytes = |q: &[i8]| q.iter().map(|&x| x as u8).collect::<Vec<u8>>();
    let f32s = |s: &[f32]| s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    Caches {
        k16: upload_f16(&dequant(&k, &sk)),
        v16: upload_f16(&dequant(&v, &sv)),
        k8: upload(&bytes(&k)),
        v8: upload(&bytes(&v)),
        ks: upload(&f32s(&sk)),
        vs: upload(&f32s(&sv)),
    }
}

fn cache_dims() -> [i64; 3] {
    [BLOCKS, BS, KV_N * D]
}

fn scale_dims() -> [i64; 3] {
    [BLOCKS, KV_N, BS]
}

#[test]
fn mode_5_reads_int8_times_its_scale_per_token_and_head() {
    let dev = device();
    let c = caches();
    let b = 2;
    let qv = rand_vec(9, (b * N * D) as usize, 1.0);
    let qb = upload_f16(&qv);
    let q = t(&qb, DType::F16, &[b, 1, N * D]);
    let tb = upload_i32(&[3, 1, 0, 4]);
    let table = t(&tb, DType::I32, &[b, 2]);
    let kv_lens = [40i64, 9];
    let (o8, o16) = (
        zeros((b * N * D * 2) as usize),
        zeros((b * N * D * 2) as usize),
    );
    let (ot8, ot16) = (
        t(&o8, DType::F16, &[b, 1, N * D]),
        t(&o16, DType::F16, &[b, 1, N * D]),
    );
    run(
        &dev,
        Call {
            q: &q,
            out: &ot8,
            key: t(&c.k8, DType::I8, &cache_dims()),
            value: t(&c.v8, DType::I8, &cache_dims()),
            scales: Some((
                t(&c.ks, DType::F32, &scale_dims()),
                t(&c.vs, DType::F32, &scale_dims()),
            )),
            modes: (5, 5),
            table: &table,
            kv_lens: &kv_lens,
            block_size: BS,
        },
    )
    .unwrap();
    run(
        &dev,
        Call {
            q: &q,
            out: &ot16,
            key: t(&c.k16, DType::F16, &cache_dims()),
            value: t(&c.v16, DType::F16, &cache_dims()),
            scales: None,
            modes: (0, 0),
            table: &table,
            kv_lens: &kv_lens,
            block_size: BS,
        },
    )
    .unwrap();
    let (got, want) = (
        read_f16(&o8, (b * N * D) as usize),
        read_f16(&o16, (b * N * D) as usize),
    );
    assert!(want.iter().any(|&x| x.abs() > 1e-3), "a non-trivial output");
    assert_eq!(got, want);
}

/// The refusal's message for a decode call (Q_S = 1) varied by `f`, or for Q_S = `s`.
fn refusal(s: i64, f: impl FnOnce(&Caches, &mut Call<'_>)) -> String {
    let dev = device();
    let c = caches();
    let qb = upload_f16(&vec![0.5; (s * N * D) as usize]);
    let q = t(&qb, DType::F16, &[1, s, N * D]);
    let ob = zeros((s * N * D * 2) as usize);
    let out = t(&ob, DType::F16, &[1, s, N * D]);
    let tb = upload_i32(&[0, 1]);
    let table = t(&tb, DType::I32, &[1, 2]);
    let mut call = Call {
        q: &q,
        out: &out,
        key: t(&c.k8, DType::I8, &cache_dims()),
        value: t(&c.v8, DType::I8, &cache_dims()),
        scales: Some((
            t(&c.ks, DType::F32, &scale_dims()),
            t(&c.vs, DType::F32, &scale_dims()),
        )),
        modes: (5, 5),
        table: &table,
        kv_lens: &[40],
        block_size: BS,
    };
    f(&c, &mut call);
    let (code, msg) = run(&dev, call).expect_err("refused");
    assert_eq!(code, ACLNN_ERR_PARAM_INVALID, "{msg}");
    msg
}

#[test]
fn the_emulation_refuses_what_the_page_forbids_for_mode_5() {
    // Each refusal below is one change to a decode call that passes (the test above).
    let msg = refusal(2, |_, _| {});
    assert!(msg.contains("Q_S >= 2 only modes 0 and 1"), "{msg}");
    assert!(refusal(1, |c, call| call.scales = Some((
        t(&c.ks, DType::F32, &[BLOCKS, BS]),
        t(&c.vs, DType::F32, &[BLOCKS, BS])
    )))
    .contains("(blockNum, KV_N, blockSize)"));
    assert!(refusal(1, |c, call| call.scales = Some((
        t(&c.ks, DType::F16, &scale_dims()),
        t(&c.vs, DType::F16, &scale_dims())
    )))
    .contains("FLOAT32"));
    assert!(refusal(1, |c, call| {
        call.key = t(&c.k16, DType::F16, &cache_dims());
        call.value = t(&c.v16, DType::F16, &cache_dims());
    })
    .contains("takes INT8 key and value caches only"));
    assert!(refusal(1, |_, call| {
        call.scales = None;
        call.modes = (0, 0);
    })
    .contains("INT8 key cache without key/value antiquant scales"));
    assert!(refusal(1, |c, call| {
        call.key = t(&c.k8, DType::I8, &[BLOCKS * 2, 16, KV_N * D]);
        call.value = t(&c.v8, DType::I8, &[BLOCKS * 2, 16, KV_N * D]);
        call.scales = Some((
            t(&c.ks, DType::F32, &[BLOCKS * 2, KV_N, 16]),
            t(&c.vs, DType::F32, &[BLOCKS * 2, KV_N, 16]),
        ));
        call.block_size = 16;
    })
    .contains("multiple of 32"));
    assert!(refusal(1, |_, call| call.modes = (5, 4)).contains("must agree"));
    assert!(refusal(1, |_, call| call.modes = (6, 6)).contains("not documented (0..=5)"));
    assert!(refusal(1, |_, call| call.modes = (3, 3)).contains("not implemented"));
}

#[test]
fn one_scale_without_the_other_is_refused() {
    let _dev = device();
    let c = caches();
    let qb = upload_f16(&vec![0.5; (N * D) as usize]);
    let q = t(&qb, DType::F16, &[1, 1, N * D]);
    let ob = zeros((N * D * 2) as usize);
    let out = t(&ob, DType::F16, &[1, 1, N * D]);
    let tb = upload_i32(&[0, 1]);
    let table = t(&tb, DType::I32, &[1, 2]);
    let acl = acl();
    let kl = TensorList::new(acl, vec![t(&c.k8, DType::I8, &cache_dims())]).unwrap();
    let vl = TensorList::new(acl, vec![t(&c.v8, DType::I8, &cache_dims())]).unwrap();
    let ks = t(&c.ks, DType::F32, &scale_dims());
    let kv = IntArray::new(acl, &[40]).unwrap();
    let null = std::ptr::null::<aclTensor>();
    let mut layout = *b"BSH\0";
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    // SAFETY: live handles and out-pointers; the value scales deliberately null.
    let rc = unsafe {
        (acl.api.ops.aclnnFusedInferAttentionScoreV2GetWorkspaceSize)(
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
            table.raw(),
            null,
            null,
            ks.raw(),
            null,
            null,
            null,
            null,
            null,
            std::ptr::null(),
            N,
            0.25,
            65535,
            0,
            layout.as_mut_ptr().cast(),
            KV_N,
            0,
            0,
            BS,
            0,
            false,
            5,
            5,
            out.raw(),
            null,
            &mut ws,
            &mut exec,
        )
    };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        acl.last_message().contains("both be null or both be set"),
        "{}",
        acl.last_message()
    );
}
