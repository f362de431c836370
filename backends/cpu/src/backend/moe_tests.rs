//! The mixture-of-experts ops against a plain computation: routing (softmax, top-k, ties to the
//! lower index, renormalisation) and the expert FFN over tokens routed to overlapping experts.

use npu_backend::{Backend, DType, HostTensor, View, ViewMut};
use npu_gguf::GgmlType;

use super::family_ops::route_row;
use super::*;

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

#[test]
fn routing_picks_the_most_probable_experts_and_renormalises() {
    let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
    let (mut ids, mut w) = ([0i32; 3], [0f32; 3]);
    route_row(&logits, 3, false, &mut ids, &mut w);
    // Ties go to the lower index.
    assert_eq!(ids, [1, 3, 4]);
    let z: f32 = logits.iter().map(|v| (v - 2.0f32).exp()).sum();
    assert!((w[0] - 1.0 / z).abs() < 1e-6 && (w[2] - (-1.0f32).exp() / z).abs() < 1e-6);
    route_row(&logits, 3, true, &mut ids, &mut w);
    assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    assert!(w[0] > w[2]);
}

#[test]
fn expert_ffn_matches_a_plain_computation() {
    let mut b = CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    });
    let (t, h, ff, ne, k) = (6usize, 64usize, 32usize, 4usize, 2usize);
    let experts: Vec<(Vec<f32>, Vec<f32>)> = (0..ne)
        .map(|e| {
            (
                values(10 + e as u64, 2 * ff * h, 0.2),
                values(50 + e as u64, h * ff, 0.2),
            )
        })
        .collect();
    fn tensor(v: &[f32], rows: usize, cols: usize) -> HostTensor<'_> {
        HostTensor {
            ty: GgmlType::F32,
            data: bytemuck::cast_slice(v),
            rows,
            cols,
        }
    }
    let mut gate_up = Vec::new();
    let mut down = Vec::new();
    for (gu, d) in &experts {
        gate_up.push(b.load_matrix(&[tensor(gu, 2 * ff, h)]).unwrap().unwrap());
        down.push(b.load_matrix(&[tensor(d, h, ff)]).unwrap().unwrap());
    }
    let x = values(3, t * h, 1.0);
    let ids: Vec<i32> = vec![0, 2, 2, 1, 3, 0, 1, 2, 2, 3, 0, 1];
    let w = values(7, t * k, 1.0);
    let xb = CpuBuffer::from_f32(x.clone());
    let wb = CpuBuffer::from_f32(w.clone());
    let mut ib = CpuBuffer::zeroed(DType::I32, t * k).unwrap();
    b.upload(
        npu_backend::HostSlice::I32(&ids),
        ViewMut::rows(&mut ib, t, k).unwrap(),
    )
    .unwrap();
    let mut out = CpuBuffer::zeroed(DType::F32, t * h).unwrap();
    b.moe_ffn(
        View::rows(&xb, t, h).unwrap(),
        View::rows(&ib, t, k).unwrap(),
        View::rows(&wb, t, k).unwrap(),
        &gate_up,
        &down,
        ff,
        ViewMut::rows(&mut out, t, h).unwrap(),
    )
    .unwrap();
    let got = out.as_f32().unwrap();
    for r in 0..t {
        let xr = &x[r * h..(r + 1) * h];
        let mut want = vec![0f64; h];
        for j in 0..k {
            let (gu, d) = &experts[ids[r * k + j] as usize];
            let dot = |row: &[f32], v: &[f32]| -> f64 {
                row.iter().zip(v).map(|(a, b)| *a as f64 * *b as f64).sum()
            };
            let act: Vec<f32> = (0..ff)
                .map(|i| {
                    let g = dot(&gu[i * h..(i + 1) * h], xr);
                    let u = dot(&gu[(ff + i) * h..(ff + i + 1) * h], xr);
                    (g / (1.0 + (-g).exp()) * u) as f32
                })
                .collect();
            for o in 0..h {
                want[o] += w[r * k + j] as f64 * dot(&d[o * ff..(o + 1) * ff], &act);
            }
        }
        for o in 0..h {
            let g = got[r * h + o];
            assert!(
                (g as f64 - want[o]).abs() < 2e-2 * (1.0 + want[o].abs()),
                "token {r} output {o}: {g} vs {}",
                want[o]
            );
        }
    }
    // An expert id beyond the experts is refused.
    b.upload(
        npu_backend::HostSlice::I32(&[9; 12]),
        ViewMut::rows(&mut ib, t, k).unwrap(),
    )
    .unwrap();
    assert!(b
        .moe_ffn(
            View::rows(&xb, t, h).unwrap(),
            View::rows(&ib, t, k).unwrap(),
            View::rows(&wb, t, k).unwrap(),
            &gate_up,
            &down,
            ff,
            ViewMut::rows(&mut out, t, h).unwrap(),
        )
        .is_err());
}
