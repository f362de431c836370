//! One tensor-parallel group as the server sees it: its ranks (agent processes, one link each)
//! and the shared-memory region through which they sum and gather activations. The engine
//! drives a group as it drives one agent (`StepAgent`): each step plan goes to every rank (each
//! through its own segment), every rank must answer, and rank 0's result (its sampled tokens)
//! is the group's. A rank that dies, hangs, breaks the protocol or fails a step takes the whole
//! group down: every rank is killed, and a restart brings all of them back on a fresh region.

use std::time::{Duration, Instant};

use npu_protocol::frame::SleepDone;
use npu_protocol::shm::{segment_name, GroupRegion, GROUP_REGION_ID_BASE};
use npu_protocol::{StepPlan, StepResult};

use super::{AgentFailure, AgentLaunch, AgentLink, AgentSpec};

/// The region of group `group`: a fresh name, `ranks` ranks, `slot_floats` values per round.
pub fn create_region(
    group: u32,
    ranks: u32,
    slot_floats: u64,
) -> Result<GroupRegion, AgentFailure> {
    let shm = |source| AgentFailure::Shm {
        agent_id: group * ranks,
        source,
    };
    let name = segment_name(GROUP_REGION_ID_BASE + group).map_err(shm)?;
    GroupRegion::create(&name, ranks, slot_floats).map_err(shm)
}

pub struct GroupLink {
    group: u32,
    ranks: Vec<AgentLink>,
    region: GroupRegion,
    slot_floats: u64,
    restarts: u32,
    /// Asleep with every rank stopped: `wake` starts the group again.
    stopped_asleep: bool,
}

impl std::fmt::Debug for GroupLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupLink")
            .field("group", &self.group)
            .field("ranks", &self.ranks)
            .field("region", &self.region.name())
            .finish()
    }
}

