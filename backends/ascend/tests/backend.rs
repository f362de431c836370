//! `AscendBackend` through the device seam (`npu_backend::Backend`), every op run on the emulated
//! CANN and compared with a plain Rust reference computed in f32 from the same f16-rounded inputs.
//!
//! Tolerances: the device holds activations in f16 (11-bit significand: one rounding is at most
//! 4.9e-4 relative), so each op's result is compared as |got − want| ≤ tol · (1 + |want|) with
//! tol = 4e-3 for element-wise ops and norms (a few roundings), 1e-2 for products over up to a few
//! hundred inputs (f16 inputs and output, f32 sums), and 5e-3 absolute for attention outputs
//! (convex combinations of f16 values). Integer results (indices, copies) must be exact.
//!
//! The tests share one process-wide emulated device and run one at a time (`serial`), so the
//! leak test sees only its own objects.

mod common;

use common::seam::*;
use common::*;
use half::f16;
use npu_backend::*;
use npu_backend_ascend::backend::{AscendBuffer, AscendMatrix};
use npu_backend_ascend::{AscendBackend, AscendConfig, RopeKernel};
use npu_gguf::GgmlType;
use npu_model::{Rope, RopeStyle};

#[test]
fn buffers_round_trip_through_strided_windows() {
    let _g = serial();
    let mut b = default_backend();
    let mut buf = b.alloc(DType::F16, 32).unwrap();
    let vals: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
    let window = Layout::new(9, 2, 4, 8).unwrap();
    b.upload(
        HostSlice::F32(&vals),
        ViewMut::new(&mut buf, window).unwrap(),
    )
    .unwrap();
    let all = down(&mut b, &buf, Layout::contiguous(4, 8));
    for (i, v) in all.iter().enumerate() {
        let (r, c) = (i / 8, i % 8);
        let want = if (1..3).contains(&r) && (1..5).contains(&c) {
            h(&[vals[(r - 1) * 4 + c - 1]])[0]
        } else {
            0.0
        };
        assert_eq!(*v, want, "element {i}");
    }
    assert_eq!(down(&mut b, &buf, window), h(&vals));
    // f32, bf16 and i32 buffers keep their types.
    let mut f = b.alloc(DType::F32, 3).unwrap();
    b.upload(
        HostSlice::F32(&[1.0e-7, 2.5, -3.0]),
        ViewMut::rows(&mut f, 1, 3).unwrap(),
    )
    .unwrap();
    assert_eq!(
        down(&mut b, &f, Layout::contiguous(1, 3)),
        vec![1.0e-7, 2.5, -3.0]
    );
    let mut bf = b.alloc(DType::BF16, 2).unwrap();
    b.upload(
        HostSlice::F32(&[1.0, 3.140625]),
        ViewMut::rows(&mut bf, 1, 2).unwrap(),
    )
    .unwrap();
    assert_eq!(
        down(&mut b, &bf, Layout::contiguous(1, 2)),
        vec![1.0, 3.140625]
    );
    let mut ib = b.alloc(DType::I32, 4).unwrap();
    b.upload(
        HostSlice::I32(&[7, -1, 1 << 30, 0]),
        ViewMut::rows(&mut ib, 2, 2).unwrap(),
    )
    .unwrap();
    let mut got = [0i32; 2];
    b.read_back(&mut [Readback {
        src: View::new(&ib, Layout::new(1, 2, 1, 2).unwrap()).unwrap(),
        dst: HostSliceMut::I32(&mut got),
    }])
    .unwrap();
    assert_eq!(got, [-1, 0]);
    // Host values of the wrong kind or count are refused by name.
    let e = b
        .upload(
            HostSlice::I32(&[1, 2]),
            ViewMut::rows(&mut buf, 1, 2).unwrap(),
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("i32 host values into a f16 buffer"),
        "{e}"
    );
    assert!(b
        .upload(
            HostSlice::F32(&[1.0]),
            ViewMut::rows(&mut buf, 1, 2).unwrap()
        )
        .is_err());
}

