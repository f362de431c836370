//! Mixture-of-experts against the CPU backend: routing (softmax and top-k per token, with a tie
//! and normalised weights) and the experts' FFN over tokens routed to overlapping experts, with
//! an expert no token chose, in every activation dtype. Experts in every form the grouped matmul
//! reads: Q8_0, Q4_0, Q4_1 and F16 kept packed, and F32 converted at load (dense rows in the
//! activation dtype). On the emulation: one grouped matmul launch per projection, no other
//! matmul kernel, and nothing synchronized (the grouping is planned on the device).

use super::*;
use npu_backend_cpu::{CpuBackend, CpuConfig};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `v` (`rows` x `cols`) in ggml type `ty`'s bytes.
fn encode(ty: GgmlType, v: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    match ty {
        GgmlType::F32 => f32_bytes(v),
        GgmlType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        GgmlType::Q4_1 => {
            // ggml's reference: d = (max - min) / 15, q = (x - min) / d rounded, at most 15.
            let mut out = Vec::new();
            for b in v.chunks(32) {
                let lo = b.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (hi - lo) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half::f16::from_f32(d).to_le_bytes());
                out.extend(half::f16::from_f32(lo).to_le_bytes());
                let q = |x: f32| (((x - lo) * id + 0.5) as u8).min(15);
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
            out
        }
        _ => {
            let mut out = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
            npu_gguf::quantize::quantize_rows(ty, v, cols, &mut out, 1).unwrap();
            out
        }
    }
}

/// The forms a grouped matmul reads, each with the kernel it launches.
const EXPERT_FORMS: [(GgmlType, MatmulMode, &str); 5] = [
    (GgmlType::Q8_0, MatmulMode::Auto, "q8_0"),
    (GgmlType::Q4_0, MatmulMode::Auto, "q4_0"),
    (GgmlType::Q4_1, MatmulMode::Quantized, "q4_1"),
    (GgmlType::F16, MatmulMode::Auto, "f16w"),
    (GgmlType::F32, MatmulMode::Dequantized, "dense"),
];

pub fn moe_routes_and_runs_experts_as_the_reference(make: Make) {
    for (ty, mode, form) in EXPERT_FORMS {
        moe_case(make, ty, mode, form);
    }
}

