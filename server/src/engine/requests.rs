//! The engine's state of one request beyond what its scheduler holds: where it runs, its
//! streaming detokenizer and stop-string matcher, its token counts, and the events each
//! generated token turns into. It survives preemption and agent restarts, so a recovered
//! request resumes its text exactly where the client's stream stopped.

use npu_structured::{Commit, Constraint};
use npu_tokenizer::{DecodeStream, Tokenizer};

use super::scheduler::SchedOutput;
use super::stop::{StopMatcher, StopOutcome};
use super::types::{FinishReason, GenEvent, GenerateRequest, RequestId, Usage};

/// One request known to the engine (from Submit to its Finished event).
pub(crate) struct RequestEntry {
    /// The agent whose scheduler holds it; None while it waits for an agent to come up.
    pub agent: Option<usize>,
    decoder: DecodeStream,
    stop: StopMatcher,
    prompt_tokens: u32,
    /// Tokens sent to the client.
    generated: u32,
    /// The request's grammar (structured output), advanced by every token it generates.
    pub constraint: Option<Box<Constraint>>,
    /// End-of-sequence ids (a constrained request's end is not a grammar token).
    eos_ids: Vec<u32>,
    /// Why the request failed, when its constraint did.
    pub failure: Option<String>,
}

impl RequestEntry {
    pub fn new(req: &GenerateRequest, tokenizer: &Tokenizer) -> Self {
        Self {
            agent: None,
            decoder: tokenizer.decode_stream_continuation(true),
            stop: StopMatcher::new(&req.stop),
            prompt_tokens: req.prompt_ids.len() as u32,
            generated: 0,
            constraint: None,
            eos_ids: tokenizer.eos_ids().to_vec(),
            failure: None,
        }
    }

    /// The token mask for the request's next token, when it is constrained. A constraint that
    /// fails allows only the end token (so the step stays valid) and marks the request failed.
    pub fn next_mask(&mut self) -> Option<Vec<u32>> {
        let c = self.constraint.as_mut()?;
        match c.mask() {
            Ok(words) => Some(words),
            Err(e) => {
                self.failure = Some(e.to_string());
                let words = c.mask_words();
                let mut only_end = vec![0u32; words];
                for &t in &self.eos_ids {
                    if let Some(w) = only_end.get_mut((t / 32) as usize) {
                        *w |= 1 << (t % 32);
                    }
                }
                Some(only_end)
            }
        }
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
        }
    }

    /// Turns one generated token into its Token event (text completed by it, less anything a
    /// stop string may still claim), and says whether the request ends with it: the
    /// scheduler's reason (EOS, length), or `Stop` when a stop string matched (the caller must
    /// then end it in the scheduler). Text held back is sent with the last token.
    pub fn on_token(
        &mut self,
        id: RequestId,
        out: &SchedOutput,
        events: &mut Vec<(RequestId, GenEvent)>,
    ) -> Option<FinishReason> {
        self.generated += 1;
        let mut grammar_done = false;
        if let Some(c) = self.constraint.as_mut() {
            if !self.eos_ids.contains(&out.token.token) && self.failure.is_none() {
                match c.commit(out.token.token) {
                    Ok(Commit::Done) => grammar_done = true,
                    Ok(Commit::Continue) => {}
                    Err(e) => self.failure = Some(e.to_string()),
                }
            }
        }
        if self.failure.is_some() {
            return Some(FinishReason::Error);
        }
        let mut text = self.decoder.push(out.token.token);
        let out_finished = out.finished.or(grammar_done.then_some(FinishReason::Stop));
        if out_finished.is_some() {
            text.push_str(&self.decoder.flush());
        }
        let (text, finished) = match self.stop.push(&text) {
            StopOutcome::Stopped(before) => (before, Some(FinishReason::Stop)),
            StopOutcome::Emit(mut t) => {
                if out_finished.is_some() {
                    t.push_str(&self.stop.finish());
                }
                (t, out_finished)
            }
        };
        events.push((
            id,
            GenEvent::Token {
                token: out.token,
                top: out.top.clone(),
                text,
            },
        ));
        finished
    }

    /// The request's last event.
    pub fn finished(
        &self,
        id: RequestId,
        reason: FinishReason,
        message: Option<String>,
    ) -> (RequestId, GenEvent) {
        (
            id,
            GenEvent::Finished {
                reason,
                usage: self.usage(),
                message,
            },
        )
    }
}
