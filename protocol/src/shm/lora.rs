//! An admission's LoRA adapter in the segment: its id (0: the base model) and its path, checked
//! when a plan is written and again when it is read.

use super::layout::RawAdmission;
use super::ShmError;
use crate::step::{LoraRequest, MAX_LORA_PATH};

/// An admission's adapter must have an id (0 is the base model) and a path that fits.
pub(super) fn check_lora(slot: u32, id: u32, path: &str) -> Result<(), ShmError> {
    if id == 0 {
        return Err(ShmError::BadPlan(format!(
            "slot {slot}: LoRA adapter id 0 (0 is the base model)"
        )));
    }
    if path.is_empty() || path.len() > MAX_LORA_PATH {
        return Err(ShmError::BadPlan(format!(
            "slot {slot}: LoRA adapter path of {} bytes (1..={MAX_LORA_PATH})",
            path.len()
        )));
    }
    Ok(())
}

/// The adapter of a stored admission: none with id 0 (and then no path), else the id and its
/// path, which must be UTF-8 within the array.
pub(super) fn lora_from_raw(raw: &RawAdmission) -> Result<Option<LoraRequest>, ShmError> {
    let len = raw.lora_path_len as usize;
    if raw.lora_id == 0 {
        if len != 0 {
            return Err(ShmError::Corrupt(format!(
                "slot {}: a LoRA path of {len} bytes with adapter id 0",
                raw.slot
            )));
        }
        return Ok(None);
    }
    if len == 0 || len > MAX_LORA_PATH {
        return Err(ShmError::Corrupt(format!(
            "slot {}: LoRA adapter {} with a path of {len} bytes",
            raw.slot, raw.lora_id
        )));
    }
    let path = std::str::from_utf8(&raw.lora_path[..len]).map_err(|e| {
        ShmError::Corrupt(format!(
            "slot {}: LoRA adapter {}'s path is not UTF-8: {e}",
            raw.slot, raw.lora_id
        ))
    })?;
    Ok(Some(LoraRequest {
        id: raw.lora_id,
        path: path.to_string(),
    }))
}
