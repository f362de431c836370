//! Low-rank adapters on the CPU ([`Capability::Lora`](npu_backend::Capability::Lora)): the
//! segmented LoRA product of one step, `out[r] += scale_g * B_g (A_g x[r])` for the rows of each
//! adapter's group, every group in one pass over the rows (split across the thread pool). The
//! shapes of every group are checked before any row is touched.

use half::bf16;
use npu_backend::{BackendError, DeviceBuffer, LoraGroup, View, ViewMut};

use super::buffer::{bad, rows, rows_mut, shape};
use super::{CpuBackend, CpuBuffer};
use crate::kernels::Isa;

const OP: &str = "lora_add";

/// The largest rank a group may have (the per-row scratch lives on the stack).
pub(crate) const MAX_RANK: usize = 256;

/// An adapter weight element: f32, or bf16 (kept as the file stores it: widening it is exact).
trait Elem: Copy + Send + Sync {
    fn f(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn f(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// `a . x` with sixteen partial sums (a shape the compiler turns into vector code; the same
/// additions in the same order whatever the instruction set).
#[inline(always)]
fn dot<T: Elem>(a: &[T], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cx) = (a.chunks_exact(16), x.chunks_exact(16));
    let (ra, rx) = (ca.remainder(), cx.remainder());
    for (p, q) in ca.zip(cx) {
        for i in 0..16 {
            acc[i] += p[i].f() * q[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (p, q) in ra.iter().zip(rx) {
        s += p.f() * q;
    }
    s
}

/// One group's weights, checked against the views' widths.
struct Group<'a, T> {
    a: &'a [T],
    b_t: &'a [T],
    rank: usize,
    scale: f32,
}

/// One row: `dst += scale * B (A x)`.
#[inline(always)]
fn add_row<T: Elem>(g: &Group<'_, T>, x: &[f32], dst: &mut [f32]) {
    let (n_in, n_out) = (x.len(), dst.len());
    let mut u = [0f32; MAX_RANK];
    for (k, uk) in u[..g.rank].iter_mut().enumerate() {
        *uk = g.scale * dot(&g.a[k * n_in..(k + 1) * n_in], x);
    }
    for (k, &uk) in u[..g.rank].iter().enumerate() {
        let bk = &g.b_t[k * n_out..(k + 1) * n_out];
        for (d, &bv) in dst.iter_mut().zip(bk) {
            *d += uk * bv.f();
        }
    }
}

/// `add_row` compiled for AVX-512 (the same operations in the same order: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_row_avx512<T: Elem>(g: &Group<'_, T>, x: &[f32], dst: &mut [f32]) {
    add_row(g, x, dst)
}

/// `add_row` compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_row_avx2<T: Elem>(g: &Group<'_, T>, x: &[f32], dst: &mut [f32]) {
    add_row(g, x, dst)
}

/// `add_row` on the best instruction set `isa` allows.
#[inline(always)]
fn add_row_on<T: Elem>(isa: Isa, g: &Group<'_, T>, x: &[f32], dst: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found AVX-512 (F among it) on this CPU; the function only
        // indexes its slices.
        Isa::Avx512Vnni => unsafe { add_row_avx512(g, x, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::checked` found AVX2 on this CPU; the function only indexes its slices.
        Isa::Avx2 => unsafe { add_row_avx2(g, x, dst) },
        _ => add_row(g, x, dst),
    }
}

/// A group's weights in their stored type.
enum Weights<'a> {
    F32(Group<'a, f32>),
    Bf16(Group<'a, bf16>),
}

/// The group's A and B as one element type (both f32 or both bf16).
fn group_weights<'a>(
    gi: usize,
    g: &LoraGroup<'a, CpuBuffer>,
) -> Result<(Weights<'a>, usize, usize), BackendError> {
    let (rank, scale) = (g.rank, g.scale);
    match (g.a.as_f32(), g.b_t.as_f32(), g.a.as_bf16(), g.b_t.as_bf16()) {
        (Some(a), Some(b_t), _, _) => Ok((
            Weights::F32(Group {
                a,
                b_t,
                rank,
                scale,
            }),
            a.len(),
            b_t.len(),
        )),
        (_, _, Some(a), Some(b_t)) => Ok((
            Weights::Bf16(Group {
                a,
                b_t,
                rank,
                scale,
            }),
            a.len(),
            b_t.len(),
        )),
        _ => Err(bad(
            OP,
            format!(
                "group {gi}: A is {} and B {}; both f32 or both bf16",
                g.a.dtype().name(),
                g.b_t.dtype().name()
            ),
        )),
    }
}

impl CpuBackend {
    pub(super) fn lora_add_op(
        &mut self,
        x: View<'_, CpuBuffer>,
        groups: &[LoraGroup<'_, CpuBuffer>],
        mut out: ViewMut<'_, CpuBuffer>,
    ) -> Result<(), BackendError> {
        let x = rows(&x, OP)?;
        let o = rows_mut(&mut out, OP)?;
        shape(OP, "out rows", o.rows, 1, x.rows, 1)?;
        let (n_in, n_out) = (x.cols, o.cols);
        // Each row's group (None: no adapter), every group checked first.
        let mut of_row: Vec<Option<u16>> = vec![None; x.rows];
        let mut checked = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            if g.rank == 0 || g.rank > MAX_RANK {
                return Err(bad(
                    OP,
                    format!("group {gi}: rank {} (1..={MAX_RANK})", g.rank),
                ));
            }
            let (w, a_len, b_len) = group_weights(gi, g)?;
            if a_len != g.rank * n_in || b_len != g.rank * n_out {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A of {a_len} and B of {b_len} values for rank {} and a \
                         {n_in} -> {n_out} projection",
                        g.rank
                    ),
                ));
            }
            let end = g.row.checked_add(g.n).filter(|&e| e <= x.rows);
            let Some(end) = end else {
                return Err(bad(
                    OP,
                    format!("group {gi}: rows {}+{} of {}", g.row, g.n, x.rows),
                ));
            };
            for slot in &mut of_row[g.row..end] {
                if slot.is_some() {
                    return Err(bad(OP, format!("group {gi} overlaps another group's rows")));
                }
                *slot = Some(gi as u16);
            }
            checked.push(w);
        }
        if checked.is_empty() {
            return Ok(());
        }
        let isa = self.isa().checked();
        self.par_rows_mut(o, |r, dst| {
            let Some(gi) = of_row[r] else { return };
            match &checked[gi as usize] {
                Weights::F32(g) => add_row_on(isa, g, x.row(r), dst),
                Weights::Bf16(g) => add_row_on(isa, g, x.row(r), dst),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use npu_backend::{Backend, DType, HostSlice, HostSliceMut, Layout, LoraGroup, Readback};
    use npu_backend::{View, ViewMut};

    use crate::backend::{CpuBackend, CpuConfig};

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Two adapters on rows 1..3 and 4..5 of six; rows 0, 3 and 5 untouched; the values are the
    /// plain-loop products.
    #[test]
    fn groups_add_their_own_low_rank_product_and_leave_other_rows() {
        let mut b = CpuBackend::new(CpuConfig {
            threads: 2,
            f32_reference: false,
        });
        let (rows, n_in, n_out) = (6usize, 40usize, 24usize);
        let xs = vals(rows * n_in, 1);
        let base = vals(rows * n_out, 2);
        let mut up = |v: &[f32]| {
            let mut buf = b.alloc(DType::F32, v.len()).unwrap();
            let l = Layout::contiguous(1, v.len());
            b.upload(HostSlice::F32(v), ViewMut::new(&mut buf, l).unwrap())
                .unwrap();
            buf
        };
        let x = up(&xs);
        let mut out = up(&base);
        let (r1, r2) = (3usize, 5usize);
        let (a1, bt1, a2, bt2) = (
            vals(r1 * n_in, 3),
            vals(r1 * n_out, 4),
            vals(r2 * n_in, 5),
            vals(r2 * n_out, 6),
        );
        let (ba1, bb1, ba2, bb2) = (up(&a1), up(&bt1), up(&a2), up(&bt2));
        let groups = [
            LoraGroup {
                row: 1,
                n: 2,
                a: &ba1,
                b_t: &bb1,
                rank: r1,
                scale: 0.5,
            },
            LoraGroup {
                row: 4,
                n: 1,
                a: &ba2,
                b_t: &bb2,
                rank: r2,
                scale: 2.0,
            },
        ];
        b.lora_add(
            View::rows(&x, rows, n_in).unwrap(),
            &groups,
            ViewMut::rows(&mut out, rows, n_out).unwrap(),
        )
        .unwrap();
        let mut got = vec![0f32; rows * n_out];
        b.read_back(&mut [Readback {
            src: View::rows(&out, rows, n_out).unwrap(),
            dst: HostSliceMut::F32(&mut got),
        }])
        .unwrap();
        let mut want = base.clone();
        for (row, a, bt, rank, scale) in [
            (1, &a1, &bt1, r1, 0.5f32),
            (2, &a1, &bt1, r1, 0.5),
            (4, &a2, &bt2, r2, 2.0),
        ] {
            for j in 0..n_out {
                let mut s = 0f64;
                for k in 0..rank {
                    let u: f64 = (0..n_in)
                        .map(|i| a[k * n_in + i] as f64 * xs[row * n_in + i] as f64)
                        .sum();
                    s += u * bt[k * n_out + j] as f64;
                }
                want[row * n_out + j] += (scale as f64 * s) as f32;
            }
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-4, "value {i}: {g} vs {w}");
        }
        for r in [0usize, 3, 5] {
            assert_eq!(
                got[r * n_out..(r + 1) * n_out],
                base[r * n_out..(r + 1) * n_out]
            );
        }
        // Overlapping groups and a wrong rank are refused by name.
        let overlap = [
            groups[0],
            LoraGroup {
                row: 2,
                ..groups[1]
            },
        ];
        let e = b
            .lora_add(
                View::rows(&x, rows, n_in).unwrap(),
                &overlap,
                ViewMut::rows(&mut out, rows, n_out).unwrap(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
        let wrong = [LoraGroup {
            rank: 4,
            ..groups[0]
        }];
        let e = b
            .lora_add(
                View::rows(&x, rows, n_in).unwrap(),
                &wrong,
                ViewMut::rows(&mut out, rows, n_out).unwrap(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("rank 4"), "{e}");
    }
}

#[cfg(test)]
mod isa_tests {
    use npu_backend::{Backend, DType, HostSlice, HostSliceMut, Layout, LoraGroup, Readback};
    use npu_backend::{View, ViewMut};

    use crate::backend::{CpuBackend, CpuConfig};
    use crate::kernels::Isa;

    /// Values bf16 holds exactly (8 significant bits).
    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((((i as u32).wrapping_mul(2654435761) ^ seed) % 255) as f32 - 127.0) / 64.0)
            .collect()
    }

    fn run(isa: Isa, dtype: DType) -> Vec<f32> {
        let mut b = CpuBackend::with_isa(
            CpuConfig {
                threads: 2,
                f32_reference: false,
            },
            isa,
        );
        let (rows, n_in, n_out, rank) = (9usize, 70usize, 37usize, 5usize);
        let mut up = |v: &[f32], dtype: DType| {
            let mut buf = b.alloc(dtype, v.len()).unwrap();
            let l = Layout::contiguous(1, v.len());
            b.upload(HostSlice::F32(v), ViewMut::new(&mut buf, l).unwrap())
                .unwrap();
            buf
        };
        let x = up(&vals(rows * n_in, 1), DType::F32);
        let mut out = up(&vals(rows * n_out, 2), DType::F32);
        let a = up(&vals(rank * n_in, 3), dtype);
        let bt = up(&vals(rank * n_out, 4), dtype);
        let g = LoraGroup {
            row: 0,
            n: rows,
            a: &a,
            b_t: &bt,
            rank,
            scale: 0.75,
        };
        b.lora_add(
            View::rows(&x, rows, n_in).unwrap(),
            &[g],
            ViewMut::rows(&mut out, rows, n_out).unwrap(),
        )
        .unwrap();
        let mut got = vec![0f32; rows * n_out];
        b.read_back(&mut [Readback {
            src: View::rows(&out, rows, n_out).unwrap(),
            dst: HostSliceMut::F32(&mut got),
        }])
        .unwrap();
        got
    }

    /// Every instruction set this CPU has, and bf16 weights of the same values, give the bits
    /// of the plain loop over f32 weights.
    #[test]
    fn every_isa_and_bf16_weights_give_the_same_bits() {
        let want = run(Isa::Scalar, DType::F32);
        for isa in Isa::available() {
            for dtype in [DType::F32, DType::BF16] {
                let got = run(isa, dtype);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
                assert!(same, "{} with {dtype:?} weights differs", isa.name());
            }
        }
    }
}
