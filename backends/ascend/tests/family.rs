//! The ops of the newer model families on `AscendBackend` over the emulated CANN, against plain
//! Rust references: per-head RMS norm (RmsNorm over a heads view), row scaling (InplaceMuls),
//! the GELU gate (GeluV2 tanh + InplaceMul, with ggml's cut-offs), rope with frequency factors
//! and ropes of different bases in one step (one cos/sin table each, not rebuilt as they
//! alternate). Sliding-window attention is in `attention.rs`, mixture-of-experts routing and the
//! experts' FFN in `moe.rs`.

mod common;

use common::seam::*;
use common::*;
use half::f16;
use npu_backend::*;
use npu_model::{intern_factors, Rope, RopeStyle};

#[test]
fn the_capabilities_built_are_reported() {
    let _g = serial();
    let b = default_backend();
    for c in [
        Capability::HeadNorm,
        Capability::GeluGate,
        Capability::ScaleRows,
        Capability::SlidingWindow,
        Capability::RopeFactors,
        Capability::PerLayerRope,
        Capability::Moe,
    ] {
        assert!(b.supports(c), "{}", c.name());
    }
}

#[test]
fn per_head_norm_scaling_and_gelu_gate_match_reference() {
    let _g = serial();
    let mut b = default_backend();
    let (rows, hd, nq, nkv) = (5usize, 16usize, 4usize, 2usize);
    let width = (nq + 2 * nkv) * hd + 3;
    let x = h(&rand_vec(1, rows * width, 3.0));
    let (wq, wk) = (rand_vec(2, hd, 2.0), rand_vec(3, hd, 2.0));
    let (bq, bk) = (le_bytes(&wq), le_bytes(&wk));
    let vq = b.load_vector(f32_tensor(&bq, hd)).unwrap();
    let vk = b.load_vector(f32_tensor(&bk, hd)).unwrap();
    let mut buf = up(&mut b, &x, width);
    {
        let mut v = ViewMut::rows(&mut buf, rows, width).unwrap();
        b.rms_norm_heads(v.col_range(0, nq * hd).unwrap(), &vq, 1e-6, hd)
            .unwrap();
        b.rms_norm_heads(v.col_range(nq * hd, nkv * hd).unwrap(), &vk, 1e-6, hd)
            .unwrap();
    }
    let got = down(&mut b, &buf, Layout::contiguous(rows, width));
    for r in 0..rows {
        let row = &x[r * width..(r + 1) * width];
        let want_q = rms_ref(&row[..nq * hd], &wq, 1e-6);
        let want_k = rms_ref(&row[nq * hd..(nq + nkv) * hd], &wk, 1e-6);
        let g = &got[r * width..(r + 1) * width];
        assert_close(&g[..nq * hd], &want_q, 4e-3, &format!("q heads, row {r}"));
        assert_close(
            &g[nq * hd..(nq + nkv) * hd],
            &want_k,
            4e-3,
            &format!("k heads, row {r}"),
        );
        assert_eq!(
            &g[(nq + nkv) * hd..],
            &row[(nq + nkv) * hd..],
            "v untouched"
        );
    }
    // A head width the weights do not have is refused.
    let e = b
        .rms_norm_heads(
            ViewMut::rows(&mut buf, rows, width)
                .unwrap()
                .col_range(0, 24)
                .unwrap(),
            &vq,
            1e-6,
            24,
        )
        .unwrap_err();
    assert!(e.to_string().contains("weights for heads of 24"), "{e}");

    // Row scaling of a window: the columns around it are untouched.
    let (sr, sc, sw) = (4usize, 40usize, 46usize);
    let xs = h(&rand_vec(4, sr * sw, 2.0));
    let mut sb = up(&mut b, &xs, sw);
    b.scale_rows(
        ViewMut::new(&mut sb, Layout::new(2, sr, sc, sw).unwrap()).unwrap(),
        25.298_222,
    )
    .unwrap();
    let got = down(&mut b, &sb, Layout::contiguous(sr, sw));
    for r in 0..sr {
        for c in 0..sw {
            let (g, x) = (got[r * sw + c], xs[r * sw + c]);
            if (2..2 + sc).contains(&c) {
                let want = x * 25.298_222;
                assert!(
                    (g - want).abs() <= 1e-3 * want.abs() + 1e-6,
                    "scaled [{r}][{c}]: {g} vs {want}"
                );
            } else {
                assert_eq!(g, x, "[{r}][{c}] outside the window");
            }
        }
    }

    // The GELU gate over [gate | up] column ranges, with gates on both sides of ggml's ±10.
    let (gr, ff) = (6usize, 48usize);
    let mut gu = h(&rand_vec(5, gr * 2 * ff, 4.0));
    for (i, v) in gu.iter_mut().step_by(7).enumerate() {
        *v = [12.5, -11.0, 10.0, -10.0, 0.0, 9.99, -9.99][i % 7];
    }
    let gu = h(&gu);
    let gbuf = up(&mut b, &gu, 2 * ff);
    let mut out = b.alloc(DType::F16, gr * ff).unwrap();
    let gv = View::rows(&gbuf, gr, 2 * ff).unwrap();
    b.geglu(
        gv.col_range(0, ff).unwrap(),
        gv.col_range(ff, ff).unwrap(),
        ViewMut::rows(&mut out, gr, ff).unwrap(),
    )
    .unwrap();
    let got = down(&mut b, &out, Layout::contiguous(gr, ff));
    let gelu = |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * x * (1.0 + 0.044_715 * x * x)).tanh());
    for r in 0..gr {
        for c in 0..ff {
            let (g, u) = (gu[r * 2 * ff + c], gu[r * 2 * ff + ff + c]);
            // ggml's CPU GELU: 0 at or below -10, the gate at or above 10, else its f16 table.
            let act = if g <= -10.0 {
                0.0
            } else if g >= 10.0 {
                g
            } else {
                f16::from_f32(gelu(g)).to_f32()
            };
            let want = f16::from_f32(act * u).to_f32();
            let got = got[r * ff + c];
            assert!(
                (got - want).abs() <= 2e-3 * want.abs() + 1e-6,
                "geglu [{r}][{c}] gate {g} up {u}: {got} vs {want}"
            );
        }
    }
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A one-row f32 tensor as the file stores it.
fn f32_tensor(data: &[u8], cols: usize) -> HostTensor<'_> {
    HostTensor {
        ty: npu_gguf::GgmlType::F32,
        data,
        rows: 1,
        cols,
    }
}

