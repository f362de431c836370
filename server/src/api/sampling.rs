//! Checks shared by both front ends: sampling parameter ranges, the max-new-tokens limit, the
//! prompt length against the context, seeds, and token texts for responses.

use std::hash::{BuildHasher, Hasher};

use npu_protocol::MAX_TOP_N;
use npu_tokenizer::Tokenizer;

use super::error::ApiError;
use super::fields::Fields;
use super::ApiSettings;
use crate::engine::RequestId;

/// temperature >= 0 (0 = greedy).
pub(crate) fn temperature(f: &Fields, key: &str) -> Result<Option<f32>, ApiError> {
    match f.f32(key)? {
        Some(t) if t < 0.0 => Err(range(f, key, t, ">= 0 (0 = greedy)")),
        other => Ok(other),
    }
}

/// top_p in (0, 1].
pub(crate) fn top_p(f: &Fields, key: &str) -> Result<Option<f32>, ApiError> {
    match f.f32(key)? {
        Some(p) if !(p > 0.0 && p <= 1.0) => Err(range(f, key, p, "in (0, 1]")),
        other => Ok(other),
    }
}

/// top_k >= 0 (0 disables); `minus_one_disables` accepts -1 as "disabled" too (OpenAI/vLLM).
pub(crate) fn top_k(
    f: &Fields,
    key: &str,
    minus_one_disables: bool,
) -> Result<Option<u32>, ApiError> {
    match f.i64(key)? {
        None => Ok(None),
        Some(-1) if minus_one_disables => Ok(Some(0)),
        Some(k) if k < 0 => Err(range(
            f,
            key,
            k,
            if minus_one_disables {
                ">= 0 (or -1 to disable)"
            } else {
                ">= 0 (0 disables)"
            },
        )),
        Some(k) => Ok(Some(u32::try_from(k).unwrap_or(u32::MAX))),
    }
}

/// min_p in [0, 1].
pub(crate) fn min_p(f: &Fields, key: &str) -> Result<Option<f32>, ApiError> {
    match f.f32(key)? {
        Some(p) if !(0.0..=1.0).contains(&p) => Err(range(f, key, p, "in [0, 1]")),
        other => Ok(other),
    }
}

/// repetition_penalty > 0 (1 disables).
pub(crate) fn repetition_penalty(f: &Fields, key: &str) -> Result<Option<f32>, ApiError> {
    match f.f32(key)? {
        Some(p) if p <= 0.0 => Err(range(f, key, p, "> 0 (1 disables)")),
        other => Ok(other),
    }
}

/// presence/frequency penalties in [-2, 2].
pub(crate) fn penalty(f: &Fields, key: &str) -> Result<Option<f32>, ApiError> {
    match f.f32(key)? {
        Some(p) if !(-2.0..=2.0).contains(&p) => Err(range(f, key, p, "in [-2, 2]")),
        other => Ok(other),
    }
}

/// Number of alternatives to report per token: 0..=MAX_TOP_N.
pub(crate) fn top_n(f: &Fields, key: &str) -> Result<Option<u32>, ApiError> {
    Ok(f.int_in(key, 0, MAX_TOP_N as i64)?.map(|n| n as u32))
}

/// max_new_tokens in 1..=max_model_len-1; the config's default when absent (the engine stops
/// earlier when the context fills up).
pub(crate) fn max_new_tokens(f: &Fields, key: &str, s: &ApiSettings) -> Result<u32, ApiError> {
    let limit = s.max_model_len.saturating_sub(1).max(1);
    match f.i64(key)? {
        None => Ok(s.max_new_tokens_default.min(limit)),
        Some(n) if n < 1 || n > i64::from(limit) => {
            let name = f.name(key);
            Err(ApiError::invalid(
                &name,
                format!(
                    "{name} must be in 1..={limit} (the context is {} tokens), got {n}",
                    s.max_model_len
                ),
            ))
        }
        Some(n) => Ok(n as u32),
    }
}

/// The prompt is not empty and leaves room for one generated token under every length limit
/// (the server refuses at start a KV pool that could not hold such a sequence), so a request
/// that passes can always run.
pub(crate) fn check_prompt(ids: &[u32], field: &str, s: &ApiSettings) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("{field} is empty: give a prompt"),
        ));
    }
    let (limit, why) = s.prompt_limit();
    if ids.len() > limit as usize {
        // OpenAI's code for it, which clients (LangChain, LiteLLM, agent tools) look for.
        let mut e = ApiError::invalid(
            field,
            format!(
                "{field} has {} tokens, more than the limit of {limit} ({why}); this model's \
                 maximum context length is {} tokens",
                ids.len(),
                s.max_model_len,
            ),
        );
        e.code = Some("context_length_exceeded");
        return Err(e);
    }
    Ok(())
}

/// Token ids given directly must be in the vocabulary.
pub(crate) fn check_token_ids(ids: &[u32], field: &str, vocab: usize) -> Result<(), ApiError> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(ApiError::invalid(
            field,
            format!(
                "{field}[{i}] = {} is not a token id (vocabulary size {vocab})",
                ids[i]
            ),
        )),
        None => Ok(()),
    }
}

/// A seed for a request that gave none.
pub(crate) fn random_seed(id: RequestId) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(id);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// The text of one token as it would print (special tokens as their text).
pub(crate) fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode_continuation(&[id], false)
}

fn range(f: &Fields, key: &str, v: impl std::fmt::Display, allowed: &str) -> ApiError {
    let name = f.name(key);
    ApiError::invalid(&name, format!("{name} must be {allowed}, got {v}"))
}
