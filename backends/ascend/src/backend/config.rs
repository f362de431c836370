//! The Ascend backend's settings ([`AscendConfig`]) and the choice of rotary operator
//! ([`RopeKernel`]), as the agent's command line and config give them.

use npu_backend::DType;

/// Which operator applies rotary embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKernel {
    /// ApplyRotaryPosEmb for a half-rotation rope of width 128 (q and k in place, one call),
    /// else RotaryPositionEmbedding (half or interleave mode) where the release has it, else
    /// ApplyRotaryPosEmb where the rotary width is 128 (the only width its page allows), else
    /// [`RopeKernel::MulAdd`].
    Auto,
    /// ApplyRotaryPosEmb (half rotation; interleaved pairs are gathered into halves and back),
    /// for a rotary width of 128; other widths fall back to RotaryPositionEmbedding where the
    /// release has it, else to [`RopeKernel::MulAdd`], with a warning.
    ApplyRotaryPosEmb,
    /// An element-wise rotation with Mul and Add (any even rotary width, any release).
    MulAdd,
}

/// Settings of one agent's Ascend backend.
#[derive(Debug, Clone)]
pub struct AscendConfig {
    /// `serving_config.start_device_id`: agent `i` runs on logical device `start + i`.
    pub start_device_id: u32,
    pub agent_index: u32,
    /// Reuse executors of repeated operator shapes where the release supports it.
    pub reuse_executors: bool,
    pub rope: RopeKernel,
    /// Quantize the activations of 4- and 8-bit matmuls to 8 bits per 32 values first
    /// (DynamicQuant over 32-value rows, then back to f16), the arithmetic of llama.cpp and the
    /// CPU backend: three more calls per such matmul. Off by default: measured on the default
    /// model, it moves logits as far from the CPU backend's as from exact arithmetic (the 8-bit
    /// rounding amplifies the f16 path's small differences into noise of its own), so it buys no
    /// agreement, while f16 activations stay within ~0.1 of exact arithmetic.
    pub q8_activations: bool,
    /// The activations' type: `None` (the default) chooses per model when it loads, bf16 for a
    /// model whose hidden states outgrow f16's range (`wide_activations`: Gemma 3), else f16;
    /// `Some(F16)` or `Some(BF16)` fixes it for every model.
    pub activations: Option<DType>,
}

impl Default for AscendConfig {
    fn default() -> Self {
        Self {
            start_device_id: 0,
            agent_index: 0,
            reuse_executors: true,
            rope: RopeKernel::Auto,
            q8_activations: false,
            activations: None,
        }
    }
}
