//! Request datasets: Alpaca JSON (as performance_serving reads it), ShareGPT JSON, JSONL prompts,
//! and a built-in synthetic dataset with chosen input/output length distributions.

use std::path::Path;

use rand::Rng;
use rand_distr::{Distribution, Exp, Normal};
use serde_json::Value;

use crate::error::BenchError;
use crate::tokens::TokenCounter;

/// One request to send: the prompt and how many tokens to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub prompt: String,
    /// Prompt length in the model's tokens.
    pub prompt_tokens: usize,
    pub max_new_tokens: usize,
}

/// How many tokens a dataset entry asks for, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputSpec {
    /// The reference answer; its token count is the request's max_new_tokens.
    Text(String),
    /// An explicit token count.
    Tokens(usize),
    /// Nothing given: the run's default applies.
    Unspecified,
}

/// A dataset entry as read from the file.
#[derive(Debug, Clone, PartialEq)]
pub struct RawSample {
    pub prompt: String,
    pub output: OutputSpec,
}

/// Dataset file layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetFormat {
    /// Decide from the extension (.jsonl) and the first entry's keys.
    Auto,
    /// `[{"instruction", "input", "output"}]`.
    Alpaca,
    /// `[{"conversations": [{"from": "human"|"gpt", "value"}]}]`.
    Sharegpt,
    /// One JSON value per line: a string, or `{"prompt", "output" | "max_new_tokens" | ...}`.
    Jsonl,
}

fn dataset_err(path: &Path, message: impl Into<String>) -> BenchError {
    BenchError::Dataset {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads a dataset file into raw samples (no tokenization yet).
pub fn read_dataset(path: &Path, format: DatasetFormat) -> Result<Vec<RawSample>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| dataset_err(path, e.to_string()))?;
    let is_jsonl_ext = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl"));
    let samples = match format {
        DatasetFormat::Jsonl => parse_jsonl(&text).map_err(|m| dataset_err(path, m))?,
        DatasetFormat::Auto if is_jsonl_ext => {
            parse_jsonl(&text).map_err(|m| dataset_err(path, m))?
        }
        _ => {
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| dataset_err(path, format!("not valid JSON: {e}")))?;
            let fmt = if format == DatasetFormat::Auto {
                detect_format(&v).map_err(|m| dataset_err(path, m))?
            } else {
                format
            };
            match fmt {
                DatasetFormat::Alpaca => parse_alpaca(&v),
                DatasetFormat::Sharegpt => parse_sharegpt(&v),
                _ => parse_prompt_array(&v),
            }
            .map_err(|m| dataset_err(path, m))?
        }
    };
    if samples.is_empty() {
        return Err(dataset_err(path, "no usable entries"));
    }
    Ok(samples)
}

fn detect_format(v: &Value) -> Result<DatasetFormat, String> {
    let first = v
        .as_array()
        .ok_or("expected a JSON array of entries (or use a .jsonl file)")?
        .first()
        .ok_or("the array is empty")?;
    if first.get("conversations").is_some() {
        Ok(DatasetFormat::Sharegpt)
    } else if first.get("instruction").is_some() {
        Ok(DatasetFormat::Alpaca)
    } else if first.is_string() || first.get("prompt").is_some() {
        Ok(DatasetFormat::Jsonl)
    } else {
        Err(
            "cannot tell the format from the first entry: expected \"instruction\" (Alpaca), \
             \"conversations\" (ShareGPT) or \"prompt\""
                .to_string(),
        )
    }
}

fn str_field<'a>(entry: &'a Value, key: &str, index: usize) -> Result<&'a str, String> {
    match entry.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(Value::Null) | None => Ok(""),
        Some(other) => Err(format!(
            "entry {index}: \"{key}\" must be a string, found {other}"
        )),
    }
}

/// Alpaca: prompt = instruction + ":" + input when input is non-empty, else the instruction;
/// max_new_tokens from the reference output.
pub fn parse_alpaca(v: &Value) -> Result<Vec<RawSample>, String> {
    let entries = v.as_array().ok_or("Alpaca data must be a JSON array")?;
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if !e.is_object() {
            return Err(format!("entry {i} is not an object"));
        }
        let instruction = str_field(e, "instruction", i)?;
        let input = str_field(e, "input", i)?;
        let output = str_field(e, "output", i)?;
        let prompt = if input.is_empty() {
            instruction.to_string()
        } else {
            format!("{instruction}:{input}")
        };
        if prompt.is_empty() {
            continue;
        }
        out.push(RawSample {
            prompt,
            output: OutputSpec::Text(output.to_string()),
        });
    }
    Ok(out)
}

