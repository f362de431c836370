//! Reads each section of the YAML document into the typed config: llm-serving's keys that are
//! used, those accepted with a warning saying why they mean nothing here, and our `npu_serving`.
//! Unknown keys warn in llm-serving's sections (configs written for it may carry more) and are
//! errors in `npu_serving` (a misspelt setting of ours would silently keep its default);
//! strict loading makes every unknown key an error.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;

use npu_protocol::agent::{GraphCapture, KvCacheDtype, MAX_KV_MEMORY_FRACTION};
use npu_protocol::shm::group::MAX_GROUP_RANKS;
use npu_protocol::LongContextConfig;
use serde_yaml::Value;

use super::error::{ConfigError, ConfigWarning};
use super::reader::{describe, Section, Unknown};
use super::roles;
use super::{
    BatchingStrategy, DeviceKind, GenerationConfigMode, ModelConfig, NpuServingConfig, PaConfig,
    ServerConfig, ServingConfig,
};
use crate::kv_events::{KvEventsConfig, KvEventsEndpoint, DEFAULT_TOPIC};

/// Largest host KV pool per agent we accept (1 TiB).
const MAX_SWAP_SPACE_MB: u64 = 1 << 20;

/// Why `--strict-config` refuses a key.
const STRICT: &str = "--strict-config refuses unknown keys";
/// Why unknown keys of our own section are refused.
const OWN_SECTION: &str = "npu_serving holds this server's own settings and refuses unknown keys";

pub(super) fn parse(text: &str, strict: bool) -> Result<ServerConfig, ConfigError> {
    let llm = if strict {
        Unknown::Refuse(STRICT)
    } else {
        Unknown::Warn
    };
    check_flow_depth(text)?;
    let doc: Value = serde_yaml::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
    let doc = match doc {
        Value::Null => Value::Mapping(Default::default()),
        Value::Mapping(_) => doc,
        other => {
            return Err(ConfigError::NotAMapping {
                found: describe(&other),
            })
        }
    };
    let mut warnings = Vec::new();
    let mut top = Section::new("", Some(&doc))?;

    let mut s = top.section("model_config")?;
    let model_config = model_config(&mut s, &mut warnings)?;
    s.finish(&mut warnings, llm)?;

    let mut s = top.section("serving_config")?;
    let serving_config = serving_config(&mut s, &mut warnings)?;
    s.finish(&mut warnings, llm)?;

    let mut s = top.section("pa_config")?;
    let pa_config = pa_config(&mut s)?;
    s.finish(&mut warnings, llm)?;

    let mut s = top.section("tokenizer")?;
    s.ignored(
        "type",
        "the tokenizer is built from the GGUF model's metadata",
        &mut warnings,
    );
    s.ignored(
        "vocab_file",
        "the tokenizer is read from the GGUF file (or a tokenizer.json beside it)",
        &mut warnings,
    );
    s.finish(&mut warnings, llm)?;

    for key in ["basic_inputs", "extra_inputs", "warmup_inputs"] {
        top.ignored(
            key,
            "MindSpore model input classes; inputs are built by the model runner here",
            &mut warnings,
        );
    }
    top.ignored(
        "model_path",
        "MindSpore graph files; the model is a GGUF file or a Hugging Face directory \
         (npu_serving.model_file)",
        &mut warnings,
    );

    let mut s = top.section("npu_serving")?;
    let mut npu_serving = npu_serving(&mut s)?;
    npu_serving.responses = super::responses::responses(&mut s)?;
    npu_serving.sleep = super::sleep::sleep(&mut s)?;
    npu_serving.models = super::models::models(&mut s, npu_serving.model_file.is_some())?;
    npu_serving.long_context = long_context(&mut s, pa_config.block_size, strict)?;
    npu_serving.speculative = super::speculative::speculative(
        &mut s,
        Unknown::Refuse(if strict { STRICT } else { OWN_SECTION }),
    )?;
    npu_serving.access = super::access::access(
        &mut s,
        Unknown::Refuse(if strict { STRICT } else { OWN_SECTION }),
    )?;
    npu_serving.lora = super::lora::lora(&mut s)?;
    if npu_serving.lora.is_some() {
        super::lora::check_with(&npu_serving)?;
    }
    if npu_serving.speculative.is_some() && npu_serving.long_context.is_some() {
        return Err(ConfigError::not_allowed(
            "npu_serving.speculative",
            "set with npu_serving.long_context",
            "absent in long-context mode (drafts are not verified over its ring of blocks)",
        ));
    }
    roles::check_roles(&npu_serving.agent_roles, serving_config.agent_ports.len())?;
    if npu_serving.long_context.is_some() && roles::splits(&npu_serving.agent_roles) {
        // A long sequence's memory units live in the agent that ran it: it cannot be handed over.
        return Err(ConfigError::not_allowed(
            "npu_serving.agent_roles",
            "a prefill/decode split",
            "every agent `both` while npu_serving.long_context is set",
        ));
    }
    if npu_serving.long_context.is_some() && npu_serving.device != DeviceKind::Cpu {
        // Only the CPU backend has the per-layer block copies the mode's memory units need.
        return Err(ConfigError::not_allowed(
            "npu_serving.long_context",
            "set",
            format!(
                "only with npu_serving.device: cpu (not built for {})",
                npu_serving.device.name()
            ),
        ));
    }
    s.finish(
        &mut warnings,
        Unknown::Refuse(if strict { STRICT } else { OWN_SECTION }),
    )?;
    check_tensor_parallel(&npu_serving, serving_config.agent_ports.len())?;

    top.finish(&mut warnings, llm)?;

    // The Ascend attention operator pages its KV cache in blocks of a multiple of 16 tokens.
    if npu_serving.device == DeviceKind::Ascend && !pa_config.block_size.is_multiple_of(16) {
        return Err(ConfigError::not_allowed(
            "pa_config.block_size",
            pa_config.block_size,
            "a multiple of 16 with npu_serving.device: ascend (128 recommended: prefill attention \
             takes multiples of 128; smaller sizes prefill token by token)",
        ));
    }

    Ok(ServerConfig {
        model_config,
        serving_config,
        pa_config,
        npu_serving,
        warnings,
    })
}

