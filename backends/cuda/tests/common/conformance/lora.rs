//! Conformance case of multi-LoRA (`lora_add`, src/lora.rs and kernels/lora.cu) against the CPU
//! backend's `lora_add`, through the `Backend` trait on both: three adapter groups (ranks 8, 16
//! and 8, f32 and bf16 weights) over a step whose rows of the base model (no adapter) lie
//! between and around them, on a strided input window, for f32, f16 and bf16 activations.
//!
//! Tolerance: none. Both backends widen the same values to f32, sum each `A_k . x` in the same
//! sixteen partial sums and order, scale it, and add `u_k * B_k` column by column in rank order,
//! every operation rounded on its own; the device then rounds the f32 sum once to the activation
//! type, which is what rounding the CPU's f32 result gives. So the results must agree bit for
//! bit, and rows in no group must be left exactly as they were.

use super::{Make, DTYPES};
use crate::common::*;
use npu_backend::{
    Backend, DType, HostSlice, HostSliceMut, Layout, LoraGroup, Readback, View, ViewMut,
};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_backend_cuda::MatmulMode;

/// (first row, rows, rank, scale, weights' dtype) of each group.
const GROUPS: [(usize, usize, usize, f32, DType); 3] = [
    (1, 3, 8, 0.5, DType::F32),
    (5, 2, 16, 2.0, DType::BF16),
    (7, 2, 8, 1.25, DType::F32),
];
const ROWS: usize = 11;
const BASE_ROWS: [usize; 4] = [0, 4, 9, 10];

fn cpu_buf<B: Backend>(b: &mut B, dt: DType, v: &[f32], rows: usize, cols: usize) -> B::Buffer {
    let mut buf = b.alloc(dt, rows * cols).unwrap();
    b.upload(
        HostSlice::F32(v),
        ViewMut::new(&mut buf, Layout::contiguous(rows, cols)).unwrap(),
    )
    .unwrap();
    buf
}

fn read<B: Backend>(b: &mut B, buf: &B::Buffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    b.read_back(&mut [Readback {
        src: View::rows(buf, 1, n).unwrap(),
        dst: HostSliceMut::F32(&mut out),
    }])
    .unwrap();
    out
}

/// Runs `lora_add` of the groups on `b` (x a window of `ldx`-strided rows); returns `out`.
#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    b: &mut B,
    act: DType,
    xs: &[f32],
    ldx: usize,
    n_in: usize,
    base: &[f32],
    n_out: usize,
    weights: &[(Vec<f32>, Vec<f32>)],
) -> Vec<f32> {
    let x = cpu_buf(b, act, xs, 1, xs.len());
    let mut out = cpu_buf(b, act, base, ROWS, n_out);
    let bufs: Vec<(B::Buffer, B::Buffer)> = GROUPS
        .iter()
        .zip(weights)
        .map(|(g, (a, bt))| {
            (
                cpu_buf(b, g.4, a, g.2, n_in),
                cpu_buf(b, g.4, bt, g.2, n_out),
            )
        })
        .collect();
    let groups: Vec<LoraGroup<'_, B::Buffer>> = GROUPS
        .iter()
        .zip(&bufs)
        .map(|(g, (a, bt))| LoraGroup {
            row: g.0,
            n: g.1,
            a,
            b_t: bt,
            rank: g.2,
            scale: g.3,
        })
        .collect();
    let xv = View::new(&x, Layout::new(ldx, ROWS, n_in, ldx).unwrap()).unwrap();
    b.lora_add(xv, &groups, ViewMut::rows(&mut out, ROWS, n_out).unwrap())
        .unwrap();
    read(b, &out, ROWS * n_out)
}

/// Three adapter groups and base rows in one `lora_add` give the CPU backend's values, bit for
/// bit, in every activation dtype; bad groups are refused by name.
pub fn lora_groups_match_the_cpu_backend(make: Make) {
    let (n_in, n_out, ldx) = (72usize, 40usize, 80usize);
    for act in DTYPES {
        let Some(mut cuda) = make(act, MatmulMode::Auto) else {
            return;
        };
        let mut cpu = CpuBackend::new(CpuConfig {
            threads: 1,
            f32_reference: false,
        });
        let mut rng = Rng::new(53 + act as u64);
        // One leading pad row, then ROWS rows of `ldx` (the last `ldx - n_in` unused).
        let xs = rounded(&rng.vec((ROWS + 1) * ldx, -1.0, 1.0), act);
        let base = rounded(&rng.vec(ROWS * n_out, -1.0, 1.0), act);
        let weights: Vec<(Vec<f32>, Vec<f32>)> = GROUPS
            .iter()
            .map(|g| {
                (
                    rounded(&rng.vec(g.2 * n_in, -0.3, 0.3), g.4),
                    rounded(&rng.vec(g.2 * n_out, -0.3, 0.3), g.4),
                )
            })
            .collect();
        let want = rounded(
            &run(&mut cpu, DType::F32, &xs, ldx, n_in, &base, n_out, &weights),
            act,
        );
        take_launches(&cuda);
        let got = run(&mut cuda, act, &xs, ldx, n_in, &base, n_out, &weights);
        let s = npu_backend_cuda::kernels::act_suffix(act).unwrap();
        if let Some(l) = take_launches(&cuda) {
            let n = l.iter().filter(|k| **k == format!("lora_{s}")).count();
            assert_eq!(n, GROUPS.len(), "one launch per group: {l:?}");
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{act:?}: row {} column {}: {g} vs the CPU's {w}",
                i / n_out,
                i % n_out
            );
        }
        for r in BASE_ROWS {
            assert_eq!(
                got[r * n_out..(r + 1) * n_out],
                base[r * n_out..(r + 1) * n_out],
                "{act:?}: base row {r} changed"
            );
        }
        // Something was added to the adapters' rows.
        assert_ne!(got[n_out..2 * n_out], base[n_out..2 * n_out]);
        refusals(&mut cuda, act, n_in, n_out);
    }
}

fn refusals(b: &mut npu_backend_cuda::CudaBackend, act: DType, n_in: usize, n_out: usize) {
    let x = put(b, act, &vec![0.5; ROWS * n_in], ROWS, n_in);
    let mut out = put(b, act, &vec![0.0; ROWS * n_out], ROWS, n_out);
    let a = put(b, DType::F32, &vec![0.1; 8 * n_in], 8, n_in);
    let bt = put(b, DType::F32, &vec![0.1; 8 * n_out], 8, n_out);
    let bt16 = put(b, DType::BF16, &vec![0.1; 8 * n_out], 8, n_out);
    let g = LoraGroup {
        row: 0,
        n: 3,
        a: &a,
        b_t: &bt,
        rank: 8,
        scale: 1.0,
    };
    let cases: [(Vec<LoraGroup<'_, _>>, &str); 5] = [
        (vec![g, LoraGroup { row: 2, ..g }], "overlaps"),
        (vec![LoraGroup { rank: 4, ..g }], "rank 4"),
        (vec![LoraGroup { rank: 300, ..g }], "rank 300"),
        (vec![LoraGroup { b_t: &bt16, ..g }], "both f32 or both bf16"),
        (vec![LoraGroup { row: 10, ..g }], "rows 10+3"),
    ];
    for (groups, want) in cases {
        let e = b
            .lora_add(
                View::rows(&x, ROWS, n_in).unwrap(),
                &groups,
                ViewMut::rows(&mut out, ROWS, n_out).unwrap(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && e.contains("lora_add"), "{want}: {e}");
    }
    // Nothing was launched for a refused call: out is as it was.
    assert!(get(b, &out).iter().all(|&v| v == 0.0));
}
