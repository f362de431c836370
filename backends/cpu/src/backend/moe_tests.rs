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

/// Packed experts take the grouped path (one job per projection over every expert's rows);
/// its outputs are bit for bit those of each expert run alone through `matmul` and `swiglu`, on
/// one thread and two, at decode batches and past a row chunk (prefill), for Q8_0 and Q4_K.
#[test]
fn grouped_experts_equal_each_expert_alone_bit_for_bit() {
    let (h, ff, ne, k) = (256usize, 256usize, 6usize, 2usize);
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        let quant = |v: &[f32], rows: usize, cols: usize| -> Vec<u8> {
            let rb = ty.row_bytes(cols).unwrap();
            let mut out = vec![0u8; rows * rb];
            for (src, dst) in v.chunks_exact(cols).zip(out.chunks_exact_mut(rb)) {
                npu_gguf::quantize::quantize_row(ty, src, dst).unwrap();
            }
            out
        };
        let experts: Vec<(Vec<u8>, Vec<u8>)> = (0..ne)
            .map(|e| {
                (
                    quant(&values(100 + e as u64, 2 * ff * h, 0.2), 2 * ff, h),
                    quant(&values(200 + e as u64, h * ff, 0.2), h, ff),
                )
            })
            .collect();
        for threads in [1, 2] {
            for t in [1usize, 7, 150] {
                let mut b = CpuBackend::new(CpuConfig {
                    threads,
                    f32_reference: false,
                });
                fn host(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> HostTensor<'_> {
                    HostTensor {
                        ty,
                        data,
                        rows,
                        cols,
                    }
                }
                let (mut gate_up, mut down) = (Vec::new(), Vec::new());
                for (gu, d) in &experts {
                    gate_up.push(b.load_matrix(&[host(ty, gu, 2 * ff, h)]).unwrap().unwrap());
                    down.push(b.load_matrix(&[host(ty, d, h, ff)]).unwrap().unwrap());
                }
                // Expert 5 serves nobody; the others unevenly.
                let ids: Vec<i32> = (0..t * k)
                    .map(|i| [0, 2, 2, 1, 3, 0, 4, 2][i % 8] ^ (i % 3 == 0) as i32)
                    .collect();
                let x = values(3 + t as u64, t * h, 1.0);
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
                let got = out.as_f32().unwrap().to_vec();
                // Each (token, slot) through its expert alone.
                let mut want = vec![0f32; t * h];
                for r in 0..t {
                    for j in 0..k {
                        let e = ids[r * k + j] as usize;
                        let xr = CpuBuffer::from_f32(x[r * h..(r + 1) * h].to_vec());
                        let mut gu = CpuBuffer::zeroed(DType::F32, 2 * ff).unwrap();
                        b.matmul(
                            View::rows(&xr, 1, h).unwrap(),
                            &gate_up[e],
                            ViewMut::rows(&mut gu, 1, 2 * ff).unwrap(),
                        )
                        .unwrap();
                        let mut act = CpuBuffer::zeroed(DType::F32, ff).unwrap();
                        let g = View::rows(&gu, 1, 2 * ff).unwrap();
                        b.swiglu(
                            g.col_range(0, ff).unwrap(),
                            g.col_range(ff, ff).unwrap(),
                            ViewMut::rows(&mut act, 1, ff).unwrap(),
                        )
                        .unwrap();
                        let mut y = CpuBuffer::zeroed(DType::F32, h).unwrap();
                        b.matmul(
                            View::rows(&act, 1, ff).unwrap(),
                            &down[e],
                            ViewMut::rows(&mut y, 1, h).unwrap(),
                        )
                        .unwrap();
                        let y = y.as_f32().unwrap();
                        for o in 0..h {
                            let v = y[o] * w[r * k + j];
                            if j == 0 {
                                want[r * h + o] = v;
                            } else {
                                want[r * h + o] += v;
                            }
                        }
                    }
                }
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} experts, {threads} threads, {t} tokens", ty.name());
            }
        }
    }
}