fn to_u32(path: &str, v: u64, min: u32) -> Result<u32, ConfigError> {
    match u32::try_from(v) {
        Ok(x) if x >= min => Ok(x),
        _ => Err(ConfigError::not_allowed(
            path,
            v,
            format!("{min}..={}", u32::MAX),
        )),
    }
}

/// A bucket list: every entry >= min; warns when several buckets are given (we use the largest).
fn buckets(
    s: &mut Section,
    key: &str,
    min: u32,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<Option<Vec<u32>>, ConfigError> {
    let Some(list) = s.u64_list(key, "give at least one value")? else {
        return Ok(None);
    };
    let path = s.key_path(key);
    let mut out = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let p = if list.len() > 1 {
            format!("{path}[{i}]")
        } else {
            path.clone()
        };
        out.push(to_u32(&p, *v, min)?);
    }
    if out.len() > 1 {
        let max = out.iter().max().copied().unwrap_or(min);
        warnings.push(ConfigWarning {
            path,
            message: format!(
                "{} buckets given; continuous batching needs no buckets, using the largest ({max})",
                out.len()
            ),
        });
    }
    Ok(Some(out))
}

fn model_config(s: &mut Section, w: &mut Vec<ConfigWarning>) -> Result<ModelConfig, ConfigError> {
    let mut m = ModelConfig::default();
    if let Some(name) = s.string("model_name")? {
        if name.trim().is_empty() {
            return Err(ConfigError::Empty {
                path: s.key_path("model_name"),
                need: "name the served model",
            });
        }
        m.model_name = name;
    }
    if let Some(v) = s.u64("max_generate_length")? {
        m.max_generate_length = Some(to_u32(&s.key_path("max_generate_length"), v, 2)?);
    }
    if let Some(list) = s.u64_list("end_token", "give at least one token id")? {
        let path = s.key_path("end_token");
        m.end_token = list
            .into_iter()
            .map(|v| to_u32(&path, v, 0))
            .collect::<Result<_, _>>()?;
    }
    m.seq_length = buckets(s, "seq_length", 2, w)?;
    if let Some(v) = s.u64("vocab_size")? {
        m.vocab_size = Some(to_u32(&s.key_path("vocab_size"), v, 1)?);
    }
    if let Some(b) = buckets(s, "prefill_batch_size", 1, w)? {
        m.prefill_batch_size = b;
    }
    if let Some(b) = buckets(s, "decode_batch_size", 1, w)? {
        m.decode_batch_size = b;
    }
    if let Some(v) = s.string("batching_strategy")? {
        m.batching_strategy = match v.as_str() {
            "continuous" => BatchingStrategy::Continuous,
            "static" => BatchingStrategy::Static,
            _ => {
                return Err(ConfigError::not_allowed(
                    &s.key_path("batching_strategy"),
                    format!("{v:?}"),
                    "'continuous' or 'static'",
                ))
            }
        };
    }
    for key in ["batch_waiting_time", "decode_batch_waiting_time"] {
        if let Some(t) = s.f64(key)? {
            if t < 0.0 {
                return Err(ConfigError::not_allowed(&s.key_path(key), t, ">= 0"));
            }
            if t > 0.0 {
                w.push(ConfigWarning {
                    path: s.key_path(key),
                    message:
                        "ignored: continuous batching schedules a step as soon as there is work"
                            .into(),
                });
            }
        }
    }
    if let Some(false) = s.bool("page_attention")? {
        w.push(ConfigWarning {
            path: s.key_path("page_attention"),
            message: "ignored: the KV cache is always paged here (pa_config)".into(),
        });
    }
    m.model_dtype = match s.raw("model_dtype") {
        None => None,
        Some(Value::String(v)) => Some(v.clone()),
        Some(other) => Some(describe(other)),
    };
    if m.model_dtype.is_some() {
        w.push(ConfigWarning {
            path: s.key_path("model_dtype"),
            message: "ignored: weight and compute types come from the GGUF file and the backend"
                .into(),
        });
    }
    let ignored: [(&str, &str); 7] = [
        (
            "zactivate_len",
            "MindSpore activation-length buckets; no static shapes here",
        ),
        (
            "model_type",
            "MindSpore graph kind; shapes are always dynamic here",
        ),
        (
            "seq_type",
            "MindSpore static/dynamic sequence graphs; no static shapes here",
        ),
        (
            "current_index",
            "MindSpore graph input; positions are part of every step plan",
        ),
        (
            "pad_token_id",
            "no padding: steps pack tokens of all sequences",
        ),
        (
            "backend",
            "MindSpore graph mode ('kbk'/'ge'); the device is npu_serving.device",
        ),
        (
            "model_cfg_path",
            "MindFormers model yaml; the model comes from the GGUF file",
        ),
    ];
    for (key, why) in ignored {
        s.ignored(key, why, w);
    }
    Ok(m)
}

