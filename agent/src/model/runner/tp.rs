//! This rank's part of a tensor-parallel group: its shard and collectives, the greedy pick over
//! vocabulary-split logits from each rank's (largest, index, exp-sum) triples without gathering
//! the logits, and the all-reduces after the row-parallel projections (with the projection in
//! one operator where the collective fuses them).

use npu_backend::{Backend, Collective, HostSliceMut, Readback, View, ViewMut};
use npu_model::shard::RankShard;

use super::StepOutput;
use crate::model::ModelError;

/// This rank's part of a tensor-parallel group.
pub(super) struct Tp<B: Backend> {
    pub(super) shard: RankShard,
    pub(super) comm: Box<dyn Collective<B>>,
    /// Host rows of the step's embeddings (reused).
    pub(super) embed: Vec<f32>,
    /// Rank 0: every rank's logit rows, rank after rank (reused).
    pub(super) gathered: Vec<f32>,
    /// The whole model's vocabulary.
    pub(super) vocab_size: usize,
    /// Collectives run so far, and the time spent in them (waiting for the other ranks
    /// included).
    pub(super) calls: u64,
    pub(super) spent: std::time::Duration,
}

/// A row's greedy pick on one rank, in the terms of `Backend::argmax_rows` and
/// `argmax_logprob_rows` (NaN read as -inf, +inf as `f32::MAX`, the first index on ties):
/// (the largest value, its index, the sum of `exp(x - largest)` over the row).
fn local_pick(row: &[f32]) -> (f32, usize, f32) {
    let read = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else if v == f32::INFINITY {
            f32::MAX
        } else {
            v
        }
    };
    let (mut m, mut at) = (f32::NEG_INFINITY, 0);
    for (i, &v) in row.iter().enumerate() {
        let v = read(v);
        if v > m {
            (m, at) = (v, i);
        }
    }
    if m == f32::NEG_INFINITY {
        return (m, 0, 0.0);
    }
    // In f64, as the sampler adds its probabilities.
    let sum: f64 = row.iter().map(|&v| ((read(v) - m) as f64).exp()).sum();
    (m, at, sum as f32)
}

/// The pick of a row split over ranks from each rank's `local_pick` (rank k's columns start at
/// `k * chunk`): the largest value (the lowest rank on ties, so the lowest index), and its
/// log-probability over the whole row (`-ln(vocab)` for a row with nothing finite, id 0).
fn combine_picks(parts: &[(f32, usize, f32)], chunk: usize, vocab: usize) -> (usize, f32) {
    let mut best: Option<(usize, f32, usize)> = None;
    for (k, &(m, at, _)) in parts.iter().enumerate() {
        if best.is_none_or(|(_, bm, _)| m > bm) {
            best = Some((k, m, at));
        }
    }
    let Some((k, m, at)) = best.filter(|&(_, m, _)| m != f32::NEG_INFINITY) else {
        return (0, -(vocab as f32).ln());
    };
    let sum: f64 = parts
        .iter()
        .filter(|&&(mk, _, _)| mk != f32::NEG_INFINITY)
        .map(|&(mk, _, sk)| sk as f64 * ((mk - m) as f64).exp())
        .sum();
    (k * chunk + at, -sum.ln() as f32)
}

/// Each row of `logits` as (largest, index, exp-sum) (`local_pick`), three values a row: from
/// the backend's own greedy ops where it has them (the pick, its log-probability, and the
/// picked value read back), else from the logits read back.
pub(super) fn local_triples<B: Backend>(
    b: &mut B,
    logits: View<'_, B::Buffer>,
    ids: &mut B::Buffer,
    logprobs: &mut B::Buffer,
    host: &mut Vec<f32>,
) -> Result<Vec<f32>, ModelError> {
    let (n, cols) = (logits.layout().rows(), logits.layout().cols());
    if b.argmax_and_logprob_rows(
        logits,
        ViewMut::rows(ids, n, 1)?,
        ViewMut::rows(logprobs, n, 1)?,
    )? {
        let (mut id, mut lp) = (vec![0i32; n], vec![0f32; n]);
        b.read_back(&mut [
            Readback {
                src: View::rows(ids, n, 1)?,
                dst: HostSliceMut::I32(&mut id),
            },
            Readback {
                src: View::rows(logprobs, n, 1)?,
                dst: HostSliceMut::F32(&mut lp),
            },
        ])?;
        // The largest value of a row is the value at its pick.
        host.resize(n, 0.0);
        let mut reads = Vec::with_capacity(n);
        for (r, dst) in host.chunks_exact_mut(1).enumerate() {
            let at = (id[r].max(0) as usize).min(cols.saturating_sub(1));
            reads.push(Readback {
                src: logits.row_range(r, 1)?.col_range(at, 1)?,
                dst: HostSliceMut::F32(dst),
            });
        }
        b.read_back(&mut reads)?;
        return Ok((0..n)
            .flat_map(|r| {
                let m = match host[r] {
                    v if v.is_nan() || v == f32::NEG_INFINITY => f32::NEG_INFINITY,
                    f32::INFINITY => f32::MAX,
                    v => v,
                };
                let sum = if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    (-lp[r]).exp()
                };
                [m, id[r].max(0) as f32, sum]
            })
            .collect());
    }
    host.resize(n * cols, 0.0);
    b.read_back(&mut [Readback {
        src: logits,
        dst: HostSliceMut::F32(host),
    }])?;
    Ok(host
        .chunks_exact(cols)
        .flat_map(|row| {
            let (m, at, sum) = local_pick(row);
            [m, at as f32, sum]
        })
        .collect())
}

