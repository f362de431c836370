//! The agent's device: which backends this build has, and the model on the one an agent runs,
//! picked at run time from `AgentEngineConfig::device`. `DeviceModel` is the one place that
//! names a backend type; everything else calls it. A device whose backend is not compiled in
//! answers `BackendError::NotBuilt` naming the cargo feature that builds it.
//!
//! Each backend crate beyond the CPU's is a few cfg lines here: a variant, its arm in
//! `dispatch!`, its constructor in `DeviceModel::load`, and its kind in `built_devices`. The
//! `cuda` feature builds `npu_backend_cuda::CudaBackend` (settings from `NPU_SERVING_CUDA_*`),
//! the `ascend` feature `npu_backend_ascend::AscendBackend`; a process that opened an Ascend
//! device calls [`release_runtimes`] once every device is closed (`aclFinalize`).

use std::sync::Arc;

use npu_backend::{
    Backend, BackendError, Collective, HostCollective, HostStaged, KvDtype, StepInputs,
};
use npu_backend_cpu::threadpool::ThreadPool;
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;
use npu_model::shard::RankShard;
use npu_model::Checkpoint;
pub use npu_protocol::agent::DeviceKind;

use crate::long_context::LongContext;
use crate::model::{Model, ModelConfig, ModelError, ModelOptions, StepOutput};

/// The devices this build has backends for.
pub fn built_devices() -> Vec<DeviceKind> {
    DeviceKind::ALL
        .into_iter()
        .filter(|&k| backend_compiled_in(k))
        .collect()
}

/// Checks the kernel settings of the environment (`NPU_SERVING_AMX`, `NPU_SERVING_PREFETCH`) once
/// at start: a value a setting does not take is refused, naming the variable, before any model
/// loads.
pub fn check_settings() -> Result<(), npu_backend_cpu::kernels::BadSetting> {
    npu_backend_cpu::kernels::check_settings()
}

/// Whether this build has a backend crate for `kind`.
fn backend_compiled_in(kind: DeviceKind) -> bool {
    match kind {
        DeviceKind::Cpu => true,
        DeviceKind::Cuda => cfg!(feature = "cuda"),
        DeviceKind::Ascend => cfg!(feature = "ascend"),
    }
}

/// Releases the process-wide runtimes of the device backends (ACL's `aclFinalize`), once, when
/// the process is done with every device: after the last model and its buffers are dropped.
/// A no-op for runtimes that never started; a failure is logged (the process is ending).
pub fn release_runtimes() {
    #[cfg(feature = "ascend")]
    if let Err(e) = npu_backend_ascend::Acl::finalize() {
        tracing::warn!("releasing the Ascend runtime (aclFinalize): {e}");
    }
}

/// The error for a device this build has no backend for: the cargo feature that builds it.
fn not_built(kind: DeviceKind) -> BackendError {
    BackendError::NotBuilt {
        device: kind.name(),
        feature: kind.cargo_feature().unwrap_or("default"),
    }
}

/// Where an agent's model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    /// Which device of that kind (ignored by the CPU backend).
    pub device_id: u32,
}

/// One rank's part of a tensor-parallel group: its shard and the group's collectives in host
/// memory. The CPU backend runs them staged through the host (`HostStaged`); Ascend and CUDA
/// take their device library's collective (HCCL, NCCL) where it loads and the whole group can
/// form a communicator, else the staged one (see `crate::collectives`).
pub struct TpSetup {
    pub shard: RankShard,
    pub host: Box<dyn HostCollective>,
}

type RankCollective<B> = (RankShard, Box<dyn Collective<B>>);

impl TpSetup {
    fn staged<B: Backend>(self) -> Option<RankCollective<B>> {
        let rank = self.host.rank();
        let c: Box<dyn Collective<B>> = Box::new(HostStaged::new(self.host));
        tracing::info!(rank, collective = %c.describe(), "tensor-parallel collectives");
        Some((self.shard, c))
    }

