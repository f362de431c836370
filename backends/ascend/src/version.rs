//! The CANN version: parsed from `aclsysGetVersionStr` (CANN 8.5+) or `aclsysGetCANNVersion`
//! when the runtime has them, else from the
//! install's `version.cfg` / `runtime/version.info`; compared with the oldest supported release.
//! CANN names releases `8.0.RC1 < 8.0.RC2 < 8.0.RC3 < 8.0.0 < 8.1.RC1 < … < 8.5.0`.

use std::path::Path;

use crate::error::{AscendError, Result};

/// The oldest CANN this backend supports: the release whose headers its declarations were
/// checked against (FusedInferAttentionScoreV2, WeightQuantBatchMatmulV2, executor reuse).
pub const MINIMUM: CannVersion = CannVersion {
    major: 8,
    minor: 1,
    stage: Stage::Rc(1),
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// A release candidate `RCn` (before the final release of the same major.minor).
    Rc(u32),
    /// A final release `major.minor.n`.
    Release(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CannVersion {
    pub major: u32,
    pub minor: u32,
    pub stage: Stage,
}

impl std::fmt::Display for CannVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.stage {
            Stage::Rc(n) => write!(f, "{}.{}.RC{n}", self.major, self.minor),
            Stage::Release(n) => write!(f, "{}.{}.{n}", self.major, self.minor),
        }
    }
}

impl CannVersion {
    /// Parses `8.1.RC1`, `8.0.0`, `8.2.RC1.alpha003`, `8.5.0.beta1`.
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.trim().split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let third = parts.next()?;
        let stage = if let Some(rc) = third
            .strip_prefix("RC")
            .or_else(|| third.strip_prefix("rc"))
        {
            Stage::Rc(rc.parse().ok()?)
        } else {
            Stage::Release(third.parse().ok()?)
        };
        Some(Self {
            major,
            minor,
            stage,
        })
    }

    /// Refuses releases older than [`MINIMUM`].
    pub fn check_supported(self) -> Result<()> {
        if self < MINIMUM {
            return Err(AscendError::TooOld {
                found: self.to_string(),
                minimum: MINIMUM.to_string(),
            });
        }
        Ok(())
    }
}

/// Reads the version from an install root: `version.cfg` (`runtime_running_version=[x:8.1.RC1]`)
/// or `runtime/version.info` (`version_dir=8.1.RC1`).
pub fn from_install(root: &Path) -> Option<CannVersion> {
    if let Ok(cfg) = std::fs::read_to_string(root.join("version.cfg")) {
        for line in cfg.lines() {
            if let Some(rest) = line.strip_prefix("runtime_running_version=[") {
                let v = rest.trim_end_matches(']').rsplit(':').next()?;
                if let Some(v) = CannVersion::parse(v) {
                    return Some(v);
                }
            }
        }
    }
    for info in ["runtime/version.info", "compiler/version.info"] {
        if let Ok(text) = std::fs::read_to_string(root.join(info)) {
            for line in text.lines() {
                if let Some(v) = line
                    .strip_prefix("version_dir=")
                    .and_then(CannVersion::parse)
                {
                    return Some(v);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_order_as_cann_names_them() {
        let v = |s| CannVersion::parse(s).unwrap();
        assert!(v("8.0.RC1") < v("8.0.RC3"));
        assert!(v("8.0.RC3") < v("8.0.0"));
        assert!(v("8.0.0") < v("8.1.RC1"));
        assert!(v("8.2.RC1.alpha003") < v("8.3.RC1"));
        assert!(v("8.3.RC1") < v("8.5.0"));
        assert_eq!(v("8.1.RC1").to_string(), "8.1.RC1");
        assert!(CannVersion::parse("garbage").is_none());
    }

    #[test]
    fn older_releases_are_refused_naming_both_versions() {
        let err = CannVersion::parse("8.0.RC3")
            .unwrap()
            .check_supported()
            .unwrap_err()
            .to_string();
        assert!(err.contains("8.0.RC3") && err.contains("8.1.RC1"), "{err}");
        CannVersion::parse("8.1.RC1")
            .unwrap()
            .check_supported()
            .unwrap();
        CannVersion::parse("8.5.0")
            .unwrap()
            .check_supported()
            .unwrap();
    }

    #[test]
    fn version_files_of_both_kinds_are_read() {
        let dir = std::env::temp_dir().join(format!("cann-version-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("runtime")).unwrap();
        std::fs::write(
            dir.join("runtime/version.info"),
            "Version=7.7.0.1.238\nversion_dir=8.1.RC1\n",
        )
        .unwrap();
        assert_eq!(from_install(&dir).unwrap().to_string(), "8.1.RC1");
        std::fs::write(
            dir.join("version.cfg"),
            "# version: 1.0\nruntime_running_version=[7.8.0:8.2.RC1]\n",
        )
        .unwrap();
        assert_eq!(from_install(&dir).unwrap().to_string(), "8.2.RC1");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