/// ShareGPT: the first human turn is the prompt, the reply after it sets max_new_tokens.
/// Conversations without a human turn followed by a reply are skipped.
pub fn parse_sharegpt(v: &Value) -> Result<Vec<RawSample>, String> {
    let entries = v.as_array().ok_or("ShareGPT data must be a JSON array")?;
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let Some(turns) = e.get("conversations").and_then(Value::as_array) else {
            return Err(format!("entry {i} has no \"conversations\" array"));
        };
        fn role(t: &Value) -> &str {
            t.get("from").and_then(Value::as_str).unwrap_or("")
        }
        fn value(t: &Value) -> &str {
            t.get("value").and_then(Value::as_str).unwrap_or("")
        }
        let Some(pos) = turns
            .iter()
            .position(|t| matches!(role(t), "human" | "user"))
        else {
            continue;
        };
        let Some(reply) = turns.get(pos + 1) else {
            continue;
        };
        let prompt = value(&turns[pos]);
        if prompt.is_empty() {
            continue;
        }
        out.push(RawSample {
            prompt: prompt.to_string(),
            output: OutputSpec::Text(value(reply).to_string()),
        });
    }
    Ok(out)
}

/// One prompt entry: a string, or an object with "prompt" (or "text"/"input") and optionally
/// "output", or a token count in "max_new_tokens" / "max_tokens" / "output_len".
fn prompt_entry(e: &Value, where_: &str) -> Result<RawSample, String> {
    if let Some(s) = e.as_str() {
        return Ok(RawSample {
            prompt: s.to_string(),
            output: OutputSpec::Unspecified,
        });
    }
    if !e.is_object() {
        return Err(format!("{where_}: expected a string or an object"));
    }
    let prompt = ["prompt", "text", "input"]
        .iter()
        .find_map(|k| e.get(*k).and_then(Value::as_str))
        .ok_or_else(|| format!("{where_}: no \"prompt\" string"))?;
    let count = ["max_new_tokens", "max_tokens", "output_len"]
        .iter()
        .find_map(|k| e.get(*k));
    let output = match (count, e.get("output").and_then(Value::as_str)) {
        (Some(n), _) => {
            let n = n
                .as_u64()
                .ok_or_else(|| format!("{where_}: token count must be a positive integer"))?;
            OutputSpec::Tokens(n as usize)
        }
        (None, Some(text)) => OutputSpec::Text(text.to_string()),
        (None, None) => OutputSpec::Unspecified,
    };
    Ok(RawSample {
        prompt: prompt.to_string(),
        output,
    })
}

/// JSONL: one prompt entry per non-empty line.
pub fn parse_jsonl(text: &str) -> Result<Vec<RawSample>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let where_ = format!("line {}", n + 1);
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("{where_}: not JSON: {e}"))?;
        let s = prompt_entry(&v, &where_)?;
        if !s.prompt.is_empty() {
            out.push(s);
        }
    }
    Ok(out)
}

/// A JSON array of prompt entries (strings or objects), as in JSONL.
fn parse_prompt_array(v: &Value) -> Result<Vec<RawSample>, String> {
    let entries = v.as_array().ok_or("expected a JSON array")?;
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let s = prompt_entry(e, &format!("entry {i}"))?;
        if !s.prompt.is_empty() {
            out.push(s);
        }
    }
    Ok(out)
}

/// Tokenizes raw samples: prompt lengths, and max_new_tokens from the reference output's token
/// count (at least 1), an explicit count, or `default_output_len`. `override_output_len`
/// replaces every count when given.
pub fn resolve_samples(
    raw: Vec<RawSample>,
    counter: &TokenCounter,
    default_output_len: usize,
    override_output_len: Option<usize>,
) -> Result<Vec<Sample>, BenchError> {
    raw.into_iter()
        .map(|r| {
            let prompt_tokens = counter
                .prompt_tokens(&r.prompt)
                .map_err(BenchError::Tokenizer)?;
            let max_new_tokens = match (override_output_len, &r.output) {
                (Some(n), _) => n,
                (None, OutputSpec::Tokens(n)) => *n,
                (None, OutputSpec::Text(t)) => {
                    counter.output_tokens(t).map_err(BenchError::Tokenizer)?
                }
                (None, OutputSpec::Unspecified) => default_output_len,
            }
            .max(1);
            Ok(Sample {
                prompt: r.prompt,
                prompt_tokens,
                max_new_tokens,
            })
        })
        .collect()
}

