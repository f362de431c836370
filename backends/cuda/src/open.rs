//! Opening the CUDA libraries a `CudaBackend` needs: the driver's supported CUDA version, then
//! NVRTC and cuBLAS of the newest major it runs, each missing one named with how to get it.

use std::path::PathBuf;
use std::sync::Arc;

use npu_backend::BackendError;

use crate::backend::NAME;
use crate::cublas::{self, CublasApi};
use crate::libs::{self, CudaLib};
use crate::nvrtc::{self, NvrtcApi};

pub(crate) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

/// NVRTC, cuBLAS and the driver's CUDA version (major, minor), as `open_libraries` found them.
pub type Libraries = (Arc<NvrtcApi>, Arc<CublasApi>, (u32, u32));

/// Loads the driver library, reads the CUDA version it supports, and loads NVRTC and cuBLAS of
/// the newest major (13, else 12) that driver runs; `MissingLibrary` names each library missing
/// and how to get it (CUDA 13's and CUDA 12's packages).
pub fn open_libraries(dirs: &[PathBuf]) -> Result<Libraries, BackendError> {
    let missing = |message: String| BackendError::MissingLibrary {
        backend: NAME,
        message,
    };
    libs::require_driver(dirs).map_err(missing)?;
    let driver = std::panic::catch_unwind(libs::driver_version)
        .map_err(|p| BackendError::Device {
            backend: NAME,
            message: format!("the NVIDIA driver library failed: {}", panic_message(p)),
        })?
        .map_err(|message| BackendError::Device {
            backend: NAME,
            message,
        })?;
    if driver.0 < 12 {
        return Err(BackendError::Device {
            backend: NAME,
            message: format!(
                "this machine's NVIDIA driver supports CUDA {}.{}; the CUDA backend needs a \
                 driver for CUDA 12 (525 or newer) or CUDA 13 (580 or newer)",
                driver.0, driver.1
            ),
        });
    }
    let search = libs::Search::with_dirs(dirs.to_vec());
    let n = nvrtc::api(&search, Some(driver.0));
    let b = cublas::api(&search, Some(driver.0));
    match (n, b) {
        (Ok(n), Ok(b)) => Ok((n, b, driver)),
        (n, b) => {
            let mut why = Vec::new();
            for (lib, e) in [(CudaLib::Nvrtc, n.err()), (CudaLib::Cublas, b.err())] {
                if let Some(e) = e {
                    why.push(format!("{e}. {}", lib.how_to_get()));
                }
            }
            Err(missing(format!(
                "{} (the driver supports CUDA {}.{}). A directory outside those paths is named \
                 with NPU_SERVING_CUDA_LIB_DIR.",
                why.join(". "),
                driver.0,
                driver.1
            )))
        }
    }
}
