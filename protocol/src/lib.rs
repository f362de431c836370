//! npu-protocol: what the server and its agents must agree on. Step plans and step results
//! (`step`, read where they lie through `source`), the shared-memory segment (`shm`), the framed
//! control messages (`frame`), and how an agent is started (`agent`).

pub mod agent;
pub mod frame;
pub mod shm;
pub mod source;
pub mod step;

pub use source::{PlanSource, SeqRef, U32s};
pub use step::{
    Admission, CopyDirection, KvCopy, SamplingParams, SeqResult, SeqStep, StepPlan, StepResult,
    StepTiming, StepTransfer, TokenLogprob, MAX_TOP_N,
};
