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
