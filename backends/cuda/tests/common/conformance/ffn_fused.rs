//! Conformance case of the one-launch feed-forward block (`rms_norm_ffn`, src/fold_ffn.rs,
//! `NPU_SERVING_CUDA_FUSE=4`'s `fold_ffn`) against the same block as the level-3 GEMV folds
//! (`rms_norm_matmul_swiglu` then `matmul_add`, each checked bit for bit against the separate
//! ops by `gemv_folds_match_the_unfused_ones`): in f32, f16 and bf16, for 1, 3 and 8 rows, each
//! quantized format as the gate/up matrix and as the down matrix, rows of 256 and 320 values,
//! 96 units (3 blocks of 32: reduction groups of 2, the last short); and 1088 units, which on
//! the emulation's 8 SMs make 17 blocks of 64 (groups of 5: 4 groups, the last of 2).
//!
//! - The normalised rows, the gate/up rows and the SwiGLU activations are the same bits.
//! - The down product and the residual after the add are within a tolerance: the one launch adds
//!   its blocks' shares in its two-level order (block order within a group, then group order),
//!   not in the GEMV's lane order, so they may differ in the last bits:
//!   |fused - level 3| <= tol max(1, the largest |level 3| value of the buffer), tol 1e-5 for
//!   f32 (the terms' rounding errors scale with the largest terms, not with an output that
//!   cancels), 2e-3 for f16 and 1.6e-2 for bf16 (a rounding step or two of the activation dtype).
//! - Two runs, the second on the same backend (every group counter and the global counter must
//!   have wrapped back to 0), give the same bits; so do runs of 96, 1088 then 96 units on one
//!   backend (other groups, a grown scratch) against each on a fresh one.
//! - The launches are named: one `ffn_fused_*`, against the two folded GEMVs.
//! - A Q4_K gate/up matrix (dequantized to F16 at load on this backend), 9 rows, and the
//!   dequantized matmul mode are not taken by the one launch: the level-3 ops run, the same bits.

use super::{Make, DTYPES};
use crate::common::*;
use npu_backend::{Backend, DType, HostTensor, ViewMut};
use npu_backend_cuda::{CudaBackend, CudaMatrix, MatmulMode};
use npu_gguf::GgmlType;

/// The FFN widths (gate/up pairs): three blocks of 32 of the one launch; 17 blocks of 64 where
/// the device has 8 SMs (the emulation; `WIDE_BLOCKS_PER_SM` in src/fold_ffn.rs).
const FF: usize = 96;
const FF_WIDE: usize = 1088;

/// Every buffer the block writes (x, xn, gate/up, h, out), read back, and the launches.
type Run = (Vec<Vec<f32>>, Vec<String>);

fn matrix(b: &mut CudaBackend, ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> CudaMatrix {
    b.load_matrix(&[HostTensor {
        ty,
        data,
        rows,
        cols,
    }])
    .unwrap()
    .expect("one part always makes a matrix")
}

/// A Q4_K tensor of random values (the reference quantizer).
fn q4k_tensor(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
    let x = rng.vec(rows * cols, -1.0, 1.0);
    let rb = GgmlType::Q4K.row_bytes(cols).unwrap();
    let mut out = vec![0u8; rows * rb];
    npu_gguf::quantize::quantize_rows(GgmlType::Q4K, &x, cols, &mut out, 1).unwrap();
    out
}

/// `rms_norm_ffn` of `rows` rows of `h` values with a `tys.0` gate/up and a `tys.1` down matrix.
fn run(
    b: &mut CudaBackend,
    dt: DType,
    rows: usize,
    (h, ff): (usize, usize),
    tys: (GgmlType, GgmlType),
) -> Run {
    let mut rng = Rng::new(170 + (rows * h + ff) as u64);
    let x0 = rounded(&rng.vec(rows * h, -2.0, 2.0), dt);
    let gu = match tys.0 {
        GgmlType::Q4K => q4k_tensor(&mut rng, 2 * ff, h),
        t => random_tensor(&mut rng, t, 2 * ff, h),
    };
    let down = random_tensor(&mut rng, tys.1, h, ff);
    let gu_m = matrix(b, tys.0, &gu, 2 * ff, h);
    let down_m = matrix(b, tys.1, &down, h, ff);
    let wf = rounded(&rng.vec(h, 0.5, 1.5), DType::BF16);
    let wf = put(b, DType::BF16, &wf, 1, h);
    let mut x = put(b, dt, &x0, rows, h);
    let mut xn = b.alloc(dt, rows * h).unwrap();
    let mut gub = b.alloc(dt, rows * 2 * ff).unwrap();
    let mut hb = b.alloc(dt, rows * ff).unwrap();
    let mut out = b.alloc(dt, rows * h).unwrap();
    take_launches(b);
    b.rms_norm_ffn(
        ViewMut::rows(&mut x, rows, h).unwrap(),
        &wf,
        1e-6,
        ViewMut::rows(&mut xn, rows, h).unwrap(),
        &gu_m,
        ViewMut::rows(&mut gub, rows, 2 * ff).unwrap(),
        ViewMut::rows(&mut hb, rows, ff).unwrap(),
        &down_m,
        ViewMut::rows(&mut out, rows, h).unwrap(),
    )
    .unwrap();
    let launched = take_launches(b).unwrap_or_default();
    let values = [&x, &xn, &gub, &hb, &out]
        .into_iter()
        .map(|buf| get(b, buf))
        .collect();
    (values, launched)
}

const NAMES: [&str; 5] = ["x", "xn", "gate/up", "swiglu", "down"];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

fn same_bits(a: &Run, b: &Run, what: &str) {
    for ((name, x), y) in NAMES.iter().zip(&a.0).zip(&b.0) {
        assert!(bits(x) == bits(y), "{what}: {name} differs");
    }
}

fn fmt_name(t: GgmlType) -> &'static str {
    match t {
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q8_0 => "q8_0",
        _ => "f16w",
    }
}

