//! Mixture-of-experts on `AscendBackend` over the emulated CANN: routing (Cast, then
//! MoeGatingTopKSoftmaxV2 with renorm 0 or 1) and the experts' FFN (MoeInitRoutingV2 grouping
//! the rows on the device, the experts' matmuls — one GroupedMatmulV4 call per projection for
//! f16 experts and for Q4_0 experts (A16W4, a scale per 32 inputs) loaded apart (a weight
//! list), and for experts loaded together (`load_experts`: one 3-D weight over a stack) of
//! Q8_0 and Q4_1 (dequantized to f16 at load) and past the list's 128 (160 f16, 256 Q4_0); one
//! call per expert where experts loaded apart are Q8_0 or mixed — one SwiGlu,
//! MoeFinalizeRoutingV2) against plain Rust references, each expert run once over its rows, the
//! grouped layers without a synchronization (nothing read back); and the emulation's refusals
//! of what the operators' pages forbid.

mod common;

use common::seam::*;
use common::*;
use npu_backend::*;
use npu_backend_ascend::backend::{AscendBuffer, AscendMatrix};
use npu_backend_ascend::tensor::{DType as TDType, Tensor, TensorList, View as TView};
use npu_backend_ascend::AscendBackend;
use npu_ffi::types::*;
use npu_gguf::GgmlType;

/// Softmax top-k of one row as the CPU reference computes it (ties to the lower index), the
/// chosen weights divided by their sum when `normalize`.
fn route_ref(logits: &[f32], k: usize, normalize: bool) -> (Vec<i32>, Vec<f32>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let e: Vec<f64> = logits.iter().map(|&v| f64::from(v - max).exp()).collect();
    let s: f64 = e.iter().sum();
    let p: Vec<f64> = e.iter().map(|v| v / s).collect();
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let ids: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
    let mut w: Vec<f64> = order[..k].iter().map(|&i| p[i]).collect();
    if normalize {
        let s: f64 = w.iter().sum::<f64>().max(6.103_515_625e-5);
        w.iter_mut().for_each(|v| *v /= s);
    }
    (ids, w.into_iter().map(|v| v as f32).collect())
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn moe_is_reported_and_routing_matches_the_reference() {
    let _g = serial();
    let mut b = default_backend();
    assert!(b.supports(Capability::Moe));
    let (t, ne, k) = (9usize, 8usize, 3usize);
    let mut logits = h(&rand_vec(61, t * ne, 3.0));
    logits[2] = logits[5]; // a tie in row 0
    logits[ne + 1] = 10.0; // row 1: one expert takes almost everything
    let lb = up(&mut b, &logits, ne);
    for normalize in [false, true] {
        let mut ids = b.alloc(DType::I32, t * k).unwrap();
        let mut w = b.alloc(DType::F32, t * k).unwrap();
        b.moe_route(
            View::rows(&lb, t, ne).unwrap(),
            k,
            normalize,
            ViewMut::rows(&mut ids, t, k).unwrap(),
            ViewMut::rows(&mut w, t, k).unwrap(),
        )
        .unwrap();
        let mut got_ids = vec![0i32; t * k];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, t, k).unwrap(),
            dst: HostSliceMut::I32(&mut got_ids),
        }])
        .unwrap();
        let got_w = down(&mut b, &w, Layout::contiguous(t, k));
        for r in 0..t {
            let (want_ids, want_w) = route_ref(&logits[r * ne..(r + 1) * ne], k, normalize);
            assert_eq!(
                &got_ids[r * k..(r + 1) * k],
                &want_ids[..],
                "row {r} ids (normalize {normalize})"
            );
            for j in 0..k {
                let (g, w) = (got_w[r * k + j], want_w[j]);
                assert!(
                    (g - w).abs() <= 1e-6 + 1e-5 * w.abs(),
                    "row {r} weight {j} (normalize {normalize}): {g} vs {w}"
                );
            }
        }
    }
    // Fewer experts than k, and k beyond the operator's 1024, are refused by the backend.
    let mut ids = b.alloc(DType::I32, t * (ne + 1)).unwrap();
    let mut w = b.alloc(DType::F32, t * (ne + 1)).unwrap();
    let e = b
        .moe_route(
            View::rows(&lb, t, ne).unwrap(),
            ne + 1,
            true,
            ViewMut::rows(&mut ids, t, ne + 1).unwrap(),
            ViewMut::rows(&mut w, t, ne + 1).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("k = 9"), "{e}");
}

