//! Collectives between the ranks of a tensor-parallel group, beside the `Backend` seam.
//!
//! A model split over a group (Megatron style) needs three things from its device's
//! communication library, all on the backend's own stream order:
//! - `all_reduce_sum`: after each row-parallel matmul (attention output, FFN down), every
//!   rank's partial sums become the total, in place, with the same bits on every rank;
//! - `matmul_all_reduce_sum`: the row-parallel product and its all-reduce, as two calls (the
//!   default) or one where the library fuses them (HCCL: aclnnMatmulAllReduce);
//! - `all_gather`: rows of every rank, rank after rank;
//! - `gather_to_host`: the vocabulary-split logit rows, rank after rank, into rank 0's host
//!   memory (rank 0 samples);
//! - `gather_host_to_root`: a few host values per rank to rank 0 (a greedy step's picks: each
//!   rank's largest logit, its index and its exp-sum per row, combined on rank 0).
//!
//! [`Collective`] is that contract for any backend. A device library implements it directly
//! on device buffers: NCCL (`ncclAllReduce` with `ncclSum` on f32 or the activation dtype,
//! `ncclAllGather`, with the `ncclUniqueId` of rank 0 handed to the others over their control
//! links and `ncclCommInitRank` per rank), HCCL (`HcclAllReduce` with `HCCL_REDUCE_SUM`,
//! `HcclAllGather`, from `HcclGetRootInfo` on rank 0 and `HcclCommInitRootInfo` on each rank)
//! — each on the stream the backend queues its ops on, so that no host sync is added.
//!
//! Where a device has no such library, [`HostStaged`] runs any [`HostCollective`] (f32 slices
//! in host memory, e.g. the agents' shared-memory group region) over any backend: read the
//! rows back, combine them on the host, upload the result.

use crate::{Backend, BackendError, HostSlice, HostSliceMut, Readback, View, ViewMut};

/// What every collective error becomes at the seam.
pub fn collective_error(message: impl Into<String>) -> BackendError {
    BackendError::Device {
        backend: "tensor-parallel group",
        message: message.into(),
    }
}

/// One rank's view of its tensor-parallel group, for backend `B`. Every rank of the group
/// calls the same collectives, in the same order, with the same shapes.
pub trait Collective<B: Backend>: Send {
    /// This rank (0 samples).
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// What carries the data, for logs ("shared memory", "NCCL", ...).
    fn describe(&self) -> String;
    /// Every rank's `x` becomes the element-wise sum over the ranks of their `x` (the same
    /// values on every rank: a fixed order of additions).
    fn all_reduce_sum(&mut self, b: &mut B, x: ViewMut<'_, B::Buffer>) -> Result<(), BackendError>;
    /// `out = x . w` (`Backend::matmul`), then `all_reduce_sum(out)`: the two calls, which this
    /// does by default (every backend without a fused operator: CPU, CUDA, the staged host
    /// path). A device library may run both as one operator where it takes the case, with the
    /// bits of the two calls on its emulation (HCCL on Ascend: aclnnMatmulAllReduce, see
    /// `npu_backend_ascend`). Returns whether it ran fused.
    fn matmul_all_reduce_sum(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        w: &B::Matrix,
        mut out: ViewMut<'_, B::Buffer>,
    ) -> Result<bool, BackendError> {
        let cols = out.layout().cols();
        b.matmul(x, w, out.col_range(0, cols)?)?;
        self.all_reduce_sum(b, out)?;
        Ok(false)
    }
    /// `out` (`size()` x `x`'s rows, `x`'s columns) gets every rank's `x`, rank 0's rows first.
    fn all_gather(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        out: ViewMut<'_, B::Buffer>,
    ) -> Result<(), BackendError>;
    /// Rank 0's `out` (`size()` x `x`'s elements, f32) gets every rank's `x`, rank after rank,
    /// each row by row; the other ranks' `out` is not touched (they may pass an empty slice).
    /// Waits for the backend's queued ops (the values reach the host).
    fn gather_to_host(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        out: &mut [f32],
    ) -> Result<(), BackendError>;
    /// Rank 0's `out` (`size()` x `mine.len()`) gets every rank's host values `mine`, rank
    /// after rank; the other ranks' `out` is not touched. Small data (a few values per logit
    /// row: greedy picks combined on rank 0).
    fn gather_host_to_root(
        &mut self,
        b: &mut B,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), BackendError>;
    /// This rank's step failed: the others should stop waiting for it. The group is unusable
    /// afterwards (it is restarted as a whole).
    fn abort(&mut self) {}
}

/// Collectives on f32 values in host memory, between the ranks of a group.
pub trait HostCollective: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn describe(&self) -> String;
    /// Every rank's `x` becomes the element-wise sum over the ranks, in rank order.
    fn all_reduce_sum(&mut self, x: &mut [f32]) -> Result<(), BackendError>;
    /// `out` (`size()` x `mine.len()`) gets every rank's `mine`, in rank order.
    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), BackendError>;
    /// `all_gather` whose result only rank 0 reads (the others pass None).
    fn gather_to_root(&mut self, mine: &[f32], out: Option<&mut [f32]>)
        -> Result<(), BackendError>;
    fn abort(&mut self) {}
}

