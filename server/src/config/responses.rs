//! `npu_serving.responses_store_size` and `npu_serving.responses_ttl_s`: the bounded in-memory
//! store of the OpenAI Responses API (`POST /v1/responses` with `store`, read back by
//! `GET /v1/responses/{id}` and continued by `previous_response_id`). The oldest response is
//! evicted first when the store is full; a response older than the TTL is gone.

use super::error::ConfigError;
use super::reader::Section;

/// Most responses the store may be asked to hold.
pub const MAX_RESPONSES_STORE_SIZE: u64 = 1_000_000;
/// Longest time to live of a stored response: 30 days.
pub const MAX_RESPONSES_TTL_S: u64 = 30 * 24 * 3600;

/// The Responses API store's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponsesConfig {
    /// Most stored responses (oldest evicted first).
    pub store_size: usize,
    /// Seconds a stored response lives.
    pub ttl_s: u64,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            store_size: 1000,
            ttl_s: 3600,
        }
    }
}

pub(super) fn responses(s: &mut Section) -> Result<ResponsesConfig, ConfigError> {
    let mut c = ResponsesConfig::default();
    if let Some(v) = s.u64("responses_store_size")? {
        if !(1..=MAX_RESPONSES_STORE_SIZE).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("responses_store_size"),
                v,
                format!(
                    "1..={MAX_RESPONSES_STORE_SIZE} (responses kept for GET /v1/responses/{{id}} \
                     and previous_response_id; requests may send store: false)"
                ),
            ));
        }
        c.store_size = v as usize;
    }
    if let Some(v) = s.u64("responses_ttl_s")? {
        if !(1..=MAX_RESPONSES_TTL_S).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("responses_ttl_s"),
                v,
                format!("1..={MAX_RESPONSES_TTL_S} (seconds a stored response is kept)"),
            ));
        }
        c.ttl_s = v;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use crate::config::ServerConfig;

    #[test]
    fn store_bounds_are_read_and_bad_values_name_the_key() {
        let c = ServerConfig::from_yaml_str("npu_serving: {}\n").unwrap();
        assert_eq!(c.npu_serving.responses, super::ResponsesConfig::default());
        let c = ServerConfig::from_yaml_str(
            "npu_serving:\n  responses_store_size: 5\n  responses_ttl_s: 60\n",
        )
        .unwrap();
        assert_eq!(
            (
                c.npu_serving.responses.store_size,
                c.npu_serving.responses.ttl_s
            ),
            (5, 60)
        );
        for (yaml, key) in [
            (
                "responses_store_size: 0",
                "npu_serving.responses_store_size",
            ),
            (
                "responses_store_size: -1",
                "npu_serving.responses_store_size",
            ),
            (
                "responses_store_size: lots",
                "npu_serving.responses_store_size",
            ),
            ("responses_ttl_s: 0", "npu_serving.responses_ttl_s"),
            (
                "responses_ttl_s: 99999999999",
                "npu_serving.responses_ttl_s",
            ),
        ] {
            let e = ServerConfig::from_yaml_str(&format!("npu_serving:\n  {yaml}\n")).unwrap_err();
            assert!(e.to_string().contains(key), "{yaml}: {e}");
        }
    }
}