fn rope_ref(rope: &Rope, x: &[f32], heads: usize, hd: usize, positions: &[u32]) -> Vec<f32> {
    let mut out = x.to_vec();
    let mut cs = vec![0f32; rope.dims];
    for (t, &p) in positions.iter().enumerate() {
        rope.angles(p, &mut cs);
        // The device's tables hold cos/sin in f16.
        let cs = h(&cs);
        for hh in 0..heads {
            let head = &mut out[(t * heads + hh) * hd..][..hd];
            for i in 0..rope.dims / 2 {
                let (a, bb) = match rope.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + rope.dims / 2),
                };
                let (x0, x1) = (head[a], head[bb]);
                head[a] = x0 * cs[2 * i] - x1 * cs[2 * i + 1];
                head[bb] = x0 * cs[2 * i + 1] + x1 * cs[2 * i];
            }
        }
        out[t * heads * hd..(t + 1) * heads * hd]
            .iter_mut()
            .for_each(|v| *v = f16::from_f32(*v).to_f32());
    }
    out
}

#[test]
fn ropes_with_factors_and_alternating_bases_keep_one_table_each() {
    let _g = serial();
    let mut b = default_backend();
    let (heads, hd) = (6usize, 16usize);
    let local = Rope::plain(RopeStyle::Halves, hd, 10_000.0, 1.0);
    let global = Rope::plain(RopeStyle::Halves, hd, 1_000_000.0, 1.0);
    let factors: Vec<f32> = (0..hd / 2).map(|i| 1.0 + i as f32).collect();
    let llama3 = Rope {
        factors: Some(intern_factors(&factors)),
        ..Rope::plain(RopeStyle::Interleaved, hd, 500_000.0, 1.0)
    };
    let geometry = |rope| AttnGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: hd,
        rope,
        scale: 0.25,
        window: None,
    };
    let positions = [0u32, 1, 9, 700, 4000, 9000];
    let t = positions.len();
    let step = StepInputs {
        tokens: vec![1; t],
        positions: positions.to_vec(),
        slot_mapping: vec![0; t],
        ..Default::default()
    };
    let w = heads * hd + 8;
    for (si, ropes) in [
        vec![local, global, local],
        vec![global, local, global],
        vec![llama3],
    ]
    .into_iter()
    .enumerate()
    {
        b.begin_step(&step).unwrap();
        let x = h(&rand_vec(10 + si as u64, t * w, 2.0));
        let mut buf = up(&mut b, &x, w);
        for r in &ropes {
            b.rope(
                ViewMut::new(&mut buf, Layout::new(0, t, heads * hd, w).unwrap()).unwrap(),
                &geometry(*r),
            )
            .unwrap();
        }
        // One gather of each rope's rows per step, then per call one rotation into a dense
        // scratch (RotaryPositionEmbedding's out must be contiguous) and its copy into the rows.
        let distinct = if ropes.len() == 3 { 2 } else { 1 };
        assert_eq!(
            b.step_stats().launches as usize,
            distinct + 2 * ropes.len(),
            "step {si}: launches"
        );
        let got = down(&mut b, &buf, Layout::contiguous(t, w));
        let mut want: Vec<f32> = (0..t)
            .flat_map(|r| x[r * w..r * w + heads * hd].to_vec())
            .collect();
        for r in &ropes {
            want = rope_ref(r, &want, heads, hd, &positions);
        }
        for r in 0..t {
            assert_close(
                &got[r * w..r * w + heads * hd],
                &want[r * heads * hd..(r + 1) * heads * hd],
                6e-3,
                &format!("step {si} row {r}"),
            );
            assert_eq!(
                &got[r * w + heads * hd..(r + 1) * w],
                &x[r * w + heads * hd..(r + 1) * w]
            );
        }
    }
    assert_eq!(b.rope_tables(), 3, "local, global and the factored rope");
}
