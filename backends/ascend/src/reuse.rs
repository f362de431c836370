//! Executor reuse for the backend's operator calls. A call names its operator, its tensors (each
//! a device buffer, a view and how its address is refreshed) and its attributes; the first call
//! of a given shape pays the first phase (`…GetWorkspaceSize`) with the executor made repeatable,
//! and later calls of the same shape — the same operator in the next layer, or the next decode
//! step of the same batch size — launch that executor again after pointing the tensors whose
//! buffers changed at their new addresses (`aclSetInputTensorAddr` / `aclSetOutputTensorAddr`).
//!
//! A tensor is refreshed by index only where the operator's documentation makes the index
//! unambiguous (a plain input or output); in-place (`…Ref`) tensors are [`Slot::Fixed`]: their
//! address is part of the key, so such executors are reused only on the very same buffers.
//! Operators whose first phase reads host values that change from step to step (attention's
//! sequence lengths) are called once each time ([`Launcher::once`]).
//!
//! Executors evicted from the cache are kept until the stream is next synchronized, as queued
//! launches may still refer to them.
//!
//! Which calls are made repeatable ([`refusal`]): CANN documents executor reuse as unsupported
//! where an operator's implementation copies host→device or device→device internally, makes a
//! view copy whose source and destination are the same memory, or creates device tensors of its
//! own — none of which a caller can see, and which can depend on strides and dtypes. So only the
//! operators of [`REUSABLE`] (element-wise ones and the matrix products) are reused, and only
//! when every tensor is contiguous (a matrix product's weight-side tensors may also be the
//! transposed view their pages allow), no tensor is an in-place (`…Ref`) one and no output
//! shares an allocation with another tensor. Every other call takes a fresh executor.

use std::collections::HashMap;

use npu_ffi::aclnn::ops::sig;
use npu_ffi::types::*;

use crate::device::Device;
use crate::error::Result;
use crate::memory::DeviceBuffer;
use crate::ops::{OpRunner, RepeatableOp, StepStats};
use crate::tensor::{Scalar, Tensor, View};

/// How a tensor of a reusable call is pointed at a new buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The operator's `n`-th tensor input.
    Input(usize),
    /// The operator's `n`-th tensor output.
    Output(usize),
    /// Not refreshed: the address is part of the key.
    Fixed,
}

/// One tensor argument.
pub struct Arg<'a> {
    pub name: &'static str,
    pub buf: &'a DeviceBuffer,
    pub view: View,
    pub slot: Slot,
}

impl<'a> Arg<'a> {
    pub fn input(name: &'static str, index: usize, buf: &'a DeviceBuffer, view: View) -> Self {
        Self {
            name,
            buf,
            view,
            slot: Slot::Input(index),
        }
    }
    pub fn output(name: &'static str, index: usize, buf: &'a DeviceBuffer, view: View) -> Self {
        Self {
            name,
            buf,
            view,
            slot: Slot::Output(index),
        }
    }
    pub fn fixed(name: &'static str, buf: &'a DeviceBuffer, view: View) -> Self {
        Self {
            name,
            buf,
            view,
            slot: Slot::Fixed,
        }
    }
}

/// An operator's first phase, given its tensors (in argument order), its scalars and the
/// workspace-size / executor out-pointers.
pub type Prepare<'p> =
    dyn FnOnce(&[Tensor], &[Scalar], *mut u64, *mut *mut aclOpExecutor) -> aclnnStatus + 'p;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    name: &'static str,
    attrs: Vec<i64>,
    scalars: Vec<u32>,
    args: Vec<(View, Slot, usize)>,
}

struct Entry {
    op: RepeatableOp,
    /// Buffer address each tensor points at now.
    addrs: Vec<usize>,
    _scalars: Vec<Scalar>,
}

/// The operators whose executors may be reused, each with the arguments that may be a
/// transposed 2-D view (the only non-contiguous form their pages allow; all others must be
/// contiguous). Element-wise operators and the matrix products, the operators the review of
/// CANN's reuse conditions (docs/reviews, finding 6) named as the safe start; grow it only after
/// the conformance suite has run bit-equal with reuse on and off on hardware.
pub const REUSABLE: &[(&str, &[&str])] = &[
    ("aclnnMatmul", &["mat2"]),
    (
        "aclnnWeightQuantBatchMatmulV2",
        &["weight", "antiquantScale", "antiquantOffset"],
    ),
    ("aclnnCast", &[]),
    ("aclnnMul", &[]),
    ("aclnnSwiGlu", &[]),
    ("aclnnGeluV2", &[]),
];

/// A dense row-major view (any offset; a dimension of extent 1 may have any stride).
fn is_contiguous(v: &View) -> bool {
    let mut want = 1i64;
    for (&d, &s) in v.dims.iter().zip(&v.strides).rev() {
        if d != 1 && s != want {
            return false;
        }
        want *= d;
    }
    true
}

