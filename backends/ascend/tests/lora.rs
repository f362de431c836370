//! `lora_add` on `AscendBackend` over the emulated CANN (backends/ascend/src/backend/lora_ops.rs)
//! against a plain Rust reference of the seam's contract, `out[r] += scale * B (A x[r])` per
//! group: f32 adapter weights uploaded whole (their 16-bit copy used: 3 launches a group) and
//! uploaded in parts (no copy: one aclnnCast more for each of A and B, the same values), bf16
//! weights, strided windows of x and out, rows in no group left as they were; the same with bf16
//! activations (Gemma 3's); and the refusals named before anything is launched.

mod common;

use common::seam::*;
use common::*;
use npu_backend::*;
use npu_backend_ascend::backend::AscendBuffer;
use npu_backend_ascend::AscendBackend;

const ROWS: usize = 9;
const N_IN: usize = 48;
const N_OUT: usize = 24;

/// A weight buffer of `dtype` holding `v`, uploaded whole or in two parts.
fn weight(b: &mut AscendBackend, dtype: DType, v: &[f32], whole: bool) -> AscendBuffer {
    let mut buf = b.alloc(dtype, v.len()).unwrap();
    if whole {
        b.upload(
            HostSlice::F32(v),
            ViewMut::rows(&mut buf, 1, v.len()).unwrap(),
        )
        .unwrap();
    } else {
        let half = v.len() / 2;
        for (at, part) in [(0, &v[..half]), (half, &v[half..])] {
            let l = Layout::new(at, 1, part.len(), part.len()).unwrap();
            b.upload(HostSlice::F32(part), ViewMut::new(&mut buf, l).unwrap())
                .unwrap();
        }
    }
    buf
}

/// Values bf16 holds exactly, so every dtype names the same numbers.
fn bf16_exact(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    rand_vec(seed, n, scale)
        .into_iter()
        .map(|v| half::bf16::from_f32(v).to_f32())
        .collect()
}

struct Case {
    x: Vec<f32>,
    out: Vec<f32>,
    a: [Vec<f32>; 2],
    bt: [Vec<f32>; 2],
    ranks: [usize; 2],
    /// (first row, rows, scale) per group.
    groups: [(usize, usize, f32); 2],
}

fn case() -> Case {
    let ranks = [8, 3];
    Case {
        x: h(&rand_vec(1, ROWS * N_IN, 1.0)),
        out: h(&rand_vec(2, ROWS * N_OUT, 1.0)),
        a: [
            bf16_exact(3, ranks[0] * N_IN, 0.5),
            bf16_exact(4, ranks[1] * N_IN, 0.5),
        ],
        bt: [
            bf16_exact(5, ranks[0] * N_OUT, 0.5),
            bf16_exact(6, ranks[1] * N_OUT, 0.5),
        ],
        ranks,
        groups: [(1, 3, 2.0), (5, 2, 0.5)],
    }
}

/// The contract in f64 over the f16 inputs.
fn reference(c: &Case) -> Vec<f32> {
    let mut o = c.out.clone();
    for (gi, &(row, n, scale)) in c.groups.iter().enumerate() {
        let r = c.ranks[gi];
        for i in row..row + n {
            let x = &c.x[i * N_IN..(i + 1) * N_IN];
            let ax: Vec<f64> = (0..r)
                .map(|k| {
                    (0..N_IN)
                        .map(|j| f64::from(c.a[gi][k * N_IN + j]) * f64::from(x[j]))
                        .sum()
                })
                .collect();
            for col in 0..N_OUT {
                let d: f64 = (0..r)
                    .map(|k| ax[k] * f64::from(c.bt[gi][k * N_OUT + col]))
                    .sum();
                o[i * N_OUT + col] += (f64::from(scale) * d) as f32;
            }
        }
    }
    o
}

/// Runs the case with x and out in windows of wider buffers; the rows of out and its launches.
fn run(b: &mut AscendBackend, c: &Case, dtypes: [DType; 2], whole: bool) -> (Vec<f32>, u32) {
    let act = b.act_dtype();
    let (xs, os) = (N_IN + 5, N_OUT + 3);
    let mut xv = vec![0f32; ROWS * xs];
    let mut ov = vec![0f32; ROWS * os];
    for r in 0..ROWS {
        xv[r * xs + 2..r * xs + 2 + N_IN].copy_from_slice(&c.x[r * N_IN..(r + 1) * N_IN]);
        ov[r * os + 1..r * os + 1 + N_OUT].copy_from_slice(&c.out[r * N_OUT..(r + 1) * N_OUT]);
    }
    let x = weight(b, act, &xv, true);
    let mut o = weight(b, act, &ov, true);
    let (xl, ol) = (
        Layout::new(2, ROWS, N_IN, xs).unwrap(),
        Layout::new(1, ROWS, N_OUT, os).unwrap(),
    );
    let a: Vec<AscendBuffer> = (0..2)
        .map(|g| weight(b, dtypes[g], &c.a[g], whole))
        .collect();
    let bt: Vec<AscendBuffer> = (0..2)
        .map(|g| weight(b, dtypes[g], &c.bt[g], whole))
        .collect();
    let groups: Vec<LoraGroup<'_, AscendBuffer>> = (0..2)
        .map(|g| LoraGroup {
            row: c.groups[g].0,
            n: c.groups[g].1,
            a: &a[g],
            b_t: &bt[g],
            rank: c.ranks[g],
            scale: c.groups[g].2,
        })
        .collect();
    b.synchronize().unwrap();
    let before = b.step_stats().launches;
    b.lora_add(
        View::new(&x, xl).unwrap(),
        &groups,
        ViewMut::new(&mut o, ol).unwrap(),
    )
    .unwrap();
    let launches = b.step_stats().launches - before;
    (down(b, &o, ol), launches)
}