/// `out[r] = Σ_j w[r][j] · down_e(silu(gate_e(x_r)) · up_e(x_r))` in f64 over the device's f16
/// inputs, `e = ids[r][j]`.
#[allow(clippy::too_many_arguments)]
fn ffn_ref(
    x: &[f32],
    ids: &[i32],
    w: &[f32],
    gate_up: &[Vec<f32>],
    down: &[Vec<f32>],
    (t, h, ff, k): (usize, usize, usize, usize),
) -> Vec<f32> {
    let mut out = vec![0f32; t * h];
    for r in 0..t {
        let xr = &x[r * h..(r + 1) * h];
        for j in 0..k {
            let e = ids[r * k + j] as usize;
            let dot = |row: &[f32]| -> f64 {
                row.iter()
                    .zip(xr)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum()
            };
            let act: Vec<f64> = (0..ff)
                .map(|i| {
                    let g = dot(&gate_up[e][i * h..(i + 1) * h]);
                    let u = dot(&gate_up[e][(ff + i) * h..(ff + i + 1) * h]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for c in 0..h {
                let y: f64 = (0..ff)
                    .map(|i| f64::from(down[e][c * ff + i]) * act[i])
                    .sum();
                out[r * h + c] += (f64::from(w[r * k + j]) * y) as f32;
            }
        }
    }
    out
}

#[test]
fn the_experts_ffn_matches_the_reference_each_expert_once() {
    let _g = serial();
    let mut b = default_backend();
    let (t, h, ff, ne, k) = (6usize, 64usize, 32usize, 5usize, 2usize);
    // Expert 4 serves nobody; expert 1 serves most tokens.
    let ids: Vec<i32> = vec![1, 0, 1, 2, 3, 1, 1, 0, 2, 1, 1, 3];
    let w = rand_vec(71, t * k, 1.0)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect::<Vec<_>>();
    let x = h_vec(&rand_vec(72, t * h, 1.0));
    // Experts 0..3 in f32 (the f16 Matmul form), expert 3 and 4 in Q8_0 (WeightQuantBatchMatmul).
    let mut gate_up = Vec::new();
    let mut down_w = Vec::new();
    let mut gu_m = Vec::new();
    let mut down_m = Vec::new();
    for e in 0..ne {
        let seed = 80 + 2 * e as u64;
        if e >= 3 {
            let (gd, gv) = q8_0_rows(seed, 2 * ff, h);
            let (dd, dv) = q8_0_rows(seed + 1, h, ff);
            gu_m.push(b.load_matrix(&[q8(&gd, 2 * ff, h)]).unwrap().unwrap());
            down_m.push(b.load_matrix(&[q8(&dd, h, ff)]).unwrap().unwrap());
            gate_up.push(gv);
            down_w.push(dv);
        } else {
            let gv = h_vec(&rand_vec(seed, 2 * ff * h, 0.2));
            let dv = h_vec(&rand_vec(seed + 1, h * ff, 0.2));
            let (gb, db) = (le_bytes(&gv), le_bytes(&dv));
            gu_m.push(b.load_matrix(&[f32_m(&gb, 2 * ff, h)]).unwrap().unwrap());
            down_m.push(b.load_matrix(&[f32_m(&db, h, ff)]).unwrap().unwrap());
            gate_up.push(gv);
            down_w.push(dv);
        }
    }
    let xb = up(&mut b, &x, h);
    let mut ib = b.alloc(DType::I32, t * k).unwrap();
    b.upload(HostSlice::I32(&ids), ViewMut::rows(&mut ib, t, k).unwrap())
        .unwrap();
    let mut wb = b.alloc(DType::F32, t * k).unwrap();
    b.upload(HostSlice::F32(&w), ViewMut::rows(&mut wb, t, k).unwrap())
        .unwrap();
    let mut ob = b.alloc(DType::F16, t * h).unwrap();
    b.synchronize().unwrap();
    let (before, ops_before) = (b.step_stats().launches, moe_op_launches());
    b.moe_ffn(
        View::rows(&xb, t, h).unwrap(),
        View::rows(&ib, t, k).unwrap(),
        View::rows(&wb, t, k).unwrap(),
        &gu_m,
        &down_m,
        ff,
        ViewMut::rows(&mut ob, t, h).unwrap(),
    )
    .unwrap();
    let launches = b.step_stats().launches - before;
    let per_op = since(&ops_before);
    let got = down(&mut b, &ob, Layout::contiguous(t, h));
    let want = ffn_ref(&x, &ids, &w, &gate_up, &down_w, (t, h, ff, k));
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * rms + 2e-3 * w.abs(),
            "out[{i}]: {g} vs {w} (rms {rms})"
        );
    }
    // Gate+up mixes f16 and Q8_0 experts: one call per expert with rows (three Matmul, one
    // WeightQuantBatchMatmulV2), the row counts read back. Down is f16 for every expert (Q8_0
    // with 32 inputs takes the f16 form): one GroupedMatmulV4. With the routing, the counts'
    // and the weights' casts, one SwiGlu over every grouped row and the finalize: 10 launches,
    // none per token.
    assert_eq!(
        per_op,
        [1, 2, 1, 1, 3, 1, 1, 0, 0],
        "launches per operator {MOE_OPS:?}"
    );
    assert_eq!(launches, 10);
}

/// Each of [`MOE_OPS`]' launches since `before`.
fn since(before: &[u64]) -> Vec<u64> {
    moe_op_launches()
        .iter()
        .zip(before)
        .map(|(a, b)| a - b)
        .collect()
}

fn h_vec(v: &[f32]) -> Vec<f32> {
    h(v)
}

fn f32_m(data: &[u8], rows: usize, cols: usize) -> HostTensor<'_> {
    HostTensor {
        ty: GgmlType::F32,
        data,
        rows,
        cols,
    }
}

