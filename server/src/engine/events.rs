//! Where the engine sends generation events: the HTTP server's `EventSink` in production (it
//! wakes the HTTP loop), or a plain channel (tests, other front ends).

use crossbeam_channel::Sender;

use super::handle::TaggedEvent;
use crate::http::EventSink;

/// Receives the engine's events, in order per request.
pub trait EventOutput: Send {
    /// Sends a batch of events at once; false when the receiver is gone.
    fn send_all(&self, events: Vec<TaggedEvent>) -> bool;
}

impl EventOutput for EventSink {
    fn send_all(&self, events: Vec<TaggedEvent>) -> bool {
        EventSink::send_all(self, events)
    }
}

impl EventOutput for Sender<TaggedEvent> {
    fn send_all(&self, events: Vec<TaggedEvent>) -> bool {
        events.into_iter().all(|e| self.send(e).is_ok())
    }
}