#[test]
fn element_and_row_ops_match_reference() {
    let _g = serial();
    let mut b = default_backend();
    b.init_kv(kv_spec(16, 8)).unwrap();
    let (vocab, hd) = (40usize, 64usize);
    // An embedding table as the file stores it (f32 here), looked up by the step's tokens.
    let table = rand_vec(1, vocab * hd, 1.0);
    let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let emb = b
        .load_embedding(HostTensor {
            ty: GgmlType::F32,
            data: &bytes,
            rows: vocab,
            cols: hd,
        })
        .unwrap();
    let step = step_of(&[(0, 2, vec![0]), (4, 1, vec![1])], 16, &[5, 39, 0]);
    b.begin_step(&step).unwrap();
    let t = step.tokens.len();
    let mut x = b.alloc(DType::F16, t * hd).unwrap();
    b.embed(&emb, ViewMut::rows(&mut x, t, hd).unwrap())
        .unwrap();
    let want_x: Vec<f32> = step
        .tokens
        .iter()
        .flat_map(|&tok| h(&table[tok as usize * hd..][..hd]))
        .collect();
    assert_eq!(down(&mut b, &x, Layout::contiguous(t, hd)), want_x);

    // RMS norm with an f32 weight vector from the file.
    let w = rand_vec(2, hd, 1.0);
    let wb: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let wv = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &wb,
            rows: 1,
            cols: hd,
        })
        .unwrap();
    let mut xn = b.alloc(DType::F16, t * hd).unwrap();
    b.rms_norm(
        View::rows(&x, t, hd).unwrap(),
        &wv,
        1e-5,
        ViewMut::rows(&mut xn, t, hd).unwrap(),
    )
    .unwrap();
    let want_n = rms_ref(&want_x, &w, 1e-5);
    assert_close(
        &down(&mut b, &xn, Layout::contiguous(t, hd)),
        &want_n,
        4e-3,
        "rms_norm",
    );

    // Residual add and bias add, in place.
    b.add(
        ViewMut::rows(&mut x, t, hd).unwrap(),
        View::rows(&xn, t, hd).unwrap(),
    )
    .unwrap();
    let got_n = down(&mut b, &xn, Layout::contiguous(t, hd));
    let want_sum: Vec<f32> = h(&want_x
        .iter()
        .zip(&got_n)
        .map(|(a, c)| a + c)
        .collect::<Vec<_>>());
    assert_close(
        &down(&mut b, &x, Layout::contiguous(t, hd)),
        &want_sum,
        4e-3,
        "add",
    );
    let bias = rand_vec(3, 16, 1.0);
    let bb: Vec<u8> = bias.iter().flat_map(|v| v.to_le_bytes()).collect();
    let bv = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &bb,
            rows: 1,
            cols: 16,
        })
        .unwrap();
    // Columns 8..24 of every row only.
    let cols = Layout::new(8, t, 16, hd).unwrap();
    b.add_bias(ViewMut::new(&mut x, cols).unwrap(), &bv)
        .unwrap();
    let after = down(&mut b, &x, Layout::contiguous(t, hd));
    for r in 0..t {
        for c in 0..hd {
            let base = want_sum[r * hd + c];
            let want = if (8..24).contains(&c) {
                base + h(&bias)[c - 8]
            } else {
                base
            };
            assert!((after[r * hd + c] - want).abs() <= 4e-3 * (1.0 + want.abs()));
        }
    }

    // SwiGLU from [gate | up] column ranges of one buffer, and from two buffers.
    let ff = 24;
    let gu = h(&rand_vec(4, t * 2 * ff, 3.0));
    let gub = up(&mut b, &gu, 2 * ff);
    let mut o = b.alloc(DType::F16, t * ff).unwrap();
    let want_sw: Vec<f32> = (0..t * ff)
        .map(|i| {
            let (r, c) = (i / ff, i % ff);
            let (g, u) = (gu[r * 2 * ff + c], gu[r * 2 * ff + ff + c]);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    b.swiglu(
        View::new(&gub, Layout::new(0, t, ff, 2 * ff).unwrap()).unwrap(),
        View::new(&gub, Layout::new(ff, t, ff, 2 * ff).unwrap()).unwrap(),
        ViewMut::rows(&mut o, t, ff).unwrap(),
    )
    .unwrap();
    assert_close(
        &down(&mut b, &o, Layout::contiguous(t, ff)),
        &want_sw,
        4e-3,
        "swiglu",
    );
    let gates: Vec<f32> = (0..t)
        .flat_map(|r| gu[r * 2 * ff..][..ff].to_vec())
        .collect();
    let ups: Vec<f32> = (0..t)
        .flat_map(|r| gu[r * 2 * ff + ff..][..ff].to_vec())
        .collect();
    let (gb, ub) = (up(&mut b, &gates, ff), up(&mut b, &ups, ff));
    let mut o2 = b.alloc(DType::F16, t * ff).unwrap();
    b.swiglu(
        View::rows(&gb, t, ff).unwrap(),
        View::rows(&ub, t, ff).unwrap(),
        ViewMut::rows(&mut o2, t, ff).unwrap(),
    )
    .unwrap();
    assert_close(
        &down(&mut b, &o2, Layout::contiguous(t, ff)),
        &want_sw,
        4e-3,
        "swiglu apart",
    );
    // Adjacent halves of a wider row (gate | up | 8 more columns) into a strided out: SwiGlu
    // takes x and out contiguous, so both go through scratch.
    let wide: Vec<f32> = (0..t)
        .flat_map(|r| {
            let mut row = gu[r * 2 * ff..][..2 * ff].to_vec();
            row.extend([0.5; 8]);
            row
        })
        .collect();
    let wb = up(&mut b, &wide, 2 * ff + 8);
    let mut o3 = b.alloc(DType::F16, t * (ff + 4)).unwrap();
    b.swiglu(
        View::new(&wb, Layout::new(0, t, ff, 2 * ff + 8).unwrap()).unwrap(),
        View::new(&wb, Layout::new(ff, t, ff, 2 * ff + 8).unwrap()).unwrap(),
        ViewMut::new(&mut o3, Layout::new(0, t, ff, ff + 4).unwrap()).unwrap(),
    )
    .unwrap();
    let got3 = down(&mut b, &o3, Layout::contiguous(t, ff + 4));
    let got3: Vec<f32> = (0..t)
        .flat_map(|r| got3[r * (ff + 4)..][..ff].to_vec())
        .collect();
    assert_close(&got3, &want_sw, 4e-3, "swiglu of a wider row, strided out");

    // Logit rows gathered, then argmax on the device (ties to the first).
    let mut lx = b.alloc(DType::F16, 2 * hd).unwrap();
    b.gather_logit_rows(
        View::rows(&x, t, hd).unwrap(),
        ViewMut::rows(&mut lx, 2, hd).unwrap(),
    )
    .unwrap();
    let gathered = down(&mut b, &lx, Layout::contiguous(2, hd));
    assert_eq!(&gathered[..hd], &after[hd..2 * hd]);
    assert_eq!(&gathered[hd..], &after[2 * hd..3 * hd]);
    let mut logits = vec![0.0f32; 3 * 50];
    logits[7] = 2.0;
    logits[50 + 3] = 1.5;
    logits[50 + 9] = 1.5;
    logits[100 + 49] = -0.5;
    for v in logits[100..149].iter_mut() {
        *v = -1.0;
    }
    let lb = up(&mut b, &logits, 50);
    let mut ids = b.alloc(DType::I32, 3).unwrap();
    assert!(b
        .argmax_rows(
            View::rows(&lb, 3, 50).unwrap(),
            ViewMut::rows(&mut ids, 3, 1).unwrap()
        )
        .unwrap());
    let mut got = [0i32; 3];
    b.read_back(&mut [Readback {
        src: View::rows(&ids, 3, 1).unwrap(),
        dst: HostSliceMut::I32(&mut got),
    }])
    .unwrap();
    assert_eq!(got, [7, 3, 49]);
}

/// Random rows in Q4_0 and their dequantized values.
fn q4_0_rows(seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
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

/// A weight's bytes as the file stores them, and its values.
type Rows = (Vec<u8>, Vec<f32>);

fn matmul_ref(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    (0..m * n)
        .map(|i| (0..k).map(|kk| x[i / n * k + kk] * w[i % n * k + kk]).sum())
        .collect()
}

/// `x` as llama.cpp's 8-bit activations stand for it: per 32-value block, `q = round(x·127/amax)`
/// (half to even), times the scale `amax/127` rounded through f16.
fn q8_ref(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|blk| {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0).to_f32();
            let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
            blk.iter()
                .map(move |v| (v * id).round_ties_even() * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn matmul_with_8_bit_activations_matches_llama_cpp_arithmetic() {
    let _g = serial();
    let mut b = backend(AscendConfig {
        q8_activations: true,
        ..AscendConfig::default()
    });
    let (m, k, n) = (3usize, 128usize, 40usize);
    let x = h(&rand_vec(100, m * k, 2.0));
    let xb = up(&mut b, &x, k);
    let (d, w) = q4_1_rows(101, n, k);
    let mat = b
        .load_matrix(&[HostTensor {
            ty: GgmlType::Q4_1,
            data: &d,
            rows: n,
            cols: k,
        }])
        .unwrap()
        .unwrap();
    let mut y = b.alloc(DType::F16, m * n).unwrap();
    b.matmul(
        View::rows(&xb, m, k).unwrap(),
        &mat,
        ViewMut::rows(&mut y, m, n).unwrap(),
    )
    .unwrap();
    let got = down(&mut b, &y, Layout::contiguous(m, n));
    let want = matmul_ref(&q8_ref(&x), &w, m, k, n);
    // Against the quantized activations: f16 output and weights only.
    assert_close(&got, &want, 4e-3, "8-bit activation matmul");
    // Unquantized activations differ by more: the check can tell the two apart.
    let plain = matmul_ref(&x, &w, m, k, n);
    let worst = got
        .iter()
        .zip(&plain)
        .map(|(g, p)| (g - p).abs() / (1.0 + p.abs()))
        .fold(0f32, f32::max);
    assert!(
        worst > 4e-3,
        "8-bit activations made no difference ({worst})"
    );
}

#[test]
fn matmul_in_every_weight_form_matches_reference() {
    let _g = serial();
    // Activations as they come (the 8-bit form is checked above).
    let mut b = default_backend();
    let (m, k) = (3usize, 128usize);
    let x = h(&rand_vec(10, m * k, 1.0));
    let xb = up(&mut b, &x, k);
    let f32_rows = |seed, n: usize| {
        let v = rand_vec(seed, n * k, 0.5);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        (bytes, h(&v))
    };
    let f16_rows = |seed, n: usize| {
        let v = h(&rand_vec(seed, n * k, 0.5));
        let bytes: Vec<u8> = v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect();
        (bytes, v)
    };
    let forms: Vec<(GgmlType, Rows, Rows)> = vec![
        (GgmlType::Q4_1, q4_1_rows(11, 40, k), q4_1_rows(12, 24, k)),
        (GgmlType::Q8_0, q8_0_rows(13, 40, k), q8_0_rows(14, 24, k)),
        (GgmlType::Q4_0, q4_0_rows(15, 40, k), q4_0_rows(16, 24, k)),
        (GgmlType::F16, f16_rows(17, 40), f16_rows(18, 24)),
        (GgmlType::F32, f32_rows(19, 40), f32_rows(20, 24)),
    ];
    for (ty, (d1, w1), (d2, w2)) in &forms {
        let parts = [
            HostTensor {
                ty: *ty,
                data: d1,
                rows: 40,
                cols: k,
            },
            HostTensor {
                ty: *ty,
                data: d2,
                rows: 24,
                cols: k,
            },
        ];
        let w = b.load_matrix(&parts).unwrap().expect("one form stacks");
        let mut y = b.alloc(DType::F16, m * 64).unwrap();
        b.matmul(
            View::rows(&xb, m, k).unwrap(),
            &w,
            ViewMut::rows(&mut y, m, 64).unwrap(),
        )
        .unwrap();
        let all_w = [w1.clone(), w2.clone()].concat();
        let want = matmul_ref(&x, &all_w, m, k, 64);
        let got = down(&mut b, &y, Layout::contiguous(m, 64));
        assert_close(&got, &want, 1e-2, &format!("{} matmul", ty.name()));
    }
    // Parts of different forms do not stack; each still loads alone.
    let mixed = [
        HostTensor {
            ty: GgmlType::Q4_1,
            data: &forms[0].1 .0,
            rows: 40,
            cols: k,
        },
        HostTensor {
            ty: GgmlType::Q8_0,
            data: &forms[1].2 .0,
            rows: 24,
            cols: k,
        },
    ];
    assert!(b.load_matrix(&mixed).unwrap().is_none());
    let q8 = b.load_matrix(&mixed[1..]).unwrap().unwrap();
    // Strided input rows and an output column range (copies through scratch buffers).
    // Each row twice: [x_r | x_r]; the view takes the second copy.
    let doubled: Vec<f32> = x.chunks(k).flat_map(|r| [r, r].concat()).collect();
    let wide = up(&mut b, &doubled, 2 * k);
    let mut y = b.alloc(DType::F16, m * 100).unwrap();
    b.matmul(
        View::new(&wide, Layout::new(k, m, k, 2 * k).unwrap()).unwrap(),
        &q8,
        ViewMut::new(&mut y, Layout::new(50, m, 24, 100).unwrap()).unwrap(),
    )
    .unwrap();
    let want = matmul_ref(&x, &forms[1].2 .1, m, k, 24);
    let got = down(&mut b, &y, Layout::new(50, m, 24, 100).unwrap());
    assert_close(&got, &want, 1e-2, "strided matmul");
    assert!(down(&mut b, &y, Layout::new(0, m, 50, 100).unwrap())
        .iter()
        .all(|&v| v == 0.0));
    // A matrix of 32 inputs (a single quantization group) goes through f16.
    let (d, wv) = q8_0_rows(21, 8, 32);
    let small = b
        .load_matrix(&[HostTensor {
            ty: GgmlType::Q8_0,
            data: &d,
            rows: 8,
            cols: 32,
        }])
        .unwrap()
        .unwrap();
    let mut y = b.alloc(DType::F16, m * 8).unwrap();
    b.matmul(
        View::new(&xb, Layout::new(0, m, 32, k).unwrap()).unwrap(),
        &small,
        ViewMut::rows(&mut y, m, 8).unwrap(),
    )
    .unwrap();
    let x32: Vec<f32> = (0..m).flat_map(|r| x[r * k..r * k + 32].to_vec()).collect();
    assert_close(
        &down(&mut b, &y, Layout::contiguous(m, 8)),
        &matmul_ref(&x32, &h(&wv), m, 32, 8),
        1e-2,
        "32-input matmul",
    );
}

fn rope_ref(rope: &Rope, x: &[f32], heads: usize, hd: usize, positions: &[u32]) -> Vec<f32> {
    let mut out = x.to_vec();
    let mut cs = vec![0f32; rope.dims];
    for (t, &p) in positions.iter().enumerate() {
        rope.angles(p, &mut cs);
        // The device's table holds cos/sin in f16.
        let cs = h(&cs);
        for hh in 0..heads {
            let head = &mut out[(t * heads + hh) * hd..][..hd];
            for i in 0..rope.dims / 2 {
                let (a, bb) = match rope.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + rope.dims / 2),
                };
                let (x0, x1) = (head[a], head[bb]);
                head[a] = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
                head[bb] = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
            }
        }
    }
    out
}

#[test]
fn rope_matches_reference_in_both_styles_and_kernels() {
    let _g = serial();
    // ApplyRotaryPosEmb takes only a rotary width of 128 (the emulation refuses others, as CANN
    // documents): with 16, 8 or 64 rotated dimensions that choice falls back to another kernel.
    for kernel in [
        RopeKernel::Auto,
        RopeKernel::ApplyRotaryPosEmb,
        RopeKernel::MulAdd,
    ] {
        let mut b = backend(AscendConfig {
            rope: kernel,
            ..AscendConfig::default()
        });
        b.init_kv(kv_spec(16, 400)).unwrap();
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            for (hd, dims) in [(16, 16), (16, 8), (128, 128), (128, 64)] {
                let g = AttnGeometry {
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: hd,
                    rope: Rope {
                        style,
                        dims,
                        base: 10000.0,
                        freq_scale: 0.5,
                        factors: None,
                    },
                    scale: 0.25,
                    window: None,
                };
                // Positions beyond the first table (4096) make it grow.
                let blocks: Vec<u32> = (0..375).collect();
                let step = step_of(&[(0, 2, blocks.clone()), (5990, 1, blocks)], 16, &[1]);
                b.begin_step(&step).unwrap();
                // Rows of 6 heads and 16 more columns (as V's columns follow Q and K).
                let (t, hw) = (3, 6 * hd);
                let w = hw + 16;
                let qkv = h(&rand_vec(30 + dims as u64, t * w, 1.0));
                let mut buf = up(&mut b, &qkv, w);
                b.rope(
                    ViewMut::new(&mut buf, Layout::new(0, t, hw, w).unwrap()).unwrap(),
                    &g,
                )
                .unwrap();
                let got = down(&mut b, &buf, Layout::contiguous(t, w));
                let heads: Vec<f32> = (0..t)
                    .flat_map(|r| qkv[r * w..r * w + hw].to_vec())
                    .collect();
                let want = rope_ref(&g.rope, &heads, 6, hd, &step.positions);
                for r in 0..t {
                    assert_close(
                        &got[r * w..r * w + hw],
                        &want[r * hw..(r + 1) * hw],
                        4e-3,
                        &format!("{kernel:?} {style:?} head {hd} dims {dims} row {r}"),
                    );
                    // The columns after the heads are untouched.
                    assert_eq!(&got[r * w + hw..(r + 1) * w], &qkv[r * w + hw..(r + 1) * w]);
                }
            }
        }
    }
}

/// A two-layer toy step's ops in the order a Llama step calls them.
fn toy_step(
    b: &mut AscendBackend,
    w: &[AscendMatrix],
    x: &mut AscendBuffer,
    y: &mut AscendBuffer,
    t: usize,
) {
    for m in w {
        b.matmul(
            View::rows(x, t, 64).unwrap(),
            m,
            ViewMut::rows(y, t, 64).unwrap(),
        )
        .unwrap();
        b.add(
            ViewMut::rows(x, t, 64).unwrap(),
            View::rows(y, t, 64).unwrap(),
        )
        .unwrap();
    }
}

#[test]
fn executors_of_repeated_shapes_are_reused() {
    let _g = serial();
    for reuse in [true, false] {
        let mut b = backend(AscendConfig {
            reuse_executors: reuse,
            ..AscendConfig::default()
        });
        b.init_kv(kv_spec(16, 8)).unwrap();
        let layers: Vec<AscendMatrix> = (0..2)
            .map(|i| {
                let (d, _) = q4_1_rows(70 + i, 64, 64);
                b.load_matrix(&[HostTensor {
                    ty: GgmlType::Q4_1,
                    data: &d,
                    rows: 64,
                    cols: 64,
                }])
                .unwrap()
                .unwrap()
            })
            .collect();
        let mut x = up(&mut b, &h(&rand_vec(80, 64, 0.1)), 64);
        let mut y = b.alloc(DType::F16, 64).unwrap();
        let mut results = Vec::new();
        for _ in 0..3 {
            let step = step_of(&[(0, 1, vec![0])], 16, &[1]);
            b.begin_step(&step).unwrap();
            toy_step(&mut b, &layers, &mut x, &mut y, 1);
            results.push(down(&mut b, &x, Layout::contiguous(1, 64)));
        }
        let s = b.step_stats();
        assert_eq!(s.launches, 4, "two matmuls and two adds per step");
        if reuse {
            // Steps after the first prepare only the in-place adds (InplaceAdd is outside the
            // reuse allowlist): both matmuls reuse their executors.
            assert_eq!((s.prepares, s.reused_launches), (2, 2), "{s:?}");
            assert_eq!(b.last_step_stats().prepares, 2);
        } else {
            assert_eq!((s.prepares, s.reused_launches), (4, 0), "{s:?}");
        }
        // Reused executors compute what fresh ones do.
        assert_ne!(results[0], results[1]);
    }
}

#[test]
fn nothing_is_left_alive_after_the_backend_and_its_buffers_drop() {
    let _g = serial();
    {
        let mut b = default_backend();
        b.init_kv(kv_spec(128, 4)).unwrap();
        let (d, _) = q4_1_rows(90, 64, 64);
        let m = b
            .load_matrix(&[HostTensor {
                ty: GgmlType::Q4_1,
                data: &d,
                rows: 64,
                cols: 64,
            }])
            .unwrap()
            .unwrap();
        let step = step_of(&[(0, 3, vec![1])], 128, &[1]);
        b.begin_step(&step).unwrap();
        let x = up(&mut b, &rand_vec(91, 3 * 64, 1.0), 64);
        let mut y = b.alloc(DType::F16, 3 * 64).unwrap();
        b.matmul(
            View::rows(&x, 3, 64).unwrap(),
            &m,
            ViewMut::rows(&mut y, 3, 64).unwrap(),
        )
        .unwrap();
        let mut host = vec![0u8; b.kv_block_bytes()];
        b.kv_blocks_to_host(&[1], &mut host).unwrap();
        b.kv_blocks_from_host(&host, &[2]).unwrap();
        // The backend goes first: the buffers keep the device until they are freed.
        drop(b);
        drop((m, x, y));
    }
    let report = leak_report();
    assert!(report.is_empty(), "objects left alive:\n{report}");
}

#[test]
fn greedy_picks_on_the_device_read_nan_and_inf_as_the_sampler_does() {
    let _g = serial();
    let mut b = default_backend();
    let cols = 12;
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let mut rows: Vec<Vec<f32>> = vec![
        (0..cols).map(|i| (i as f32 * 0.7).sin()).collect(),
        vec![0.0; cols],
        vec![-1.0; cols],
        vec![0.5; cols],
        vec![nan; cols],
        vec![-inf; cols],
    ];
    rows[1][3] = 2.0;
    rows[1][9] = 2.0;
    rows[2][0] = nan;
    rows[2][5] = 1.0;
    rows[3][4] = inf;
    rows[3][8] = inf;
    rows[5][6] = -3.0;
    let flat: Vec<f32> = rows.concat();
    let lb = up(&mut b, &flat, cols);
    let n = rows.len();
    let (mut ids, mut lps) = (
        b.alloc(DType::I32, n).unwrap(),
        b.alloc(DType::F32, n).unwrap(),
    );
    assert!(b
        .argmax_logprob_rows(
            View::rows(&lb, n, cols).unwrap(),
            ViewMut::rows(&mut lps, n, 1).unwrap()
        )
        .unwrap());
    assert!(b
        .argmax_rows(
            View::rows(&lb, n, cols).unwrap(),
            ViewMut::rows(&mut ids, n, 1).unwrap()
        )
        .unwrap());
    let (mut got_ids, mut got_lp) = (vec![0i32; n], vec![0f32; n]);
    b.read_back(&mut [
        Readback {
            src: View::rows(&ids, n, 1).unwrap(),
            dst: HostSliceMut::I32(&mut got_ids),
        },
        Readback {
            src: View::rows(&lps, n, 1).unwrap(),
            dst: HostSliceMut::F32(&mut got_lp),
        },
    ])
    .unwrap();
    // The sampler's reading: NaN as −inf, +inf as f32::MAX, first index on ties, a row with
    // nothing finite picks 0 with a uniform log-probability.
    let read = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else if v == inf {
            f32::MAX
        } else {
            v
        }
    };
    for (r, row) in rows.iter().enumerate() {
        let vals: Vec<f32> = h(row).into_iter().map(read).collect();
        let (mut best, mut arg) = (f32::NEG_INFINITY, 0);
        for (i, &v) in vals.iter().enumerate() {
            if v > best {
                (best, arg) = (v, i);
            }
        }
        assert_eq!(got_ids[r], arg as i32, "row {r}");
        let want = if best == f32::NEG_INFINITY {
            -(cols as f32).ln()
        } else {
            -vals
                .iter()
                .map(|&v| ((v as f64) - best as f64).exp())
                .sum::<f64>()
                .ln() as f32
        };
        assert!(
            (got_lp[r] - want).abs() < 1e-5,
            "row {r}: log-probability {} vs {want}",
            got_lp[r]
        );
    }
    assert_eq!(&got_ids[1..5], &[3, 5, 4, 0]);
}