    /// The device library's collective (`form`, e.g. `crate::collectives::hccl`) unless
    /// `NPU_SERVING_TP_COLLECTIVE` says `host`; where it cannot be formed, the staged one with a
    /// warning naming why (or, under `device`, the error).
    #[cfg_attr(not(any(feature = "cuda", feature = "ascend")), allow(dead_code))]
    fn device<B: Backend, C: Collective<B> + 'static>(
        self,
        b: &mut B,
        form: impl FnOnce(&mut B, Box<dyn HostCollective>) -> Result<C, crate::collectives::NotFormed>,
    ) -> Result<Option<RankCollective<B>>, BackendError> {
        use crate::collectives::{Choice, CHOICE_VAR};
        let choice = Choice::from_env().map_err(|message| BackendError::BadArgument {
            op: "tensor-parallel collectives",
            message,
        })?;
        let rank = self.host.rank();
        if choice == Choice::Host {
            tracing::info!(
                rank,
                "{CHOICE_VAR}=host: staging the collectives through host memory"
            );
            return Ok(self.staged());
        }
        match form(b, self.host) {
            Ok(c) => {
                let c: Box<dyn Collective<B>> = Box::new(c);
                tracing::info!(rank, collective = %c.describe(), "tensor-parallel collectives");
                Ok(Some((self.shard, c)))
            }
            Err((why, _)) if choice == Choice::Device => Err(BackendError::Device {
                backend: "tensor-parallel group",
                message: format!("{CHOICE_VAR}=device, but {why}"),
            }),
            Err((why, host)) => {
                tracing::warn!(
                    rank,
                    "{why}; staging the collectives through host memory instead"
                );
                Self {
                    shard: self.shard,
                    host,
                }
                .staged()
                .map(Ok)
                .transpose()
            }
        }
    }
}

/// A model on one of the backends compiled in.
pub enum DeviceModel {
    // Boxed: the models differ in size by backend, and the enum is moved around whole.
    Cpu(Box<Model<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<Model<npu_backend_cuda::CudaBackend>>),
    #[cfg(feature = "ascend")]
    Ascend(Box<Model<npu_backend_ascend::AscendBackend>>),
}

