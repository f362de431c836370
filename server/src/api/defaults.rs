//! The model's own sampling defaults: what a Hugging Face model directory's
//! `generation_config.json` says of temperature, top_p, top_k, min_p, repetition_penalty and
//! max_new_tokens, applied to every request that does not set the field (vLLM's default
//! `--generation-config auto`); a request's own value always wins. Read and checked once at
//! start (`npu_serving.generation_config: ignore` leaves them out); a GGUF model has none.

use npu_hf::GenerationConfig;

/// Per-field defaults; `None` falls back to the server's own (temperature 1, top_p 1, top_k and
/// min_p off, repetition_penalty 1, `npu_serving.max_new_tokens_default`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    /// At least 0 (0 is greedy).
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// Positive.
    pub top_k: Option<u32>,
    /// In [0, 1].
    pub min_p: Option<f32>,
    /// Positive (1 is off).
    pub repetition_penalty: Option<f32>,
    /// At least 1 (bounded by the context as a request's own value is).
    pub max_new_tokens: Option<u32>,
}

impl SamplingDefaults {
    /// The defaults a `generation_config.json` gives, checked against the ranges a request's
    /// own fields must be in; an error names the file's key. (`do_sample: false` comes here as
    /// temperature 0, see `npu_hf::generation`.)
    pub fn from_generation_config(g: &GenerationConfig) -> Result<Self, String> {
        let d = Self {
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: g.top_k,
            min_p: g.min_p,
            repetition_penalty: g.repetition_penalty,
            max_new_tokens: g.max_new_tokens,
        };
        d.check()?;
        Ok(d)
    }

    fn check(&self) -> Result<(), String> {
        let floats = [
            (
                "temperature",
                self.temperature,
                "at least 0",
                0.0..=f32::MAX,
            ),
            ("top_p", self.top_p, "in (0, 1]", f32::MIN_POSITIVE..=1.0),
            ("min_p", self.min_p, "in [0, 1]", 0.0..=1.0),
            (
                "repetition_penalty",
                self.repetition_penalty,
                "positive",
                f32::MIN_POSITIVE..=f32::MAX,
            ),
        ];
        for (key, v, allowed, range) in floats {
            if let Some(v) = v.filter(|v| !range.contains(v)) {
                return Err(format!("{key}: {v} must be {allowed}"));
            }
        }
        if self.top_k == Some(0) {
            return Err("top_k: 0 must be positive (leave it out for no top-k)".into());
        }
        if self.max_new_tokens == Some(0) {
            return Err("max_new_tokens: 0 must be at least 1".into());
        }
        Ok(())
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The fields set, as `key=value` joined by commas (for the start-up log).
    pub fn describe(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut float = |k: &str, v: Option<f32>| {
            if let Some(v) = v {
                out.push(format!("{k}={v}"));
            }
        };
        float("temperature", self.temperature);
        float("top_p", self.top_p);
        float("min_p", self.min_p);
        float("repetition_penalty", self.repetition_penalty);
        if let Some(k) = self.top_k {
            out.push(format!("top_k={k}"));
        }
        if let Some(n) = self.max_new_tokens {
            out.push(format!("max_new_tokens={n}"));
        }
        out.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn from(v: serde_json::Value) -> Result<SamplingDefaults, String> {
        SamplingDefaults::from_generation_config(&GenerationConfig::from_json(&v).unwrap())
    }

    #[test]
    fn the_files_sampling_fields_become_defaults() {
        let d = from(
            json!({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1, "max_new_tokens": 64,
                            "eos_token_id": [1, 2], "do_sample": true}),
        )
        .unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: Some(0.05),
                repetition_penalty: Some(1.1),
                max_new_tokens: Some(64),
            }
        );
        assert_eq!(
            d.describe(),
            "temperature=0.6, top_p=0.95, min_p=0.05, repetition_penalty=1.1, top_k=20, \
             max_new_tokens=64"
        );
        // Token ids alone set no sampling default.
        assert!(from(json!({"eos_token_id": 2, "bos_token_id": 1}))
            .unwrap()
            .is_empty());
        // do_sample: false is greedy, whatever else the file says.
        let greedy = from(json!({"do_sample": false, "temperature": 0.7, "top_p": 0.8})).unwrap();
        assert_eq!(greedy.temperature, Some(0.0));
        assert_eq!(greedy.top_p, None);
    }

    #[test]
    fn values_out_of_a_requests_ranges_are_refused_naming_the_key() {
        let bad = SamplingDefaults {
            top_p: Some(1.5),
            ..SamplingDefaults::default()
        };
        assert!(bad.check().unwrap_err().starts_with("top_p:"));
        let bad = SamplingDefaults {
            top_k: Some(0),
            ..SamplingDefaults::default()
        };
        assert!(bad.check().unwrap_err().starts_with("top_k:"));
        let bad = SamplingDefaults {
            temperature: Some(f32::NAN),
            ..SamplingDefaults::default()
        };
        assert!(bad.check().unwrap_err().starts_with("temperature:"));
    }
}