fn moe_case(make: Make, ty: GgmlType, mode: MatmulMode, form: &str) {
    let (t, h, ff, ne, k) = (7usize, 64usize, 32usize, 6usize, 2usize);
    for dt in DTYPES {
        let Some(mut b) = make(dt, mode) else {
            return;
        };
        let mut cpu = CpuBackend::new(CpuConfig {
            threads: 1,
            f32_reference: false,
        });
        let mut rng = Rng::new(31);
        let mut logits = rounded(&rng.vec(t * ne, -3.0, 3.0), dt);
        logits[1] = logits[2]; // a tie: the lower index first
                               // Expert 5 is never chosen.
        for r in 0..t {
            logits[r * ne + 5] = -30.0;
        }
        let x = rounded(&rng.vec(t * h, -1.0, 1.0), dt);
        let experts: Vec<(Vec<f32>, Vec<f32>)> = (0..ne)
            .map(|_| (rng.vec(2 * ff * h, -0.2, 0.2), rng.vec(h * ff, -0.2, 0.2)))
            .collect();
        let q8 = |v: &[f32], rows: usize, cols: usize| encode(ty, v, rows, cols);
        // The CUDA backend.
        let lg = put(&mut b, dt, &logits, t, ne);
        let xb = put(&mut b, dt, &x, t, h);
        let mut ids = b.alloc(DType::I32, t * k).unwrap();
        let mut w = b.alloc(DType::F32, t * k).unwrap();
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for (gu, d) in &experts {
            let (gb, db) = (q8(gu, 2 * ff, h), q8(d, h, ff));
            gate_up.push(
                b.load_matrix(&[HostTensor {
                    ty,
                    data: &gb,
                    rows: 2 * ff,
                    cols: h,
                }])
                .unwrap()
                .unwrap(),
            );
            down.push(
                b.load_matrix(&[HostTensor {
                    ty,
                    data: &db,
                    rows: h,
                    cols: ff,
                }])
                .unwrap()
                .unwrap(),
            );
        }
        take_launches(&b);
        b.moe_route(
            View::rows(&lg, t, ne).unwrap(),
            k,
            true,
            ViewMut::rows(&mut ids, t, k).unwrap(),
            ViewMut::rows(&mut w, t, k).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("moe_route_{}", dt.name())]);
        let mut out = b.alloc(dt, t * h).unwrap();
        b.moe_ffn(
            View::rows(&xb, t, h).unwrap(),
            View::rows(&ids, t, k).unwrap(),
            View::rows(&w, t, k).unwrap(),
            &gate_up,
            &down,
            ff,
            ViewMut::rows(&mut out, t, h).unwrap(),
        )
        .unwrap();
        if let Some(l) = take_launches(&b) {
            // One plan, one gather, one grouped matmul per projection, one SwiGLU and one
            // combine a layer (quantized experts: each projection's rows quantized once), and
            // nothing synchronized: every launch is still queued.
            let s = dt.name();
            let mm = format!("moe_mm_{form}_{s}");
            let mut want = vec![
                format!("moe_plan_{s}"),
                format!("gather_rows_{s}"),
                mm.clone(),
                format!("swiglu_{s}"),
                mm.clone(),
                format!("moe_combine_{s}"),
            ];
            if !matches!(form, "f16w" | "dense") {
                want.insert(2, format!("quantize_q8_{s}"));
                want.insert(5, format!("quantize_q8_{s}"));
            }
            assert_eq!(l, want, "{form}: launches");
            let mm_n = l.iter().filter(|n| **n == mm).count();
            assert_eq!(mm_n, 2, "{form}: one grouped matmul per projection");
            let queued = b.emulation().unwrap().queued();
            assert!(
                queued >= l.len(),
                "{form}: {queued} units queued after {} launches: moe_ffn synchronized",
                l.len()
            );
        }
        let mut id_dev = vec![0i32; t * k];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, t, k).unwrap(),
            dst: HostSliceMut::I32(&mut id_dev),
        }])
        .unwrap();
        let w_dev = get(&mut b, &w);
        let out_dev = get(&mut b, &out);

        // The CPU reference on the same (rounded) values.
        let lgc = cpu
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: &f32_bytes(&logits),
                rows: 1,
                cols: t * ne,
            })
            .unwrap();
        let xc = cpu
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: &f32_bytes(&x),
                rows: 1,
                cols: t * h,
            })
            .unwrap();
        let mut idc = cpu.alloc(DType::I32, t * k).unwrap();
        let mut wc = cpu.alloc(DType::F32, t * k).unwrap();
        cpu.moe_route(
            View::rows(&lgc, t, ne).unwrap(),
            k,
            true,
            ViewMut::rows(&mut idc, t, k).unwrap(),
            ViewMut::rows(&mut wc, t, k).unwrap(),
        )
        .unwrap();
        let mut cgu = Vec::new();
        let mut cd = Vec::new();
        for (gu, d) in &experts {
            let (gb, db) = (q8(gu, 2 * ff, h), q8(d, h, ff));
            let m = |cpu: &mut CpuBackend, data: &[u8], rows, cols| {
                cpu.load_matrix(&[HostTensor {
                    ty,
                    data,
                    rows,
                    cols,
                }])
                .unwrap()
                .unwrap()
            };
            cgu.push(m(&mut cpu, &gb, 2 * ff, h));
            cd.push(m(&mut cpu, &db, h, ff));
        }
        let mut oc = cpu.alloc(DType::F32, t * h).unwrap();
        cpu.moe_ffn(
            View::rows(&xc, t, h).unwrap(),
            View::rows(&idc, t, k).unwrap(),
            View::rows(&wc, t, k).unwrap(),
            &cgu,
            &cd,
            ff,
            ViewMut::rows(&mut oc, t, h).unwrap(),
        )
        .unwrap();
        let mut id_cpu = vec![0i32; t * k];
        let mut w_cpu = vec![0f32; t * k];
        let mut out_cpu = vec![0f32; t * h];
        cpu.read_back(&mut [
            Readback {
                src: View::rows(&idc, t, k).unwrap(),
                dst: HostSliceMut::I32(&mut id_cpu),
            },
            Readback {
                src: View::rows(&wc, t, k).unwrap(),
                dst: HostSliceMut::F32(&mut w_cpu),
            },
            Readback {
                src: View::rows(&oc, t, h).unwrap(),
                dst: HostSliceMut::F32(&mut out_cpu),
            },
        ])
        .unwrap();
        assert_eq!(id_dev, id_cpu, "{form} {}: routed ids", dt.name());
        assert!(id_dev.iter().all(|&e| e != 5));
        assert!(
            worst(&w_dev, &w_cpu, 1e-6, 1e-5) <= 1.0,
            "{}: weights",
            dt.name()
        );
        // Q8_0 activations are quantized per 32 values on both sides; the sums run in other
        // orders, and the device keeps intermediates in its activation dtype.
        let (mut max_abs, mut at) = (0f32, 0);
        for (i, (a, c)) in out_dev.iter().zip(&out_cpu).enumerate() {
            if (a - c).abs() > max_abs {
                (max_abs, at) = ((a - c).abs(), i);
            }
        }
        // bf16 rounds the gate/up outputs, the SwiGLU and the expert outputs to 8 bits each.
        let atol = match dt {
            DType::BF16 => 1e-2,
            DType::F16 => 4e-3,
            _ => 2e-3,
        };
        assert!(
            worst(&out_dev, &out_cpu, atol, 4.0 * out_rtol(dt) + 2e-3) <= 1.0,
            "{form} {}: expert FFN: worst at {at}: {} vs {} (CPU)",
            dt.name(),
            out_dev[at],
            out_cpu[at]
        );
    }
}