/// A distribution of token lengths for the synthetic dataset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthDist {
    /// Always N.
    Fixed(usize),
    /// Uniform integer in [a, b].
    Uniform(usize, usize),
    /// Normal(mean, std), rounded, at least 1.
    Normal(f64, f64),
    /// Exponential with this mean, rounded, at least 1.
    Exponential(f64),
}

impl std::str::FromStr for LengthDist {
    type Err = String;

    /// `fixed:N`, `uniform:A,B`, `normal:MEAN,STD`, `exp:MEAN`, or a bare `N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (kind, args) = s.split_once(':').unwrap_or(("fixed", s));
        let nums: Vec<f64> = args
            .split(',')
            .map(|a| a.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("{s:?}: numbers expected after ':'"))?;
        let positive = |x: f64| x.is_finite() && x >= 1.0;
        match (kind, nums.as_slice()) {
            ("fixed", [n]) if positive(*n) => Ok(LengthDist::Fixed(*n as usize)),
            ("uniform", [a, b]) if positive(*a) && b >= a => {
                Ok(LengthDist::Uniform(*a as usize, *b as usize))
            }
            ("normal", [m, sd]) if positive(*m) && sd.is_finite() && *sd >= 0.0 => {
                Ok(LengthDist::Normal(*m, *sd))
            }
            ("exp", [m]) if positive(*m) => Ok(LengthDist::Exponential(*m)),
            _ => Err(format!(
                "{s:?}: expected fixed:N, uniform:A,B (1 <= A <= B), normal:MEAN,STD or exp:MEAN \
                 with lengths >= 1"
            )),
        }
    }
}

impl LengthDist {
    /// One length, at least 1.
    pub fn sample<R: Rng>(&self, rng: &mut R) -> usize {
        let x = match *self {
            LengthDist::Fixed(n) => return n.max(1),
            LengthDist::Uniform(a, b) => return rng.gen_range(a..=b).max(1),
            LengthDist::Normal(m, sd) => Normal::new(m, sd).map(|d| d.sample(rng)).unwrap_or(m),
            LengthDist::Exponential(m) => Exp::new(1.0 / m).map(|d| d.sample(rng)).unwrap_or(m),
        };
        (x.round().max(1.0)) as usize
    }
}

/// Words the synthetic prompts are drawn from.
const WORDS: &[&str] = &[
    "river", "engine", "garden", "signal", "market", "window", "forest", "theory", "silver",
    "harbor", "pencil", "canvas", "rocket", "meadow", "ladder", "planet", "bridge", "coffee",
    "winter", "summer", "violin", "marble", "socket", "kernel", "mirror", "pepper", "copper",
    "island", "button", "candle", "desert", "falcon", "glacier", "helmet", "jacket", "lantern",
    "magnet", "needle", "orchard", "paddle", "quartz", "ribbon", "saddle", "tunnel", "velvet",
    "walnut", "yellow", "zephyr", "anchor", "basket", "cactus", "dragon", "ember", "feather",
    "granite", "hollow", "ivory", "jungle", "kettle", "lemon", "mosaic", "nectar", "oyster",
    "puzzle", "quiver", "raven", "shadow", "thunder", "umbrella", "valley", "whisper", "yonder",
    "explain", "describe", "compare", "why", "how", "the", "a", "of", "and", "with", "under",
    "over", "between", "quickly", "slowly", "bright", "quiet", "ancient", "modern", "small",
    "large", "story", "question", "answer", "reason", "number", "7", "42", "2024", "seven",
];

