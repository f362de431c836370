//! Limits that CANN's operator pages document and the backend must stay within, over the strict
//! emulation (which enforces them as the pages state): WeightQuantBatchMatmulV2's range of k and
//! n (a large vocabulary's output matrix is multiplied in column blocks), RmsNorm's gamma type
//! with f16 activations (the f32 mix is documented only from CANN 8.5), and executor reuse only
//! for the allowlisted operators on contiguous, out-of-place tensors — with results bit-equal to
//! fresh executors; MoeInitRoutingV2's dropless grouping and its page's refusals, and
//! GroupedMatmulV4's antiquant table (A16W4 per group symmetric, A16W8 per channel only); the
//! int8 KV cache refused by name (FusedInferAttentionScore reads per-token, per-head scales from a
//! paged INT8 cache only when Q_S = 1).
//!
//! Tolerances as in `backend.rs`: 1e-2 relative for products, 4e-3 for norms.

mod common;

use common::seam::*;
use common::*;
use npu_backend::*;
use npu_backend_ascend::backend::{AscendBuffer, AscendMatrix};
use npu_backend_ascend::ops::OpRunner;
use npu_backend_ascend::tensor::{DType as TDType, Tensor, View as TView};
use npu_backend_ascend::{weights, AscendBackend, AscendConfig};
use npu_gguf::GgmlType;

fn matmul_ref(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            out[i * n + j] = xr
                .iter()
                .zip(&w[j * k..(j + 1) * k])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
    out
}

/// More outputs than WeightQuantBatchMatmulV2 takes (65535): 70,000 (above a block and not a
/// multiple of its width), k = 64.
const WIDE_N: usize = 70_000;

#[test]
fn quantized_matrices_wider_than_65535_outputs_match_the_reference() {
    let _g = serial();
    let mut b = default_backend();
    let k = 64usize;
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
        let (data, w) = match ty {
            GgmlType::Q8_0 => q8_0_rows(41, WIDE_N, k),
            _ => q4_0_rows(42, WIDE_N, k),
        };
        let mat = b
            .load_matrix(&[HostTensor {
                ty,
                data: &data,
                rows: WIDE_N,
                cols: k,
            }])
            .unwrap()
            .unwrap();
        // One row (each block written in place), three rows (through a scratch block), and
        // three rows into a column range of a wider buffer (through the strided-output copy).
        for (m, extra) in [(1usize, 0usize), (3, 0), (3, 8)] {
            let x = h(&rand_vec(43 + m as u64, m * k, 1.0));
            let xb = up(&mut b, &x, k);
            let width = WIDE_N + extra;
            let mut y = b.alloc(DType::F16, m * width).unwrap();
            let out = Layout::new(extra, m, WIDE_N, width).unwrap();
            b.matmul(
                View::rows(&xb, m, k).unwrap(),
                &mat,
                ViewMut::new(&mut y, out).unwrap(),
            )
            .unwrap_or_else(|e| panic!("{} matmul of {m} rows: {e}", ty.name()));
            let want = matmul_ref(&x, &w, m, k, WIDE_N);
            let got = down(&mut b, &y, out);
            assert_close(&got, &want, 1e-2, &format!("{} {m}x{WIDE_N}", ty.name()));
            if extra > 0 {
                let left = down(&mut b, &y, Layout::new(0, m, extra, width).unwrap());
                assert!(left.iter().all(|&v| v == 0.0), "columns outside the view");
            }
        }
    }
}

/// Q4_0 rows of `n` outputs and `k` inputs (GGUF's block layout) and their values.
fn q4_0_rows(seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    use half::f16;
    let vals = rand_vec(seed, n * k, 1.0);
    let (mut data, mut deq) = (Vec::new(), Vec::new());
    for blk in vals.chunks(32) {
        let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = f16::from_f32(amax / 8.0);
        let q: Vec<u8> = blk
            .iter()
            .map(|v| ((v / d.to_f32()).round() + 8.0).clamp(0.0, 15.0) as u8)
            .collect();
        data.extend(d.to_le_bytes());
        for i in 0..16 {
            data.push(q[i] | (q[i + 16] << 4));
        }
        deq.extend(q.iter().map(|&q| d.to_f32() * (q as f32 - 8.0)));
    }
    (data, deq)
}

