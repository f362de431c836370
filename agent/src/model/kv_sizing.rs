//! Sizing the paged KV pool from the memory the device has free once the weights and step
//! buffers are placed (`npu_serving.kv_cache_memory_fraction`): how many whole blocks a fraction
//! of that memory holds, at most a cap, and the error when not even one fits.

pub use npu_protocol::agent::MAX_KV_MEMORY_FRACTION;

use super::ModelError;

/// Blocks of `block_bytes` that `fraction` of `free` bytes holds, at most `max_blocks`; an error
/// naming the setting when the fraction is out of range or not one block fits.
pub fn blocks_for_memory(
    free: u64,
    fraction: f64,
    block_bytes: usize,
    max_blocks: usize,
) -> Result<usize, ModelError> {
    if !(fraction > 0.0 && fraction <= MAX_KV_MEMORY_FRACTION) {
        return Err(ModelError::BadOptions(format!(
            "kv_cache_memory_fraction is {fraction}; allowed: above 0, at most \
             {MAX_KV_MEMORY_FRACTION}"
        )));
    }
    if block_bytes == 0 || max_blocks == 0 {
        return Err(ModelError::BadOptions(format!(
            "an empty KV block ({block_bytes} bytes) or cap ({max_blocks} blocks)"
        )));
    }
    let budget = (free as f64 * fraction).floor() as u64;
    let blocks = (budget / block_bytes as u64).min(max_blocks as u64) as usize;
    if blocks == 0 {
        return Err(ModelError::OutOfMemory(format!(
            "kv_cache_memory_fraction {fraction} of the {free} bytes free after loading the \
             weights is {budget} bytes, less than one KV block ({block_bytes} bytes): raise \
             npu_serving.kv_cache_memory_fraction or free device memory"
        )));
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_blocks_of_the_fraction_at_most_the_cap() {
        // 1000 bytes free, half of it, blocks of 64 bytes: 500 / 64 = 7 whole blocks.
        assert_eq!(blocks_for_memory(1000, 0.5, 64, 100).unwrap(), 7);
        assert_eq!(blocks_for_memory(1000, 0.5, 64, 3).unwrap(), 3);
        assert_eq!(
            blocks_for_memory(1 << 40, 0.9, 368_640, 1 << 16).unwrap(),
            1 << 16
        );
        // 80 GB free, 0.9 of it, 2 MiB blocks (an 8B-class model at block 16).
        let n = blocks_for_memory(80_000_000_000, 0.9, 2 << 20, 1 << 16).unwrap();
        assert_eq!(n, (72_000_000_000u64 / (2 << 20)) as usize);
    }

    #[test]
    fn no_block_fits_names_the_setting() {
        let e = blocks_for_memory(1000, 0.01, 64, 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("npu_serving.kv_cache_memory_fraction"), "{e}");
        assert!(e.contains("less than one KV block (64 bytes)"), "{e}");
    }

    #[test]
    fn a_fraction_out_of_range_is_refused() {
        for f in [0.0, -0.5, 1.0, 1.5, f64::NAN] {
            let e = blocks_for_memory(1000, f, 64, 100).unwrap_err().to_string();
            assert!(e.contains("kv_cache_memory_fraction"), "{f}: {e}");
        }
    }
}