fn q8(data: &[u8], rows: usize, cols: usize) -> HostTensor<'_> {
    HostTensor {
        ty: GgmlType::Q8_0,
        data,
        rows,
        cols,
    }
}

/// A first phase's status and the emulation's message.
fn first_phase(rc: i32) -> (i32, String) {
    (rc, acl().last_message())
}

#[test]
fn moe_operator_misuses_are_refused_with_the_documented_codes() {
    let _dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let gating = ops.aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize.unwrap();
    let fin = ops.aclnnMoeFinalizeRoutingV2GetWorkspaceSize.unwrap();
    let (xb, yb, ib) = (upload(&[0u8; 4 * 64]), zeros(4 * 64), zeros(4 * 64));
    let x = t(&xb, TDType::F32, &[4, 8]);
    let y = t(&yb, TDType::F32, &[4, 2]);
    let ids = t(&ib, TDType::I32, &[4, 2]);
    let null = std::ptr::null();
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let mut gate = |x: &Tensor, k: i64, renorm: i64, y: &Tensor, ids: &Tensor| {
        // SAFETY: live tensors and out-pointers.
        first_phase(unsafe {
            gating(
                x.raw(),
                null,
                k,
                renorm,
                false,
                y.raw(),
                ids.raw(),
                null,
                &mut ws,
                &mut exec,
            )
        })
    };
    // k above x's last axis, or above 1024: the tiling refuses it.
    let (c, msg) = gate(&x, 9, 0, &y, &ids);
    assert_eq!(c, ACLNN_ERR_INNER_TILING_ERROR, "{msg}");
    assert!(msg.contains("k = 9"), "{msg}");
    // renorm is 0 or 1.
    let (c, msg) = gate(&x, 2, 2, &y, &ids);
    assert_eq!(c, ACLNN_ERR_INNER_TILING_ERROR, "{msg}");
    assert!(msg.contains("renorm"), "{msg}");
    // yOut has x's data type.
    let y16 = t(&yb, TDType::F16, &[4, 2]);
    let (c, msg) = gate(&x, 2, 0, &y16, &ids);
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    // yOut's last axis is k.
    let y3 = t(&yb, TDType::F32, &[4, 3]);
    let (c, msg) = gate(&x, 2, 0, &y3, &ids);
    assert_eq!(c, ACLNN_ERR_INNER_TILING_ERROR, "{msg}");
    // The outputs do not support non-contiguous tensors.
    let y_strided =
        Tensor::new(acl, &yb, TView::strided(TDType::F32, &[4, 2], &[4, 1], 0)).unwrap();
    let (c, msg) = gate(&x, 2, 0, &y_strided, &ids);
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("yOut"), "{msg}");
    // A one-dimensional x.
    let x1 = t(&xb, TDType::F32, &[32]);
    let (c, msg) = gate(&x1, 2, 0, &y, &ids);
    assert_eq!(c, ACLNN_ERR_INNER_TILING_ERROR, "{msg}");

    // MoeFinalizeRoutingV2: f16 expandedX (4·2 rows of 8), row indices, scales, out.
    let (eb, rb, sb, ob) = (zeros(2 * 64), zeros(4 * 8), zeros(4 * 8), zeros(2 * 32));
    let ex = t(&eb, TDType::F16, &[8, 8]);
    let rows = t(&rb, TDType::I32, &[8]);
    let out = t(&ob, TDType::F16, &[4, 8]);
    let mut finalize = |scales: &Tensor, mode: i64, out: &Tensor| {
        // SAFETY: live tensors and out-pointers.
        first_phase(unsafe {
            fin(
                ex.raw(),
                rows.raw(),
                null,
                null,
                null,
                scales.raw(),
                null,
                mode,
                out.raw(),
                &mut ws,
                &mut exec,
            )
        })
    };
    // f32 scales with f16 expandedX: the mixed mode is documented for BFLOAT16 only.
    let s32 = t(&sb, TDType::F32, &[4, 2]);
    let (c, msg) = finalize(&s32, 2, &out);
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("scalesOptional"), "{msg}");
    let s16 = t(&sb, TDType::F16, &[4, 2]);
    // dropPadMode outside [0, 3].
    let (c, msg) = finalize(&s16, 4, &out);
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    // K from the scales must match expandedX's rows.
    let s3 = t(&sb, TDType::F16, &[4, 3]);
    let (c, msg) = finalize(&s3, 2, &out);
    assert_eq!(c, ACLNN_ERR_INNER_TILING_ERROR, "{msg}");
    // out does not support non-contiguous tensors.
    let out_strided =
        Tensor::new(acl, &ob, TView::strided(TDType::F16, &[4, 4], &[8, 1], 0)).unwrap();
    let ex4 = t(&eb, TDType::F16, &[8, 4]);
    let (mut ws2, mut exec2) = (0u64, std::ptr::null_mut());
    // SAFETY: live tensors and out-pointers.
    let (c, msg) = first_phase(unsafe {
        fin(
            ex4.raw(),
            rows.raw(),
            null,
            null,
            null,
            s16.raw(),
            null,
            2,
            out_strided.raw(),
            &mut ws2,
            &mut exec2,
        )
    });
    assert_eq!(c, ACLNN_ERR_PARAM_INVALID, "{msg}");
    assert!(msg.contains("out"), "{msg}");
}