#[test]
fn the_emulation_refuses_weight_quant_matmul_beyond_65535_outputs() {
    let _g = serial();
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (m, k, n) = (1i64, 64i64, 65_536i64);
    let (data, _) = q8_0_rows(44, n as usize, k as usize);
    let qw = weights::from_q8_0(&data, n as usize, k as usize).unwrap();
    let g = k / weights::GROUP as i64;
    let (xb, wb, yb) = (
        upload_f16(&vec![0.5; (m * k) as usize]),
        upload(&qw.weight),
        zeros((m * n * 2) as usize),
    );
    let sb = upload(
        &qw.scale
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let wt = Tensor::new(acl(), &wb, TView::strided(TDType::I8, &[k, n], &[1, k], 0)).unwrap();
    let st = Tensor::new(acl(), &sb, TView::strided(TDType::F16, &[g, n], &[1, g], 0)).unwrap();
    let e = ops
        .weight_quant_matmul(
            &t(&xb, TDType::F16, &[m, k]),
            &wt,
            &st,
            None,
            weights::GROUP as i32,
            &t(&yb, TDType::F16, &[m, n]),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ACLNN_ERR_PARAM_INVALID") && e.contains("65535"),
        "{e}"
    );
}

#[test]
fn rms_norm_takes_gamma_in_the_activations_type() {
    let _g = serial();
    let mut b = default_backend();
    let (rows, dim) = (3usize, 64usize);
    let x = h(&rand_vec(51, rows * dim, 2.0));
    let w = rand_vec(52, dim, 1.0);
    let xb = up(&mut b, &x, dim);
    let want = rms_ref(&x, &h(&w), 1e-5);
    // An f32 vector from the file (with its f16 copy), the same written since (no copy: cast
    // on the device), and an f16 buffer.
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let loaded = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &bytes,
            rows: 1,
            cols: dim,
        })
        .unwrap();
    let mut written = b.alloc(DType::F32, dim).unwrap();
    b.upload(
        HostSlice::F32(&w),
        ViewMut::rows(&mut written, 1, dim).unwrap(),
    )
    .unwrap();
    let mut halves = b.alloc(DType::F16, dim).unwrap();
    b.upload(
        HostSlice::F32(&w),
        ViewMut::rows(&mut halves, 1, dim).unwrap(),
    )
    .unwrap();
    for (what, gamma) in [("loaded", &loaded), ("written", &written), ("f16", &halves)] {
        let mut y = b.alloc(DType::F16, rows * dim).unwrap();
        b.rms_norm(
            View::rows(&xb, rows, dim).unwrap(),
            gamma,
            1e-5,
            ViewMut::rows(&mut y, rows, dim).unwrap(),
        )
        .unwrap_or_else(|e| panic!("{what} gamma: {e}"));
        let got = down(&mut b, &y, Layout::contiguous(rows, dim));
        assert_close(&got, &want, 4e-3, &format!("rms_norm, {what} gamma"));
        // Per head (16 wide) with the first 16 weights, in place.
        let mut hx = up(&mut b, &x, dim);
        let hw = &w[..16];
        let mut hg = b.alloc(DType::F32, 16).unwrap();
        b.upload(HostSlice::F32(hw), ViewMut::rows(&mut hg, 1, 16).unwrap())
            .unwrap();
        b.rms_norm_heads(ViewMut::rows(&mut hx, rows, dim).unwrap(), &hg, 1e-5, 16)
            .unwrap_or_else(|e| panic!("{what}: rms_norm_heads: {e}"));
        let got = down(&mut b, &hx, Layout::contiguous(rows, dim));
        assert_close(&got, &rms_ref(&x, &h(hw), 1e-5), 4e-3, "rms_norm_heads");
    }
}

