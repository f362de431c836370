//! Fault injection for the instruction-set check program (built only with the
//! `fault-injection` feature): while switched on, every kernel run with an instruction set other
//! than scalar flips the lowest bit of one value it produced. The check program turns it on to
//! prove that a wrong SIMD result makes it fail, then off to check the real kernels.

use std::sync::atomic::{AtomicBool, Ordering};

use super::Isa;

static CORRUPT_SIMD: AtomicBool = AtomicBool::new(false);

/// Switches the fault on or off (process-wide).
pub fn corrupt_simd_results(on: bool) {
    CORRUPT_SIMD.store(on, Ordering::SeqCst);
}

/// Flips the lowest mantissa bit of `v` when the fault is on and `isa` is not scalar.
pub(crate) fn apply(isa: Isa, v: Option<&mut f32>) {
    if isa != Isa::Scalar && CORRUPT_SIMD.load(Ordering::SeqCst) {
        if let Some(v) = v {
            *v = f32::from_bits(v.to_bits() ^ 1);
        }
    }
}