/// A 2-D view whose storage is the transpose of a dense (dims[1], dims[0]) matrix.
fn is_transposed_2d(v: &View) -> bool {
    v.dims.len() == 2 && v.strides[0] == 1 && (v.strides[1] == v.dims[0] || v.dims[1] == 1)
}

/// Why a call may not reuse its executor (`None`: it may). `args` are each tensor's parameter
/// name, slot, view and buffer address, in argument order.
pub fn refusal(name: &str, args: &[(&str, Slot, &View, usize)]) -> Option<String> {
    let Some((_, transposable)) = REUSABLE.iter().find(|(n, _)| *n == name) else {
        return Some(format!("{name} is not on the reuse allowlist"));
    };
    for &(arg, slot, view, addr) in args {
        if slot == Slot::Fixed {
            return Some(format!("{name}: {arg} is modified in place"));
        }
        let transposed = transposable.contains(&arg) && is_transposed_2d(view);
        if !(is_contiguous(view) || transposed) {
            return Some(format!("{name}: {arg} is not contiguous"));
        }
        if matches!(slot, Slot::Output(_))
            && args
                .iter()
                .any(|&(other, _, _, a)| other != arg && a == addr)
        {
            return Some(format!(
                "{name}: {arg} shares its allocation with another tensor"
            ));
        }
    }
    None
}

/// Most executors kept; beyond it the cache starts over.
const CAPACITY: usize = 1024;

pub struct Launcher {
    pub runner: OpRunner,
    cache: HashMap<Key, Entry>,
    retired: Vec<Entry>,
    reuse: bool,
}

impl Launcher {
    /// Reuses executors when the CANN release supports it and `reuse` asks for it.
    pub fn new(device: &Device, reuse: bool) -> Self {
        let base = &device.acl.api.base;
        let supported = base.aclSetAclOpExecutorRepeatable.is_some()
            && base.aclDestroyAclOpExecutor.is_some()
            && base.aclSetInputTensorAddr.is_some()
            && base.aclSetOutputTensorAddr.is_some();
        Self {
            runner: OpRunner::new(device),
            cache: HashMap::new(),
            retired: Vec::new(),
            reuse: reuse && supported,
        }
    }

    /// Whether executors are being reused.
    pub fn reusing(&self) -> bool {
        self.reuse
    }

    pub fn take_stats(&mut self) -> StepStats {
        self.runner.take_stats()
    }

    pub fn stats(&self) -> StepStats {
        self.runner.stats()
    }

    /// After a stream synchronization: releases replaced workspaces and evicted executors.
    pub fn synchronized(&mut self) {
        self.runner.synchronized();
        self.retired.clear();
    }

    /// Forgets every cached executor (their tensors name device addresses that are about to
    /// move: sleep level 1); they are destroyed at the next synchronization.
    pub fn forget(&mut self) {
        self.retired.extend(self.cache.drain().map(|(_, e)| e));
    }