#[test]
fn lora_add_follows_the_contract_with_every_weight_form() {
    let _g = serial();
    let mut b = default_backend();
    assert!(b.supports(Capability::Lora));
    let c = case();
    let want = reference(&c);
    let (whole, n_whole) = run(&mut b, &c, [DType::F32, DType::F32], true);
    // Two intermediates and the sum rounded to f16.
    assert_close(&whole, &want, 4e-3, "f32 weights, uploaded whole");
    assert_eq!(n_whole, 6, "Matmul, Matmul, InplaceAdd per group");
    // Rows in no group are the input's exactly.
    for r in [0, 4, 7, 8] {
        assert_eq!(
            &whole[r * N_OUT..(r + 1) * N_OUT],
            &c.out[r * N_OUT..(r + 1) * N_OUT],
            "row {r}"
        );
    }
    let (parts, n_parts) = run(&mut b, &c, [DType::F32, DType::F32], false);
    assert_eq!(
        parts, whole,
        "weights cast on the device give the same values"
    );
    assert_eq!(n_parts, 10, "and one Cast each for A and B");
    let (bf, n_bf) = run(&mut b, &c, [DType::BF16, DType::F32], true);
    assert_eq!(bf, whole, "bf16 weights of the same values");
    assert_eq!(n_bf, 6);
}

#[test]
fn lora_add_with_bf16_activations() {
    let _g = serial();
    let mut b = backend(npu_backend_ascend::AscendConfig {
        activations: Some(DType::BF16),
        ..Default::default()
    });
    assert_eq!(b.act_dtype(), DType::BF16);
    let mut c = case();
    let bf = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    c.x = bf(&c.x);
    c.out = bf(&c.out);
    let want = reference(&c);
    // Two intermediates and the sum rounded to bf16 (2^-8 each).
    let (got, n) = run(&mut b, &c, [DType::BF16, DType::BF16], true);
    assert_close(&got, &want, 2e-2, "bf16 weights and activations");
    assert_eq!(n, 6);
    let (f32w, n) = run(&mut b, &c, [DType::F32, DType::F32], false);
    assert_eq!(f32w, got, "f32 weights cast to bf16 on the device");
    assert_eq!(n, 10);
}

/// A group of rank 4 and scale 1.
fn grp<'a>(
    row: usize,
    n: usize,
    a: &'a AscendBuffer,
    b_t: &'a AscendBuffer,
) -> LoraGroup<'a, AscendBuffer> {
    LoraGroup {
        row,
        n,
        a,
        b_t,
        rank: 4,
        scale: 1.0,
    }
}

#[test]
fn bad_groups_are_refused_by_name_before_anything_runs() {
    let _g = serial();
    let mut b = default_backend();
    let x = up(&mut b, &vec![0.5; ROWS * N_IN], N_IN);
    let mut o = up(&mut b, &vec![0.0; ROWS * N_OUT], N_OUT);
    let a = weight(&mut b, DType::F32, &vec![0.1; 4 * N_IN], true);
    let bt = weight(&mut b, DType::F32, &vec![0.1; 4 * N_OUT], true);
    let short = weight(&mut b, DType::F32, &vec![0.1; 3 * N_OUT], true);
    let i32s = b.alloc(DType::I32, 4 * N_IN).unwrap();
    let cases: Vec<(Vec<LoraGroup<'_, AscendBuffer>>, &str)> = vec![
        (vec![grp(0, 3, &a, &bt), grp(2, 2, &a, &bt)], "overlaps"),
        (vec![grp(7, 3, &a, &bt)], "rows 7+3 of 9"),
        (vec![grp(0, 2, &a, &short)], "B of 72 values"),
        (vec![grp(0, 2, &i32s, &i32s)], "both f32, bf16 or f16"),
        (
            vec![LoraGroup {
                rank: 0,
                ..grp(0, 1, &a, &bt)
            }],
            "rank 0",
        ),
    ];
    b.synchronize().unwrap();
    let before = b.step_stats().launches;
    for (groups, want) in cases {
        let e = b
            .lora_add(
                View::new(&x, Layout::contiguous(ROWS, N_IN)).unwrap(),
                &groups,
                ViewMut::new(&mut o, Layout::contiguous(ROWS, N_OUT)).unwrap(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("lora_add") && e.contains(want), "{want}: {e}");
    }
    assert_eq!(b.step_stats().launches, before, "nothing launched");
    assert_eq!(
        down(&mut b, &o, Layout::contiguous(ROWS, N_OUT)),
        vec![0.0; ROWS * N_OUT]
    );
}
