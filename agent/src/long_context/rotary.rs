//! Rotary position embedding on the host, by a signed angle: long-context mode moves keys from
//! the position they were cached at to the one memory tokens take, and turns queries back to
//! score memory units. Same pairing and frequencies as the model's rope (`npu_model::Rope`).

use npu_model::{Rope, RopeStyle};

/// Cosines and sines of a rotation by `delta` positions (`dims / 2` pairs), into `cs`.
pub fn angles(rope: &Rope, delta: f64, cs: &mut Vec<f32>) {
    cs.clear();
    let dims = rope.dims as f64;
    for i in 0..rope.dims / 2 {
        let inv_freq =
            f64::from(rope.base).powf(-2.0 * i as f64 / dims) / f64::from(rope.factor(i));
        let t = delta * f64::from(rope.freq_scale) * inv_freq;
        cs.push(t.cos() as f32);
        cs.push(t.sin() as f32);
    }
}

/// Rotates each `head_dim` head of `row` by the angles `cs` (from `angles`).
pub fn rotate(rope: &Rope, row: &mut [f32], head_dim: usize, cs: &[f32]) {
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..rope.dims / 2 {
            let (c, s) = (cs[2 * i], cs[2 * i + 1]);
            let (a, b) = match rope.style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + rope.dims / 2),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(style: RopeStyle) -> Rope {
        Rope {
            style,
            dims: 8,
            base: 10000.0,
            freq_scale: 0.5,
            factors: None,
        }
    }

    /// Rotating by `a` then by `b` is rotating by `a + b`, and the rotations agree with the
    /// model's own angles at a position.
    #[test]
    fn rotations_compose_and_match_the_model_angles() {
        for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
            let r = rope(style);
            let row0: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut cs = Vec::new();
            let mut two = row0.clone();
            angles(&r, 700.0, &mut cs);
            rotate(&r, &mut two, 8, &cs);
            angles(&r, -300.0, &mut cs);
            rotate(&r, &mut two, 8, &cs);
            let mut one = row0.clone();
            angles(&r, 400.0, &mut cs);
            rotate(&r, &mut one, 8, &cs);
            let mut model_cs = vec![0f32; 8];
            r.angles(400, &mut model_cs);
            let mut model = row0.clone();
            rotate(&r, &mut model, 8, &model_cs);
            for i in 0..16 {
                assert!((two[i] - one[i]).abs() < 1e-4, "{style:?} {i}");
                assert!((model[i] - one[i]).abs() < 1e-3, "{style:?} {i}");
            }
            assert!((one[0] - row0[0]).abs() > 1e-3, "it does rotate");
        }
    }
}