#[test]
fn the_emulation_takes_an_f32_gamma_with_f16_x_only_from_cann_8_5() {
    let _g = serial();
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let (rows, dim) = (2i64, 32i64);
    let xb = upload_f16(&vec![1.0; (rows * dim) as usize]);
    let gb = upload(&vec![0u8; (dim * 4) as usize]);
    let (yb, rb) = (zeros((rows * dim * 2) as usize), zeros((rows * 4) as usize));
    let r = ops.rms_norm(
        &t(&xb, TDType::F16, &[rows, dim]),
        &t(&gb, TDType::F32, &[dim]),
        1e-5,
        &t(&yb, TDType::F16, &[rows, dim]),
        &t(&rb, TDType::F32, &[rows, 1]),
    );
    let v = acl().version;
    let documented = (v.major, v.minor) >= (8, 5);
    match r {
        Ok(()) => assert!(documented, "CANN {v} accepted f32 gamma with f16 x"),
        Err(e) => {
            let e = e.to_string();
            assert!(!documented, "CANN {v} refused: {e}");
            assert!(e.contains("ACLNN_ERR_PARAM_INVALID"), "{e}");
        }
    }
    dev.synchronize().unwrap();
}

/// One layer-like round of ops: norm, two matmul forms, bias, SwiGLU, residual adds, greedy pick.
struct Toy {
    norm: AscendBuffer,
    bias: AscendBuffer,
    q: AscendMatrix,
    f: AscendMatrix,
}

fn toy(b: &mut AscendBackend) -> Toy {
    let d = 64usize;
    let vec_of = |b: &mut AscendBackend, seed| {
        let v = rand_vec(seed, d, 1.0);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        b.load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &bytes,
            rows: 1,
            cols: d,
        })
        .unwrap()
    };
    let norm = vec_of(b, 61);
    let bias = vec_of(b, 62);
    let (qd, _) = q4_1_rows(63, 2 * d, d);
    let q = b
        .load_matrix(&[HostTensor {
            ty: GgmlType::Q4_1,
            data: &qd,
            rows: 2 * d,
            cols: d,
        }])
        .unwrap()
        .unwrap();
    let fv: Vec<u8> = rand_vec(64, d * d, 0.2)
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect();
    let f = b
        .load_matrix(&[HostTensor {
            ty: GgmlType::F16,
            data: &fv,
            rows: d,
            cols: d,
        }])
        .unwrap()
        .unwrap();
    Toy { norm, bias, q, f }
}

/// Three steps of the toy round; the residual stream after each, as f16 bit patterns.
fn run_toy(reuse: bool) -> (Vec<Vec<u16>>, usize, u32) {
    let mut b = backend(AscendConfig {
        reuse_executors: reuse,
        ..AscendConfig::default()
    });
    let w = toy(&mut b);
    let (t, d) = (2usize, 64usize);
    let mut x = up(&mut b, &h(&rand_vec(65, t * d, 1.0)), d);
    let mut n = b.alloc(DType::F16, t * d).unwrap();
    let mut gu = b.alloc(DType::F16, t * 2 * d).unwrap();
    let mut a = b.alloc(DType::F16, t * d).unwrap();
    let mut results = Vec::new();
    let mut reused = 0;
    for _ in 0..3 {
        b.begin_step(&step_of(&[(0, 2, vec![0])], 16, &[1, 2]))
            .unwrap();
        b.rms_norm(
            View::rows(&x, t, d).unwrap(),
            &w.norm,
            1e-5,
            ViewMut::rows(&mut n, t, d).unwrap(),
        )
        .unwrap();
        b.matmul(
            View::rows(&n, t, d).unwrap(),
            &w.q,
            ViewMut::rows(&mut gu, t, 2 * d).unwrap(),
        )
        .unwrap();
        let gate = View::new(&gu, Layout::new(0, t, d, 2 * d).unwrap()).unwrap();
        let upv = View::new(&gu, Layout::new(d, t, d, 2 * d).unwrap()).unwrap();
        b.swiglu(gate, upv, ViewMut::rows(&mut a, t, d).unwrap())
            .unwrap();
        b.add_bias(ViewMut::rows(&mut a, t, d).unwrap(), &w.bias)
            .unwrap();
        b.matmul(
            View::rows(&a, t, d).unwrap(),
            &w.f,
            ViewMut::rows(&mut n, t, d).unwrap(),
        )
        .unwrap();
        b.add(
            ViewMut::rows(&mut x, t, d).unwrap(),
            View::rows(&n, t, d).unwrap(),
        )
        .unwrap();
        let got = down(&mut b, &x, Layout::contiguous(t, d));
        reused = b.step_stats().reused_launches;
        results.push(
            got.iter()
                .map(|v| half::f16::from_f32(*v).to_bits())
                .collect(),
        );
    }
    (results, b.cached_executors(), reused)
}