/// `dispatch!(model, m => expr)`: `expr` with `m` bound to the `Model<B>` inside.
macro_rules! dispatch {
    ($dm:expr, $m:ident => $body:expr) => {
        match $dm {
            DeviceModel::Cpu($m) => $body,
            #[cfg(feature = "cuda")]
            DeviceModel::Cuda($m) => $body,
            #[cfg(feature = "ascend")]
            DeviceModel::Ascend($m) => $body,
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
        Self::load_shard(&Checkpoint::from(file), spec, pool, opts, None)
    }

    /// `load` of a checkpoint (a GGUF file or a Hugging Face directory), or of one rank's shard
    /// of a tensor-parallel group (None: the whole model).
    pub fn load_shard(
        file: &Checkpoint,
        spec: DeviceSpec,
        pool: &Arc<ThreadPool>,
        opts: ModelOptions,
        tp: Option<TpSetup>,
    ) -> Result<Self, ModelError> {
        Self::load_shard_kv(file, spec, pool, opts, tp, KvDtype::F16)
    }

    /// `load_shard` with the KV pool storing `kv` (`npu_serving.kv_cache_dtype`; a backend
    /// that does not store it refuses it by name before the weights load).
    pub fn load_shard_kv(
        file: &Checkpoint,
        spec: DeviceSpec,
        pool: &Arc<ThreadPool>,
        opts: ModelOptions,
        tp: Option<TpSetup>,
        kv: KvDtype,
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
                let mut backend = CpuBackend::on_pool(pool.clone(), cfg);
                backend.set_kv_dtype(kv)?;
                let tp = tp.and_then(TpSetup::staged);
                Ok(Self::Cpu(Box::new(Model::load_checkpoint(
                    file, backend, opts, tp,
                )?)))
            }
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                use npu_backend_cuda::{CudaBackend, CudaConfig};
                let cfg = CudaConfig::from_env().map_err(|message| BackendError::BadArgument {
                    op: "cuda settings",
                    message,
                })?;
                let mut backend = CudaBackend::new(spec.device_id as usize, cfg)?;
                backend.set_kv_dtype(kv)?;
                let tp = match tp {
                    Some(tp) => tp.device(&mut backend, crate::collectives::nccl)?,
                    None => None,
                };
                Ok(Self::Cuda(Box::new(Model::load_checkpoint(
                    file, backend, opts, tp,
                )?)))
            }
            #[cfg(feature = "ascend")]
            DeviceKind::Ascend => {
                use npu_backend_ascend::{AscendBackend, AscendConfig};
                // `spec.device_id` is already `start_device_id` + the agent's index.
                let mut backend = AscendBackend::new(AscendConfig {
                    start_device_id: spec.device_id,
                    agent_index: 0,
                    ..AscendConfig::default()
                })?;
                backend.set_kv_dtype(kv)?;
                let tp = match tp {
                    Some(tp) => tp.device(&mut backend, crate::collectives::hccl)?,
                    None => None,
                };
                Ok(Self::Ascend(Box::new(Model::load_checkpoint(
                    file, backend, opts, tp,
                )?)))
            }
            #[allow(unreachable_patterns)]
            other => Err(not_built(other).into()),
        }
    }

    /// Gives the model `max_loras` adapter slots of rank up to `max_rank` (refused by name
    /// where the backend, family or tensor parallelism cannot take adapters).
    pub fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<(), ModelError> {
        dispatch!(self, m => m.enable_lora(max_loras, max_rank))
    }

    /// Reads an adapter (PEFT directory or GGUF LoRA file) checked against this model.
    pub fn read_lora(
        &mut self,
        path: &std::path::Path,
    ) -> Result<crate::model::lora::HostAdapter, ModelError> {
        dispatch!(self, m => m.read_lora(path))
    }

    /// Places `ad` in adapter slot `slot` (0-based).
    pub fn load_lora(
        &mut self,
        slot: usize,
        ad: &crate::model::lora::HostAdapter,
    ) -> Result<(), ModelError> {
        dispatch!(self, m => m.load_lora(slot, ad))
    }

    /// The next forward's adapter per token row (`lora::BASE` or a 1-based slot; empty: all
    /// base).
    pub fn set_step_lora(&mut self, per_token: &[u16], t: usize) -> Result<(), ModelError> {
        dispatch!(self, m => m.set_step_lora(per_token, t))
    }

    pub fn config(&self) -> &ModelConfig {
        dispatch!(self, m => &m.cfg)
    }

    /// This rank's shard (the whole model without tensor parallelism).
    pub fn shard(&self) -> RankShard {
        dispatch!(self, m => m.shard())
    }

    /// See `Model::collective_time`.
    pub fn collective_time(&self) -> Option<(u64, std::time::Duration)> {
        dispatch!(self, m => m.collective_time())
    }

    /// What carries the collectives of a tensor-parallel rank (None otherwise).
    pub fn describe_collectives(&self) -> Option<String> {
        dispatch!(self, m => m.describe_collectives())
    }

    /// The backend, instruction set or architecture, for logs and the handshake.
    pub fn describe(&self) -> String {
        dispatch!(self, m => m.backend().describe())
    }

    /// The capacities the model was loaded with (`num_blocks`: the blocks its KV pool has).
    pub fn options(&self) -> ModelOptions {
        dispatch!(self, m => m.opts)
    }

    /// Turns decode-step graphs on where the backend and model allow (see
    /// `Model::enable_step_graphs`); the pool's last blocks are kept for padded rows.
    pub fn enable_step_graphs(
        &mut self,
        buckets: Option<&[usize]>,
    ) -> Result<Result<(), String>, ModelError> {
        dispatch!(self, m => m.enable_step_graphs(buckets))
    }

    /// Whether decode steps go through graphs (`Model::step_graphs_state`).
    pub fn step_graphs_state(&self) -> Option<Result<(), &str>> {
        dispatch!(self, m => m.step_graphs_state())
    }

    /// Frees the KV pool down to one block (sleep level 1); returns the bytes released.
    pub fn release_kv(&mut self) -> Result<u64, ModelError> {
        dispatch!(self, m => m.release_kv())
    }

    /// Allocates the whole KV pool again (waking from level 1); returns its bytes.
    pub fn restore_kv(&mut self) -> Result<u64, ModelError> {
        dispatch!(self, m => m.restore_kv())
    }

    /// Whether this model's weights live in host memory (the CPU backend): sleeping at level 1
    /// keeps them where they are. On a device, level 1 moves them to host memory
    /// (`offload_weights`) where the backend can, else drops the model as level 2 does.
    pub fn weights_in_host_memory(&self) -> bool {
        matches!(self, DeviceModel::Cpu(_))
    }

    /// The device's memory as its backend reports it (free and total bytes).
    pub fn mem_info(&self) -> Result<npu_backend::MemInfo, BackendError> {
        dispatch!(self, m => m.backend().mem_info())
    }

    /// Why this device model cannot move its weights to host memory (see
    /// `Model::weights_offload_refusal`); None when it can.
    pub fn weights_offload_refusal(&self) -> Option<String> {
        dispatch!(self, m => m.weights_offload_refusal())
    }

    /// Copies the weights to host memory and frees their device memory (sleep level 1 on a
    /// device); returns the device bytes released.
    pub fn offload_weights(&mut self) -> Result<u64, ModelError> {
        dispatch!(self, m => m.offload_weights())
    }

    /// Puts the weights back on the device (waking from `offload_weights`); returns the device
    /// bytes allocated.
    pub fn restore_weights(&mut self) -> Result<u64, ModelError> {
        dispatch!(self, m => m.restore_weights())
    }

    /// Bytes of one KV block (every layer's K and V): the unit of host copies.
    pub fn kv_block_bytes(&self) -> usize {
        dispatch!(self, m => m.backend().kv_block_bytes())
    }

    /// Copies device KV `blocks` into `dst` (`kv_block_bytes()` each, in order).
    pub fn kv_to_host(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), BackendError> {
        dispatch!(self, m => m.backend_mut().kv_blocks_to_host(blocks, dst))
    }

    /// Copies host bytes (as `kv_to_host` wrote them) into device KV `blocks`.
    pub fn kv_from_host(&mut self, src: &[u8], blocks: &[u32]) -> Result<(), BackendError> {
        dispatch!(self, m => m.backend_mut().kv_blocks_from_host(src, blocks))
    }

    /// Bytes of weight matrices one decode step reads, in the device's own format as loaded
    /// there (every matrix of every layer and the output head; of an MoE layer, every expert),
    /// where the backend says (CPU, CUDA and Ascend do).
    pub fn weight_bytes_per_step(&self) -> Option<u64> {
        match self {
            DeviceModel::Cpu(m) => Some(
                m.weights()
                    .matrices()
                    .iter()
                    .map(|w| w.bytes() as u64)
                    .sum(),
            ),
            #[allow(unreachable_patterns)]
            m => dispatch!(m, m => m
                .weights()
                .matrices()
                .iter()
                .map(|w| m.backend().matrix_bytes(w))
                .sum()),
        }
    }

    /// Work the backend has queued on its device since it was made, where it counts it (CUDA:
    /// kernel launches; Ascend: aclnn launches and first phases; the CPU backend: `None`).
    pub fn op_counts(&self) -> Option<npu_backend::OpCounts> {
        dispatch!(self, m => m.backend().op_counts())
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

    /// Long-context mode's work before a step (see `Model::prepare_long_context`).
    pub fn prepare_long_context(
        &mut self,
        lc: &mut LongContext,
        step: &mut StepInputs,
        slots: &[u32],
    ) -> Result<(), ModelError> {
        dispatch!(self, m => m.prepare_long_context(lc, step, slots))
    }

    /// One step with long-context mode's selection (see `Model::forward_with`).
    pub fn forward_with(
        &mut self,
        step: &StepInputs,
        greedy: bool,
        out: &mut StepOutput,
        lc: Option<&mut LongContext>,
    ) -> Result<(), ModelError> {
        dispatch!(self, m => m.forward_with(step, greedy, out, lc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_not_built_in_names_its_feature() {
        let built = built_devices();
        assert!(built.contains(&DeviceKind::Cpu));
        assert_eq!(built.contains(&DeviceKind::Cuda), cfg!(feature = "cuda"));
        assert_eq!(
            built.contains(&DeviceKind::Ascend),
            cfg!(feature = "ascend")
        );
        for kind in [DeviceKind::Cuda, DeviceKind::Ascend] {
            let e = not_built(kind).to_string();
            assert!(e.contains(&format!("--features {}", kind.name())), "{e}");
        }
    }
}
