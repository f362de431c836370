//! LoRA adapters in the engine: a request that names one keeps its adapter for its whole life
//! (set in the scheduler each time it is queued on an agent, also after a recovery), the
//! run-time load of an adapter (`POST /v1/load_lora_adapter`, answered like `/sleep`), and the
//! adapters of running and waiting requests published for `/metrics`. Loading reads and checks
//! the adapter's files on a thread of its own, so steps go on meanwhile. A request whose
//! adapter an agent could not read at admission ends alone with the reason (the rest of its
//! step ran), and the adapter goes out of service (later requests naming it get a 400 at once).

use std::collections::BTreeSet;

use crossbeam_channel::{Receiver, Sender};

use npu_protocol::{LoraRequest, StepResult};
use serde_json::json;

use super::Engine;
use crate::engine::handle::ControlReply;
use crate::engine::types::{FinishReason, GenEvent, GenerateRequest, RequestId, Usage};

/// Where load threads send their answers, and where the engine takes them.
pub(super) type LoraLoads = (
    Sender<(RequestId, ControlReply)>,
    Receiver<(RequestId, ControlReply)>,
);

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

    /// Reads and checks the adapter on a thread of its own (steps go on meanwhile); the
    /// answer comes back through `lora_loads`.
    pub(super) fn load_lora(&mut self, id: RequestId, name: &str, path: &str) {
        let Some(reg) = self.cfg.lora.clone() else {
            let reply = ControlReply {
                status: 400,
                body: json!({"error": {
                    "message": "LoRA adapters are not served here: set npu_serving.max_loras \
                                (or npu_serving.lora_adapters) to load them",
                    "type": "invalid_request_error", "param": "lora_name", "code": 400}}),
            };
            return self.lora_loaded(id, reply);
        };
        let (name, path, done) = (
            name.to_string(),
            path.to_string(),
            self.lora_loads.0.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("lora-load".into())
            .spawn(move || {
                let reply = match reg.0.load(&name, &path) {
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
                };
                let _ = done.send((id, reply));
            });
        if let Err(e) = spawned {
            let reply = ControlReply {
                status: 503,
                body: json!({"error": {"message": format!("cannot start a thread to read the \
                    adapter: {e}"), "type": "unavailable", "code": 503}}),
            };
            self.lora_loaded(id, reply);
        }
    }

    /// Answers a load request.
    pub(super) fn lora_loaded(&mut self, id: RequestId, reply: ControlReply) {
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

    /// Ends the requests of the sequences agent `i` could not run in `result` (their adapter's
    /// files could not be read or placed), each with the agent's reason naming the adapter,
    /// before the result is applied; their adapters go out of service.
    pub(super) fn end_failed_seqs(&mut self, i: usize, result: &StepResult) {
        if result.failed.is_empty() {
            return;
        }
        let failed: Vec<(RequestId, String)> = self.agents[i]
            .sched
            .failed_requests(result)
            .into_iter()
            .map(|(id, e)| (id, e.to_string()))
            .collect();
        for (id, error) in failed {
            let adapter = self.loras.get(&id).map(|l| l.id);
            let name = match (adapter, &self.cfg.lora) {
                (Some(l), Some(reg)) => reg.0.mark_unusable(l, &error),
                _ => None,
            };
            let message = match name {
                Some(name) => format!(
                    "LoRA adapter '{name}' cannot be used: agent {i}: {error}; the adapter is \
                     out of service until it is loaded again (POST /v1/load_lora_adapter)"
                ),
                None => format!("agent {i} could not run the request: {error}"),
            };
            tracing::warn!(agent = i, request = id, %message, "request ended alone");
            self.agents[i].sched.abort(id);
            self.emit_finished(id, FinishReason::Error, Some(message));
        }
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
