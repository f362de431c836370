//! The fused operators of a decode layer, over the strict emulation: `add_rms_norm` as one
//! aclnnAddRmsNorm call (bit-equal to InplaceAdd then RmsNorm, which it replaces; strided views
//! take the two-call path), and the automatic rope choice — ApplyRotaryPosEmb, q and k in place
//! in one call, for a half-rotation rope of width 128; RotaryPositionEmbedding and its copy back
//! otherwise.

mod common;

use common::seam::*;
use common::*;
use npu_backend::*;
use npu_backend_ascend::{AscendBackend, AscendConfig};
use npu_model::{Rope, RopeStyle};

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

fn launches(b: &AscendBackend) -> u64 {
    b.op_counts().unwrap().launches
}

fn step(b: &mut AscendBackend, rows: usize) {
    let blocks: Vec<u32> = (0..4).collect();
    let seqs: Vec<(u32, u32, Vec<u32>)> = (0..rows as u32)
        .map(|i| (3 + i, 1, blocks.clone()))
        .collect();
    let tokens = vec![1u32; rows];
    b.begin_step(&step_of(&seqs, 16, &tokens)).unwrap();
}

#[test]
fn add_rms_norm_is_one_call_and_bit_equal_to_add_then_norm() {
    let _g = serial();
    let mut b = default_backend();
    b.init_kv(kv_spec(16, 8)).unwrap();
    let (rows, cols) = (3usize, 64usize);
    step(&mut b, rows);
    let x = h(&rand_vec(1, rows * cols, 2.0));
    let y = h(&rand_vec(2, rows * cols, 2.0));
    let w = h(&rand_vec(3, cols, 1.0));
    let wb = b
        .load_vector(HostTensor {
            ty: npu_gguf::GgmlType::F32,
            data: &w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
            rows: 1,
            cols,
        })
        .unwrap();
    let all = Layout::contiguous(rows, cols);

    // Fused: one aclnnAddRmsNorm launch.
    let (mut xb, yb) = (up(&mut b, &x, cols), up(&mut b, &y, cols));
    let mut ob = b.alloc(DType::F16, rows * cols).unwrap();
    let (before, fused_before) = (launches(&b), launches_of(c"aclnnAddRmsNorm"));
    b.add_rms_norm(
        ViewMut::rows(&mut xb, rows, cols).unwrap(),
        View::rows(&yb, rows, cols).unwrap(),
        &wb,
        1e-5,
        ViewMut::rows(&mut ob, rows, cols).unwrap(),
    )
    .unwrap();
    b.synchronize().unwrap();
    assert_eq!(launches(&b) - before, 1, "add_rms_norm launches");
    assert_eq!(launches_of(c"aclnnAddRmsNorm") - fused_before, 1);
    let (sum, normed) = (down(&mut b, &xb, all), down(&mut b, &ob, all));

    // The chain it replaces: InplaceAdd, then RmsNorm.
    let (mut xc, yc) = (up(&mut b, &x, cols), up(&mut b, &y, cols));
    let mut oc = b.alloc(DType::F16, rows * cols).unwrap();
    b.add(
        ViewMut::rows(&mut xc, rows, cols).unwrap(),
        View::rows(&yc, rows, cols).unwrap(),
    )
    .unwrap();
    b.rms_norm(
        View::rows(&xc, rows, cols).unwrap(),
        &wb,
        1e-5,
        ViewMut::rows(&mut oc, rows, cols).unwrap(),
    )
    .unwrap();
    assert_eq!(down(&mut b, &xc, all), sum, "the residual sum");
    assert_eq!(down(&mut b, &oc, all), normed, "the norm");

    // And the reference: x + y rounded to f16, RMS-normalised.
    let want_sum = h(&x.iter().zip(&y).map(|(a, b)| a + b).collect::<Vec<_>>());
    assert_close(&sum, &want_sum, 1e-3, "sum");
    assert_close(&normed, &rms_ref(&want_sum, &w, 1e-5), 4e-3, "norm");
}