/// Launches of operator `name` so far in this process (the emulation's count, an
/// emulation-only extension symbol).
fn launches_of(name: &core::ffi::CStr) -> u64 {
    let path = emulator_root().join("lib64/libascendcl.so");
    // SAFETY: the library the runtime already loaded (one state); the symbol has this prototype
    // and the name is NUL-terminated.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(*const core::ffi::c_char) -> u64> =
            lib.get(b"ascendEmulatorLaunchCount\0").unwrap();
        f(name.as_ptr())
    }
}

/// GroupedMatmulV4 launches so far in this process.
fn grouped_matmul_launches() -> u64 {
    launches_of(c"aclnnGroupedMatmulV4")
}

/// The operators a MoE layer launches, for counting per operator.
const MOE_OPS: [&core::ffi::CStr; 9] = [
    c"aclnnMoeInitRoutingV2",
    c"aclnnCast",
    c"aclnnGroupedMatmulV4",
    c"aclnnWeightQuantBatchMatmulV2",
    c"aclnnMatmul",
    c"aclnnSwiGlu",
    c"aclnnMoeFinalizeRoutingV2",
    c"aclnnInplaceCopy",
    c"aclnnEmbedding",
];

/// Each of [`MOE_OPS`]' launch counts so far.
fn moe_op_launches() -> Vec<u64> {
    MOE_OPS.iter().map(|n| launches_of(n)).collect()
}