fn serving_config(
    s: &mut Section,
    w: &mut Vec<ConfigWarning>,
) -> Result<ServingConfig, ConfigError> {
    let mut c = ServingConfig::default();
    // One entry per agent. Agents talk to the server over private socket pairs, so the values
    // are not ports any more: any 0..=65535 is accepted, repeats included.
    let need = "one entry per agent";
    if let Some(list) = s.u64_list("agent_ports", need)? {
        let path = s.key_path("agent_ports");
        c.agent_ports = Vec::with_capacity(list.len());
        for v in list {
            let port = u16::try_from(v).map_err(|_| {
                ConfigError::not_allowed(&path, v, "0..=65535 (one entry per agent)")
            })?;
            c.agent_ports.push(port);
        }
    }
    if c.agent_ports.is_empty() {
        return Err(ConfigError::Empty {
            path: s.key_path("agent_ports"),
            need,
        });
    }
    s.ignored(
        "agent_ip",
        "agents talk to the server over private socket pairs, not over the network",
        w,
    );
    if let Some(v) = s.u64("start_device_id")? {
        c.start_device_id = to_u32(&s.key_path("start_device_id"), v, 0)?;
    }
    if let Some(ip) = s.string("server_ip")? {
        c.server_ip = check_host(&s.key_path("server_ip"), ip)?;
    }
    if let Some(v) = s.u64("server_port")? {
        c.server_port = u16::try_from(v).map_err(|_| {
            ConfigError::not_allowed(
                &s.key_path("server_port"),
                v,
                "0..=65535 (0 = any free port)",
            )
        })?;
    }
    for key in ["prefill_batch_waiting_time", "decode_batch_waiting_time"] {
        if let Some(t) = s.f64(key)? {
            if t < 0.0 {
                return Err(ConfigError::not_allowed(&s.key_path(key), t, ">= 0"));
            }
            if t > 0.0 {
                w.push(ConfigWarning {
                    path: s.key_path(key),
                    message:
                        "ignored: continuous batching schedules a step as soon as there is work"
                            .into(),
                });
            }
        }
    }
    s.ignored(
        "enable_host_post_sampling",
        "sampling always runs on the agent, next to the logits",
        w,
    );
    Ok(c)
}