    /// Executors kept for reuse.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    fn tensors(&self, args: &[Arg<'_>]) -> Result<Vec<Tensor>> {
        let acl = self.runner.acl();
        args.iter()
            .map(|a| Tensor::new(acl, a.buf, a.view.clone()))
            .collect()
    }

    fn scalars(&self, values: &[f32]) -> Result<Vec<Scalar>> {
        let acl = self.runner.acl();
        values.iter().map(|&v| Scalar::f32(acl, v)).collect()
    }

    /// Whether a call is outside what may be reused ([`refusal`]; logged with the reason when
    /// `NPU_SERVING_ACL_LOG` is set).
    fn refuses(&self, name: &str, args: &[Arg<'_>]) -> bool {
        let described: Vec<_> = args
            .iter()
            .map(|a| (a.name, a.slot, &a.view, a.buf.ptr() as usize))
            .collect();
        match refusal(name, &described) {
            Some(why) => {
                self.runner.acl().log("executor not reused", || why);
                true
            }
            None => false,
        }
    }

    /// One call, its executor reused when an earlier call had the same key (and [`refusal`]
    /// allows it), else a fresh executor.
    pub fn call(
        &mut self,
        name: &'static str,
        launch: sig::aclnnAdd,
        args: &[Arg<'_>],
        attrs: &[i64],
        scalars: &[f32],
        prepare: Box<Prepare<'_>>,
    ) -> Result<()> {
        if !self.reuse || self.refuses(name, args) {
            return self.once(name, launch, args, attrs, scalars, prepare);
        }
        let key = Key {
            name,
            attrs: attrs.to_vec(),
            scalars: scalars.iter().map(|v| v.to_bits()).collect(),
            args: args
                .iter()
                .map(|a| {
                    let fixed = if a.slot == Slot::Fixed {
                        a.buf.ptr() as usize
                    } else {
                        0
                    };
                    (a.view.clone(), a.slot, fixed)
                })
                .collect(),
        };
        if let Some(entry) = self.cache.get_mut(&key) {
            for (i, a) in args.iter().enumerate() {
                let addr = a.buf.ptr() as usize;
                if entry.addrs[i] == addr {
                    continue;
                }
                match a.slot {
                    Slot::Input(index) => entry.op.set_input_addr(index, i, a.buf)?,
                    Slot::Output(index) => entry.op.set_output_addr(index, i, a.buf)?,
                    Slot::Fixed => unreachable!("fixed addresses are part of the key"),
                }
                entry.addrs[i] = addr;
            }
            return self.runner.launch_repeatable(&entry.op);
        }
        let tensors = self.tensors(args)?;
        let kept = self.scalars(scalars)?;
        let addrs = args.iter().map(|a| a.buf.ptr() as usize).collect();
        let op = self.runner.prepare_repeatable(
            name,
            tensors,
            |ts, w, e| prepare(ts, &kept, w, e),
            launch,
        )?;
        self.runner.launch_repeatable(&op)?;
        if self.cache.len() >= CAPACITY {
            self.retired.extend(self.cache.drain().map(|(_, e)| e));
        }
        self.cache.insert(
            key,
            Entry {
                op,
                addrs,
                _scalars: kept,
            },
        );
        Ok(())
    }

    /// One call with a fresh executor (consumed by its launch).
    pub fn once(
        &mut self,
        name: &'static str,
        launch: sig::aclnnAdd,
        args: &[Arg<'_>],
        attrs: &[i64],
        scalars: &[f32],
        prepare: Box<Prepare<'_>>,
    ) -> Result<()> {
        let tensors = self.tensors(args)?;
        let kept = self.scalars(scalars)?;
        let detail = args
            .iter()
            .map(|a| format!("{}={}", a.name, a.view.describe()))
            .chain(attrs.iter().map(|v| format!("{v}")))
            .collect::<Vec<_>>()
            .join(" ");
        self.runner
            .call(name, detail, |w, e| prepare(&tensors, &kept, w, e), launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn c(dims: &[i64]) -> View {
        View::contiguous(DType::F16, dims)
    }

    #[test]
    fn only_allowlisted_contiguous_out_of_place_calls_are_reused() {
        let (x, y, w) = (
            c(&[4, 8]),
            c(&[4, 16]),
            View::strided(DType::I8, &[8, 16], &[1, 8], 0),
        );
        let mm = [
            ("x", Slot::Input(0), &x, 0x1000),
            ("weight", Slot::Input(1), &w, 0x2000),
            ("antiquantScale", Slot::Input(2), &w, 0x3000),
            ("y", Slot::Output(0), &y, 0x4000),
        ];
        assert_eq!(refusal("aclnnWeightQuantBatchMatmulV2", &mm), None);
        // A transposed x is not the documented weight-side case.
        let xt = View::strided(DType::F16, &[4, 8], &[1, 4], 0);
        let mut bad = mm;
        bad[0].2 = &xt;
        assert!(refusal("aclnnWeightQuantBatchMatmulV2", &bad).is_some());
        // Strided rows (a column range of a wider buffer).
        let cols = View::strided(DType::F16, &[4, 8], &[24, 1], 8);
        let sw = [
            ("x", Slot::Input(0), &cols, 0x1000),
            ("out", Slot::Output(0), &x, 0x2000),
        ];
        assert!(refusal("aclnnSwiGlu", &sw)
            .unwrap()
            .contains("not contiguous"));
        // An output in the allocation of an input (in place through two views).
        let alias = [
            ("x", Slot::Input(0), &x, 0x1000),
            ("out", Slot::Output(0), &x, 0x1000),
        ];
        assert!(refusal("aclnnSwiGlu", &alias).unwrap().contains("shares"));
        let ok = [
            ("x", Slot::Input(0), &x, 0x1000),
            ("out", Slot::Output(0), &x, 0x2000),
        ];
        assert_eq!(refusal("aclnnSwiGlu", &ok), None);
        // In-place (…Ref) tensors and operators off the list.
        let inplace = [
            ("selfRef", Slot::Fixed, &x, 0x1000),
            ("other", Slot::Input(0), &x, 0x2000),
        ];
        assert!(refusal("aclnnInplaceAdd", &inplace).is_some());
        for op in [
            "aclnnInplaceCopy",
            "aclnnNanToNum",
            "aclnnRotaryPositionEmbedding",
            "aclnnScatterPaKvCache",
            "aclnnEmbedding",
            "aclnnRmsNorm",
        ] {
            assert!(refusal(op, &ok).unwrap().contains("allowlist"), "{op}");
        }
        // A dimension of extent 1 may have any stride: one row of a wider buffer is contiguous.
        let row = View::strided(DType::F16, &[1, 8], &[24, 1], 16);
        let one = [
            ("x", Slot::Input(0), &row, 0x1000),
            ("out", Slot::Output(0), &x, 0x2000),
        ];
        assert_eq!(refusal("aclnnCast", &one), None);
    }
}
