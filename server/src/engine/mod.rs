//! The engine: one thread owns the scheduler, the block managers and the agent links, and turns
//! generation requests into step plans and step results into generation events.

pub mod handle;
pub mod scheduler;
pub mod types;

pub use types::{FinishReason, GenEvent, GenerateRequest, RequestId, Usage};
pub use handle::{EngineCommand, EngineHandle, EngineStats, TaggedEvent};