fn check_host(path: &str, ip: String) -> Result<String, ConfigError> {
    if ip == "localhost" || ip.parse::<IpAddr>().is_ok() {
        Ok(ip)
    } else {
        Err(ConfigError::not_allowed(
            path,
            format!("{ip:?}"),
            "an IPv4/IPv6 address or \"localhost\"",
        ))
    }
}

fn pa_config(s: &mut Section) -> Result<PaConfig, ConfigError> {
    let mut c = PaConfig::default();
    if let Some(v) = s.u64("num_blocks")? {
        c.num_blocks = to_u32(&s.key_path("num_blocks"), v, 1)?;
        c.num_blocks_set = true;
    }
    if let Some(v) = s.u64("block_size")? {
        if !(1..=256).contains(&v) || !v.is_power_of_two() {
            return Err(ConfigError::not_allowed(
                &s.key_path("block_size"),
                v,
                "1..=256 and a power of two",
            ));
        }
        c.block_size = v as u32;
    }
    if let Some(v) = s.u64("decode_seq_length")? {
        c.decode_seq_length = Some(to_u32(&s.key_path("decode_seq_length"), v, 2)?);
    }
    Ok(c)
}

/// `kv_events_endpoint` (publishing is on when it is given) and `kv_events_topic`.
fn kv_events(s: &mut Section) -> Result<Option<KvEventsConfig>, ConfigError> {
    let topic = s.string("kv_events_topic")?;
    let Some(endpoint) = s.string("kv_events_endpoint")? else {
        if topic.is_some() {
            return Err(ConfigError::not_allowed(
                &s.key_path("kv_events_topic"),
                "a topic without npu_serving.kv_events_endpoint",
                "a topic only together with kv_events_endpoint (KV events are off without one)",
            ));
        }
        return Ok(None);
    };
    let endpoint = KvEventsEndpoint::parse(endpoint.trim()).map_err(|need| {
        ConfigError::not_allowed(
            &s.key_path("kv_events_endpoint"),
            format!("{endpoint:?}"),
            need,
        )
    })?;
    Ok(Some(KvEventsConfig {
        endpoint,
        topic: topic.unwrap_or_else(|| DEFAULT_TOPIC.to_string()),
    }))
}

/// Deepest nesting of flow collections (`[...]`, `{...}`) a config may have: the YAML reader
/// refuses past 128 levels anyway, but only after a parse that grows with the square of the
/// depth (30,000 open brackets took seconds), so deeper text is refused before it is parsed.
const MAX_FLOW_DEPTH: usize = 128;

fn check_flow_depth(text: &str) -> Result<(), ConfigError> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut chars = text.chars().peekable();
    let mut prev = '\n';
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            '#' if prev.is_whitespace() => {
                // A comment: to the end of the line.
                while chars.next_if(|&n| n != '\n').is_some() {}
            }
            '\'' | '"' => {
                // A quoted scalar: brackets inside do not nest.
                while let Some(q) = chars.next() {
                    match q {
                        '\n' => line += 1,
                        '\\' if c == '"' => {
                            chars.next();
                        }
                        _ if q == c => break,
                        _ => {}
                    }
                }
            }
            '[' | '{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Err(ConfigError::Yaml(format!(
                        "line {line}: collections nested more than {MAX_FLOW_DEPTH} levels deep"
                    )));
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        prev = c;
    }
    Ok(())
}

