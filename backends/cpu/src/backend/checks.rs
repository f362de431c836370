//! The CPU backend's plain checks and host facts: the host's memory (/proc/meminfo), a host
//! tensor's row length checked against its data, and an op's attention geometry checked against
//! the KV pool's.

use npu_backend::{AttnGeometry, BackendError, HostTensor, KvSpec, MemInfo};

use super::buffer::bad;
use super::NAME;

/// Free and total memory of this host, from /proc/meminfo (MemAvailable, MemTotal).
pub(super) fn host_mem_info() -> Result<MemInfo, BackendError> {
    let err = |message: String| BackendError::Device {
        backend: NAME,
        message,
    };
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| err(format!("reading /proc/meminfo: {e}")))?;
    let field = |name: &str| -> Result<u64, BackendError> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or_else(|| err(format!("/proc/meminfo has no readable {name}")))
    };
    Ok(MemInfo {
        free: field("MemAvailable")?,
        total: field("MemTotal")?,
    })
}

/// The byte length of `rows` rows of `cols` values of `ty`, checked against the data.
pub(super) fn tensor_row_bytes(
    op: &'static str,
    t: &HostTensor<'_>,
) -> Result<usize, BackendError> {
    let rb =
        t.ty.row_bytes(t.cols)
            .ok_or_else(|| BackendError::Unsupported {
                backend: NAME,
                what: format!("rows of {} {} values", t.cols, t.ty.name()),
            })?;
    if rb.checked_mul(t.rows) != Some(t.data.len()) {
        return Err(bad(
            op,
            format!(
                "{} bytes for {} rows of {} {} values",
                t.data.len(),
                t.rows,
                t.cols,
                t.ty.name()
            ),
        ));
    }
    Ok(rb)
}

/// The geometry an op is given must be the one the KV pool was made for.
pub(super) fn check_geometry(
    op: &'static str,
    spec: &KvSpec,
    g: &AttnGeometry,
) -> Result<(), BackendError> {
    if g.n_kv_heads != spec.n_kv_heads || g.head_dim != spec.head_dim {
        return Err(bad(
            op,
            format!(
                "{} KV heads of {} for a pool of {} KV heads of {}",
                g.n_kv_heads, g.head_dim, spec.n_kv_heads, spec.head_dim
            ),
        ));
    }
    Ok(())
}
