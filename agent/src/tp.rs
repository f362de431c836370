//! Tensor parallelism on the agent's side: joining the group the server made
//! (`TensorParallelSpec`: rank, size, the group's shared-memory region) and the shared-memory
//! collectives as the device seam's `HostCollective`.

use std::time::{Duration, Instant};

use npu_backend::collective::collective_error;
use npu_backend::{BackendError, HostCollective};
use npu_protocol::agent::TensorParallelSpec;
use npu_protocol::shm::{GroupError, GroupMember, GroupRegion};

/// The collectives of one rank through its group's shared-memory region.
#[derive(Debug)]
pub struct ShmCollective {
    member: GroupMember,
    /// Log the time spent waiting when dropped.
    report: bool,
}

fn err(e: GroupError) -> BackendError {
    collective_error(e.to_string())
}

impl ShmCollective {
    /// Opens the group's region and joins it as `spec.rank`, waiting for every rank to join
    /// (at most `spec.join_ms`).
    pub fn join(spec: &TensorParallelSpec) -> Result<Self, GroupError> {
        let region = GroupRegion::open(&spec.region)?;
        if region.ranks() != spec.size {
            return Err(GroupError::Bad(format!(
                "the region {} is for {} ranks, this rank was told {}",
                spec.region,
                region.ranks(),
                spec.size
            )));
        }
        let member = region.join(
            spec.rank,
            Duration::from_millis(spec.wait_ms.max(1)),
            Instant::now() + Duration::from_millis(spec.join_ms),
        )?;
        Ok(Self {
            member,
            report: true,
        })
    }

    /// A member joined already (in-process groups of tests and benchmarks).
    pub fn from_member(member: GroupMember) -> Self {
        Self {
            member,
            report: true,
        }
    }

    /// Says nothing when dropped (benchmarks print their own figures).
    pub fn quiet(mut self) -> Self {
        self.report = false;
        self
    }

    pub fn member_mut(&mut self) -> &mut GroupMember {
        &mut self.member
    }
}

impl Drop for ShmCollective {
    /// Says how much of the collectives' time was waiting for the other ranks.
    fn drop(&mut self) {
        let (rounds, waited) = self.member.stats();
        if rounds > 0 && self.report {
            tracing::info!(
                rank = self.member.rank(),
                rounds,
                waited_s = waited.as_secs_f64(),
                "tensor-parallel rank: time waiting at the group's barriers for the other ranks"
            );
        }
    }
}

impl HostCollective for ShmCollective {
    fn rank(&self) -> usize {
        self.member.rank() as usize
    }

    fn size(&self) -> usize {
        self.member.ranks() as usize
    }

    fn describe(&self) -> String {
        format!(
            "shared memory, rank {} of {}",
            self.member.rank(),
            self.member.ranks()
        )
    }

    fn all_reduce_sum(&mut self, x: &mut [f32]) -> Result<(), BackendError> {
        self.member.all_reduce_sum(x).map_err(err)
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        self.member.all_gather(mine, out).map_err(err)
    }

    fn gather_to_root(
        &mut self,
        mine: &[f32],
        out: Option<&mut [f32]>,
    ) -> Result<(), BackendError> {
        self.member.gather_to_root(mine, out).map_err(err)
    }

    fn abort(&mut self) {
        self.member.abort()
    }
}

/// A tensor-parallel group in this process: one thread per rank, each with its own engine
/// (its shard, its pools, its compute threads), joined through a shared-memory region this
/// group owns. Every step plan goes to every rank; rank 0's result is the group's. The local
/// commands and tests run groups so; the server runs each rank as its own agent process.
pub struct LocalGroup {
    ranks: Vec<RankThread>,
    facts: crate::engine::ModelFacts,
    _region: GroupRegion,
}