fn npu_serving(s: &mut Section) -> Result<NpuServingConfig, ConfigError> {
    let mut c = NpuServingConfig::default();
    if let Some(p) = s.string("model_file")? {
        if p.trim().is_empty() {
            return Err(ConfigError::Empty {
                path: s.key_path("model_file"),
                need: "a GGUF file, a Hugging Face model directory or ORG/NAME in the local \
                       Hugging Face cache, or leave the key out for the default model",
            });
        }
        c.model_file = Some(expand_home(&p));
    }
    if let Some(d) = s.string("device")? {
        c.device = match d.to_ascii_lowercase().as_str() {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            "ascend" | "npu" => DeviceKind::Ascend,
            _ => {
                return Err(ConfigError::not_allowed(
                    &s.key_path("device"),
                    format!("{d:?}"),
                    "one of cpu, cuda, ascend",
                ))
            }
        };
    }
    if let Some(q) = s.string("quantize")? {
        c.quantize = match q.to_ascii_lowercase().as_str() {
            "none" => None,
            "q8_0" | "q4_k" | "q4_0" => Some(q.to_ascii_lowercase()),
            _ => {
                return Err(ConfigError::not_allowed(
                    &s.key_path("quantize"),
                    format!("{q:?}"),
                    "one of q8_0, q4_k, q4_0, none",
                ))
            }
        };
    }
    if let Some(v) = s.string("kv_cache_dtype")? {
        let path = s.key_path("kv_cache_dtype");
        c.kv_cache_dtype = KvCacheDtype::parse(&v).ok_or_else(|| {
            ConfigError::not_allowed(&path, format!("{v:?}"), "one of auto, f16, int8")
        })?;
        if c.kv_cache_dtype == KvCacheDtype::Int8
            && !matches!(c.device, DeviceKind::Cpu | DeviceKind::Cuda)
        {
            return Err(ConfigError::not_allowed(
                &path,
                format!("{v:?}"),
                "auto or f16 on this device (the int8 KV cache is built on the CPU and CUDA \
                 backends only; on ascend, FusedInferAttentionScore reads a paged INT8 cache with \
                 per-token, per-head scales only when Q_S = 1 (keyAntiquantMode 5), and its \
                 prefill form (Q_S > 1) takes none: docs/kv-cache.md)",
            ));
        }
    }
    if let Some(v) = s.string("graph_capture")? {
        c.graph_capture = GraphCapture::parse(&v).ok_or_else(|| {
            ConfigError::not_allowed(
                &s.key_path("graph_capture"),
                format!("{v:?}"),
                "auto or off",
            )
        })?;
    }
    if let Some(v) = s.u64("threads_per_agent")? {
        c.threads_per_agent = to_u32(&s.key_path("threads_per_agent"), v, 0)?;
    }
    if let Some(v) = s.u64("max_tokens_per_step")? {
        c.max_tokens_per_step = to_u32(&s.key_path("max_tokens_per_step"), v, 1)?;
    }
    if let Some(v) = s.bool("prefix_cache")? {
        c.prefix_cache = v;
    }
    if let Some(v) = s.u64("swap_space_mb")? {
        if v > MAX_SWAP_SPACE_MB {
            return Err(ConfigError::not_allowed(
                &s.key_path("swap_space_mb"),
                v,
                format!("0..={MAX_SWAP_SPACE_MB} (MiB of host memory per agent; 0: no host pool)"),
            ));
        }
        c.swap_space_mb = v;
    }
    if let Some(v) = s.u64("max_queue")? {
        c.max_queue = to_u32(&s.key_path("max_queue"), v, 1)?;
    }
    if let Some(v) = s.u64("max_body_bytes")? {
        if v < 64 {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_body_bytes"),
                v,
                ">= 64",
            ));
        }
        c.max_body_bytes = v;
    }
    if let Some(v) = s.u64("max_header_bytes")? {
        if !(1024..=1 << 20).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_header_bytes"),
                v,
                "1024..=1048576",
            ));
        }
        c.max_header_bytes = v as u32;
    }
    for (key, field) in [
        ("header_timeout_ms", &mut c.header_timeout_ms),
        ("step_deadline_ms", &mut c.step_deadline_ms),
    ] {
        if let Some(v) = s.u64(key)? {
            if v == 0 {
                return Err(ConfigError::not_allowed(
                    &s.key_path(key),
                    v,
                    ">= 1 (milliseconds)",
                ));
            }
            *field = v;
        }
    }
    if let Some(v) = s.u64("shutdown_grace_ms")? {
        c.shutdown_grace_ms = v;
    }
    if let Some(v) = s.u64("max_new_tokens_default")? {
        c.max_new_tokens_default = to_u32(&s.key_path("max_new_tokens_default"), v, 1)?;
        c.max_new_tokens_default_set = true;
    }
    if let Some(v) = s.string("generation_config")? {
        c.generation_config = GenerationConfigMode::from_name(&v).ok_or_else(|| {
            ConfigError::not_allowed(
                &s.key_path("generation_config"),
                format!("{v:?}"),
                "auto (a model directory's generation_config.json sets the sampling defaults) \
                 or ignore",
            )
        })?;
    }
    if let Some(v) = s.u64("max_model_len")? {
        c.max_model_len = Some(to_u32(&s.key_path("max_model_len"), v, 2)?);
    }
    c.served_model_names = served_model_names(s)?;
    c.agent_roles = roles::agent_roles(s)?;
    if let Some(v) = roles::handoff_space_mb(s)? {
        c.handoff_space_mb = v;
    }
    if let Some(v) = s.u64("tensor_parallel_size")? {
        if !(1..=MAX_GROUP_RANKS as u64).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("tensor_parallel_size"),
                v,
                format!(
                    "1..={MAX_GROUP_RANKS} (ranks of one tensor-parallel group; 1: every agent \
                     runs the whole model)"
                ),
            ));
        }
        c.tensor_parallel_size = v as u32;
    }
    if let Some(v) = s.string("moe_tensor_parallel")? {
        use npu_model::shard::ExpertSplit;
        c.moe_tensor_parallel = ExpertSplit::from_name(&v).ok_or_else(|| {
            ConfigError::not_allowed(
                &s.key_path("moe_tensor_parallel"),
                format!("{v:?}"),
                format!(
                    "{} (how a tensor-parallel group splits an MoE model's routed experts: \
                     each rank its share of every expert's columns, or whole experts per rank)",
                    ExpertSplit::NAMES
                ),
            )
        })?;
    }
    c.kv_events = kv_events(s)?;
    if c.kv_events.is_some() && !c.prefix_cache {
        return Err(ConfigError::not_allowed(
            &s.key_path("kv_events_endpoint"),
            "an endpoint with npu_serving.prefix_cache: false",
            "KV events only with the prefix cache on (they report its blocks)",
        ));
    }
    if let Some(v) = s.f64("kv_cache_memory_fraction")? {
        if !(v > 0.0 && v <= MAX_KV_MEMORY_FRACTION) {
            return Err(ConfigError::not_allowed(
                &s.key_path("kv_cache_memory_fraction"),
                v,
                format!(
                    "above 0 and at most {MAX_KV_MEMORY_FRACTION} (the share of the device memory \
                     free after the weights that the KV pool takes; leave the key out for \
                     exactly pa_config.num_blocks)"
                ),
            ));
        }
        c.kv_cache_memory_fraction = Some(v);
    }
    Ok(c)
}

