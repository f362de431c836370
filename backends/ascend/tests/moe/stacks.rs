//! Experts loaded together (`load_experts`): one projection of every expert in one stack,
//! GroupedMatmulV4's single 3-D weight — Q8_0 and Q4_1 experts (dequantized to f16 at load),
//! 160 f16 and 256 Q4_0 experts (past the weight list's 128) — and the single-weight form's
//! documented limits on the emulation.

use super::*;
use npu_backend_ascend::ops::OpRunner;

/// One projection's experts loaded together (`load_experts`: the Ascend backend stacks them
/// in one allocation for GroupedMatmulV4's single 3-D weight).
fn load_stacked(
    b: &mut AscendBackend,
    experts: &[(Vec<u8>, GgmlType)],
    rows: usize,
    cols: usize,
) -> Vec<AscendMatrix> {
    let parts: Vec<Vec<HostTensor<'_>>> = experts
        .iter()
        .map(|(data, ty)| {
            vec![HostTensor {
                ty: *ty,
                data,
                rows,
                cols,
            }]
        })
        .collect();
    b.load_experts(&parts).unwrap().unwrap()
}

/// Random rows of `ty` (Q8_0, Q4_1, Q4_0 or f32 rounded through f16) and their values.
fn rows_of(ty: GgmlType, seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    match ty {
        GgmlType::Q8_0 => q8_0_rows(seed, n, k),
        GgmlType::Q4_1 => q4_1_rows(seed, n, k),
        GgmlType::Q4_0 => q4_0_block_rows(seed, n, k),
        _ => {
            let v = h_vec(&rand_vec(seed, n * k, 0.2));
            (le_bytes(&v), v)
        }
    }
}

/// `ne` experts of `ty` loaded with `load_experts`, `t` tokens routed to `k` each: one
/// GroupedMatmulV4 per projection (the single 3-D weight over each stack), 7 launches, no
/// Matmul or WeightQuantBatchMatmulV2 (one call per expert) and no synchronization (the row
/// counts stay on the device), and the reference's sums.
fn stacked_experts_case(ty: GgmlType, ne: usize, (t, h, ff, k): (usize, usize, usize, usize)) {
    let _g = serial();
    let mut b = default_backend();
    // Slot j of row r: expert (7r + 41j) mod ne — distinct in a row, some experts idle, the
    // last ones (past the 128-tensor list) served.
    let ids: Vec<i32> = (0..t)
        .flat_map(|r| (0..k).map(move |j| ((7 * r + 41 * j) % ne) as i32))
        .collect();
    let w = rand_vec(131, t * k, 1.0)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect::<Vec<_>>();
    let x = h_vec(&rand_vec(132, t * h, 1.0));
    let (mut gate_up, mut down_w, mut gu_d, mut down_d) = (vec![], vec![], vec![], vec![]);
    let file_ty = |ty: GgmlType| match ty {
        GgmlType::Q8_0 | GgmlType::Q4_1 | GgmlType::Q4_0 => ty,
        _ => GgmlType::F32,
    };
    for e in 0..ne {
        let seed = 1000 + 2 * e as u64;
        let (gd, gv) = rows_of(ty, seed, 2 * ff, h);
        let (dd, dv) = rows_of(ty, seed + 1, h, ff);
        gu_d.push((gd, file_ty(ty)));
        down_d.push((dd, file_ty(ty)));
        gate_up.push(gv);
        down_w.push(dv);
    }
    let gu_m = load_stacked(&mut b, &gu_d, 2 * ff, h);
    let down_m = load_stacked(&mut b, &down_d, h, ff);
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
    let syncs = b.device().synchronizations();
    run_ffn(
        &mut b,
        (&xb, &ib, &wb),
        (&gu_m, &down_m),
        &mut ob,
        (t, h, ff, k),
    );
    let launches = b.step_stats().launches - before;
    let (per_op, layer_syncs) = (since(&ops_before), b.device().synchronizations() - syncs);
    let got = down(&mut b, &ob, Layout::contiguous(t, h));
    let want = ffn_ref(&x, &ids, &w, &gate_up, &down_w, (t, h, ff, k));
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * rms + 2e-3 * w.abs(),
            "{} x{ne} out[{i}]: {g} vs {w} (rms {rms})",
            ty.name()
        );
    }
    assert_eq!(
        per_op,
        [1, 2, 2, 0, 0, 1, 1, 0, 0],
        "{} x{ne}: launches per operator {MOE_OPS:?}",
        ty.name()
    );
    assert_eq!(launches, 7, "{} x{ne}", ty.name());
    assert_eq!(
        layer_syncs,
        0,
        "{} x{ne}: synchronizations in the layer",
        ty.name()
    );
}

#[test]
fn q8_0_experts_run_as_one_grouped_matmul_per_projection() {
    // Dequantized to f16 at load (no grouped form takes a scale per 32 INT8 inputs).
    stacked_experts_case(GgmlType::Q8_0, 5, (6, 64, 64, 2));
}

#[test]
fn q4_1_experts_run_as_one_grouped_matmul_per_projection() {
    // Dequantized to f16 at load (per-group INT4 is symmetric only).
    stacked_experts_case(GgmlType::Q4_1, 5, (6, 64, 64, 2));
}

#[test]
fn more_experts_than_a_weight_list_takes_run_as_one_grouped_matmul_per_projection() {
    // 160 f16 experts and 256 Q4_0 ones (DeepSeek-V3's count; INT4 with its [g, G, n] scales):
    // past the list's 128 tensors, one 3-D weight each.
    stacked_experts_case(GgmlType::F16, 160, (40, 64, 32, 4));
    stacked_experts_case(GgmlType::Q4_0, 256, (40, 64, 64, 4));
}