#[test]
fn f16_experts_run_as_one_grouped_matmul_per_projection() {
    let _g = serial();
    let mut b = default_backend();
    let (t, h, ff, ne, k) = (6usize, 64usize, 32usize, 5usize, 2usize);
    // Expert 4 serves nobody (an empty group in the list); expert 1 serves most tokens.
    let ids: Vec<i32> = vec![1, 0, 1, 2, 3, 1, 1, 0, 2, 1, 1, 3];
    let w = rand_vec(91, t * k, 1.0)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect::<Vec<_>>();
    let x = h_vec(&rand_vec(92, t * h, 1.0));
    let (mut gate_up, mut down_w, mut gu_m, mut down_m) = (vec![], vec![], vec![], vec![]);
    for e in 0..ne {
        let seed = 100 + 2 * e as u64;
        let gv = h_vec(&rand_vec(seed, 2 * ff * h, 0.2));
        let dv = h_vec(&rand_vec(seed + 1, h * ff, 0.2));
        let (gb, db) = (le_bytes(&gv), le_bytes(&dv));
        gu_m.push(b.load_matrix(&[f32_m(&gb, 2 * ff, h)]).unwrap().unwrap());
        down_m.push(b.load_matrix(&[f32_m(&db, h, ff)]).unwrap().unwrap());
        gate_up.push(gv);
        down_w.push(dv);
    }
    let xb = up(&mut b, &x, h);
    let mut ib = b.alloc(DType::I32, t * k).unwrap();
    b.upload(HostSlice::I32(&ids), ViewMut::rows(&mut ib, t, k).unwrap())
        .unwrap();
    let mut wb = b.alloc(DType::F32, t * k).unwrap();
    b.upload(HostSlice::F32(&w), ViewMut::rows(&mut wb, t, k).unwrap())
        .unwrap();
    let mut ob = b.alloc(DType::F16, t * h).unwrap();
    b.synchronize().unwrap();
    let (before, gmm_before) = (b.step_stats().launches, grouped_matmul_launches());
    let (ops_before, syncs) = (moe_op_launches(), b.device().synchronizations());
    b.moe_ffn(
        View::rows(&xb, t, h).unwrap(),
        View::rows(&ib, t, k).unwrap(),
        View::rows(&wb, t, k).unwrap(),
        &gu_m,
        &down_m,
        ff,
        ViewMut::rows(&mut ob, t, h).unwrap(),
    )
    .unwrap();
    let launches = b.step_stats().launches - before;
    let gmm = grouped_matmul_launches() - gmm_before;
    let (per_op, layer_syncs) = (since(&ops_before), b.device().synchronizations() - syncs);
    let got = down(&mut b, &ob, Layout::contiguous(t, h));
    let want = ffn_ref(&x, &ids, &w, &gate_up, &down_w, (t, h, ff, k));
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * rms + 2e-3 * w.abs(),
            "out[{i}]: {g} vs {w} (rms {rms})"
        );
    }
    // One GroupedMatmulV4 per projection; with the routing, the counts' cast (INT32 to the
    // group list's INT64), the SwiGlu, the weights' cast and the finalize: 7 launches for the
    // layer, and no synchronization (nothing read back).
    assert_eq!(gmm, 2, "GroupedMatmulV4 calls");
    assert_eq!(
        per_op,
        [1, 2, 2, 0, 0, 1, 1, 0, 0],
        "launches per operator {MOE_OPS:?}"
    );
    assert_eq!(launches, 7);
    assert_eq!(layer_syncs, 0, "synchronizations in the layer");
}

#[allow(clippy::too_many_arguments)]
fn run_ffn(
    b: &mut AscendBackend,
    (xb, ib, wb): (&AscendBuffer, &AscendBuffer, &AscendBuffer),
    (gu_m, down_m): (&[AscendMatrix], &[AscendMatrix]),
    ob: &mut AscendBuffer,
    (t, h, ff, k): (usize, usize, usize, usize),
) {
    b.moe_ffn(
        View::rows(xb, t, h).unwrap(),
        View::rows(ib, t, k).unwrap(),
        View::rows(wb, t, k).unwrap(),
        gu_m,
        down_m,
        ff,
        ViewMut::rows(ob, t, h).unwrap(),
    )
    .unwrap();
}