/// `tensor_parallel_size` against the agents and the features that do not run over a group yet.
fn check_tensor_parallel(c: &NpuServingConfig, agents: usize) -> Result<(), ConfigError> {
    const KEY: &str = "npu_serving.tensor_parallel_size";
    let t = c.tensor_parallel_size as usize;
    if t <= 1 {
        return Ok(());
    }
    if !agents.is_multiple_of(t) {
        let divisors: Vec<String> = (1..=agents)
            .filter(|d| agents.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        return Err(ConfigError::not_allowed(
            KEY,
            t,
            format!(
                "a divisor of the {agents} agents of serving_config.agent_ports (the agents form \
                 groups of tensor_parallel_size ranks): one of {}, or {t} x N entries in \
                 serving_config.agent_ports",
                divisors.join(", ")
            ),
        ));
    }
    let not_with = |key: &str, what: &str, value: String| {
        Err(ConfigError::not_allowed(
            key,
            value,
            format!(
                "{what} with {KEY}: {t} ({what_key} does not run over tensor-parallel groups \
                 yet; set {KEY}: 1 to use it)",
                what_key = key.trim_start_matches("npu_serving.")
            ),
        ))
    };
    if c.swap_space_mb > 0 {
        return not_with(
            "npu_serving.swap_space_mb",
            "0 (no swap preemption or prefix-cache host tier)",
            c.swap_space_mb.to_string(),
        );
    }
    if roles::splits(&c.agent_roles) {
        return not_with(
            "npu_serving.agent_roles",
            "every agent `both` (no prefill/decode split)",
            "a prefill/decode split".into(),
        );
    }
    if c.long_context.is_some() {
        return not_with(
            "npu_serving.long_context",
            "absent (no long-context mode)",
            "set".into(),
        );
    }
    Ok(())
}

/// `long_context`: a mapping of the mode's settings (absent keys take their defaults), or absent
/// for off; checked against the block size.
fn long_context(
    s: &mut Section,
    block_size: u32,
    strict: bool,
) -> Result<Option<LongContextConfig>, ConfigError> {
    if s.raw("long_context").is_none() {
        return Ok(None);
    }
    let mut sec = s.section("long_context")?;
    let mut c = LongContextConfig::default();
    for (key, field) in [
        ("initial_blocks", &mut c.initial_blocks),
        ("local_blocks", &mut c.local_blocks),
        ("topk_blocks", &mut c.topk_blocks),
        ("representative_keys", &mut c.representative_keys),
        ("device_blocks", &mut c.device_blocks),
    ] {
        if let Some(v) = sec.u64(key)? {
            *field = to_u32(&sec.key_path(key), v, 0)?;
        }
    }
    let path = sec.key_path("");
    sec.finish(
        &mut Vec::new(),
        Unknown::Refuse(if strict { STRICT } else { OWN_SECTION }),
    )?;
    c.validate(block_size)
        .map_err(|e| ConfigError::not_allowed(&format!("{path}{}", e.key), e.value, e.allowed))?;
    Ok(Some(c))
}

/// `served_model_names`: one name or a list of distinct, non-empty names without spaces.
fn served_model_names(s: &mut Section) -> Result<Vec<String>, ConfigError> {
    let key = "served_model_names";
    let path = s.key_path(key);
    let names: Vec<String> = match s.raw(key) {
        None => return Ok(Vec::new()),
        Some(Value::String(n)) => vec![n.clone()],
        Some(Value::Sequence(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(n) => out.push(n.clone()),
                    other => {
                        return Err(ConfigError::WrongType {
                            path: format!("{path}[{i}]"),
                            expected: "a model name (string)",
                            found: describe(other),
                        })
                    }
                }
            }
            out
        }
        Some(other) => {
            return Err(ConfigError::WrongType {
                path,
                expected: "a model name or a list of names",
                found: describe(other),
            })
        }
    };
    if names.is_empty() {
        return Err(ConfigError::Empty {
            path,
            need: "give at least one name, or leave the key out to serve model_config.model_name",
        });
    }
    let mut seen = BTreeSet::new();
    for n in &names {
        if n.trim().is_empty() || n.chars().any(char::is_whitespace) {
            return Err(ConfigError::not_allowed(
                &path,
                format!("{n:?}"),
                "non-empty names without whitespace",
            ));
        }
        if !seen.insert(n.as_str()) {
            return Err(ConfigError::not_allowed(
                &path,
                format!("{n:?} twice"),
                "distinct names",
            ));
        }
    }
    Ok(names)
}

/// `~/x` -> `$HOME/x` (configs are written by hand; the shell does not expand YAML values).
pub(super) fn expand_home(p: &str) -> PathBuf {
    match (p.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(p),
    }
}
