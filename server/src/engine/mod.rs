//! The engine: one thread owns the scheduler, the block managers and the agent links, and turns
//! generation requests into step plans and step results into generation events.

pub mod agent_thread;
pub mod config;
pub mod driver;
pub mod events;
pub mod handle;
mod requests;
pub mod scheduler;
pub mod stop;
pub mod types;

pub use agent_thread::{AgentThreadSettings, StepAgent};
pub use config::EngineConfig;
pub use driver::{start_engine, EngineError, RunningEngine};
pub use events::EventOutput;
pub use handle::{EngineCommand, EngineHandle, EngineStats, TaggedEvent};
pub use types::{FinishReason, GenEvent, GenerateRequest, RequestId, Usage};