struct RankThread {
    plans: std::sync::mpsc::Sender<std::sync::Arc<npu_protocol::StepPlan>>,
    results: std::sync::mpsc::Receiver<Result<npu_protocol::StepResult, String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LocalGroup {
    /// Loads `size` ranks of the model `cfg` names (each with `cfg`'s threads and pools), the
    /// routed experts split as `share_each_expert`.
    pub fn load(
        cfg: &crate::engine::AgentEngineConfig,
        size: u32,
    ) -> Result<Self, crate::engine::EngineError> {
        Self::load_split(cfg, size, npu_model::shard::ExpertSplit::ShareEachExpert)
    }

    /// `load` with the routed experts split as `split` says.
    pub fn load_split(
        cfg: &crate::engine::AgentEngineConfig,
        size: u32,
        split: npu_model::shard::ExpertSplit,
    ) -> Result<Self, crate::engine::EngineError> {
        use crate::engine::{AgentEngine, EngineError};
        use std::sync::mpsc;
        let file = crate::engine::open_checkpoint(cfg)?;
        let mc = file.config().map_err(crate::model::ModelError::from)?;
        let name = npu_protocol::shm::segment_name(npu_protocol::shm::GROUP_REGION_ID_BASE)
            .map_err(|e| EngineError::BadConfig(e.to_string()))?;
        let floats =
            npu_protocol::shm::slot_floats_for(mc.hidden, cfg.max_tokens_per_step as usize);
        let region = GroupRegion::create(&name, size, floats)
            .map_err(|e| EngineError::BadConfig(format!("the group's region: {e}")))?;
        let mut ranks = Vec::new();
        let (loaded_tx, loaded_rx) = mpsc::channel();
        for rank in 0..size {
            let mut cfg = cfg.clone();
            cfg.tensor_parallel = Some(TensorParallelSpec {
                rank,
                size,
                region: name.clone(),
                wait_ms: 60_000,
                join_ms: 120_000,
                whole_experts: split == npu_model::shard::ExpertSplit::WholeExperts,
            });
            let (plan_tx, plan_rx) = mpsc::channel::<std::sync::Arc<npu_protocol::StepPlan>>();
            let (res_tx, res_rx) = mpsc::channel();
            let loaded_tx = loaded_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || {
                    let mut engine = match AgentEngine::load(&cfg) {
                        Ok(e) => {
                            let _ = loaded_tx.send((rank, Ok(e.facts().clone())));
                            e
                        }
                        Err(e) => {
                            let _ = loaded_tx.send((rank, Err(e.to_string())));
                            return;
                        }
                    };
                    drop(loaded_tx);
                    while let Ok(plan) = plan_rx.recv() {
                        let r = engine.step(plan.as_ref()).map_err(|e| e.to_string());
                        if res_tx.send(r).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| EngineError::BadConfig(format!("a rank's thread: {e}")))?;
            ranks.push(RankThread {
                plans: plan_tx,
                results: res_rx,
                thread: Some(thread),
            });
        }
        drop(loaded_tx);
        let mut facts = None;
        let mut failure = None;
        for (rank, outcome) in loaded_rx.iter().take(size as usize) {
            match outcome {
                Ok(f) if rank == 0 => facts = Some(f),
                Ok(_) => {}
                Err(e) if failure.is_none() => failure = Some(format!("rank {rank}: {e}")),
                Err(_) => {}
            }
        }
        let group = Self {
            ranks,
            facts: facts.unwrap_or_else(|| crate::engine::ModelFacts {
                name: String::new(),
                architecture: String::new(),
                vocab_size: 0,
                n_layers: 0,
                hidden: 0,
                n_heads: 0,
                n_kv_heads: 0,
                head_dim: 0,
                context_length: 0,
                eos_ids: Vec::new(),
                bos_id: None,
                backend: String::new(),
                kv: Default::default(),
            }),
            _region: region,
        };
        match failure {
            Some(f) => Err(EngineError::BadConfig(f)),
            None => Ok(group),
        }
    }

    /// Rank 0's facts.
    pub fn facts(&self) -> &crate::engine::ModelFacts {
        &self.facts
    }

    /// Runs `plan` on every rank; rank 0's result (an error names the first rank that failed).
    pub fn step(
        &mut self,
        plan: &npu_protocol::StepPlan,
    ) -> Result<npu_protocol::StepResult, crate::engine::EngineError> {
        let plan = std::sync::Arc::new(plan.clone());
        for r in &self.ranks {
            let _ = r.plans.send(plan.clone());
        }
        let mut first = None;
        let mut failure = None;
        for (rank, r) in self.ranks.iter().enumerate() {
            match r.results.recv() {
                Ok(Ok(res)) if rank == 0 => first = Some(res),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    failure.get_or_insert(format!("rank {rank}: {e}"));
                }
                Err(_) => {
                    failure.get_or_insert(format!("rank {rank} is gone"));
                }
            }
        }
        match (failure, first) {
            (None, Some(res)) => Ok(res),
            (f, _) => Err(crate::engine::EngineError::BadPlan(
                f.unwrap_or_else(|| "rank 0 gave no result".into()),
            )),
        }
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            // Closing the plan channel ends the rank's loop.
            let (tx, _) = std::sync::mpsc::channel();
            drop(std::mem::replace(&mut r.plans, tx));
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
