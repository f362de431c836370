//! npu-protocol: what the server and its agents must agree on. Step plans and step results
//! (`step`), and later the shared-memory layout and the framed control messages.

pub mod agent;
pub mod frame;
pub mod shm;
pub mod step;

pub use step::{
    Admission, SamplingParams, SeqResult, SeqStep, StepPlan, StepResult, StepTiming, TokenLogprob,
    MAX_TOP_N,
};
