//! Weight and activation number formats: the
//! packed weight layout our matmul kernels read (`packed`), and 8-bit activation quantization
//! (`acts`).

pub mod acts;
pub mod packed;

pub use acts::QuantizedActs;
pub use packed::{FloatActs, PackedMatrix, WeightMatrix};
/// Test support (random well-formed tensors), shared with the instruction-set check program.
pub mod testing;
