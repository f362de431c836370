//! A measuring instrument for the int8 KV cache's rounding: `CpuBackend::set_kv_rounding`
//! makes an f16 cache store each K and/or V row as an int8 cache would read it back (or as
//! variants of that scheme would), so a test can tell what the rounding of K alone, of V
//! alone, or of another grouping, resolution, smoothing or rotation costs a model, on the f16
//! cache's exact attention. Serving never sets it (None by default); an int8 pool refuses it.

use std::collections::HashMap;

use half::f16;
use npu_backend::{BackendError, KvDtype};

use super::buffer::bad;
use super::CpuBackend;

/// How an f16 cache rounds the rows it is given before storing them (values are stored as
/// `q * scale`, then rounded to f16 as every f16 cache value is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRounding {
    /// Round the K rows.
    pub k: bool,
    /// Round the V rows.
    pub v: bool,
    /// The largest quantized magnitude: 127 is the int8 cache's (`quantize_row_i8`); 255 and
    /// 511 are what 9 and 10 bits would give.
    pub levels: u16,
    /// Values per scale (0: `head_dim`, the int8 cache's one scale per token and KV head).
    pub group: usize,
    /// Scales kept in f32 instead of rounded to f16.
    pub f32_scales: bool,
    /// Exact static key smoothing: each key channel (per layer and KV head) divided, before
    /// rounding, by a factor multiplied back after it (as a query scaled by the same factor
    /// would see), the factor being that channel's root mean square over the first write's
    /// rows of the layer (its first prefill) relative to the head's.
    pub smooth_keys: bool,
    /// Each key row rotated by a normalised Hadamard transform before rounding and back after
    /// (as a query rotated alike would see; `head_dim` a power of two).
    pub hadamard_keys: bool,
}

impl KvRounding {
    /// The int8 cache's rounding of the rows `k` and `v` say.
    pub fn int8(k: bool, v: bool) -> Self {
        Self {
            k,
            v,
            levels: 127,
            group: 0,
            f32_scales: false,
            smooth_keys: false,
            hadamard_keys: false,
        }
    }
}

/// The rounding and the smoothing factors of each layer (from its first write).
#[derive(Debug, Clone)]
pub(super) struct RoundingState {
    cfg: KvRounding,
    factors: HashMap<usize, Vec<f32>>,
}

impl CpuBackend {
    /// Makes the f16 cache store rows rounded as `r` says (None: exactly, the default).
    /// Refused for an int8 cache, whose rows are rounded by what it stores.
    pub fn set_kv_rounding(&mut self, r: Option<KvRounding>) -> Result<(), BackendError> {
        const OP: &str = "set_kv_rounding";
        if let Some(r) = r {
            if self.kv_dtype == KvDtype::Int8 {
                return Err(bad(OP, "an int8 cache rounds its rows itself".into()));
            }
            if r.levels == 0 {
                return Err(bad(OP, "0 quantization levels".into()));
            }
        }
        self.kv_rounding = r.map(|cfg| RoundingState {
            cfg,
            factors: HashMap::new(),
        });
        Ok(())
    }
}

impl RoundingState {
    /// Rounded copies of `n` rows of K and V (rows `ldk` and `ldv` apart, `kvh` heads of `hd`
    /// values each) written to `layer`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn round(
        &mut self,
        op: &'static str,
        layer: usize,
        k: &[f32],
        ldk: usize,
        v: &[f32],
        ldv: usize,
        n: usize,
        kvh: usize,
        hd: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        let c = self.cfg;
        let group = if c.group == 0 { hd } else { c.group };
        if c.hadamard_keys && !hd.is_power_of_two() {
            return Err(bad(op, format!("a Hadamard rotation of {hd} values")));
        }
        let row = |x: &mut [f32]| {
            for g in x.chunks_mut(group) {
                quantize(g, c.levels as f32, c.f32_scales);
            }
        };
        let (mut k, mut v) = (k.to_vec(), v.to_vec());
        if c.k {
            let f = self.factors.entry(layer).or_insert_with(|| {
                if c.smooth_keys {
                    channel_factors(&k, ldk, n, kvh, hd)
                } else {
                    vec![1.0; kvh * hd]
                }
            });
            for t in 0..n {
                for (h, f) in f.chunks_exact(hd).enumerate() {
                    let x = &mut k[t * ldk + h * hd..t * ldk + (h + 1) * hd];
                    x.iter_mut().zip(f).for_each(|(x, f)| *x /= f);
                    if c.hadamard_keys {
                        hadamard(x);
                    }
                    row(x);
                    if c.hadamard_keys {
                        hadamard(x);
                    }
                    x.iter_mut().zip(f).for_each(|(x, f)| *x *= f);
                }
            }
        }
        if c.v {
            for t in 0..n {
                for h in 0..kvh {
                    row(&mut v[t * ldv + h * hd..t * ldv + (h + 1) * hd]);
                }
            }
        }
        Ok((k, v))
    }
}

