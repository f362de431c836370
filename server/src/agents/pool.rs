//! All agents of the server: started together (their model loads overlap), stepped together
//! (submit to every agent, then collect), shut down together. Segments a crashed earlier run
//! left behind are removed before the first agent starts.

use std::time::{Duration, Instant};

use npu_protocol::shm::cleanup_stale_segments;
use npu_protocol::{StepPlan, StepResult};

use super::{AgentFailure, AgentLaunch, AgentLink, AgentSpec};

#[derive(Debug)]
pub struct AgentPool {
    links: Vec<AgentLink>,
}

impl AgentPool {
    /// Removes stale segments, then starts every agent in parallel. If any fails, the others
    /// are shut down and the first failure (in spec order) is returned.
    pub fn start(specs: Vec<AgentSpec>, launch: AgentLaunch) -> Result<Self, AgentFailure> {
        let removed = cleanup_stale_segments();
        if !removed.is_empty() {
            tracing::info!(
                ?removed,
                "removed shared-memory segments of a crashed earlier run"
            );
        }
        let outcomes: Vec<Result<AgentLink, AgentFailure>> = std::thread::scope(|scope| {
            let handles: Vec<_> = specs
                .into_iter()
                .map(|spec| {
                    let launch = launch.clone();
                    scope.spawn(move || AgentLink::start(spec, launch))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("agent start-up thread panicked"))
                .collect()
        });
        let mut links = Vec::with_capacity(outcomes.len());
        let mut first_failure = None;
        for outcome in outcomes {
            match outcome {
                Ok(link) => links.push(link),
                Err(failure) if first_failure.is_none() => first_failure = Some(failure),
                Err(failure) => tracing::warn!(%failure, "another agent failed to start too"),
            }
        }
        match first_failure {
            Some(failure) => {
                for link in &mut links {
                    link.shutdown();
                }
                Err(failure)
            }
            None => Ok(Self { links }),
        }
    }

    pub fn len(&self) -> usize {
        self.links.len()
    }

    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    pub fn links(&self) -> &[AgentLink] {
        &self.links
    }

    pub fn links_mut(&mut self) -> &mut [AgentLink] {
        &mut self.links
    }

    /// The links, in agent order, to drive separately (each shuts down when dropped).
    pub fn into_links(self) -> Vec<AgentLink> {
        self.links
    }

    pub fn link_mut(&mut self, index: usize) -> Option<&mut AgentLink> {
        self.links.get_mut(index)
    }

    /// Runs one step on several agents at once: `plans[i]` goes to agent `i` (None: no step
    /// for it). Every plan is submitted before any result is awaited, all under one deadline.
    /// The outcome of agent `i` is at index `i` (None where no plan was given).
    pub fn step_all(
        &mut self,
        plans: &[Option<StepPlan>],
        deadline: Duration,
    ) -> Vec<Option<Result<StepResult, AgentFailure>>> {
        let until = Instant::now() + deadline;
        let mut outcomes: Vec<Option<Result<StepResult, AgentFailure>>> =
            (0..self.links.len()).map(|_| None).collect();
        for (i, link) in self.links.iter_mut().enumerate() {
            if let Some(Some(plan)) = plans.get(i) {
                if let Err(failure) = link.submit(plan) {
                    outcomes[i] = Some(Err(failure));
                }
            }
        }
        for (i, link) in self.links.iter_mut().enumerate() {
            if matches!(plans.get(i), Some(Some(_))) && outcomes[i].is_none() {
                outcomes[i] = Some(link.wait_complete(until));
            }
        }
        outcomes
    }

    /// Shuts every agent down and removes the segments.
    pub fn shutdown(&mut self) {
        for link in &mut self.links {
            link.shutdown();
        }
    }
}