impl GroupLink {
    /// Starts the ranks of group `group` (`specs` in rank order, each naming `region`) together:
    /// each loads its shard and joins the others before its handshake completes. A rank that
    /// fails to start makes the others stop waiting for it; the first failure (in rank order)
    /// is returned and nothing is left running.
    pub fn start(
        group: u32,
        specs: Vec<AgentSpec>,
        launch: &AgentLaunch,
        region: GroupRegion,
    ) -> Result<Self, AgentFailure> {
        let region_ref = &region;
        let outcomes: Vec<Result<AgentLink, AgentFailure>> = std::thread::scope(|s| {
            let handles: Vec<_> = specs
                .into_iter()
                .map(|spec| {
                    let launch = launch.clone();
                    s.spawn(move || {
                        let outcome = AgentLink::start(spec, launch);
                        if outcome.is_err() {
                            region_ref.abort_all();
                        }
                        outcome
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank's start-up thread panicked"))
                .collect()
        });
        let mut ranks = Vec::new();
        let mut first = None;
        for (r, o) in outcomes.into_iter().enumerate() {
            match o {
                Ok(link) => ranks.push(link),
                Err(f) if first.is_none() => first = Some((r, f)),
                Err(_) => {}
            }
        }
        if let Some((r, f)) = first {
            for mut link in ranks {
                link.kill_now();
            }
            return Err(AgentFailure::Rank {
                group,
                rank: r as u32,
                failure: Box::new(f),
            });
        }
        Ok(Self::new(group, ranks, region))
    }

    /// The ranks, to adjust before steps run (e.g. pin their KV pools).
    pub fn ranks_mut(&mut self) -> &mut [AgentLink] {
        &mut self.ranks
    }

    /// A group of started `ranks` (rank order), which joined `region`.
    pub fn new(group: u32, ranks: Vec<AgentLink>, region: GroupRegion) -> Self {
        let slot_floats = region.slot_floats() as u64;
        Self {
            group,
            ranks,
            region,
            slot_floats,
            restarts: 0,
            stopped_asleep: false,
        }
    }

    pub fn group(&self) -> u32 {
        self.group
    }

    pub fn ranks(&self) -> &[AgentLink] {
        &self.ranks
    }

    /// The region's name (it changes at every restart).
    pub fn region_name(&self) -> &str {
        self.region.name()
    }

    /// How many times the group has been brought back.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Every rank's pid while it runs (None for a rank that is down).
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.ranks.iter().map(AgentLink::pid).collect()
    }

    /// Takes the whole group down after rank `rank` failed with `failure`.
    fn down(&mut self, rank: usize, failure: AgentFailure) -> AgentFailure {
        for link in &mut self.ranks {
            link.kill_now();
        }
        let failure = AgentFailure::Rank {
            group: self.group,
            rank: rank as u32,
            failure: Box::new(failure),
        };
        tracing::warn!(group = self.group, %failure, "tensor-parallel group down");
        failure
    }

    /// Runs one step on every rank; rank 0's result.
    pub fn step(
        &mut self,
        plan: &StepPlan,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        self.step_with_masks(plan, None, deadline)
    }

    /// `step` for a plan whose mask words may follow it: they go to rank 0 alone (the one
    /// rank that samples), the other ranks never wait for them.
    pub fn step_with_masks(
        &mut self,
        plan: &StepPlan,
        masks: Option<&crossbeam_channel::Receiver<Vec<npu_protocol::TokenMask>>>,
        deadline: Duration,
    ) -> Result<StepResult, AgentFailure> {
        let until = Instant::now() + deadline;
        for r in 0..self.ranks.len() {
            if let Err(f) = self.ranks[r].submit(plan) {
                return Err(self.down(r, f));
            }
        }
        if plan.masks_follow() {
            let agent_id = self.ranks.first().map_or(0, AgentLink::agent_id);
            let sent = super::link::receive_masks(masks, until, agent_id, plan.step_id)
                .and_then(|words| self.ranks[0].send_masks(&words));
            if let Err(f) = sent {
                return Err(self.down(0, f));
            }
        }
        let mut answer = None;
        for r in 0..self.ranks.len() {
            match self.ranks[r].wait_complete(until) {
                Ok(result) if r == 0 => answer = Some(result),
                Ok(_) => {}
                Err(f) => return Err(self.down(r, f)),
            }
        }
        answer.ok_or(AgentFailure::NothingInFlight {
            agent_id: self.ranks.first().map_or(0, AgentLink::agent_id),
        })
    }

    /// A rank that died or broke the protocol while idle takes the group down.
    pub fn check_idle(&mut self) -> Option<AgentFailure> {
        for r in 0..self.ranks.len() {
            if let Some(f) = self.ranks[r].check_idle() {
                return Some(self.down(r, f));
            }
        }
        None
    }

    /// Kills every rank, makes a fresh region, and starts every rank again together (each
    /// waits for the others to join before its handshake completes).
    pub fn restart(&mut self) -> Result<(), AgentFailure> {
        for link in &mut self.ranks {
            link.kill_now();
        }
        let size = self.ranks.len() as u32;
        self.region = create_region(self.group, size, self.slot_floats)?;
        let name = self.region.name().to_string();
        for link in &mut self.ranks {
            link.set_group_region(&name);
        }
        let region = &self.region;
        let outcomes: Vec<Result<(), AgentFailure>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .map(|link| {
                    s.spawn(move || {
                        let outcome = link.restart();
                        if outcome.is_err() {
                            region.abort_all();
                        }
                        outcome
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank's restart thread panicked"))
                .collect()
        });
        if let Some((r, f)) = outcomes
            .into_iter()
            .enumerate()
            .find_map(|(r, o)| o.err().map(|f| (r, f)))
        {
            return Err(self.down(r, f));
        }
        self.restarts += 1;
        Ok(())
    }

    /// Puts the group to sleep: at level 1 on the CPU every rank releases its KV pool and
    /// keeps its weights; otherwise (level 2, or level 1 with the weights on a device) every
    /// rank is shut down, and `wake` starts the group again (a rank cannot rejoin its group's
    /// region after dropping its model). Returns the level and rank 0's report.
    pub fn sleep(&mut self, level: u8) -> Result<SleepDone, AgentFailure> {
        let on_cpu = self
            .ranks
            .first()
            .is_some_and(|l| l.spec().engine.device == npu_protocol::agent::DeviceKind::Cpu);
        if level == 1 && on_cpu {
            let mut first = None;
            for r in 0..self.ranks.len() {
                match self.ranks[r].sleep(level) {
                    Ok(d) => {
                        first.get_or_insert(d);
                    }
                    Err(f) => return Err(self.down(r, f)),
                }
            }
            return Ok(first.unwrap_or_default());
        }
        let started = Instant::now();
        for link in &mut self.ranks {
            link.shutdown();
        }
        self.stopped_asleep = true;
        Ok(SleepDone {
            level,
            bytes: 0,
            took_us: started.elapsed().as_micros() as u64,
            error: String::new(),
        })
    }

    /// Wakes the group: every rank wakes, or the group starts again when its sleep stopped it.
    pub fn wake(&mut self) -> Result<SleepDone, AgentFailure> {
        let started = Instant::now();
        if std::mem::take(&mut self.stopped_asleep) {
            self.restart()?;
            self.restarts -= 1;
            return Ok(SleepDone {
                took_us: started.elapsed().as_micros() as u64,
                ..SleepDone::default()
            });
        }
        let mut first = None;
        for r in 0..self.ranks.len() {
            match self.ranks[r].wake() {
                Ok(d) => {
                    first.get_or_insert(d);
                }
                Err(f) => return Err(self.down(r, f)),
            }
        }
        Ok(first.unwrap_or_default())
    }

    /// Shuts every rank down (the region goes with the group).
    pub fn shutdown(&mut self) {
        for link in &mut self.ranks {
            link.shutdown();
        }
    }

    /// Rank 0's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.ranks.first().and_then(AgentLink::pid)
    }
}

impl Drop for GroupLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}