/// `x` replaced by `q * scale`, `scale = max|x| / levels` (rounded to f16 unless `f32_scale`),
/// `q = round(x / scale)` within ±`levels`: `quantize_row_i8`'s arithmetic at 127 levels.
fn quantize(x: &mut [f32], levels: f32, f32_scale: bool) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut s = amax / levels;
    if !f32_scale {
        s = f16::from_f32(s.min(f16::MAX.to_f32())).to_f32();
    }
    if s == 0.0 || !s.is_finite() {
        x.fill(0.0);
        return;
    }
    for v in x.iter_mut() {
        *v = (*v / s).round().clamp(-levels, levels) * s;
    }
}

/// Per KV head and channel, the channel's root mean square over `n` rows over the head's (1
/// where a head is all zero; at least 1e-3).
fn channel_factors(k: &[f32], ldk: usize, n: usize, kvh: usize, hd: usize) -> Vec<f32> {
    let mut f = vec![1f32; kvh * hd];
    for (h, f) in f.chunks_exact_mut(hd).enumerate() {
        let mut ms = vec![0f64; hd];
        for t in 0..n {
            for (d, m) in ms.iter_mut().enumerate() {
                *m += (k[t * ldk + h * hd + d] as f64).powi(2);
            }
        }
        let all = ms.iter().sum::<f64>() / hd as f64;
        if all > 0.0 {
            for (f, m) in f.iter_mut().zip(&ms) {
                *f = ((m / all).sqrt() as f32).max(1e-3);
            }
        }
    }
    f
}

/// The normalised Hadamard transform of `x` (its own inverse; `x.len()` a power of two).
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_at_127_levels_is_the_int8_caches() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.3) * 0.173)
            .collect();
        let mut q = vec![0i8; 64];
        let s = crate::kernels::attention::quantize_row_i8(&x, &mut q);
        let mut want = vec![0f32; 64];
        crate::kernels::attention::dequantize_row_i8(&q, s, &mut want);
        let mut got = x.clone();
        quantize(&mut got, 127.0, false);
        assert_eq!(got, want);
        // More levels round finer.
        let err = |y: &[f32]| {
            y.iter()
                .zip(&x)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
        };
        let mut fine = x.clone();
        quantize(&mut fine, 511.0, false);
        assert!(err(&fine) < err(&got) / 3.0, "{} {}", err(&fine), err(&got));
    }

    #[test]
    fn hadamard_is_its_own_inverse_and_smoothing_factors_track_channels() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut y = x.clone();
        hadamard(&mut y);
        assert_ne!(y, x);
        hadamard(&mut y);
        for (a, b) in y.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5);
        }
        // Channel 1 of every row 4x channel 0's: its factor is 4x.
        let k: Vec<f32> = (0..8)
            .flat_map(|t| [1.0 + t as f32, 4.0 + 4.0 * t as f32])
            .collect();
        let f = channel_factors(&k, 2, 8, 1, 2);
        assert!((f[1] / f[0] - 4.0).abs() < 1e-5, "{f:?}");
    }

    #[test]
    fn an_int8_cache_and_zero_levels_are_refused_by_name() {
        use npu_backend::Backend;
        let mut b = CpuBackend::new(crate::CpuConfig {
            threads: 1,
            f32_reference: false,
        });
        let zero = KvRounding {
            levels: 0,
            ..KvRounding::int8(true, true)
        };
        let e = b.set_kv_rounding(Some(zero)).unwrap_err().to_string();
        assert!(
            e.contains("set_kv_rounding") && e.contains("0 quantization levels"),
            "{e}"
        );
        b.set_kv_dtype(KvDtype::Int8).unwrap();
        let e = b
            .set_kv_rounding(Some(KvRounding::int8(true, false)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("int8 cache"), "{e}");
        b.set_kv_rounding(None).unwrap();
    }
}
