//! LoRA adapters in the agent's engine: each admitted request slot's adapter (from its
//! admission), the model's adapter slots filled on demand (an adapter not resident is read from
//! the path its admission carries and placed in a free slot, or in the least recently used one
//! no admitted request holds), pinned while a request slot uses them and released when it is
//! forgotten, and every step's adapter per token row. The server's scheduler admits no more
//! distinct adapters than there are slots, so a slot is always found. An adapter whose files
//! cannot be read or placed (deleted or changed since the server checked them) fails the
//! admissions that name it, each with the reason, and nothing else.

use npu_protocol::agent::AgentLoraConfig;
use npu_protocol::{Admission, LoraRequest};

use crate::device::DeviceModel;
use crate::engine::EngineError;
use crate::model::lora::pool::{Acquire, SlotPool};
use crate::step_input::StepRead;

/// The engine's adapter bookkeeping (present only when the server turned LoRA on).
pub(crate) struct EngineLora {
    pool: SlotPool,
    /// Per request slot: the adapter id it runs under, and that adapter's model slot.
    held: Vec<Option<(u32, usize)>>,
    /// The current step's adapter per token row (reused).
    per_token: Vec<u16>,
}

impl EngineLora {
    /// Turns adapters on in `model` as `cfg` says, for `max_slots` request slots.
    pub fn enable(
        model: &mut DeviceModel,
        cfg: &AgentLoraConfig,
        max_slots: usize,
    ) -> Result<Self, EngineError> {
        model.enable_lora(cfg.max_loras as usize, cfg.max_lora_rank as usize)?;
        Ok(Self {
            pool: SlotPool::new(cfg.max_loras as usize),
            held: vec![None; max_slots],
            per_token: Vec::new(),
        })
    }

    /// Request slot `slot` is forgotten: its adapter is unpinned (it stays resident until a
    /// slot is needed for another).
    pub fn forget(&mut self, slot: usize) {
        if let Some((id, _)) = self.held.get_mut(slot).and_then(Option::take) {
            self.pool.release(&id.to_string());
        }
    }

    /// Every request slot is forgotten.
    pub fn reset(&mut self) {
        for s in 0..self.held.len() {
            self.forget(s);
        }
    }

    /// Request slot `slot` is admitted under `lora` (None: the base model): the adapter is
    /// pinned, read and placed in a model slot first when it is not resident. `Ok(Some(why))`:
    /// the adapter could not be read or placed; the slot holds nothing and its request cannot
    /// run (the engine goes on with the others).
    pub fn admit(
        &mut self,
        model: &mut DeviceModel,
        slot: usize,
        lora: Option<&LoraRequest>,
    ) -> Result<Option<String>, EngineError> {
        self.forget(slot);
        let Some(l) = lora else {
            return Ok(None);
        };
        let name = l.id.to_string();
        let model_slot = match self.pool.acquire(&name) {
            Acquire::Resident(s) => s,
            Acquire::Load { slot: s, evicted } => {
                if let Some(old) = evicted {
                    tracing::debug!(adapter = %old, slot = s, "LoRA adapter evicted");
                }
                let placed = match model.read_lora(std::path::Path::new(&l.path)) {
                    Ok(ad) => model
                        .load_lora(s, &ad)
                        .map_err(|e| format!("cannot be placed in adapter slot {s}: {e}")),
                    Err(e) => Err(format!("cannot be read: {e}")),
                };
                if let Err(why) = placed {
                    // The slot holds nothing usable: give it up.
                    self.pool.release(&name);
                    let _ = self.pool.remove(&name);
                    tracing::warn!(adapter = l.id, path = %l.path, %why, "LoRA adapter failed");
                    return Ok(Some(format!("LoRA adapter {} at {}: {why}", l.id, l.path)));
                }
                tracing::info!(adapter = l.id, path = %l.path, slot = s, "LoRA adapter loaded");
                s
            }
            Acquire::Wait => {
                return Err(EngineError::BadPlan(format!(
                    "slot {slot}: LoRA adapter {} admitted while every adapter slot is held by \
                     running requests (more adapters than max_loras)",
                    l.id
                )))
            }
        };
        self.held[slot] = Some((l.id, model_slot));
        Ok(None)
    }

    /// Tells the model the adapter of every token row of the step `read` holds.
    pub fn set_step(
        &mut self,
        model: &mut DeviceModel,
        read: &StepRead,
    ) -> Result<(), EngineError> {
        self.per_token.clear();
        let t = read.inputs.tokens.len();
        let any = read
            .seqs
            .iter()
            .any(|f| self.held.get(f.slot as usize).is_some_and(Option::is_some));
        if any {
            self.per_token.resize(t, crate::model::lora::BASE);
            for (i, f) in read.seqs.iter().enumerate() {
                let Some(Some((_, s))) = self.held.get(f.slot as usize) else {
                    continue;
                };
                let span = &read.inputs.seqs[i];
                let rows = span.q_row as usize..(span.q_row + span.n_q) as usize;
                self.per_token[rows].fill(*s as u16 + 1);
            }
        }
        model.set_step_lora(&self.per_token, t)?;
        Ok(())
    }
}

/// Admission `a` into request slot `slot`: its adapter pinned where adapters are on, refused
/// by name where they are not. `Ok(Some(why))`: this request cannot run (its adapter's files
/// could not be read or placed), the step's others can.
pub(crate) fn admit(
    lora: Option<&mut EngineLora>,
    model: &mut DeviceModel,
    slot: usize,
    a: &Admission,
) -> Result<Option<String>, EngineError> {
    match (lora, &a.lora) {
        (Some(l), lora) => l.admit(model, slot, lora.as_ref()),
        (None, Some(lora)) => Err(EngineError::BadPlan(format!(
            "slot {}: LoRA adapter {} ({}) admitted, and this agent serves no adapters \
             (npu_serving.max_loras)",
            a.slot, lora.id, lora.path
        ))),
        (None, None) => Ok(None),
    }
}