impl<H: HostCollective + ?Sized> HostCollective for Box<H> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn all_reduce_sum(&mut self, x: &mut [f32]) -> Result<(), BackendError> {
        (**self).all_reduce_sum(x)
    }
    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        (**self).all_gather(mine, out)
    }
    fn gather_to_root(
        &mut self,
        mine: &[f32],
        out: Option<&mut [f32]>,
    ) -> Result<(), BackendError> {
        (**self).gather_to_root(mine, out)
    }
    fn abort(&mut self) {
        (**self).abort()
    }
}

/// A [`HostCollective`] run over any backend: rows are read back, combined in host memory and
/// uploaded again.
pub struct HostStaged<H> {
    host: H,
    a: Vec<f32>,
    b: Vec<f32>,
}

impl<H: HostCollective> HostStaged<H> {
    pub fn new(host: H) -> Self {
        Self {
            host,
            a: Vec::new(),
            b: Vec::new(),
        }
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }
}

impl<B: Backend, H: HostCollective> Collective<B> for HostStaged<H> {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn describe(&self) -> String {
        format!("{} (staged through host memory)", self.host.describe())
    }

    fn all_reduce_sum(&mut self, b: &mut B, x: ViewMut<'_, B::Buffer>) -> Result<(), BackendError> {
        let n = x.layout().elements();
        self.a.resize(n, 0.0);
        b.read_back(&mut [Readback {
            src: x.as_view(),
            dst: HostSliceMut::F32(&mut self.a),
        }])?;
        self.host.all_reduce_sum(&mut self.a)?;
        b.upload(HostSlice::F32(&self.a), x)
    }

    fn all_gather(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        out: ViewMut<'_, B::Buffer>,
    ) -> Result<(), BackendError> {
        let n = x.layout().elements();
        let want = n * self.host.size();
        if out.layout().elements() != want || out.layout().cols() != x.layout().cols() {
            return Err(BackendError::BadArgument {
                op: "all_gather",
                message: format!(
                    "{} ranks x {:?} do not fill {:?}",
                    self.host.size(),
                    x.layout(),
                    out.layout()
                ),
            });
        }
        self.a.resize(n, 0.0);
        b.read_back(&mut [Readback {
            src: x,
            dst: HostSliceMut::F32(&mut self.a),
        }])?;
        self.b.resize(want, 0.0);
        self.host.all_gather(&self.a, &mut self.b)?;
        b.upload(HostSlice::F32(&self.b), out)
    }

    fn gather_to_host(
        &mut self,
        b: &mut B,
        x: View<'_, B::Buffer>,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let n = x.layout().elements();
        self.a.resize(n, 0.0);
        b.read_back(&mut [Readback {
            src: x,
            dst: HostSliceMut::F32(&mut self.a),
        }])?;
        let root = self.host.rank() == 0;
        self.host
            .gather_to_root(&self.a, if root { Some(out) } else { None })
    }

    fn gather_host_to_root(
        &mut self,
        _b: &mut B,
        mine: &[f32],
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let root = self.host.rank() == 0;
        self.host
            .gather_to_root(mine, if root { Some(out) } else { None })
    }

    fn abort(&mut self) {
        self.host.abort()
    }
}
