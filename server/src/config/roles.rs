//! Agent roles for prefill/decode disaggregation: `npu_serving.agent_roles` (one of `prefill`,
//! `decode`, `both` per `serving_config.agent_ports` entry; left out, every agent does both)
//! and `npu_serving.handoff_space_mb` (the shared-memory region KV blocks are handed over
//! through), how they are read, and their checks against the number of agents.

use serde_yaml::Value;

use super::error::ConfigError;
use super::reader::{describe, Section};

/// What an agent does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgentRole {
    /// Prefills and decodes (colocated): the default.
    #[default]
    Both,
    /// Prefills, samples the first token, and hands the KV over to a decode agent.
    Prefill,
    /// Continues requests handed over by prefill agents; computes no prompt.
    Decode,
}

impl AgentRole {
    pub fn name(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// Whether new (and recovered) requests may be prefilled here.
    pub fn prefills(self) -> bool {
        self != Self::Decode
    }

    /// Whether handed-over requests may be decoded here.
    pub fn decodes(self) -> bool {
        self != Self::Prefill
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "both" => Self::Both,
            "prefill" => Self::Prefill,
            "decode" => Self::Decode,
            _ => return None,
        })
    }
}

/// Largest `handoff_space_mb`: the region is one shared-memory object (at most 1 GiB).
pub const MAX_HANDOFF_SPACE_MB: u64 = 1000;

/// `agent_roles`: a list of role names (empty when the key is left out).
pub(super) fn agent_roles(s: &mut Section) -> Result<Vec<AgentRole>, ConfigError> {
    let key = "agent_roles";
    let path = s.key_path(key);
    let items = match s.raw(key) {
        None => return Ok(Vec::new()),
        Some(Value::Sequence(items)) => items.clone(),
        Some(other) => {
            return Err(ConfigError::WrongType {
                path,
                expected: "a list of roles (prefill, decode or both), one per agent",
                found: describe(other),
            })
        }
    };
    let mut roles = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let role = match item {
            Value::String(r) => AgentRole::parse(r).ok_or_else(|| {
                ConfigError::not_allowed(
                    &format!("{path}[{i}]"),
                    format!("{r:?}"),
                    "one of prefill, decode, both",
                )
            })?,
            other => {
                return Err(ConfigError::WrongType {
                    path: format!("{path}[{i}]"),
                    expected: "a role (prefill, decode or both)",
                    found: describe(other),
                })
            }
        };
        roles.push(role);
    }
    Ok(roles)
}

/// `handoff_space_mb`, when given: 1..=MAX_HANDOFF_SPACE_MB.
pub(super) fn handoff_space_mb(s: &mut Section) -> Result<Option<u64>, ConfigError> {
    let Some(v) = s.u64("handoff_space_mb")? else {
        return Ok(None);
    };
    if !(1..=MAX_HANDOFF_SPACE_MB).contains(&v) {
        return Err(ConfigError::not_allowed(
            &s.key_path("handoff_space_mb"),
            v,
            format!(
                "1..={MAX_HANDOFF_SPACE_MB} (MiB of shared memory KV blocks are handed over \
                 through)"
            ),
        ));
    }
    Ok(Some(v))
}

/// Roles given must name one per agent, and leave some agent to prefill and some to decode.
pub(super) fn check_roles(roles: &[AgentRole], agents: usize) -> Result<(), ConfigError> {
    const PATH: &str = "npu_serving.agent_roles";
    if roles.is_empty() {
        return Ok(());
    }
    let list = || {
        let names: Vec<&str> = roles.iter().map(|r| r.name()).collect();
        format!("[{}]", names.join(", "))
    };
    if roles.len() != agents {
        return Err(ConfigError::not_allowed(
            PATH,
            list(),
            format!("one role per serving_config.agent_ports entry ({agents})"),
        ));
    }
    if !roles.iter().any(|r| r.prefills()) || !roles.iter().any(|r| r.decodes()) {
        return Err(ConfigError::not_allowed(
            PATH,
            list(),
            "at least one agent that prefills (prefill or both) and one that decodes (decode \
             or both)",
        ));
    }
    Ok(())
}

/// Whether `roles` split prefill from decode (some agent is not `both`).
pub(super) fn splits(roles: &[AgentRole]) -> bool {
    roles.iter().any(|r| !(r.prefills() && r.decodes()))
}
