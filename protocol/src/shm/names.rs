//! Segment names: `/npu-serving-<owner pid>-<agent id>-<128 random bits in hex>`, unguessable
//! and carrying the owner's pid, so that segments a crashed run left behind can be found in
//! /dev/shm and removed once their owner is dead.

use std::io::Read;

use super::{unlink_name, ShmError};

/// Every segment name starts with this (after the leading '/').
pub const SEGMENT_PREFIX: &str = "npu-serving-";

/// Where POSIX shared memory objects show up as files (Linux).
const SHM_DIR: &str = "/dev/shm";

/// A fresh segment name for `agent_id`, owned by this process.
pub fn segment_name(agent_id: u32) -> Result<String, ShmError> {
    let mut bits = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bits))
        .map_err(|source| ShmError::Os {
            op: "read /dev/urandom",
            name: String::new(),
            source,
        })?;
    let hex: String = bits.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!(
        "/{SEGMENT_PREFIX}{}-{agent_id}-{hex}",
        std::process::id()
    ))
}

/// The owner pid in a segment name made by `segment_name` (with or without the leading '/').
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('/').unwrap_or(name);
    let rest = rest.strip_prefix(SEGMENT_PREFIX)?;
    let mut parts = rest.split('-');
    let pid = parts.next()?.parse().ok()?;
    let _agent: u32 = parts.next()?.parse().ok()?;
    let hex = parts.next()?;
    (hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) && parts.next().is_none())
        .then_some(pid)
}

/// Whether a process with this pid exists (a zombie counts as existing).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    // EPERM: it exists but belongs to someone else.
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the segments in /dev/shm named by `segment_name` whose owner process is dead, and
/// returns their names. Segments of live owners (including ours) and names of other shapes are
/// left alone; a segment we may not remove is skipped. Where /dev/shm does not exist, nothing is
/// done.
pub fn cleanup_stale_segments() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Ok(file_name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(pid) = owner_pid(&file_name) else {
            continue;
        };
        if pid_alive(pid) {
            continue;
        }
        let name = format!("/{file_name}");
        if unlink_name(&name).is_ok() {
            removed.push(name);
        }
    }
    removed
}
