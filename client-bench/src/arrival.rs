//! Arrival processes: when each request is sent, as offsets from the start of the run, for a
//! target rate X (Poisson, constant, gamma with a chosen coefficient of variation, bursts, and
//! performance_serving's own interval rule). Seeded, so a run can be repeated exactly.

use rand::SeedableRng;
use rand_distr::{Distribution, Exp, Gamma, Poisson};

/// Shape of the gaps between requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArrivalKind {
    /// Exponential gaps with mean 1/X (a Poisson process).
    Poisson,
    /// Every gap is exactly 1/X.
    Constant,
    /// Gamma gaps with mean 1/X and coefficient of variation --cv (cv 1 = Poisson; > 1 burstier).
    Gamma,
    /// Groups of --burst-size requests sent at once, groups 1/X·size apart (mean rate X).
    Burst,
    /// performance_serving's rule: each gap is a Poisson-distributed number of milliseconds
    /// with mean round(1/X, 2)·1000 (nearly constant).
    PerfServing,
}

/// A fully specified arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrivalSpec {
    pub kind: ArrivalKind,
    /// Requests per second (X), > 0.
    pub rate: f64,
    /// Coefficient of variation of the gaps (gamma only), > 0.
    pub cv: f64,
    /// Requests per burst (burst only), >= 1.
    pub burst_size: usize,
}

impl ArrivalSpec {
    /// Checks the numbers; the message names the flag at fault.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(("--qps", format!("{} is not a positive rate", self.rate)));
        }
        if self.kind == ArrivalKind::Gamma && !(self.cv.is_finite() && self.cv > 0.0) {
            return Err(("--cv", format!("{} must be > 0", self.cv)));
        }
        if self.kind == ArrivalKind::Burst && self.burst_size == 0 {
            return Err(("--burst-size", "must be at least 1".to_string()));
        }
        if self.kind == ArrivalKind::PerfServing && (1.0 / self.rate * 100.0).round() <= 0.0 {
            return Err((
                "--qps",
                format!(
                    "{} rounds to a zero interval under perf-serving arrivals",
                    self.rate
                ),
            ));
        }
        Ok(())
    }
}

/// Send offsets in seconds for `n` requests: the first at 0, then one gap after another.
/// Non-decreasing. Panics only if the spec was not validated.
pub fn schedule(spec: &ArrivalSpec, n: usize, seed: u64) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mean_gap = 1.0 / spec.rate;
    let mut offsets = Vec::with_capacity(n);
    let mut t = 0.0f64;
    for i in 0..n {
        if i > 0 {
            let gap = match spec.kind {
                ArrivalKind::Constant => mean_gap,
                ArrivalKind::Poisson => Exp::new(spec.rate)
                    .expect("validated rate")
                    .sample(&mut rng),
                ArrivalKind::Gamma => {
                    let shape = 1.0 / (spec.cv * spec.cv);
                    Gamma::new(shape, mean_gap / shape)
                        .expect("validated cv")
                        .sample(&mut rng)
                }
                ArrivalKind::Burst => {
                    if i % spec.burst_size == 0 {
                        mean_gap * spec.burst_size as f64
                    } else {
                        0.0
                    }
                }
                ArrivalKind::PerfServing => {
                    let interval_ms = (mean_gap * 100.0).round() / 100.0 * 1000.0;
                    Poisson::new(interval_ms)
                        .expect("validated interval")
                        .sample(&mut rng)
                        / 1000.0
                }
            };
            t += gap;
        }
        offsets.push(t);
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: ArrivalKind, rate: f64) -> ArrivalSpec {
        ArrivalSpec {
            kind,
            rate,
            cv: 1.0,
            burst_size: 4,
        }
    }

    fn gaps(o: &[f64]) -> Vec<f64> {
        o.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_cv(g: &[f64]) -> (f64, f64) {
        let m = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - m).powi(2)).sum::<f64>() / g.len() as f64;
        (m, var.sqrt() / m)
    }

    #[test]
    fn constant_is_exact() {
        let o = schedule(&spec(ArrivalKind::Constant, 4.0), 5, 1);
        assert_eq!(o, vec![0.0, 0.25, 0.5, 0.75, 1.0]);
    }

    #[test]
    fn poisson_mean_rate_and_cv() {
        let o = schedule(&spec(ArrivalKind::Poisson, 5.0), 20_001, 7);
        let (m, cv) = mean_cv(&gaps(&o));
        assert!((m - 0.2).abs() < 0.2 * 0.03, "mean gap {m}");
        assert!((cv - 1.0).abs() < 0.05, "cv {cv}");
        assert!(o.windows(2).all(|w| w[1] >= w[0]));
    }

    #[test]
    fn gamma_has_requested_cv() {
        let mut s = spec(ArrivalKind::Gamma, 2.0);
        s.cv = 3.0;
        let o = schedule(&s, 40_001, 11);
        let (m, cv) = mean_cv(&gaps(&o));
        assert!((m - 0.5).abs() < 0.5 * 0.06, "mean gap {m}");
        assert!((cv - 3.0).abs() < 0.3, "cv {cv}");
    }

    #[test]
    fn bursts_share_a_send_time() {
        let o = schedule(&spec(ArrivalKind::Burst, 2.0), 9, 1);
        assert_eq!(o, vec![0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 4.0]);
    }

    #[test]
    fn perf_serving_rule_is_nearly_constant() {
        // X = 3: interval round(1/3, 2) = 0.33 s, Poisson(330) ms per gap.
        let o = schedule(&spec(ArrivalKind::PerfServing, 3.0), 5_001, 3);
        let g = gaps(&o);
        let (m, cv) = mean_cv(&g);
        assert!((m - 0.33).abs() < 0.002, "mean gap {m}");
        assert!((cv - (330f64).sqrt() / 330.0).abs() < 0.01, "cv {cv}");
        // Whole milliseconds.
        assert!(g
            .iter()
            .all(|x| ((x * 1000.0) - (x * 1000.0).round()).abs() < 1e-6));
    }

    #[test]
    fn same_seed_same_schedule() {
        let s = spec(ArrivalKind::Poisson, 1.0);
        assert_eq!(schedule(&s, 50, 42), schedule(&s, 50, 42));
        assert_ne!(schedule(&s, 50, 42), schedule(&s, 50, 43));
    }

    #[test]
    fn validation_names_the_flag() {
        assert_eq!(
            spec(ArrivalKind::Poisson, 0.0).validate().unwrap_err().0,
            "--qps"
        );
        let mut g = spec(ArrivalKind::Gamma, 1.0);
        g.cv = 0.0;
        assert_eq!(g.validate().unwrap_err().0, "--cv");
        let mut b = spec(ArrivalKind::Burst, 1.0);
        b.burst_size = 0;
        assert_eq!(b.validate().unwrap_err().0, "--burst-size");
        assert_eq!(
            spec(ArrivalKind::PerfServing, 1000.0)
                .validate()
                .unwrap_err()
                .0,
            "--qps"
        );
    }
}
