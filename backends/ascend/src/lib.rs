//! npu-backend-ascend: the Ascend backend. Safe wrappers over CANN's ACL runtime and aclnn
//! operators (declared in `npu-ffi`, loaded at run time): the process-wide runtime and the CANN
//! version check ([`runtime`], [`version`]), an agent's device, context and stream ([`device`]),
//! device and pinned memory ([`memory`]), aclnn objects ([`tensor`]), the two-phase operator
//! calls with a growable workspace and per-step call counts ([`ops`]), executor reuse for repeated
//! shapes ([`reuse`]), the paged KV layout ([`kv`]) and GGUF weights in WeightQuantBatchMatmulV2's
//! form ([`weights`]); and on them [`AscendBackend`], the agent's device seam
//! (`npu_backend::Backend`) on one NPU ([`backend`]).
//!
//! In CI every call goes to a strict emulation of the documented API (`emulators/ascend`,
//! `scripts/ascend-emulator.sh`); none of this has run on Ascend hardware.
//!
//! # Design
//!
//! - Buffers are device allocations with a dtype and a length; the seam's strided views of them
//!   become aclTensors (`aclCreateTensor` with strides and an offset), so the Q/K/V parts of a
//!   fused QKV row, or the logit rows of a step, are addressed without copies.
//! - Activations are f16; matmuls take INT4/INT8 weights through WeightQuantBatchMatmulV2 with
//!   per-group (32) antiquant scale/offset — exactly Q4_1's `d·q + m`, Q4_0's `d·(q − 8)` and
//!   Q8_0's `d·q` — or f16 weights through Matmul.
//! - The KV pool is two tensors per layer, (blocks, block_size, KV_N·D), the layout
//!   FusedInferAttentionScore takes with a BSH query; new tokens are written by slot mapping
//!   (ScatterPaKvCache, or ScatterNdUpdate on releases without it). Decode steps are one batch
//!   entry per sequence through the incremental branch (block size a multiple of 16); steps with
//!   prefill chunks take the prompt branch with the right-down causal mask when the block size is a
//!   multiple of 128 (the sequences padded to the longest chunk), else go token by token through
//!   the incremental branch (each token its own entry, causality by KV length) — hence 128 is the
//!   recommended `pa_config.block_size`.
//! - The newer families' ops ([`npu_backend::Capability`]; all but mixture-of-experts):
//!   per-head Q/K norm as RmsNorm over a (rows, heads, head_dim) view, row scaling as
//!   InplaceMuls, the GELU gate as GeluV2 (tanh) then InplaceMul, sliding windows through
//!   FusedInferAttentionScore (band mode in the prompt branch; per-entry key masks, packed into
//!   the step's upload, in the incremental branch, which has no window parameter), rope
//!   frequency factors and per-layer bases through host cos/sin tables kept per rope.
//!   f16 activations bound hidden states by 65504: Gemma 3 270M's residual stream passes that
//!   at layer 8 (measured on the emulation), so that model needs wider activations (f32 or bf16,
//!   not built here yet) — its family ops themselves agree with the CPU backend.
//! - One host synchronization per step: the step's inputs go up in one async copy from pinned
//!   memory (`begin_step`), the kernels are queued behind it, and the host waits when it reads the
//!   sampled ids (or logits) back.
//!
//! # Graph capture per padded batch bucket (`npu_serving.graph_capture: auto`)
//!
//! Host-side launch overhead dominates small-batch decode on Ascend: a Llama step is ~10 aclnn
//! calls per layer, each a first phase (argument checks, tiling) plus a launch. So a decode-only
//! step can be captured once per padded shape and replayed with one call: CANN's
//! `aclmdlRICaptureBegin/End` (ACL graph, 8.1+) records the stream's launches into a model run
//! instance that `aclmdlRIExecuteAsync` replays ([`graph`]). The Model pads the batch to its bucket
//! and the block tables to a power-of-two width (padded rows write to a block kept for them); the
//! backend (`backend::graphs`) keeps each shape's inputs at their own fixed device addresses and
//! uploads them in the graph form of `backend::step::StepPlan::graph_form`: attention's sequence
//! lengths are host arguments of FusedInferAttentionScore's first phase, frozen at capture, so
//! every entry gets the tables' whole reach as its length and the keys past its own length are
//! hidden by a device key mask in the step's upload (as the incremental branch's sliding-window
//! masks are). The first step of a shape runs eagerly (growing workspaces and scratch, warming
//! executors), then the same ops are recorded; later steps replay. A graph is dropped when memory it
//! may have recorded is freed. Prefill and mixed steps stay eager, and so do MoE steps whose
//! experts run one matmul each (they read the experts' row counts back, which a capture refuses:
//! more than 1024 experts, bf16), latent attention and sliding windows. Repeatable executors
//! ([`reuse`]) still remove the first phase of every eager operator whose shape repeats, and
//! [`ops::StepStats`] reports how many calls a step makes.

pub mod backend;
pub mod device;
pub mod error;
pub mod graph;
pub mod kv;
pub mod memory;
pub mod ops;
pub mod reuse;
pub mod runtime;
pub mod tensor;
pub mod version;
pub mod weights;

pub use backend::{AscendBackend, AscendConfig, RopeKernel};
pub use error::{AscendError, Result};
pub use runtime::Acl;