#[test]
fn add_rms_norm_over_strided_views_takes_the_two_call_path() {
    let _g = serial();
    let mut b = default_backend();
    b.init_kv(kv_spec(16, 8)).unwrap();
    let (rows, cols, wide) = (2usize, 32usize, 48usize);
    step(&mut b, rows);
    let x = h(&rand_vec(4, rows * wide, 2.0));
    let y = h(&rand_vec(5, rows * cols, 2.0));
    let w = h(&rand_vec(6, cols, 1.0));
    let wb = b
        .load_vector(HostTensor {
            ty: npu_gguf::GgmlType::F32,
            data: &w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
            rows: 1,
            cols,
        })
        .unwrap();
    // x: the first 32 of 48 columns (rows 48 apart: not contiguous, which AddRmsNorm refuses).
    let (mut xb, yb) = (up(&mut b, &x, wide), up(&mut b, &y, cols));
    let mut ob = b.alloc(DType::F16, rows * cols).unwrap();
    let xl = Layout::new(0, rows, cols, wide).unwrap();
    let (before, fused_before) = (launches(&b), launches_of(c"aclnnAddRmsNorm"));
    b.add_rms_norm(
        ViewMut::new(&mut xb, xl).unwrap(),
        View::rows(&yb, rows, cols).unwrap(),
        &wb,
        1e-5,
        ViewMut::rows(&mut ob, rows, cols).unwrap(),
    )
    .unwrap();
    b.synchronize().unwrap();
    assert_eq!(launches(&b) - before, 2, "InplaceAdd and RmsNorm");
    assert_eq!(launches_of(c"aclnnAddRmsNorm"), fused_before);
    let sum = down(&mut b, &xb, xl);
    let xs: Vec<f32> = (0..rows)
        .flat_map(|r| x[r * wide..r * wide + cols].to_vec())
        .collect();
    let want_sum = h(&xs.iter().zip(&y).map(|(a, b)| a + b).collect::<Vec<_>>());
    assert_close(&sum, &want_sum, 1e-3, "sum");
    let normed = down(&mut b, &ob, Layout::contiguous(rows, cols));
    assert_close(&normed, &rms_ref(&want_sum, &w, 1e-5), 4e-3, "norm");
    // The columns outside the view are untouched.
    let right = down(
        &mut b,
        &xb,
        Layout::new(cols, rows, wide - cols, wide).unwrap(),
    );
    let want_right: Vec<f32> = (0..rows)
        .flat_map(|r| x[r * wide + cols..(r + 1) * wide].to_vec())
        .collect();
    assert_eq!(right, want_right);
}

/// Launches of one `rope` call (after a first call has gathered the step's table rows).
fn rope_launches(b: &mut AscendBackend, style: RopeStyle, hd: usize) -> (u64, u64) {
    let g = AttnGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: hd,
        rope: Rope {
            style,
            dims: hd,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 0.25,
        window: None,
    };
    let w = 8 * hd;
    let qkv = h(&rand_vec(7, w, 1.0));
    let mut buf = up(b, &qkv, w);
    let l = Layout::new(0, 1, 6 * hd, w).unwrap();
    b.rope(ViewMut::new(&mut buf, l).unwrap(), &g).unwrap();
    let (before, apply) = (launches(b), launches_of(c"aclnnApplyRotaryPosEmb"));
    b.rope(ViewMut::new(&mut buf, l).unwrap(), &g).unwrap();
    b.synchronize().unwrap();
    (
        launches(b) - before,
        launches_of(c"aclnnApplyRotaryPosEmb") - apply,
    )
}