#[test]
fn reuse_is_limited_to_the_allowlist_and_changes_no_bit() {
    let _g = serial();
    let (on, cached, reused) = run_toy(true);
    let (off, none, fresh) = run_toy(false);
    assert_eq!(on, off, "results with and without executor reuse");
    assert_ne!(on[0], on[1], "the steps compute something");
    // Kept: the two matmuls (WeightQuantBatchMatmulV2 and Matmul) and SwiGlu, whose gate/up
    // halves make one contiguous row. Not kept: RmsNorm, the in-place adds (InplaceAdd) — off
    // the allowlist.
    assert_eq!(cached, 3, "executors kept");
    assert_eq!(reused, 3, "launches of kept executors in the last step");
    assert_eq!((none, fresh), (0, 0));
}

/// A first phase's status and the emulation's message.
fn first_phase(rc: i32) -> (i32, String) {
    (rc, acl().last_message())
}

/// MoeInitRoutingV2 (ops-transformer `moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md`)
/// in the dropless mode: the rows grouped by expert (equal ids in flattened order), the row map
/// `expandedRowIdxOut[sortedRowIdx[i]] = i` and the cumulative counts; then what its page
/// forbids (data types, shapes, attributes, null outputs, non-contiguous outputs), the modes not
/// emulated, and an id outside `[0, expertNum)` faulting at run time.
#[test]
fn moe_init_routing_groups_rows_and_refuses_what_its_page_forbids() {
    use npu_ffi::types::*;
    let _g = serial();
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let api = acl().api.ops;
    let (prep, launch) = (
        api.aclnnMoeInitRoutingV2GetWorkspaceSize.unwrap(),
        api.aclnnMoeInitRoutingV2.unwrap(),
    );
    let (rows, h, k, e) = (4i64, 8i64, 2i64, 3i64);
    // Token r's row is all r + 1.
    let x: Vec<f32> = (0..rows * h).map(|i| (i / h + 1) as f32).collect();
    let ids: Vec<i32> = vec![2, 0, 1, 2, 0, 2, 2, 1];
    let i32_bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (xb, ib) = (upload_f16(&x), upload(&i32_bytes(&ids)));
    let (eb, rb, cb) = (
        zeros((rows * k * h * 2) as usize),
        zeros((rows * k * 4) as usize),
        zeros(64),
    );
    let xt = t(&xb, TDType::F16, &[rows, h]);
    let it = t(&ib, TDType::I32, &[rows, k]);
    let et = t(&eb, TDType::F16, &[rows * k, h]);
    let rt = t(&rb, TDType::I32, &[rows * k]);
    let ct = t(&cb, TDType::I32, &[e]);
    let null = std::ptr::null();
    ops.call(
        "aclnnMoeInitRoutingV2",
        String::new(),
        // SAFETY: live tensors and the runner's out-pointers.
        |w, ex| unsafe {
            prep(
                xt.raw(),
                it.raw(),
                0,
                0,
                e,
                0,
                1,
                false,
                et.raw(),
                rt.raw(),
                ct.raw(),
                null,
                w,
                ex,
            )
        },
        launch,
    )
    .unwrap();
    dev.synchronize().unwrap();
    // Expert 0: slots 1, 4; expert 1: 2, 7; expert 2: 0, 3, 5, 6 (flattened order).
    let mut raw = vec![0u8; (rows * k * 4) as usize];
    rb.download(0, &mut raw).unwrap();
    let row_idx: Vec<i32> = raw
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(row_idx, [4, 0, 2, 5, 1, 6, 7, 3]);
    let mut raw = vec![0u8; (e * 4) as usize];
    cb.download(0, &mut raw).unwrap();
    let cumsum: Vec<i32> = raw
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(cumsum, [2, 4, 8]);
    let expanded = read_f16(&eb, (rows * k * h) as usize);
    let firsts: Vec<f32> = expanded.chunks(h as usize).map(|r| r[0]).collect();
    assert_eq!(firsts, [1.0, 3.0, 2.0, 4.0, 1.0, 2.0, 3.0, 4.0]);

    // First phases of misuses: (active, capacity, experts, drop, flag, before) and the tensors.
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    #[allow(clippy::type_complexity)]
    let mut call =
        |x: &Tensor,
         ids: &Tensor,
         (active, capacity, experts, drop, flag, before): (i64, i64, i64, i64, i64, bool),
         ex: &Tensor,
         rows: &Tensor,
         counts: *const aclTensor| {
            // SAFETY: live tensors (or null), out-pointers.
            first_phase(unsafe {
                prep(
                    x.raw(),
                    ids.raw(),
                    active,
                    capacity,
                    experts,
                    drop,
                    flag,
                    before,
                    ex.raw(),
                    rows.raw(),
                    counts,
                    null,
                    &mut ws,
                    &mut exec,
                )
            })
        };
    let ok = (0, 0, e, 0, 1, false);
    assert_eq!(
        call(&xt, &it, ok, &et, &rt, ct.raw()).0,
        0,
        "the dropless call"
    );
    let expect = |r: (i32, String), code: i32, what: &str| {
        assert_eq!(r.0, code, "{what}: {}", r.1);
        assert!(r.1.contains(what), "{what}: {}", r.1);
    };
    // expandedXOut of another type than x; INT64 ids.
    let et32 = t(&eb, TDType::F32, &[rows * k, h / 2]);
    expect(
        call(&xt, &it, ok, &et32, &rt, ct.raw()),
        ACLNN_ERR_PARAM_INVALID,
        "expandedXOut",
    );
    let it64 = t(&ib, TDType::I64, &[rows, k / 2]);
    expect(
        call(&xt, &it64, ok, &et, &rt, ct.raw()),
        ACLNN_ERR_PARAM_INVALID,
        "expertIdx",
    );
    // The tiling's refusals: attributes out of range, expertNum 0 with counts asked for,
    // shapes other than the page's.
    for (attrs, what) in [
        ((0, 0, e, 2, 1, false), "dropPadMode"),
        ((0, 0, e, 0, 3, false), "expertTokensCountOrCumsumFlag"),
        ((-1, 0, e, 0, 1, false), "activeNum"),
        ((0, 0, 0, 0, 1, false), "expertNum = 0"),
        ((0, 0, e, 1, 0, false), "dropPadMode 1"),
    ] {
        expect(
            call(&xt, &it, attrs, &et, &rt, ct.raw()),
            ACLNN_ERR_INNER_TILING_ERROR,
            what,
        );
    }
    let et_short = t(&eb, TDType::F16, &[rows, h]);
    expect(
        call(&xt, &it, ok, &et_short, &rt, ct.raw()),
        ACLNN_ERR_INNER_TILING_ERROR,
        "expandedXOut",
    );
    let ct4 = t(&cb, TDType::I32, &[e + 1]);
    expect(
        call(&xt, &it, ok, &et, &rt, ct4.raw()),
        ACLNN_ERR_INNER_TILING_ERROR,
        "expertTokensCountOrCumsumOut",
    );
    // The count output asked for but null.
    expect(
        call(&xt, &it, ok, &et, &rt, null),
        ACLNN_ERR_PARAM_NULLPTR,
        "expertTokensCountOrCumsumOut",
    );
    // The outputs do not support non-contiguous tensors.
    let rt_strided = Tensor::new(
        acl(),
        &eb,
        TView::strided(TDType::I32, &[rows * k], &[2], 0),
    )
    .unwrap();
    expect(
        call(&xt, &it, ok, &et, &rt_strided, ct.raw()),
        ACLNN_ERR_PARAM_INVALID,
        "expandedRowIdxOut",
    );
    // The Drop/Pad and Active modes are not emulated.
    expect(
        call(&xt, &it, (0, 2, e, 1, 0, true), &et, &rt, null),
        ACLNN_ERR_PARAM_INVALID,
        "Drop/Pad",
    );
    expect(
        call(&xt, &it, (4, 0, e, 0, 1, false), &et, &rt, ct.raw()),
        ACLNN_ERR_PARAM_INVALID,
        "Active",
    );
    // An id outside [0, expertNum) faults at run time.
    let bad = upload(&i32_bytes(&[0, 1, 2, 3, 0, 1, 2, 0]));
    let bt = t(&bad, TDType::I32, &[rows, k]);
    ops.call(
        "aclnnMoeInitRoutingV2",
        String::new(),
        // SAFETY: live tensors and the runner's out-pointers.
        |w, ex| unsafe {
            prep(
                xt.raw(),
                bt.raw(),
                0,
                0,
                e,
                0,
                1,
                false,
                et.raw(),
                rt.raw(),
                ct.raw(),
                null,
                w,
                ex,
            )
        },
        launch,
    )
    .unwrap();
    let fault = dev.synchronize().unwrap_err().to_string();
    assert!(fault.contains("expertIdx[3] = 3"), "{fault}");
}

