//! `npu_serving.sleep_idle_seconds` and `npu_serving.sleep_idle_level`: the server puts its
//! agents to sleep by itself after that long without requests (as `POST /sleep` does), and wakes
//! them at the next request.

use std::time::Duration;

use super::error::ConfigError;
use super::reader::Section;

/// Longest idle time before sleeping that may be set: 30 days.
pub const MAX_SLEEP_IDLE_SECONDS: f64 = 30.0 * 24.0 * 3600.0;

/// When the server sleeps by itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SleepConfig {
    /// Sleep after this long without requests; None (0 or absent): never.
    pub idle: Option<Duration>,
    /// The level of that sleep (1: KV pool freed, weights kept; 2: both dropped).
    pub idle_level: u8,
}

impl Default for SleepConfig {
    fn default() -> Self {
        Self {
            idle: None,
            idle_level: 1,
        }
    }
}

pub(super) fn sleep(s: &mut Section) -> Result<SleepConfig, ConfigError> {
    let mut c = SleepConfig::default();
    if let Some(v) = s.f64("sleep_idle_seconds")? {
        if !(0.0..=MAX_SLEEP_IDLE_SECONDS).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("sleep_idle_seconds"),
                v,
                format!(
                    "0..={MAX_SLEEP_IDLE_SECONDS} (seconds without requests before the server \
                     sleeps by itself; 0: never)"
                ),
            ));
        }
        c.idle = (v > 0.0).then(|| Duration::from_secs_f64(v));
    }
    if let Some(v) = s.u64("sleep_idle_level")? {
        if !(1..=2).contains(&v) {
            return Err(ConfigError::not_allowed(
                &s.key_path("sleep_idle_level"),
                v,
                "1 (KV pool freed, weights kept) or 2 (weights and KV pool dropped, reloaded \
                 from the checkpoint on wake)",
            ));
        }
        c.idle_level = v as u8;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::ServerConfig;

    #[test]
    fn idle_sleep_is_read_and_bad_values_name_the_key() {
        let c = ServerConfig::from_yaml_str("npu_serving: {}\n").unwrap();
        assert_eq!(c.npu_serving.sleep, Default::default());
        let c = ServerConfig::from_yaml_str(
            "npu_serving:\n  sleep_idle_seconds: 1.5\n  sleep_idle_level: 2\n",
        )
        .unwrap();
        assert_eq!(c.npu_serving.sleep.idle, Some(Duration::from_millis(1500)));
        assert_eq!(c.npu_serving.sleep.idle_level, 2);
        let c = ServerConfig::from_yaml_str("npu_serving:\n  sleep_idle_seconds: 0\n").unwrap();
        assert_eq!(c.npu_serving.sleep.idle, None);
        for (yaml, key) in [
            ("sleep_idle_seconds: -1", "npu_serving.sleep_idle_seconds"),
            ("sleep_idle_seconds: soon", "npu_serving.sleep_idle_seconds"),
            ("sleep_idle_level: 3", "npu_serving.sleep_idle_level"),
            ("sleep_idle_level: 0", "npu_serving.sleep_idle_level"),
        ] {
            let e = ServerConfig::from_yaml_str(&format!("npu_serving:\n  {yaml}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
    }
}
