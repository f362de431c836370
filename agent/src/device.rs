//! The agent's device: which backends this build has, and the model on the one an agent runs,
//! picked at run time from `AgentEngineConfig::device`. `DeviceModel` is the one place that
//! names a backend type; everything else calls it. A device whose backend is not compiled in
//! answers `BackendError::NotBuilt` naming the cargo feature that builds it.
//!
//! Adding a backend crate is a few cfg lines here: a variant
//! (`#[cfg(feature = "cuda")] Cuda(Model<npu_backend_cuda::CudaBackend>)`), its arm in
//! `dispatch!`, its constructor in `DeviceModel::load`, and its kind in `built_devices`.

use std::sync::Arc;

use npu_backend::{Backend, BackendError, StepInputs};
use npu_backend_cpu::threadpool::ThreadPool;
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;
pub use npu_protocol::agent::DeviceKind;

use crate::model::{Model, ModelConfig, ModelError, ModelOptions, StepOutput};

/// The devices this build has backends for.
pub fn built_devices() -> Vec<DeviceKind> {
    vec![DeviceKind::Cpu]
}

/// Whether this build was asked for `kind`'s backend (its cargo feature is on).
fn feature_enabled(kind: DeviceKind) -> bool {
    match kind {
        DeviceKind::Cpu => true,
        DeviceKind::Cuda => cfg!(feature = "cuda"),
        DeviceKind::Ascend => cfg!(feature = "ascend"),
    }
}

/// The error for a device this build has no backend for.
pub fn not_built(kind: DeviceKind) -> BackendError {
    match kind.cargo_feature() {
        Some(feature) if !feature_enabled(kind) => BackendError::NotBuilt {
            device: kind.name(),
            feature,
        },
        _ => BackendError::Unsupported {
            backend: kind.name(),
            what: format!(
                "running a model: the `{}` feature is on, but this source tree has no {} \
                 backend crate yet",
                kind.name(),
                kind.name()
            ),
        },
    }
}

/// Where an agent's model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    /// Which device of that kind (ignored by the CPU backend).
    pub device_id: u32,
}

/// A model on one of the backends compiled in.
pub enum DeviceModel {
    Cpu(Model<CpuBackend>),
}

/// `dispatch!(model, m => expr)`: `expr` with `m` bound to the `Model<B>` inside.
macro_rules! dispatch {
    ($dm:expr, $m:ident => $body:expr) => {
        match $dm {
            DeviceModel::Cpu($m) => $body,
        }
    };
}

impl DeviceModel {
    /// Loads the model from `file` onto the device `spec` names. `pool` is the engine's host
    /// thread pool: the CPU backend computes on it (so sampling and kernels share the cores).
    pub fn load(
        file: &GgufFile,
        spec: DeviceSpec,
        pool: &Arc<ThreadPool>,
        opts: ModelOptions,
    ) -> Result<Self, ModelError> {
        match spec.kind {
            DeviceKind::Cpu => {
                if spec.device_id != 0 {
                    tracing::debug!(
                        device_id = spec.device_id,
                        "the CPU backend has one device; the id is ignored"
                    );
                }
                let cfg = CpuConfig {
                    threads: pool.threads(),
                    f32_reference: false,
                };
                let backend = CpuBackend::on_pool(pool.clone(), cfg);
                Ok(Self::Cpu(Model::load(file, backend, opts)?))
            }
            other => Err(not_built(other).into()),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        dispatch!(self, m => &m.cfg)
    }

    /// The backend, instruction set or architecture, for logs and the handshake.
    pub fn describe(&self) -> String {
        dispatch!(self, m => m.backend().describe())
    }

    /// Bytes of weight matrices one decode step reads, in the device's own format, where the
    /// backend says (the CPU backend does).
    pub fn weight_bytes_per_step(&self) -> Option<u64> {
        match self {
            DeviceModel::Cpu(m) => Some(
                m.weights()
                    .matrices()
                    .iter()
                    .map(|w| w.bytes() as u64)
                    .sum(),
            ),
        }
    }

    /// See `Model::matmul_macs_per_token`.
    pub fn matmul_macs_per_token(&self) -> (u64, u64) {
        dispatch!(self, m => m.matmul_macs_per_token())
    }

    /// One step (see `Model::forward`).
    pub fn forward(
        &mut self,
        step: &StepInputs,
        greedy: bool,
        out: &mut StepOutput,
    ) -> Result<(), ModelError> {
        dispatch!(self, m => m.forward(step, greedy, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_not_built_in_names_its_feature() {
        assert!(built_devices().contains(&DeviceKind::Cpu));
        for kind in [DeviceKind::Cuda, DeviceKind::Ascend] {
            if built_devices().contains(&kind) {
                continue;
            }
            let e = not_built(kind).to_string();
            assert!(e.contains(&format!("--features {}", kind.name())), "{e}");
        }
    }
}