#[test]
fn q4_0_experts_run_as_one_grouped_antiquant_matmul_per_projection() {
    let _g = serial();
    let mut b = default_backend();
    // ff = 64: the down projections (64 inputs) keep the Q4_0 form too.
    let (t, h, ff, ne, k) = (6usize, 64usize, 64usize, 5usize, 2usize);
    // Expert 4 serves nobody (an empty group); expert 1 serves most tokens.
    let ids: Vec<i32> = vec![1, 0, 1, 2, 3, 1, 1, 0, 2, 1, 1, 3];
    let w = rand_vec(111, t * k, 1.0)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect::<Vec<_>>();
    let x = h_vec(&rand_vec(112, t * h, 1.0));
    let (mut gate_up, mut down_w, mut gu_m, mut down_m) = (vec![], vec![], vec![], vec![]);
    for e in 0..ne {
        let seed = 120 + 2 * e as u64;
        let (gd, gv) = q4_0_block_rows(seed, 2 * ff, h);
        let (dd, dv) = q4_0_block_rows(seed + 1, h, ff);
        gu_m.push(b.load_matrix(&[q4(&gd, 2 * ff, h)]).unwrap().unwrap());
        down_m.push(b.load_matrix(&[q4(&dd, h, ff)]).unwrap().unwrap());
        gate_up.push(gv);
        down_w.push(dv);
    }
    let xb = up(&mut b, &x, h);
    let mut ib = b.alloc(DType::I32, t * k).unwrap();
    b.upload(HostSlice::I32(&ids), ViewMut::rows(&mut ib, t, k).unwrap())
        .unwrap();
    let mut wb = b.alloc(DType::F32, t * k).unwrap();
    b.upload(HostSlice::F32(&w), ViewMut::rows(&mut wb, t, k).unwrap())
        .unwrap();
    let mut ob = b.alloc(DType::F16, t * h).unwrap();
    let shape = (t, h, ff, k);
    // The first layer copies each matrix's scales into the grouped form once (2·E copies).
    let first = moe_op_launches();
    run_ffn(&mut b, (&xb, &ib, &wb), (&gu_m, &down_m), &mut ob, shape);
    assert_eq!(since(&first)[7], 2 * ne as u64, "InplaceCopy of the scales");
    b.synchronize().unwrap();
    let (before, ops_before) = (b.step_stats().launches, moe_op_launches());
    let syncs = b.device().synchronizations();
    run_ffn(&mut b, (&xb, &ib, &wb), (&gu_m, &down_m), &mut ob, shape);
    let launches = b.step_stats().launches - before;
    let (per_op, layer_syncs) = (since(&ops_before), b.device().synchronizations() - syncs);
    let got = down(&mut b, &ob, Layout::contiguous(t, h));
    let want = ffn_ref(&x, &ids, &w, &gate_up, &down_w, (t, h, ff, k));
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * rms + 2e-3 * w.abs(),
            "out[{i}]: {g} vs {w} (rms {rms})"
        );
    }
    // One GroupedMatmulV4 per projection for the INT4 experts (no WeightQuantBatchMatmulV2),
    // no scale copy after the first layer, no synchronization: 7 launches.
    assert_eq!(
        per_op,
        [1, 2, 2, 0, 0, 1, 1, 0, 0],
        "launches per operator {MOE_OPS:?}"
    );
    assert_eq!(launches, 7);
    assert_eq!(layer_syncs, 0, "synchronizations in the layer");
}

fn q4(data: &[u8], rows: usize, cols: usize) -> HostTensor<'_> {
    HostTensor {
        ty: GgmlType::Q4_0,
        data,
        rows,
        cols,
    }
}

