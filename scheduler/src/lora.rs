//! LoRA adapters in the scheduler: which adapter a queued request runs under (set right after
//! it is added; carried in its admission, and into the prefix cache's hashes), and the limit on
//! distinct adapters among admitted requests, the agent's adapter slots: a waiting request
//! whose adapter would need one more slot than there are waits (FCFS) until a running request
//! of another adapter ends, so the agent never lacks a slot.

use std::collections::BTreeSet;

use npu_protocol::LoraRequest;

use super::error::SchedError;
use super::Scheduler;
use crate::types::RequestId;

impl Scheduler {
    /// At most `n` distinct adapters among admitted requests (0: no limit).
    pub fn set_max_loras(&mut self, n: usize) {
        self.max_loras = n;
    }

    /// Runs queued request `id` under `lora`. Only before it is admitted: an admitted
    /// request's KV was computed under the adapter it had.
    pub fn set_lora(&mut self, id: RequestId, lora: LoraRequest) -> Result<(), SchedError> {
        let refuse = |reason: &str| SchedError::Lora {
            id,
            reason: reason.to_string(),
        };
        if self.max_loras == 0 {
            return Err(refuse("LoRA adapters are not served here (max_loras 0)"));
        }
        if lora.id == 0 {
            return Err(refuse("LoRA adapter id 0 is the base model"));
        }
        let seq = self
            .seqs
            .get_mut(&id)
            .ok_or_else(|| refuse("not queued here"))?;
        if seq.admitted.is_some() || seq.swapped.is_some() {
            return Err(refuse("already admitted: its adapter cannot change"));
        }
        seq.lora = Some(lora);
        Ok(())
    }

    /// Distinct adapter ids of admitted requests.
    fn running_loras(&self) -> BTreeSet<u32> {
        self.running
            .iter()
            .map(|id| self.seqs[id].lora_id())
            .filter(|&l| l != 0)
            .collect()
    }

    /// Whether waiting request `id` may be admitted as far as adapter slots go.
    pub(crate) fn lora_fits(&self, id: RequestId) -> bool {
        let lora = self.seqs[&id].lora_id();
        if self.max_loras == 0 || lora == 0 {
            return true;
        }
        let running = self.running_loras();
        running.contains(&lora) || running.len() < self.max_loras
    }

    /// Adapter ids of admitted requests and of waiting ones (each once, ascending).
    pub fn lora_ids(&self) -> (Vec<u32>, Vec<u32>) {
        let waiting: BTreeSet<u32> = self
            .waiting
            .iter()
            .map(|id| self.seqs[id].lora_id())
            .filter(|&l| l != 0)
            .collect();
        (
            self.running_loras().into_iter().collect(),
            waiting.into_iter().collect(),
        )
    }
}