/// The block as the one launch (`ffn` on) or the level-3 folds, on a fresh backend, twice for
/// the one launch (the second run on the same backend).
fn runs(
    make: Make,
    dt: DType,
    mode: MatmulMode,
    rows: usize,
    shape: (usize, usize),
    tys: (GgmlType, GgmlType),
) -> Option<[Run; 3]> {
    let mut fused = make(dt, mode)?;
    fused.set_fold_ffn(true);
    let first = run(&mut fused, dt, rows, shape, tys);
    let again = run(&mut fused, dt, rows, shape, tys);
    let mut plain = make(dt, mode)?;
    let level3 = run(&mut plain, dt, rows, shape, tys);
    Some([first, again, level3])
}

/// The checks of the module note for one case: `runs`' three runs.
fn compare(what: &str, dt: DType, rows: usize, tys: (GgmlType, GgmlType), r: &[Run; 3]) {
    let [first, again, level3] = r;
    let tol = match dt {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    };
    same_bits(first, again, &format!("{what}: two runs of the one launch"));
    for (k, name) in NAMES.iter().enumerate().take(4).skip(1) {
        assert!(
            bits(&first.0[k]) == bits(&level3.0[k]),
            "{what}: {name} differs from the level-3 folds"
        );
    }
    for k in [0, 4] {
        let scale = level3.0[k].iter().fold(1f32, |m, v| m.max(v.abs()));
        let w = worst(&first.0[k], &level3.0[k], tol * scale, 0.0);
        assert!(
            w <= 1.0,
            "{what}: {} off the level-3 folds by {w} x tol",
            NAMES[k]
        );
    }
    if first.1.is_empty() {
        return; // a real device: no launch list
    }
    let s = dt.name();
    let r = if rows == 1 { 1 } else { 8 };
    let (g, d) = (fmt_name(tys.0), fmt_name(tys.1));
    assert_eq!(first.1, vec![format!("ffn_fused_{g}_r{r}_{s}")], "{what}");
    assert_eq!(
        level3.1,
        vec![
            format!("gemv_fold_{g}_r{r}_{s}"),
            format!("gemv_fold_{d}_r{r}_{s}")
        ],
        "{what}"
    );
}

pub fn fused_ffn_matches_the_gemv_folds(make: Make) {
    let pairs = [
        (GgmlType::Q4_0, GgmlType::Q8_0),
        (GgmlType::Q4_1, GgmlType::Q4_0),
        (GgmlType::Q8_0, GgmlType::Q4_1),
    ];
    for dt in DTYPES {
        let s = dt.name();
        for (i, tys) in pairs.into_iter().enumerate() {
            for rows in [1usize, 3, 8] {
                let h = if (rows + i) % 3 == 0 { 320 } else { 256 };
                let Some(r) = runs(make, dt, MatmulMode::Quantized, rows, (h, FF), tys) else {
                    return;
                };
                compare(
                    &format!("{s} {rows} rows of {h}, {tys:?}"),
                    dt,
                    rows,
                    tys,
                    &r,
                );
            }
        }
    }
    // The wide chunk (on the emulation) and more groups, one case a dtype.
    for (i, (dt, rows)) in [(DType::F32, 8), (DType::F16, 1), (DType::BF16, 3)]
        .into_iter()
        .enumerate()
    {
        let tys = pairs[i];
        let Some(r) = runs(make, dt, MatmulMode::Quantized, rows, (256, FF_WIDE), tys) else {
            return;
        };
        let what = format!("{} {rows} rows of 256, {FF_WIDE} units, {tys:?}", dt.name());
        compare(&what, dt, rows, tys, &r);
    }
    // Other splits one after another on one backend: each as on a fresh one.
    let tys = pairs[0];
    let Some(mut one) = make(DType::F32, MatmulMode::Quantized) else {
        return;
    };
    one.set_fold_ffn(true);
    for ff in [FF, FF_WIDE, FF] {
        let got = run(&mut one, DType::F32, 3, (256, ff), tys);
        let Some(mut fresh) = make(DType::F32, MatmulMode::Quantized) else {
            return;
        };
        fresh.set_fold_ffn(true);
        let want = run(&mut fresh, DType::F32, 3, (256, ff), tys);
        same_bits(&got, &want, &format!("{ff} units after other splits"));
    }
    // Where the one launch does not fit, the level-3 ops run: the same bits, no ffn_fused.
    let others = [
        (
            "a Q4_K gate/up matrix",
            MatmulMode::Quantized,
            3,
            (GgmlType::Q4K, GgmlType::Q8_0),
        ),
        (
            "9 rows",
            MatmulMode::Quantized,
            9,
            (GgmlType::Q4_0, GgmlType::Q8_0),
        ),
        (
            "dequantized matrices",
            MatmulMode::Dequantized,
            3,
            (GgmlType::Q4_0, GgmlType::Q8_0),
        ),
    ];
    for (what, mode, rows, tys) in others {
        let Some([first, again, level3]) = runs(make, DType::F32, mode, rows, (256, FF), tys)
        else {
            return;
        };
        same_bits(&first, &level3, what);
        same_bits(&first, &again, what);
        assert_eq!(first.1, level3.1, "{what}: the same launches");
        assert!(
            first.1.iter().all(|l| !l.starts_with("ffn_fused")),
            "{what}: {:?}",
            first.1
        );
    }
}
