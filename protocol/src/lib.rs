//! npu-protocol: what the server and its agents must agree on. Step plans and step results
//! (`step`, read where they lie through `source`), the shared-memory segment (`shm`), the framed
//! control messages (`frame`), how an agent is started (`agent`), and the block layout of
//! long-context sequences (`long_context`).

pub mod agent;
pub mod frame;
pub mod long_context;
pub mod shm;
pub mod source;
pub mod step;

pub use long_context::{LongContextConfig, LongContextLayout, LongContextSettingError};
pub use source::{PlanSource, SeqRef, U32s};
pub use step::{
    Admission, CopyDirection, KvCopy, LoraRequest, SamplingParams, SeqFailure, SeqResult, SeqStep,
    StepPlan, StepResult, StepTiming, StepTransfer, TokenLogprob, TokenMask, MAX_DRAFT_TOKENS,
    MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LORA_PATH, MAX_SEQ_FAILURE, MAX_STEP_DRAFT_TOKENS,
    MAX_TOP_N,
};