/// `moe_ffn_held` over a range of whole experts: all of them is `moe_ffn` bit for bit; two
/// halves hold each token's slots between them, so with two slots a token their outputs add up
/// to the whole bit for bit (a + b either way round), and a token whose experts are all in the
/// other half gets a zero row. Ids beyond the router's experts and ranges that do not match the
/// matrices are refused.
#[test]
fn held_experts_add_up_to_every_expert() {
    let mut b = CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    });
    let (t, h, ff, ne, k) = (6usize, 64usize, 32usize, 4usize, 2usize);
    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
    for e in 0..ne as u64 {
        let (gu, d) = (values(10 + e, 2 * ff * h, 0.2), values(50 + e, h * ff, 0.2));
        fn m(v: &[f32], rows: usize, cols: usize) -> HostTensor<'_> {
            HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(v),
                rows,
                cols,
            }
        }
        gate_up.push(b.load_matrix(&[m(&gu, 2 * ff, h)]).unwrap().unwrap());
        down.push(b.load_matrix(&[m(&d, h, ff)]).unwrap().unwrap());
    }
    // Token 4 is routed to experts 2 and 3 only.
    let ids: Vec<i32> = vec![0, 2, 2, 1, 3, 0, 1, 2, 2, 3, 0, 1];
    let xb = CpuBuffer::from_f32(values(3, t * h, 1.0));
    let wb = CpuBuffer::from_f32(values(7, t * k, 1.0));
    let mut ib = CpuBuffer::zeroed(DType::I32, t * k).unwrap();
    let upload_ids = |b: &mut CpuBackend, ib: &mut CpuBuffer, ids: &[i32]| {
        b.upload(
            npu_backend::HostSlice::I32(ids),
            ViewMut::rows(ib, t, k).unwrap(),
        )
        .unwrap();
    };
    upload_ids(&mut b, &mut ib, &ids);
    let run = |b: &mut CpuBackend, ib: &CpuBuffer, held: std::ops::Range<usize>| {
        let mut out = CpuBuffer::zeroed(DType::F32, t * h).unwrap();
        let (x, i, w) = (
            View::rows(&xb, t, h).unwrap(),
            View::rows(ib, t, k).unwrap(),
            View::rows(&wb, t, k).unwrap(),
        );
        let o = ViewMut::rows(&mut out, t, h).unwrap();
        let r = match held.clone() {
            h if h == (0..ne) => b.moe_ffn(x, i, w, &gate_up, &down, ff, o),
            h => b.moe_ffn_held(x, i, w, &gate_up[h.clone()], &down[h.clone()], h, ne, ff, o),
        };
        r.map(|()| out.as_f32().unwrap().to_vec())
    };
    let whole = run(&mut b, &ib, 0..ne).unwrap();
    let mut all = CpuBuffer::zeroed(DType::F32, t * h).unwrap();
    b.moe_ffn_held(
        View::rows(&xb, t, h).unwrap(),
        View::rows(&ib, t, k).unwrap(),
        View::rows(&wb, t, k).unwrap(),
        &gate_up,
        &down,
        0..ne,
        ne,
        ff,
        ViewMut::rows(&mut all, t, h).unwrap(),
    )
    .unwrap();
    let same = all
        .as_f32()
        .unwrap()
        .iter()
        .zip(&whole)
        .all(|(a, w)| a.to_bits() == w.to_bits());
    assert!(same, "every expert held is moe_ffn bit for bit");
    let (lo, hi) = (
        run(&mut b, &ib, 0..2).unwrap(),
        run(&mut b, &ib, 2..4).unwrap(),
    );
    assert!(
        lo[4 * h..5 * h].iter().all(|&v| v.to_bits() == 0),
        "token 4"
    );
    assert!(hi[4 * h..5 * h] == whole[4 * h..5 * h]);
    for (i, (&w, (&a, &c))) in whole.iter().zip(lo.iter().zip(&hi)).enumerate() {
        assert_eq!(
            (a + c).to_bits(),
            w.to_bits(),
            "value {i}: {a} + {c} vs {w}"
        );
    }
    // An id beyond the router's experts is refused even where no rank holds it.
    let mut bad = ids.clone();
    bad[5] = ne as i32;
    upload_ids(&mut b, &mut ib, &bad);
    let e = run(&mut b, &ib, 0..2).unwrap_err();
    assert!(e.to_string().contains("routed to expert 4 of 4"), "{e}");
    upload_ids(&mut b, &mut ib, &ids);
    // Matrices that are not the range's experts.
    let e = b
        .moe_ffn_held(
            View::rows(&xb, t, h).unwrap(),
            View::rows(&ib, t, k).unwrap(),
            View::rows(&wb, t, k).unwrap(),
            &gate_up[..2],
            &down[..2],
            1..4,
            ne,
            ff,
            ViewMut::rows(&mut CpuBuffer::zeroed(DType::F32, t * h).unwrap(), t, h).unwrap(),
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("2 experts given as experts 1..4 of 4"),
        "{e}"
    );
}