/// The built-in synthetic dataset: `n` prompts of exactly the sampled token length (random
/// words cut on a token boundary) and sampled output lengths, reproducible from `seed`.
pub fn synthetic(
    n: usize,
    input: LengthDist,
    output: LengthDist,
    seed: u64,
    counter: &TokenCounter,
) -> Result<Vec<Sample>, BenchError> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5EED_DA7A);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let want = input.sample(&mut rng);
        // Words are at least one token each, so `want` words always suffice.
        let words: Vec<&str> = (0..want)
            .map(|_| WORDS[rng.gen_range(0..WORDS.len())])
            .collect();
        let text = words.join(" ");
        let prompt = counter
            .truncate_to_tokens(&text, want)
            .map_err(BenchError::Tokenizer)?;
        let prompt_tokens = counter
            .prompt_tokens(&prompt)
            .map_err(BenchError::Tokenizer)?;
        out.push(Sample {
            prompt,
            prompt_tokens,
            max_new_tokens: output.sample(&mut rng),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn alpaca_with_and_without_input() {
        let v = json!([
            {"instruction": "Give three tips", "input": "", "output": "1. Eat."},
            {"instruction": "Translate", "input": "bonjour", "output": "hello"},
            {"instruction": "", "input": "", "output": "skipped"}
        ]);
        let s = parse_alpaca(&v).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].prompt, "Give three tips");
        assert_eq!(s[1].prompt, "Translate:bonjour");
        assert_eq!(s[1].output, OutputSpec::Text("hello".into()));
        assert!(parse_alpaca(&json!([{"instruction": 3}])).is_err());
    }

    #[test]
    fn sharegpt_first_human_turn_and_reply() {
        let v = json!([
            {"id": "a", "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "hi?"},
                {"from": "gpt", "value": "hello there"},
                {"from": "human", "value": "more"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "no reply"}]},
            {"id": "c", "conversations": []}
        ]);
        let s = parse_sharegpt(&v).unwrap();
        assert_eq!(
            s,
            vec![RawSample {
                prompt: "hi?".into(),
                output: OutputSpec::Text("hello there".into())
            }]
        );
        assert_eq!(detect_format(&v).unwrap(), DatasetFormat::Sharegpt);
    }

    #[test]
    fn jsonl_variants() {
        let text = "\"plain prompt\"\n\n{\"prompt\": \"p2\", \"max_tokens\": 9}\n\
                    {\"text\": \"p3\", \"output\": \"abc\"}\n{\"prompt\": \"p4\"}\n";
        let s = parse_jsonl(text).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].output, OutputSpec::Unspecified);
        assert_eq!(s[1].output, OutputSpec::Tokens(9));
        assert_eq!(s[2].prompt, "p3");
        assert_eq!(s[2].output, OutputSpec::Text("abc".into()));
        let err = parse_jsonl("{\"prompt\": \"x\"}\n{oops}\n").unwrap_err();
        assert!(err.starts_with("line 2"), "{err}");
        assert!(parse_jsonl("{\"prompt\": \"x\", \"max_tokens\": -1}").is_err());
    }

    #[test]
    fn read_dataset_detects_and_reports() {
        let dir = std::env::temp_dir().join(format!("bench-ds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let alpaca = dir.join("a.json");
        std::fs::write(&alpaca, r#"[{"instruction":"I","input":"x","output":"o"}]"#).unwrap();
        let s = read_dataset(&alpaca, DatasetFormat::Auto).unwrap();
        assert_eq!(s[0].prompt, "I:x");
        let jsonl = dir.join("p.jsonl");
        std::fs::write(&jsonl, "\"a\"\n\"b\"\n").unwrap();
        assert_eq!(read_dataset(&jsonl, DatasetFormat::Auto).unwrap().len(), 2);
        let bad = dir.join("bad.json");
        std::fs::write(&bad, r#"[{"foo": 1}]"#).unwrap();
        let e = read_dataset(&bad, DatasetFormat::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot tell the format"), "{e}");
        let missing = read_dataset(&dir.join("none.json"), DatasetFormat::Auto);
        assert!(missing.is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn length_dist_parsing_and_sampling() {
        use rand::SeedableRng;
        assert_eq!("fixed:8".parse::<LengthDist>(), Ok(LengthDist::Fixed(8)));
        assert_eq!("12".parse::<LengthDist>(), Ok(LengthDist::Fixed(12)));
        assert_eq!(
            "uniform:4,9".parse::<LengthDist>(),
            Ok(LengthDist::Uniform(4, 9))
        );
        assert!("uniform:9,4".parse::<LengthDist>().is_err());
        assert!("normal:0,1".parse::<LengthDist>().is_err());
        assert!("gauss:3".parse::<LengthDist>().is_err());
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..200 {
            let x = LengthDist::Uniform(4, 9).sample(&mut rng);
            assert!((4..=9).contains(&x));
            assert!(LengthDist::Normal(2.0, 50.0).sample(&mut rng) >= 1);
        }
        let mean = (0..4000)
            .map(|_| LengthDist::Exponential(50.0).sample(&mut rng) as f64)
            .sum::<f64>()
            / 4000.0;
        assert!((mean - 50.0).abs() < 5.0, "mean {mean}");
    }
}