#[test]
fn grouped_matmul_misuses_are_refused_with_the_documented_codes() {
    let _dev = device();
    let acl = acl();
    let gmm = acl.api.ops.aclnnGroupedMatmulV4GetWorkspaceSize.unwrap();
    let (xb, wb, ob, gb) = (
        zeros(8 * 32 * 2),
        zeros(32 * 16 * 2),
        zeros(8 * 16 * 2),
        zeros(64),
    );
    let list = |ts: Vec<Tensor>| TensorList::new(acl, ts).unwrap();
    let x = || t(&xb, TDType::F16, &[8, 32]);
    let w = |dt| Tensor::new(acl, &wb, TView::strided(dt, &[32, 16], &[1, 32], 0)).unwrap();
    let out = || t(&ob, TDType::F16, &[8, 16]);
    let gl = |n: i64, dt| t(&gb, dt, &[n]);
    let null = std::ptr::null();
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let mut call = |x: &TensorList,
                    w: &TensorList,
                    g: &Tensor,
                    scale: *const aclTensorList,
                    (split, gtype, ltype, act): (i64, i64, i64, i64),
                    o: &TensorList| {
        // SAFETY: live lists and tensors, null optionals, out-pointers.
        first_phase(unsafe {
            gmm(
                x.raw(),
                w.raw(),
                null,
                scale,
                null,
                null,
                null,
                null,
                g.raw(),
                null,
                null,
                null,
                split,
                gtype,
                ltype,
                act,
                o.raw() as *mut _,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut ws,
                &mut exec,
            )
        })
    };
    let ok = (3, 0, 0, 0);
    let refused = |r: (i32, String), what: &str| {
        assert_eq!(r.0, ACLNN_ERR_PARAM_INVALID, "{}", r.1);
        assert!(r.1.contains(what), "{what}: {}", r.1);
    };
    let two = || list(vec![w(TDType::F16), w(TDType::F16)]);
    // groupListType 2 belongs to the quantized scenarios; actType 0 only; groupType -1/0/2.
    for (args, what) in [
        ((3, 0, 2, 0), "groupListType 2"),
        ((3, 0, 0, 5), "actType 5"),
        ((3, 1, 0, 0), "groupType 1"),
        ((4, 0, 0, 0), "splitItem 4"),
    ] {
        refused(
            call(
                &list(vec![x()]),
                &two(),
                &gl(2, TDType::I64),
                null,
                args,
                &list(vec![out()]),
            ),
            what,
        );
    }
    // A group list of another length than the weight list, or not INT64.
    refused(
        call(
            &list(vec![x()]),
            &two(),
            &gl(3, TDType::I64),
            null,
            ok,
            &list(vec![out()]),
        ),
        "groupListOptional of 3",
    );
    refused(
        call(
            &list(vec![x()]),
            &two(),
            &gl(4, TDType::I32),
            null,
            ok,
            &list(vec![out()]),
        ),
        "groupListOptional",
    );
    // Weights of another type than x (no mixed non-quantized scenario).
    refused(
        call(
            &list(vec![x()]),
            &list(vec![w(TDType::Bf16), w(TDType::Bf16)]),
            &gl(2, TDType::I64),
            null,
            ok,
            &list(vec![out()]),
        ),
        "weight[0]",
    );
    // Quantization parameters are not emulated.
    let sb = zeros(64);
    let scale = list(vec![t(&sb, TDType::F32, &[16])]);
    refused(
        call(
            &list(vec![x()]),
            &two(),
            &gl(2, TDType::I64),
            scale.raw(),
            ok,
            &list(vec![out()]),
        ),
        "scaleOptional",
    );
    // More than 128 weights.
    let many = list((0..129).map(|_| w(TDType::F16)).collect());
    refused(
        call(
            &list(vec![x()]),
            &many,
            &gl(2, TDType::I64),
            null,
            ok,
            &list(vec![out()]),
        ),
        "weight lists 129",
    );
    // A null x.
    // SAFETY: null x (refused before anything is read), live others, out-pointers.
    let (c, msg) = first_phase(unsafe {
        gmm(
            null,
            two().raw(),
            null,
            null,
            null,
            null,
            null,
            null,
            gl(2, TDType::I64).raw(),
            null,
            null,
            null,
            3,
            0,
            0,
            0,
            list(vec![out()]).raw() as *mut _,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut ws,
            &mut exec,
        )
    });
    assert_eq!(c, ACLNN_ERR_PARAM_NULLPTR, "{msg}");
}

#[path = "moe/stacks.rs"]
mod stacks;