/// The single 3-D weight (the page's groupType-0 "单单单" row): (E, K, N), seen transposed or
/// not, with a group list of E ≤ 1024 entries is taken, f16 or INT4 with `[g, G, n]` scales;
/// more than 1024 groups, a first axis other than the group list's length, `[G, n]` scales
/// without the expert axis and FLOAT32 with a weight list are refused; and at run time a group
/// list that does not end at x's rows faults.
#[test]
fn the_single_weight_form_takes_what_its_page_gives() {
    let _g = serial();
    let dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let gmm = ops.aclnnGroupedMatmulV4GetWorkspaceSize.unwrap();
    let (m, k, n, e) = (4i64, 64i64, 16i64, 1025i64);
    let (xb, wb, ob, sb) = (
        zeros((m * k * 4) as usize),
        zeros((e * k * n * 4) as usize),
        zeros((m * n * 4) as usize),
        zeros((e * k / 32 * n * 2) as usize),
    );
    let counts: Vec<u8> = (0..e)
        .flat_map(|i| {
            [2i64, 4]
                .get(i as usize)
                .copied()
                .unwrap_or(4)
                .to_le_bytes()
        })
        .collect();
    let gb = upload(&counts);
    let list = |ts: Vec<Tensor>| TensorList::new(acl, ts).unwrap();
    let x = |dt| list(vec![t(&xb, dt, &[m, k])]);
    let out = |dt| list(vec![t(&ob, dt, &[m, n])]);
    // (g, K, N) over (g, n, k) storage.
    let w3 = |dt, g: i64| {
        let v = TView::strided(dt, &[g, k, n], &[n * k, 1, k], 0);
        list(vec![Tensor::new(acl, &wb, v).unwrap()])
    };
    let gl = |g: i64| t(&gb, TDType::I64, &[g]);
    let null = std::ptr::null::<aclTensorList>();
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let mut call =
        |x: &TensorList, w: &TensorList, g: &Tensor, s: *const aclTensorList, o: &TensorList| {
            // SAFETY: live lists and tensors, null optionals, out-pointers.
            first_phase(unsafe {
                gmm(
                    x.raw(),
                    w.raw(),
                    null,
                    null,
                    null,
                    s,
                    null,
                    null,
                    g.raw(),
                    null,
                    null,
                    null,
                    3,
                    0,
                    0,
                    0,
                    o.raw() as *mut _,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut ws,
                    &mut exec,
                )
            })
        };
    let f16 = TDType::F16;
    let r = call(&x(f16), &w3(f16, 3), &gl(3), null, &out(f16));
    assert_eq!(r.0, 0, "f16, 3 groups: {}", r.1);
    let scales = |dims: &[i64]| list(vec![t(&sb, f16, dims)]);
    let r = call(
        &x(f16),
        &w3(TDType::I4, 3),
        &gl(3),
        scales(&[3, k / 32, n]).raw(),
        &out(f16),
    );
    assert_eq!(r.0, 0, "INT4 with [g, G, n] scales: {}", r.1);
    let refused = |r: (i32, String), what: &str| {
        assert_eq!(r.0, ACLNN_ERR_PARAM_INVALID, "{what}: {}", r.1);
        assert!(r.1.contains(what), "{what}: {}", r.1);
    };
    refused(
        call(&x(f16), &w3(f16, e), &gl(e), null, &out(f16)),
        "1025 groups",
    );
    refused(call(&x(f16), &w3(f16, 4), &gl(3), null, &out(f16)), "E = 3");
    refused(
        call(
            &x(f16),
            &w3(TDType::I4, 3),
            &gl(3),
            scales(&[k / 32, n]).raw(),
            &out(f16),
        ),
        "[g, G, n] per group",
    );
    let w2 = || Tensor::new(acl, &wb, TView::strided(TDType::F32, &[k, n], &[1, k], 0)).unwrap();
    refused(
        call(
            &x(TDType::F32),
            &list(vec![w2(), w2()]),
            &gl(2),
            null,
            &out(TDType::F32),
        ),
        "FLOAT32",
    );
    // At run time the list must end at x's rows: [2, 4, 4] over 4 rows runs, [1, 2, 3] faults.
    let launch = ops.aclnnGroupedMatmulV4.unwrap();
    let mut runner = OpRunner::new(&dev);
    for (ends, runs) in [([2i64, 4, 4], true), ([1, 2, 3], false)] {
        let lb = upload(
            &ends
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let g = t(&lb, TDType::I64, &[3]);
        let (xl, wl, ol) = (x(f16), w3(f16, 3), out(f16));
        runner
            .call(
                "aclnnGroupedMatmulV4",
                String::new(),
                // SAFETY: live lists and tensors, null optionals, the runner's out-pointers.
                |w, ex| unsafe {
                    gmm(
                        xl.raw(),
                        wl.raw(),
                        null,
                        null,
                        null,
                        null,
                        null,
                        null,
                        g.raw(),
                        null,
                        null,
                        null,
                        3,
                        0,
                        0,
                        0,
                        ol.raw() as *mut _,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        w,
                        ex,
                    )
                },
                launch,
            )
            .unwrap();
        let r = dev.synchronize();
        if runs {
            r.unwrap();
        } else {
            let fault = r.unwrap_err().to_string();
            assert!(fault.contains("cover 3 rows of x's 4"), "{fault}");
        }
    }
}
