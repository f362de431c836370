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

    /// One call, its executor reused when an earlier call had the same key.
    pub fn call(
        &mut self,
        name: &'static str,
        launch: sig::aclnnAdd,
        args: &[Arg<'_>],
        attrs: &[i64],
        scalars: &[f32],
        prepare: Box<Prepare<'_>>,
    ) -> Result<()> {
        if !self.reuse {
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