#[test]
fn token_ops_work_before_the_kv_pool_exists_and_kv_ops_say_why_not() {
    let _g = serial();
    let mut b = default_backend();
    let table = rand_vec(110, 8 * 16, 1.0);
    let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let emb = b
        .load_embedding(HostTensor {
            ty: GgmlType::F32,
            data: &bytes,
            rows: 8,
            cols: 16,
        })
        .unwrap();
    b.begin_step(&step_of(&[(0, 2, vec![0])], 16, &[3, 5]))
        .unwrap();
    let mut x = b.alloc(DType::F16, 2 * 16).unwrap();
    b.embed(&emb, ViewMut::rows(&mut x, 2, 16).unwrap())
        .unwrap();
    let got = down(&mut b, &x, Layout::contiguous(2, 16));
    assert_eq!(
        got,
        h(&[&table[3 * 16..4 * 16], &table[5 * 16..6 * 16]].concat())
    );
    let g = AttnGeometry {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 16,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: 16,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 0.25,
        window: None,
    };
    let e = b
        .kv_write(
            View::rows(&x, 2, 16).unwrap(),
            View::rows(&x, 2, 16).unwrap(),
            &g,
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("KV pool is not initialised"), "{e}");
}

#[test]
fn a_kv_pool_larger_than_free_memory_is_refused_with_what_fits() {
    let _g = serial();
    let mut b = default_backend();
    let free = b.mem_info().unwrap().free as usize;
    // Blocks of 2 layers x K/V x 128 slots x 32 values x 2 bytes.
    let per_block = 2 * 2 * 128 * 32 * 2;
    let e = b
        .init_kv(kv_spec(128, free / per_block + 10))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("out of memory")
            && e.contains("pa_config.num_blocks")
            && e.contains("room for about"),
        "{e}"
    );
    // Nothing was allocated: a pool that fits still does.
    b.init_kv(kv_spec(128, 4)).unwrap();
}
