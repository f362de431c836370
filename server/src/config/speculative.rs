//! `npu_serving.speculative`: n-gram (prompt-lookup) speculative decoding. A mapping of its
//! settings (absent keys take their defaults, `{}` turns it on with all of them), or absent for
//! off; each setting checked by the scheduler's own validation and named by its full key.

use npu_scheduler::{SchedError, SpeculativeConfig};

use super::error::ConfigError;
use super::reader::{Section, Unknown};

/// The one drafting method built: drafts looked up in the request's own tokens.
const METHOD: &str = "ngram";

pub(super) fn speculative(
    s: &mut Section,
    unknown: Unknown,
) -> Result<Option<SpeculativeConfig>, ConfigError> {
    if s.raw("speculative").is_none() {
        return Ok(None);
    }
    let mut sec = s.section("speculative")?;
    if let Some(m) = sec.string("method")? {
        if m != METHOD {
            return Err(ConfigError::not_allowed(
                &sec.key_path("method"),
                format!("{m:?}"),
                "ngram (drafts looked up in the request's prompt and output; no draft model)",
            ));
        }
    }
    let mut c = SpeculativeConfig::default();
    for (key, field) in [
        ("num_speculative_tokens", &mut c.num_speculative_tokens),
        ("prompt_lookup_max", &mut c.prompt_lookup_max),
        ("prompt_lookup_min", &mut c.prompt_lookup_min),
        ("max_batch", &mut c.max_batch),
    ] {
        if let Some(v) = sec.u64(key)? {
            *field = usize::try_from(v).unwrap_or(usize::MAX);
        }
    }
    if let Some(v) = sec.f64("min_acceptance")? {
        c.min_acceptance = v;
    }
    let path = sec.key_path("");
    sec.finish(&mut Vec::new(), unknown)?;
    c.validate().map_err(|e| match e {
        SchedError::InvalidConfig { field, reason } => ConfigError::not_allowed(
            &format!("{path}{}", field.trim_start_matches("speculative.")),
            reason,
            "see docs/configuration.md (npu_serving.speculative)",
        ),
        other => ConfigError::not_allowed(&path, other, "valid settings"),
    })?;
    Ok(Some(c))
}
