//! Device faults (review finding 8). A kernel that faults on a GPU (illegal or misaligned
//! address, illegal instruction, launch failure, uncorrectable ECC error) leaves the CUDA context
//! unusable: the error surfaces at some later call, and every call after it fails the same way.
//! The backend therefore remembers the first such error and answers every later call with it at
//! once, naming the kernels queued last (or, with `NPU_SERVING_CUDA_SYNC=1`, the kernel that
//! faulted: the stream is synchronized after every launch and GEMM), so the caller sees one
//! clear, permanent error instead of a stream of unrelated ones.

use std::collections::VecDeque;
use std::sync::Mutex;

use npu_backend::BackendError;

/// Environment variable: `1` synchronizes after every kernel launch and GEMM, so a device fault
/// names the kernel and grid that caused it (slow; for finding bugs on a GPU).
pub const ENV_SYNC: &str = "NPU_SERVING_CUDA_SYNC";

/// Launches remembered for a fault's message.
const RECENT: usize = 8;

/// The driver's error codes after which the context is unusable (CUDA driver API, "Error
/// codes": "the process must be terminated and relaunched").
pub fn is_sticky(code: u32) -> bool {
    matches!(
        code,
        214 // CUDA_ERROR_ECC_UNCORRECTABLE
        | 700 // CUDA_ERROR_ILLEGAL_ADDRESS
        | 702 // CUDA_ERROR_LAUNCH_TIMEOUT
        | 714 // CUDA_ERROR_HARDWARE_STACK_ERROR
        | 715 // CUDA_ERROR_ILLEGAL_INSTRUCTION
        | 716 // CUDA_ERROR_MISALIGNED_ADDRESS
        | 717 // CUDA_ERROR_INVALID_ADDRESS_SPACE
        | 718 // CUDA_ERROR_INVALID_PC
        | 719 // CUDA_ERROR_LAUNCH_FAILED
    )
}

/// Whether `NPU_SERVING_CUDA_SYNC` asks for a synchronize after every launch.
pub fn sync_each_launch() -> bool {
    std::env::var(ENV_SYNC).is_ok_and(|v| v == "1")
}

/// One launch as a fault message names it; plain data, formatted only when a fault is reported
/// (recording it is on the path of every launch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Launch {
    /// A kernel with its grid, block and dynamic shared memory.
    Kernel {
        name: &'static str,
        grid: [u32; 3],
        block: [u32; 3],
        smem: u32,
    },
    /// A cuBLAS GEMM of these sizes.
    Gemm { m: usize, n: usize, k: usize },
}

impl std::fmt::Display for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Launch::Kernel {
                name,
                grid,
                block,
                smem,
            } => write!(f, "{name} grid {grid:?} block {block:?} smem {smem}"),
            Launch::Gemm { m, n, k } => write!(f, "cublasGemmEx m {m} n {n} k {k}"),
        }
    }
}

/// The first fatal error of a device, and the launches queued last.
#[derive(Default)]
pub struct Fault {
    first: Mutex<Option<String>>,
    recent: Mutex<VecDeque<Launch>>,
}

impl Fault {
    /// `Err` with the first fatal error once there was one.
    pub fn check(&self) -> Result<(), BackendError> {
        match self
            .first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            None => Ok(()),
            Some(first) => Err(BackendError::Device {
                backend: "cuda",
                message: format!(
                    "the CUDA context is unusable after an earlier device fault ({first}); \
                     restart the process (NPU_SERVING_CUDA_SYNC=1 names the kernel that faulted)"
                ),
            }),
        }
    }

    /// Whether a fatal error was seen.
    pub fn is_set(&self) -> bool {
        self.first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Records a launch (kernel name and grid) for fault messages.
    pub fn launched(&self, what: Launch) {
        let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() == RECENT {
            r.pop_front();
        }
        r.push_back(what);
    }

    /// Records a fatal error seen at `call` (the first one is kept) and returns the error to
    /// report now: it names the call and the launches queued last.
    pub fn fatal(&self, call: &str, error: &str) -> BackendError {
        let recent: Vec<String> = self
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(Launch::to_string)
            .collect();
        let what = if recent.is_empty() {
            format!("{call} failed: {error}")
        } else {
            format!(
                "{call} failed: {error}; kernels queued last, oldest first: {}",
                recent.join(", ")
            )
        };
        let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            tracing::error!("cuda: device fault, the context is now unusable: {what}");
            *first = Some(what.clone());
        }
        BackendError::Device {
            backend: "cuda",
            message: what,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_fault_is_kept_and_answers_every_later_call() {
        let f = Fault::default();
        assert!(f.check().is_ok());
        f.launched(Launch::Kernel {
            name: "rms_norm_f32",
            grid: [4, 1, 1],
            block: [256, 1, 1],
            smem: 0,
        });
        f.launched(Launch::Gemm { m: 8, n: 16, k: 32 });
        let e = f.fatal("cuStreamSynchronize", "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(
            e.to_string().contains(
                "rms_norm_f32 grid [4, 1, 1] block [256, 1, 1] smem 0, cublasGemmEx m 8 n 16 k 32"
            ),
            "{e}"
        );
        let _ = f.fatal("cuMemFreeAsync", "CUDA_ERROR_ILLEGAL_ADDRESS");
        let e = f.check().unwrap_err().to_string();
        assert!(e.contains("unusable"), "{e}");
        assert!(e.contains("cuStreamSynchronize failed"), "{e}");
        assert!(!e.contains("cuMemFreeAsync"), "{e}");
    }

    #[test]
    fn sticky_codes_are_the_context_killing_ones() {
        for c in [700, 716, 719, 214] {
            assert!(is_sticky(c));
        }
        for c in [1, 2, 200, 222, 701] {
            assert!(!is_sticky(c), "{c}");
        }
    }
}