/// GroupedMatmulV4's antiquant scenario as its page's table gives it (Atlas A2/A3): f16 x with
/// INT4 weights and a symmetric per-group scale `[G_i, n_i]` per weight, or INT8 weights with a
/// per-channel `[n_i]` one, is taken; INT8 per group, INT4 per group with an offset, a G that
/// does not divide k, a scale list of another length, scales of another type than x, weights
/// of x's type with antiquant parameters, and an offset without a scale are refused; so are
/// non-contiguous parameters (the page's column is "-": never looser than unstated).
#[test]
fn grouped_matmul_antiquant_takes_what_its_page_table_gives() {
    use npu_backend_ascend::tensor::TensorList;
    use npu_ffi::types::*;
    let _g = serial();
    let _dev = device();
    let acl = acl();
    let gmm = acl.api.ops.aclnnGroupedMatmulV4GetWorkspaceSize.unwrap();
    let (m, k, n) = (4i64, 64i64, 16i64);
    let (xb, wb, ob, gb, sb) = (
        zeros((m * k * 2) as usize),
        zeros((k * n * 2) as usize),
        zeros((m * n * 2) as usize),
        zeros(64),
        zeros((k * n * 2) as usize),
    );
    let list = |ts: Vec<Tensor>| TensorList::new(acl, ts).unwrap();
    let x = list(vec![t(&xb, TDType::F16, &[m, k])]);
    let out = list(vec![t(&ob, TDType::F16, &[m, n])]);
    let gl = t(&gb, TDType::I64, &[2]);
    // Two experts' (k, n) weights, each its (n, k) storage seen transposed.
    let w = |dt| {
        let w1 = Tensor::new(acl, &wb, TView::strided(dt, &[k, n], &[1, k], 0)).unwrap();
        let w2 = Tensor::new(acl, &wb, TView::strided(dt, &[k, n], &[1, k], 0)).unwrap();
        list(vec![w1, w2])
    };
    let scales = |dt, dims: &[i64]| list(vec![t(&sb, dt, dims), t(&sb, dt, dims)]);
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let null = std::ptr::null::<aclTensorList>();
    let mut call = |w: &TensorList, scale: *const aclTensorList, offset: *const aclTensorList| {
        // SAFETY: live lists and tensors, null optionals, out-pointers.
        first_phase(unsafe {
            gmm(
                x.raw(),
                w.raw(),
                null,
                null,
                null,
                scale,
                offset,
                null,
                gl.raw(),
                null,
                null,
                null,
                3,
                0,
                0,
                0,
                out.raw() as *mut _,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut ws,
                &mut exec,
            )
        })
    };
    let per_group = scales(TDType::F16, &[k / 32, n]);
    let per_channel = scales(TDType::F16, &[n]);
    // Taken: INT4 per group (symmetric), INT4 and INT8 per channel.
    for (dt, s, what) in [
        (TDType::I4, &per_group, "INT4 per group"),
        (TDType::I4, &per_channel, "INT4 per channel"),
        (TDType::I8, &per_channel, "INT8 per channel"),
    ] {
        let r = call(&w(dt), s.raw(), null);
        assert_eq!(r.0, 0, "{what}: {}", r.1);
    }
    let refused = |r: (i32, String), what: &str| {
        assert_eq!(r.0, ACLNN_ERR_PARAM_INVALID, "{what}: {}", r.1);
        assert!(r.1.contains(what), "{what}: {}", r.1);
    };
    refused(
        call(&w(TDType::I8), per_group.raw(), null),
        "per-channel antiquant only",
    );
    refused(
        call(&w(TDType::I4), per_group.raw(), per_group.raw()),
        "symmetric only",
    );
    refused(
        call(&w(TDType::I4), scales(TDType::F16, &[3, n]).raw(), null),
        "does not divide",
    );
    let one = list(vec![t(&sb, TDType::F16, &[k / 32, n])]);
    refused(call(&w(TDType::I4), one.raw(), null), "lists 1 tensors");
    refused(
        call(
            &w(TDType::I4),
            scales(TDType::Bf16, &[k / 32, n]).raw(),
            null,
        ),
        "antiquantScaleOptional",
    );
    refused(call(&w(TDType::F16), per_group.raw(), null), "weight[0]");
    refused(
        call(&w(TDType::I4), null, per_group.raw()),
        "without antiquantScaleOptional",
    );
    let transposed = || {
        Tensor::new(
            acl,
            &sb,
            TView::strided(TDType::F16, &[k / 32, n], &[1, k / 32], 0),
        )
        .unwrap()
    };
    let strided = list(vec![transposed(), transposed()]);
    refused(call(&w(TDType::I4), strided.raw(), null), "contiguous");
}

#[test]
fn the_int8_kv_cache_is_refused_naming_the_missing_attention_form() {
    let _g = serial();
    let mut b = backend(AscendConfig::default());
    b.set_kv_dtype(KvDtype::F16).unwrap();
    assert_eq!(b.kv_dtype(), KvDtype::F16);
    let e = b.set_kv_dtype(KvDtype::Int8).unwrap_err().to_string();
    for part in [
        "kv_cache_dtype int8",
        "ascend",
        "FusedInferAttentionScore",
        "keyAntiquantMode/valueAntiquantMode 5",
        "only when Q_S = 1",
        "no page attention",
    ] {
        assert!(e.contains(part), "{part:?} missing from {e}");
    }
    // Refused before any pool exists: the f16 pool's block bytes stay the sizing.
    let spec = KvSpec {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 64,
        block_size: 128,
        num_blocks: 4,
    };
    assert_eq!(b.kv_block_bytes_for(&spec), spec.f16_block_bytes());
    assert_eq!(b.kv_dtype(), KvDtype::F16);
}
