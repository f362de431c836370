//! Low-rank adapters on the CPU ([`Capability::Lora`](npu_backend::Capability::Lora)): the
//! segmented LoRA product of one step, `out[r] += scale_g * B_g (A_g x[r])` for the rows of each
//! adapter's group, every group in one pass over the rows (split across the thread pool). The
//! shapes of every group are checked before any row is touched.

use npu_backend::{BackendError, LoraGroup, View, ViewMut};

use super::buffer::{bad, rows, rows_mut, shape};
use super::{CpuBackend, CpuBuffer};

const OP: &str = "lora_add";

/// The largest rank a group may have (the per-row scratch lives on the stack).
pub(crate) const MAX_RANK: usize = 256;

/// `a . b` with sixteen partial sums (a shape the compiler turns into vector code).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One group's weights as f32 slices, checked against the views' widths.
struct Group<'a> {
    a: &'a [f32],
    b_t: &'a [f32],
    rank: usize,
    scale: f32,
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
            let a = g.a.f32s(OP)?;
            let b_t = g.b_t.f32s(OP)?;
            if a.len() != g.rank * n_in || b_t.len() != g.rank * n_out {
                return Err(bad(
                    OP,
                    format!(
                        "group {gi}: A of {} and B of {} values for rank {} and a {n_in} -> \
                         {n_out} projection",
                        a.len(),
                        b_t.len(),
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
            checked.push(Group {
                a,
                b_t,
                rank: g.rank,
                scale: g.scale,
            });
        }
        if checked.is_empty() {
            return Ok(());
        }
        self.par_rows_mut(o, |r, dst| {
            let Some(gi) = of_row[r] else { return };
            let g = &checked[gi as usize];
            let xr = x.row(r);
            let mut u = [0f32; MAX_RANK];
            for (k, uk) in u[..g.rank].iter_mut().enumerate() {
                *uk = g.scale * dot(&g.a[k * n_in..(k + 1) * n_in], xr);
            }
            for (k, &uk) in u[..g.rank].iter().enumerate() {
                let bk = &g.b_t[k * n_out..(k + 1) * n_out];
                for (d, &bv) in dst.iter_mut().zip(bk) {
                    *d += uk * bv;
                }
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