impl<B: Backend> Tp<B> {
    /// Greedy picks over vocabulary-split logits without gathering them: each rank reduces its
    /// rows to (largest, index, exp-sum) triples (`mine`, see `local_triples`), rank 0 gathers
    /// those and combines them into the pick and its log-probability, `-ln(sum over the
    /// vocabulary of exp(x - largest))`, as one rank's `argmax_and_logprob_rows` would (rows
    /// with nothing finite: id 0, `-ln(vocab)`).
    pub(super) fn greedy_picks(
        &mut self,
        b: &mut B,
        mine: &[f32],
        n: usize,
        out: &mut StepOutput,
    ) -> Result<(), ModelError> {
        let started = std::time::Instant::now();
        let size = self.shard.size;
        let root = self.shard.rank == 0;
        self.gathered
            .resize(if root { size * mine.len() } else { 0 }, 0.0);
        self.comm.gather_host_to_root(b, mine, &mut self.gathered)?;
        self.calls += 1;
        self.spent += started.elapsed();
        if !root {
            return Ok(());
        }
        out.ids.clear();
        out.logprobs.clear();
        let mut parts = Vec::with_capacity(size);
        for r in 0..n {
            parts.clear();
            parts.extend((0..size).map(|k| {
                let at = (k * n + r) * 3;
                let g = &self.gathered[at..at + 3];
                (g[0], g[1] as usize, g[2])
            }));
            let (id, logprob) = combine_picks(&parts, self.shard.vocab_chunk, self.vocab_size);
            out.ids.push(id as i32);
            out.logprobs.push(logprob);
        }
        out.picked_on_device = true;
        Ok(())
    }

    /// `out = x . w`, then the all-reduce of `out`: one fused operator where the group's
    /// collective has it for this case (`Collective::matmul_all_reduce_sum`: HCCL's
    /// aclnnMatmulAllReduce), else the two calls. Counted as one collective; its time includes
    /// the product's launch (and, fused, the product itself where the host waits).
    pub(super) fn matmul_all_reduce(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        w: &B::Matrix,
        out: ViewMut<'_, B::Buffer>,
    ) -> Result<(), ModelError> {
        let t = std::time::Instant::now();
        let r = self.comm.matmul_all_reduce_sum(b, x, w, out);
        self.calls += 1;
        self.spent += t.elapsed();
        r?;
        Ok(())
    }

    pub(super) fn all_reduce(
        &mut self,
        b: &mut B,
        x: ViewMut<'_, B::Buffer>,
    ) -> Result<(), ModelError> {
        let t = std::time::Instant::now();
        let r = self.comm.all_reduce_sum(b, x);
        self.calls += 1;
        self.spent += t.elapsed();
        Ok(r?)
    }
}

#[cfg(test)]
mod tests {
    use super::{combine_picks, local_pick};

    /// Splitting a row over ranks and combining the parts gives the whole row's pick.
    #[test]
    fn split_picks_combine_into_the_whole_rows_pick() {
        let rows: [&[f32]; 5] = [
            &[0.5, 3.0, -1.0, 3.0, 2.0, 0.0],
            &[f32::NAN, -2.0, 1.0, f32::INFINITY, 0.0, 5.0],
            &[f32::NEG_INFINITY; 6],
            &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            &[-7.0, f32::NAN, f32::NAN, f32::NAN, -3.0, -9.0],
        ];
        for row in rows {
            let (m, at, sum) = local_pick(row);
            let whole = if m == f32::NEG_INFINITY {
                (0, -(6f32).ln())
            } else {
                (at, -sum.ln())
            };
            for chunk in [2, 3, 4, 6] {
                let parts: Vec<_> = row.chunks(chunk).map(local_pick).collect();
                let (id, lp) = combine_picks(&parts, chunk, 6);
                assert_eq!(id, whole.0, "{row:?} in chunks of {chunk}");
                assert!((lp - whole.1).abs() < 1e-6, "{row:?}: {lp} vs {}", whole.1);
            }
        }
        // Ties go to the first index, across ranks too.
        assert_eq!(combine_picks(&[(1.0, 1, 2.0), (1.0, 0, 1.0)], 4, 8).0, 1);
    }

    /// The backend's greedy ops give each row's triple as the host scan does, on a window of a
    /// wider buffer (a last rank whose vocabulary rows are fewer than the others').
    #[test]
    fn device_triples_equal_the_host_scan() {
        use npu_backend::{Backend, DType, HostSlice, View, ViewMut};
        use npu_backend_cpu::{CpuBackend, CpuConfig};
        let mut b = CpuBackend::new(CpuConfig {
            threads: 1,
            f32_reference: false,
        });
        let (n, chunk, mine) = (3, 8, 5);
        let values: Vec<f32> = (0..n * chunk)
            .map(|i| ((i * 7919) % 23) as f32 * 0.37 - 4.0)
            .collect();
        let mut logits = b.alloc(DType::F32, n * chunk).unwrap();
        b.upload(
            HostSlice::F32(&values),
            ViewMut::rows(&mut logits, n, chunk).unwrap(),
        )
        .unwrap();
        let mut ids = b.alloc(DType::I32, n).unwrap();
        let mut lps = b.alloc(DType::F32, n).unwrap();
        let view = View::rows(&logits, n, chunk)
            .unwrap()
            .col_range(0, mine)
            .unwrap();
        let got = super::local_triples(&mut b, view, &mut ids, &mut lps, &mut Vec::new()).unwrap();
        for r in 0..n {
            let (m, at, sum) = local_pick(&values[r * chunk..r * chunk + mine]);
            assert_eq!((got[3 * r], got[3 * r + 1] as usize), (m, at), "row {r}");
            assert!((got[3 * r + 2] - sum).abs() < 1e-5 * sum, "row {r}");
        }
    }
}