#[test]
fn auto_rope_rotates_half_rotation_heads_of_128_in_one_call() {
    let _g = serial();
    let mut b = backend(AscendConfig::default());
    b.init_kv(kv_spec(16, 8)).unwrap();
    step(&mut b, 1);
    // Qwen-style halves, width 128: ApplyRotaryPosEmb, q and k in place.
    assert_eq!(rope_launches(&mut b, RopeStyle::Halves, 128), (1, 1));
    // Interleaved pairs (GGUF Llama): RotaryPositionEmbedding and the copy back.
    assert_eq!(rope_launches(&mut b, RopeStyle::Interleaved, 128), (2, 0));
    // Width 64 (not ApplyRotaryPosEmb's): RotaryPositionEmbedding and the copy back.
    assert_eq!(rope_launches(&mut b, RopeStyle::Halves, 64), (2, 0));
}

/// The emulation's aclnnAddRmsNorm refuses what its page does (a non-contiguous x1, gamma of
/// another type than x1) and outputs sharing memory with inputs other than the in-place pairing
/// (xOut exactly x2), which it accepts.
#[test]
fn the_emulation_refuses_add_rms_norm_outside_its_page() {
    use npu_backend_ascend::ops::OpRunner;
    use npu_backend_ascend::tensor::{DType as TDType, Tensor, View as TView};
    let _g = serial();
    let dev = device();
    let mut ops = OpRunner::new(&dev);
    let api = acl().api.ops;
    let (prep, launch) = api
        .aclnnAddRmsNormGetWorkspaceSize
        .zip(api.aclnnAddRmsNorm)
        .expect("the emulation has AddRmsNorm");
    let (rows, dim) = (2i64, 16i64);
    let n = (rows * dim) as usize;
    let (x1b, x2b, yb) = (
        upload_f16(&vec![1.0; n]),
        upload_f16(&vec![2.0; n]),
        zeros(n * 2),
    );
    let (g16, g32, rb) = (
        upload_f16(&vec![1.0; dim as usize]),
        upload(&vec![0u8; dim as usize * 4]),
        zeros(rows as usize * 4),
    );
    let mut call = |x1: &Tensor, x2: &Tensor, g: &Tensor, y: &Tensor, x: &Tensor| {
        let r = t(&rb, TDType::F32, &[rows, 1]);
        ops.call(
            "aclnnAddRmsNorm",
            String::new(),
            // SAFETY: live tensors and the runner's out-pointers.
            |w, e| unsafe {
                prep(
                    x1.raw(),
                    x2.raw(),
                    g.raw(),
                    1e-5,
                    y.raw(),
                    r.raw(),
                    x.raw(),
                    w,
                    e,
                )
            },
            launch,
        )
        .map_err(|e| e.to_string())
    };
    let x1 = t(&x1b, TDType::F16, &[rows, dim]);
    let x2 = t(&x2b, TDType::F16, &[rows, dim]);
    let y = t(&yb, TDType::F16, &[rows, dim]);
    let gamma = t(&g16, TDType::F16, &[dim]);
    // The in-place pairing: xOut is x2.
    call(&x1, &x2, &gamma, &y, &x2).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(read_f16(&x2b, n), vec![3.0; n], "xOut = x1 + x2, over x2");
    // xOut on x1: refused.
    let e = call(&x1, &x2, &gamma, &y, &x1).unwrap_err();
    assert!(
        e.contains("ACLNN_ERR_PARAM_INVALID") && e.contains("xOut"),
        "{e}"
    );
    // gamma f32 with f16 x: refused.
    let g = t(&g32, TDType::F32, &[dim]);
    let e = call(&x1, &x2, &g, &y, &x2).unwrap_err();
    assert!(e.contains("gamma"), "{e}");
    // x1 strided (every other row of a 4-row buffer): refused.
    let wide = upload_f16(&vec![1.0; 2 * n]);
    let strided = Tensor::new(
        acl(),
        &wide,
        TView::strided(TDType::F16, &[rows, dim], &[2 * dim, 1], 0),
    )
    .unwrap();
    let e = call(&strided, &x2, &gamma, &y, &x2).unwrap_err();
    assert!(e.contains("contiguous"), "{e}");
    dev.synchronize().unwrap();
}
