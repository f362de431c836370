//! LoRA adapters in the engine: a request that names one keeps its adapter for its whole life
//! (set in the scheduler each time it is queued on an agent, also after a recovery), the
//! run-time load of an adapter (`POST /v1/load_lora_adapter`, answered like `/sleep`), and the
//! adapters of running and waiting requests published for `/metrics`. Loading reads and checks
//! the adapter's files on this thread: steps already sent keep running on their agents, the
//! next ones wait for the read.

use std::collections::BTreeSet;

use npu_protocol::LoraRequest;
use serde_json::json;

use super::Engine;
use crate::engine::handle::ControlReply;
use crate::engine::types::{FinishReason, GenEvent, GenerateRequest, RequestId, Usage};

impl Engine {
    pub(super) fn submit_lora(
        &mut self,
        req: GenerateRequest,
        constraint: Option<Box<npu_structured::Constraint>>,
        lora: LoraRequest,
    ) {
        if self.cfg.lora.is_none() {
            let id = req.id;
            self.requests
                .insert(id, super::RequestEntry::new(&req, &self.tokenizer));
            let msg = "LoRA adapters are not served here (npu_serving.lora_adapters)".into();
            return self.emit_finished(id, FinishReason::Rejected, Some(msg));
        }
        self.loras.insert(req.id, lora);
        self.submit(req, constraint);
    }

    pub(super) fn load_lora(&mut self, id: RequestId, name: &str, path: &str) {
        let reply = match &self.cfg.lora {
            None => ControlReply {
                status: 400,
                body: json!({"error": {
                    "message": "LoRA adapters are not served here: set npu_serving.max_loras \
                                (or npu_serving.lora_adapters) to load them",
                    "type": "invalid_request_error", "param": "lora_name", "code": 400}}),
            },
            Some(reg) => match reg.0.load(name, path) {
                Ok(_) => ControlReply {
                    status: 200,
                    body: json!({"message":
                        format!("Success: LoRA adapter '{name}' added successfully.")}),
                },
                Err(e) => ControlReply {
                    status: e.status(),
                    body: json!({"error": {"message": e.to_string(),
                        "type": if e.status() == 404 { "NotFoundError" } else { "BadRequestError" },
                        "param": e.param(), "code": e.status()}}),
                },
            },
        };
        let message = serde_json::to_string(&reply).unwrap_or_default();
        let reason = if reply.status < 400 {
            FinishReason::Stop
        } else {
            FinishReason::Error
        };
        self.events.push((
            id,
            GenEvent::Finished {
                reason,
                usage: Usage::default(),
                message: Some(message),
            },
        ));
    }

    /// Tells the registry which adapters running and waiting requests use (`/metrics`).
    pub(super) fn publish_lora_activity(&self) {
        let Some(reg) = &self.cfg.lora else {
            return;
        };
        let (mut running, mut waiting) = (BTreeSet::new(), BTreeSet::new());
        for a in &self.agents {
            let (r, w) = a.sched.lora_ids();
            running.extend(r);
            waiting.extend(w);
        }
        for p in &self.pending {
            if let Some(l) = self.loras.get(&p.id()) {
                waiting.insert(l.id);
            }
        }
        reg.0
            .set_activity(running.into_iter().collect(), waiting.into_iter().collect());
    }
}
