//! The conformance cases of the CUDA backend: each op (and the KV pool) checked against the CPU
//! backend's reference kernels and the reference dequantization. They take a factory, so the
//! same cases run on the CPU emulation of the kernels (tests/emulation_ops.rs) and on a real GPU
//! (tests/gpu_conformance.rs).

mod attention;
mod attention_out;
mod ffn_fused;
mod fold;
mod fused;
mod kquants;
mod kv_int8;
mod latent;
mod lora;
mod matmul;
mod moe;

pub use attention::*;
pub use attention_out::*;
pub use ffn_fused::*;
pub use fold::*;
pub use fused::*;
pub use kquants::*;
pub use kv_int8::*;
pub use latent::*;
pub use lora::*;
pub use matmul::*;
pub use moe::*;

use super::*;
use npu_backend::{
    AttnGeometry, Backend, BackendError, Capability, DType, HostSlice, HostSliceMut, HostTensor,
    KvSpec, Layout, Readback, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cpu::kernels::{elementwise as cpu_ew, Isa};
use npu_backend_cuda::{CudaBackend, MatmulMode};
use npu_gguf::GgmlType;
use npu_model::{intern_factors, Rope, RopeStyle};

/// Makes a backend computing in a dtype with a matmul mode (`None`: skip, reason printed).
pub type Make<'a> = &'a dyn Fn(DType, MatmulMode) -> Option<CudaBackend>;

/// A conformance case.
pub type Case = fn(Make);

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    (
        "embed_dequantizes_each_table_format_on_lookup",
        embed_dequantizes_each_table_format_on_lookup,
    ),
    (
        "rms_norm_matches_the_reference",
        rms_norm_matches_the_reference,
    ),
    (
        "fused_launches_match_the_unfused_ones",
        fused_launches_match_the_unfused_ones,
    ),
    (
        "wide_gemv_matches_the_plain_one",
        wide_gemv_matches_the_plain_one,
    ),
    (
        "gemv_folds_match_the_unfused_ones",
        gemv_folds_match_the_unfused_ones,
    ),
    (
        "gemv_rope_fold_matches_the_unfused_ones",
        gemv_rope_fold_matches_the_unfused_ones,
    ),
    (
        "fused_ffn_matches_the_gemv_folds",
        fused_ffn_matches_the_gemv_folds,
    ),
    (
        "attention_out_fold_matches_the_separate_launches",
        attention_out_fold_matches_the_separate_launches,
    ),
    (
        "attention_writes_the_output_projections_activations",
        attention_writes_the_output_projections_activations,
    ),
    (
        "rope_matches_the_reference_in_both_styles",
        rope_matches_the_reference_in_both_styles,
    ),
    (
        "swiglu_add_and_bias_match_the_reference",
        swiglu_add_and_bias_match_the_reference,
    ),
    (
        "gather_and_argmax_pick_the_right_rows",
        gather_and_argmax_pick_the_right_rows,
    ),
    (
        "paged_attention_mixes_prefill_chunks_and_decodes_with_gqa",
        paged_attention_mixes_prefill_chunks_and_decodes_with_gqa,
    ),
    (
        "paged_attention_splits_long_contexts",
        paged_attention_splits_long_contexts,
    ),
    (
        "paged_attention_slides_a_window",
        paged_attention_slides_a_window,
    ),
    (
        "int8_kv_pool_is_sized_and_copied_as_the_cpus",
        int8_kv_pool_is_sized_and_copied_as_the_cpus,
    ),
    (
        "int8_kv_writes_leave_the_cpus_bytes",
        int8_kv_writes_leave_the_cpus_bytes,
    ),
    (
        "int8_paged_attention_matches_the_cpu_backend",
        int8_paged_attention_matches_the_cpu_backend,
    ),
    (
        "head_norm_geglu_and_scale_match_the_reference",
        head_norm_geglu_and_scale_match_the_reference,
    ),
    (
        "rope_factors_and_per_layer_bases_match_the_reference",
        rope_factors_and_per_layer_bases_match_the_reference,
    ),
    ("kv_blocks_copy_on_the_device", kv_blocks_copy_on_the_device),
    (
        "matmul_paths_match_their_references",
        matmul_paths_match_their_references,
    ),
    (
        "quantized_matmul_is_batch_invariant",
        quantized_matmul_is_batch_invariant,
    ),
    (
        "uploads_and_reads_strided_windows",
        uploads_and_reads_strided_windows,
    ),
    (
        "ops_refuse_bad_shapes_steps_and_foreign_buffers",
        ops_refuse_bad_shapes_steps_and_foreign_buffers,
    ),
    (
        "moe_routes_and_runs_experts_as_the_reference",
        moe_routes_and_runs_experts_as_the_reference,
    ),
    (
        "scored_routing_matches_the_reference",
        scored_routing_matches_the_reference,
    ),
    (
        "latent_attention_matches_the_reference",
        latent_attention_matches_the_reference,
    ),
    ("latent_pool_refusals", latent_pool_refusals),
    (
        "packed_kquant_gemvs_match_the_f16_path",
        packed_kquant_gemvs_match_the_f16_path,
    ),
    (
        "tiled_kquant_gemm_matches_the_gemv",
        tiled_kquant_gemm_matches_the_gemv,
    ),
    (
        "lora_groups_match_the_cpu_backend",
        lora_groups_match_the_cpu_backend,
    ),
];

pub(crate) const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Output rounding tolerance of a dtype (relative).
pub(crate) fn out_rtol(dt: DType) -> f32 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 => 1e-3,
        _ => 8e-3,
    }
}

/// A KV pool and a step of `n` tokens: one sequence at positions 0..n.
fn one_seq_step(b: &mut CudaBackend, tokens: Vec<u32>) -> StepInputs {
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 8,
        block_size: 16,
        n_kv_heads: 1,
        head_dim: 32,
    })
    .unwrap();
    let n = tokens.len();
    let s = StepInputs {
        positions: (0..n as u32).collect(),
        slot_mapping: (0..n as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: 0,
        }],
        block_tables: (0..8).collect(),
        max_blocks: 8,
        logit_rows: vec![],
        tokens,
    };
    b.begin_step(&s).unwrap();
    s
}

pub fn embed_dequantizes_each_table_format_on_lookup(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(1);
        let (vocab, dim) = (50, 96);
        let tokens = vec![3, 49, 0, 17, 3];
        one_seq_step(&mut b, tokens.clone());
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::F16,
            GgmlType::F32,
            GgmlType::BF16,
        ] {
            let data = random_tensor(&mut rng, ty, vocab, dim);
            let table = b
                .load_embedding(HostTensor {
                    ty,
                    data: &data,
                    rows: vocab,
                    cols: dim,
                })
                .unwrap();
            let mut out = b.alloc(dt, tokens.len() * dim).unwrap();
            take_launches(&b);
            b.embed(&table, ViewMut::rows(&mut out, tokens.len(), dim).unwrap())
                .unwrap();
            assert_launched(&b, vec![format!("embed_{}", dt.name())]);
            let all = dequantized(ty, &data, vocab, dim);
            let want: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| all[t as usize * dim..(t as usize + 1) * dim].to_vec())
                .collect();
            assert_eq!(
                get(&mut b, &out),
                rounded(&want, dt),
                "{} {}",
                ty.name(),
                dt.name()
            );
        }
        // A token beyond the table is refused before any kernel runs, and a tensor whose bytes
        // do not match its shape is refused at load.
        let data = random_tensor(&mut rng, GgmlType::Q8_0, 10, dim);
        let small = HostTensor {
            ty: GgmlType::Q8_0,
            data: &data,
            rows: 10,
            cols: dim,
        };
        let table = b.load_embedding(small).unwrap();
        let mut out = b.alloc(dt, tokens.len() * dim).unwrap();
        take_launches(&b);
        let e = b
            .embed(&table, ViewMut::rows(&mut out, tokens.len(), dim).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("token id 49"), "{e}");
        assert!(take_launches(&b).unwrap_or_default().is_empty());
        let e = b
            .load_embedding(HostTensor { rows: 11, ..small })
            .unwrap_err();
        assert!(matches!(e, BackendError::BadArgument { .. }), "{e}");
    }
}

pub fn rms_norm_matches_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(2);
        let (rows, cols) = (5, 576);
        let x = rounded(&rng.vec(rows * cols, -3.0, 3.0), dt);
        let w = rng.vec(cols, 0.5, 1.5);
        let xb = put(&mut b, dt, &x, rows, cols);
        let wb = b
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(&w),
                rows: 1,
                cols,
            })
            .unwrap();
        // Output into a strided window (rows 700 apart, from column 3).
        let mut out = b.alloc(dt, rows * 700).unwrap();
        let win = Layout::new(3, rows, cols, 700).unwrap();
        take_launches(&b);
        b.rms_norm(
            View::rows(&xb, rows, cols).unwrap(),
            &wb,
            1e-5,
            ViewMut::new(&mut out, win).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("rms_norm_{}", dt.name())]);
        let mut want = vec![0f32; rows * cols];
        cpu_ew::rms_norm(&x, &w, 1e-5, &mut want);
        let all = get(&mut b, &out);
        let got: Vec<f32> = (0..rows)
            .flat_map(|r| all[r * 700 + 3..r * 700 + 3 + cols].to_vec())
            .collect();
        let e = worst(&got, &want, 1e-6, out_rtol(dt) + 1e-6);
        assert!(e <= 1.0, "{}: worst {e}", dt.name());
    }
}

pub fn rope_matches_the_reference_in_both_styles(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(3);
        let n = 6;
        let mut s = one_seq_step(&mut b, vec![0; n]);
        // Positions far apart (the reference takes them from the step too).
        s.positions = vec![0, 1, 17, 900, 4095, 33];
        b.begin_step(&s).unwrap();
        // Few heads, and a 1B-class row (24 heads of 128: more (head, pair) items than one
        // block of threads takes, so a row spans several blocks).
        for (n_heads, n_kv, hd, style, dims, base, freq_scale) in [
            (4, 2, 64, RopeStyle::Interleaved, 64, 10000.0, 1.0),
            (4, 2, 64, RopeStyle::Halves, 64, 1_000_000.0, 1.0),
            (4, 2, 64, RopeStyle::Interleaved, 32, 100000.0, 0.25),
            (16, 8, 128, RopeStyle::Halves, 128, 500_000.0, 1.0),
            (16, 8, 128, RopeStyle::Interleaved, 96, 10000.0, 1.0),
        ] {
            let heads = n_heads + n_kv;
            let rope = Rope {
                style,
                dims,
                base,
                freq_scale,
                factors: None,
            };
            let g = AttnGeometry {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
                rope,
                scale: 0.125,
                window: None,
            };
            // The q/k heads sit in a wider row (V after them, untouched).
            let ld = (heads + n_kv) * hd;
            let x = rounded(&rng.vec(n * ld, -2.0, 2.0), dt);
            let mut buf = put(&mut b, dt, &x, n, ld);
            take_launches(&b);
            b.rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &g).unwrap();
            assert_launched(&b, vec![format!("rope_{}", dt.name())]);
            let mut want = x.clone();
            let mut cs = vec![0f32; dims];
            for (r, &pos) in s.positions.iter().enumerate() {
                rope.angles(pos, &mut cs);
                cpu_ew::rope_apply(
                    &rope,
                    &mut want[r * ld..r * ld + heads * hd],
                    heads,
                    hd,
                    &cs,
                );
            }
            let got = get(&mut b, &buf);
            let e = worst(&got, &want, 2e-5, out_rtol(dt) + 1e-5);
            assert!(
                e <= 1.0,
                "{n_heads}+{n_kv} heads of {hd}, {style:?} dims {dims} {}: worst {e}",
                dt.name()
            );
        }
    }
}

/// Rows `r` of `all` (rows `ld` apart), columns `c0..c0 + cols`.
fn window_of(all: &[f32], rows: usize, ld: usize, c0: usize, cols: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| all[r * ld + c0..r * ld + c0 + cols].to_vec())
        .collect()
}

/// The ops of the newer families: per-head Q/K RMS norm in place on a QKV window (V untouched),
/// the GELU-gated activation with ggml's f16-table values (around its ±10 cut-offs too), and
/// row scaling of a strided window.
pub fn head_norm_geglu_and_scale_match_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
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
        let mut rng = Rng::new(6);

        // Per-head norm: rows of 4 Q heads, 2 K heads, 2 V heads of 64, 520 apart from column
        // 3; Q weights f32 (a loaded vector), K weights bf16.
        let (rows, hd, nq, nkv, ld) = (5, 64, 4, 2, 520);
        let width = (nq + 2 * nkv) * hd;
        let x = rounded(&rng.vec(rows * ld, -3.0, 3.0), dt);
        let wq = rng.vec(hd, 0.5, 1.5);
        let wk = rounded(&rng.vec(hd, 0.5, 1.5), DType::BF16);
        let mut xb = put(&mut b, dt, &x, rows, ld);
        let wqb = b
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(&wq),
                rows: 1,
                cols: hd,
            })
            .unwrap();
        let wkb = put(&mut b, DType::BF16, &wk, 1, hd);
        let win = Layout::new(3, rows, width, ld).unwrap();
        take_launches(&b);
        {
            let mut v = ViewMut::new(&mut xb, win).unwrap();
            b.rms_norm_heads(v.col_range(0, nq * hd).unwrap(), &wqb, 1e-6, hd)
                .unwrap();
            b.rms_norm_heads(v.col_range(nq * hd, nkv * hd).unwrap(), &wkb, 1e-6, hd)
                .unwrap();
        }
        assert_launched(&b, vec![format!("rms_norm_heads_{}", dt.name()); 2]);
        let mut want = x.clone();
        for r in 0..rows {
            let row = &mut want[r * ld + 3..r * ld + 3 + width];
            cpu_ew::rms_norm_in_place(&mut row[..nq * hd], &wq, 1e-6);
            cpu_ew::rms_norm_in_place(&mut row[nq * hd..(nq + nkv) * hd], &wk, 1e-6);
        }
        let got = get(&mut b, &xb);
        let (g_qk, w_qk) = (
            window_of(&got, rows, ld, 3, (nq + nkv) * hd),
            window_of(&want, rows, ld, 3, (nq + nkv) * hd),
        );
        let e = worst(&g_qk, &w_qk, 1e-6, out_rtol(dt) + 1e-6);
        assert!(e <= 1.0, "rms_norm_heads {}: worst {e}", dt.name());
        // V and everything outside the window are untouched.
        let v0 = 3 + (nq + nkv) * hd;
        assert_eq!(
            window_of(&got, rows, ld, v0, ld - v0),
            window_of(&x, rows, ld, v0, ld - v0)
        );
        assert_eq!(
            window_of(&got, rows, ld, 0, 3),
            window_of(&x, rows, ld, 0, 3)
        );
        // Weights that are not one head's, and rows that are not whole heads, are refused.
        let v = ViewMut::new(&mut xb, win).unwrap();
        let e = b.rms_norm_heads(v, &wqb, 1e-6, 32).unwrap_err();
        assert!(
            matches!(
                e,
                BackendError::BadArgument {
                    op: "rms_norm_heads",
                    ..
                }
            ),
            "{e}"
        );
        let mut v = ViewMut::new(&mut xb, win).unwrap();
        let e = b
            .rms_norm_heads(v.col_range(0, 100).unwrap(), &wqb, 1e-6, hd)
            .unwrap_err();
        assert!(e.to_string().contains("rows of 100"), "{e}");

        // GELU gate: gate | up in one row; the gates cover ±10, beyond, and the f16 grid.
        let (rows, ff) = (4, 300);
        let mut gu = rng.vec(rows * 2 * ff, -6.0, 6.0);
        let edges = [12.5, -11.0, 10.0, -10.0, 0.0, 9.99, -9.99, 1e-3, -0.5];
        for r in 0..rows {
            for (i, &e) in edges.iter().enumerate() {
                gu[r * 2 * ff + 7 * i + r] = e;
            }
        }
        let gu = rounded(&gu, dt);
        let gub = put(&mut b, dt, &gu, rows, 2 * ff);
        let ow = Layout::new(2, rows, ff, ff + 5).unwrap();
        let mut out = b.alloc(dt, rows * (ff + 5)).unwrap();
        let v = View::rows(&gub, rows, 2 * ff).unwrap();
        take_launches(&b);
        b.geglu(
            v.col_range(0, ff).unwrap(),
            v.col_range(ff, ff).unwrap(),
            ViewMut::new(&mut out, ow).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("geglu_{}", dt.name())]);
        let mut want = vec![0f32; rows * ff];
        for (g_u, w) in gu.chunks(2 * ff).zip(want.chunks_mut(ff)) {
            cpu_ew::geglu(&g_u[..ff], &g_u[ff..], w);
        }
        let got = window_of(&get(&mut b, &out), rows, ff + 5, 2, ff);
        if dt == DType::F32 {
            // The activation comes from the host's f16 table on every device (a device tanhf
            // may differ from the host's, and the emulation's does on purpose): the same values
            // as the reference, bit for bit.
            assert_eq!(got, want, "geglu f32");
        }
        let e = worst(&got, &want, 1e-6, out_rtol(dt) + 1e-6);
        assert!(e <= 1.0, "geglu {}: worst {e}", dt.name());
        let e = b
            .geglu(
                v.col_range(0, ff).unwrap(),
                v.col_range(ff, ff - 1).unwrap(),
                ViewMut::new(&mut out, ow).unwrap(),
            )
            .unwrap_err();
        assert!(
            matches!(e, BackendError::BadArgument { op: "geglu", .. }),
            "{e}"
        );

        // Row scaling of a window (Gemma's sqrt(hidden) embedding scale).
        let (rows, cols, ld) = (3, 640, 650);
        let x = rounded(&rng.vec(rows * ld, -2.0, 2.0), dt);
        let mut xb = put(&mut b, dt, &x, rows, ld);
        let win = Layout::new(4, rows, cols, ld).unwrap();
        take_launches(&b);
        b.scale_rows(ViewMut::new(&mut xb, win).unwrap(), 25.298_222)
            .unwrap();
        assert_launched(&b, vec![format!("scale_{}", dt.name())]);
        let got = get(&mut b, &xb);
        let mut want = x.clone();
        for r in 0..rows {
            cpu_ew::scale(&mut want[r * ld + 4..r * ld + 4 + cols], 25.298_222);
        }
        let want = rounded(&want, dt);
        assert_eq!(got, want, "scale_rows {}", dt.name());
    }
}

/// Rope with per-pair frequency factors (Llama 3), and ropes of two bases applied to one step
/// one after the other (Gemma 3's local and global layers). A factor table is uploaded once:
/// again, or equal at another address, it is found.
pub fn rope_factors_and_per_layer_bases_match_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(7);
        let (n_heads, n_kv, hd) = (4, 2, 64);
        let heads = n_heads + n_kv;
        let n = 6;
        let mut s = one_seq_step(&mut b, vec![0; n]);
        s.positions = vec![0, 1, 17, 900, 4095, 9000];
        b.begin_step(&s).unwrap();
        let geometry = |rope: Rope| AttnGeometry {
            n_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            rope,
            scale: 0.125,
            window: None,
        };
        let ld = (heads + n_kv) * hd;
        let reference = |x: &[f32], ropes: &[Rope]| {
            let mut want = x.to_vec();
            for rope in ropes {
                let mut cs = vec![0f32; rope.dims];
                for (r, &pos) in s.positions.iter().enumerate() {
                    rope.angles(pos, &mut cs);
                    cpu_ew::rope_apply(
                        rope,
                        &mut want[r * ld..r * ld + heads * hd],
                        heads,
                        hd,
                        &cs,
                    );
                    // The device stores each rope's output in its dtype.
                    let row = &mut want[r * ld..r * ld + heads * hd];
                    row.copy_from_slice(&rounded(row, dt));
                }
            }
            want
        };
        // Llama 3-style factors (1 for high frequencies up to 8 for low ones), both styles.
        let factors: Vec<f32> = (0..32).map(|i| 1.0 + 7.0 * i as f32 / 31.0).collect();
        let table = intern_factors(&factors);
        for (i, style) in [RopeStyle::Interleaved, RopeStyle::Halves]
            .into_iter()
            .enumerate()
        {
            let rope = Rope {
                style,
                dims: 64,
                base: 500_000.0,
                freq_scale: 1.0,
                factors: Some(table),
            };
            let x = rounded(&rng.vec(n * ld, -2.0, 2.0), dt);
            let mut buf = put(&mut b, dt, &x, n, ld);
            let before = b.emulation().map(|e| e.live_allocations());
            take_launches(&b);
            b.rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &geometry(rope))
                .unwrap();
            assert_launched(&b, vec![format!("rope_{}", dt.name())]);
            let after = b.emulation().map(|e| e.live_allocations());
            if let (Some(x0), Some(x1)) = (before, after) {
                // The first rope with factors uploads the table; the second finds it.
                assert_eq!(x1 - x0, usize::from(i == 0), "{style:?}");
            }
            let got = get(&mut b, &buf);
            let want = reference(&x, &[rope]);
            let e = worst(&got, &want, 2e-5, out_rtol(dt) + 1e-5);
            assert!(e <= 1.0, "factors {style:?} {}: worst {e}", dt.name());
        }
        // An equal table at another address shares the upload; one of the wrong length is
        // refused.
        let copy: &'static [f32] = Box::leak(factors.clone().into_boxed_slice());
        let mut rope = Rope {
            style: RopeStyle::Halves,
            dims: 64,
            base: 10_000.0,
            freq_scale: 0.5,
            factors: Some(copy),
        };
        let x = rounded(&rng.vec(n * ld, -2.0, 2.0), dt);
        let mut buf = put(&mut b, dt, &x, n, ld);
        let before = b.emulation().map(|e| e.live_allocations());
        b.rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &geometry(rope))
            .unwrap();
        assert_eq!(before, b.emulation().map(|e| e.live_allocations()));
        let want = reference(&x, &[rope]);
        let e = worst(&get(&mut b, &buf), &want, 2e-5, out_rtol(dt) + 1e-5);
        assert!(e <= 1.0, "copied factors {}: worst {e}", dt.name());
        rope.factors = Some(&copy[..31]);
        let e = b
            .rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &geometry(rope))
            .unwrap_err();
        assert!(e.to_string().contains("31 frequency factors"), "{e}");

        // Two bases on one step, one after the other: local, global, local.
        let local = Rope::plain(RopeStyle::Halves, 64, 10_000.0, 1.0);
        let global = Rope::plain(RopeStyle::Halves, 64, 1_000_000.0, 1.0);
        let x = rounded(&rng.vec(n * ld, -2.0, 2.0), dt);
        let mut buf = put(&mut b, dt, &x, n, ld);
        take_launches(&b);
        for rope in [local, global, local] {
            b.rope(ViewMut::rows(&mut buf, n, ld).unwrap(), &geometry(rope))
                .unwrap();
        }
        assert_launched(&b, vec![format!("rope_{}", dt.name()); 3]);
        let got = get(&mut b, &buf);
        let want = reference(&x, &[local, global, local]);
        let e = worst(&got, &want, 4e-5, 3.0 * out_rtol(dt) + 2e-5);
        assert!(e <= 1.0, "two bases {}: worst {e}", dt.name());
    }
}

pub fn swiglu_add_and_bias_match_the_reference(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(4);
        let (rows, ff) = (3, 300);
        // gate | up in one row, as the fused projection writes them.
        let gu = rounded(&rng.vec(rows * 2 * ff, -6.0, 6.0), dt);
        let gub = put(&mut b, dt, &gu, rows, 2 * ff);
        let mut out = b.alloc(dt, rows * ff).unwrap();
        let v = View::rows(&gub, rows, 2 * ff).unwrap();
        take_launches(&b);
        b.swiglu(
            v.col_range(0, ff).unwrap(),
            v.col_range(ff, ff).unwrap(),
            ViewMut::rows(&mut out, rows, ff).unwrap(),
        )
        .unwrap();
        assert_launched(&b, vec![format!("swiglu_{}", dt.name())]);
        let mut want = vec![0f32; rows * ff];
        for ((g_u, w), _) in gu.chunks(2 * ff).zip(want.chunks_mut(ff)).zip(0..rows) {
            cpu_ew::swiglu(Isa::Scalar, &g_u[..ff], &g_u[ff..], w);
        }
        let got = get(&mut b, &out);
        assert!(worst(&got, &want, 1e-5, out_rtol(dt) + 1e-5) <= 1.0);

        // x += y, then x += bias (a bf16 bias vector: vectors may be of any float dtype).
        let x = rounded(&rng.vec(rows * ff, -1.0, 1.0), dt);
        let y = rounded(&rng.vec(rows * ff, -1.0, 1.0), dt);
        let bias = rounded(&rng.vec(ff, -1.0, 1.0), DType::BF16);
        let mut xb = put(&mut b, dt, &x, rows, ff);
        let yb = put(&mut b, dt, &y, rows, ff);
        let bb = put(&mut b, DType::BF16, &bias, 1, ff);
        b.add(
            ViewMut::rows(&mut xb, rows, ff).unwrap(),
            View::rows(&yb, rows, ff).unwrap(),
        )
        .unwrap();
        b.add_bias(ViewMut::rows(&mut xb, rows, ff).unwrap(), &bb)
            .unwrap();
        assert_launched(
            &b,
            vec![
                format!("add_{}", dt.name()),
                format!("add_bias_{}", dt.name()),
            ],
        );
        let want: Vec<f32> = (0..rows * ff)
            .map(|i| {
                let s = rounded(&[x[i] + y[i]], dt)[0];
                s + bias[i % ff]
            })
            .collect();
        let got = get(&mut b, &xb);
        assert!(
            worst(&got, &want, 1e-6, out_rtol(dt)) <= 1.0,
            "{}",
            dt.name()
        );
    }
}

pub fn gather_and_argmax_pick_the_right_rows(make: Make) {
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        let mut rng = Rng::new(5);
        let (n, cols) = (7, 1000);
        let mut s = one_seq_step(&mut b, vec![1; n]);
        s.logit_rows = vec![6, 0, 3];
        b.begin_step(&s).unwrap();
        let x = rounded(&rng.vec(n * cols, -4.0, 4.0), dt);
        let xb = put(&mut b, dt, &x, n, cols);
        let mut g = b.alloc(dt, 3 * cols).unwrap();
        b.gather_logit_rows(
            View::rows(&xb, n, cols).unwrap(),
            ViewMut::rows(&mut g, 3, cols).unwrap(),
        )
        .unwrap();
        let got = get(&mut b, &g);
        for (i, &r) in s.logit_rows.iter().enumerate() {
            assert_eq!(
                &got[i * cols..(i + 1) * cols],
                &x[r as usize * cols..(r as usize + 1) * cols]
            );
        }
        // Argmax: a tie (first index wins), a NaN (counts as -inf), an all -inf row.
        let mut l = rounded(&rng.vec(4 * cols, -4.0, 4.0), dt);
        l[17] = 50.0;
        l[900] = 50.0;
        l[cols + 5] = f32::NAN;
        l[cols + 600] = 9.0;
        for v in &mut l[2 * cols..3 * cols] {
            *v = f32::NEG_INFINITY;
        }
        l[3 * cols + cols - 1] = 99.0;
        let lb = put(&mut b, dt, &l, 4, cols);
        let mut ids = b.alloc(DType::I32, 4).unwrap();
        take_launches(&b);
        let ran = b
            .argmax_rows(
                View::rows(&lb, 4, cols).unwrap(),
                ViewMut::rows(&mut ids, 4, 1).unwrap(),
            )
            .unwrap();
        assert!(ran, "the CUDA backend has a device argmax");
        assert_launched(&b, vec![format!("argmax_{}", dt.name())]);
        let mut out = [0i32; 4];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, 4, 1).unwrap(),
            dst: HostSliceMut::I32(&mut out),
        }])
        .unwrap();
        assert_eq!(out, [17, 600, 0, cols as i32 - 1], "{}", dt.name());
        // The pick's log-probability, as the sampler computes it from the same values (an +inf
        // counts as the largest float; a row with nothing finite is uniform).
        l[cols + 7] = f32::INFINITY;
        let lb = put(&mut b, dt, &l, 4, cols);
        let held = get(&mut b, &lb);
        let mut lps = b.alloc(DType::F32, 4).unwrap();
        take_launches(&b);
        let ran = b
            .argmax_logprob_rows(
                View::rows(&lb, 4, cols).unwrap(),
                ViewMut::rows(&mut lps, 4, 1).unwrap(),
            )
            .unwrap();
        assert!(ran, "the CUDA backend has a device log-probability");
        assert_launched(&b, vec![format!("argmax_logprob_{}", dt.name())]);
        let got = get(&mut b, &lps);
        for (r, row) in held.chunks(cols).enumerate() {
            let want = npu_backend_cpu::kernels::scan::max_logprob_sanitized(row);
            assert!(
                (got[r] - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{} row {r}: {} vs {want}",
                dt.name(),
                got[r]
            );
        }
    }
}

pub fn uploads_and_reads_strided_windows(make: Make) {
    let Some(mut b) = make(DType::BF16, MatmulMode::Auto) else {
        return;
    };
    let mut buf = b.alloc(DType::F32, 20).unwrap();
    let win = Layout::new(2, 3, 4, 6).unwrap();
    let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
    b.upload(HostSlice::F32(&v), ViewMut::new(&mut buf, win).unwrap())
        .unwrap();
    let all = get(&mut b, &buf);
    assert_eq!(&all[2..6], &v[0..4]);
    assert_eq!(&all[6..8], &[0.0, 0.0]);
    assert_eq!(&all[8..12], &v[4..8]);
    let mut back = vec![0f32; 12];
    b.read_back(&mut [Readback {
        src: View::new(&buf, win).unwrap(),
        dst: HostSliceMut::F32(&mut back),
    }])
    .unwrap();
    assert_eq!(back, v);
    // Wrong kinds and lengths are refused with the op's name.
    let mut ib = b.alloc(DType::I32, 4).unwrap();
    let e = b
        .upload(
            HostSlice::F32(&v[..4]),
            ViewMut::rows(&mut ib, 1, 4).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("upload"), "{e}");
    let e = b
        .upload(HostSlice::F32(&v), ViewMut::rows(&mut buf, 1, 4).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("upload"), "{e}");
}

pub fn ops_refuse_bad_shapes_steps_and_foreign_buffers(make: Make) {
    let Some(mut b) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let Some(mut other) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let x = b.alloc(DType::F16, 64).unwrap();
    let mut y = b.alloc(DType::F16, 64).unwrap();
    let foreign = other.alloc(DType::F16, 64).unwrap();
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&foreign, 2, 32).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("another backend"), "{e}");
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&x, 4, 16).unwrap(),
        )
        .unwrap_err();
    assert!(
        matches!(e, BackendError::BadArgument { op: "add", .. }),
        "{e}"
    );
    let f = b.alloc(DType::F32, 64).unwrap();
    let e = b
        .add(
            ViewMut::rows(&mut y, 2, 32).unwrap(),
            View::rows(&f, 2, 32).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("one dtype"), "{e}");
    // A step may begin before the KV pool exists (token ops only); KV ops need the pool.
    b.begin_step(&StepInputs::default()).unwrap();
    let e = b.kv_copy_blocks(&[(0, 1)]).unwrap_err();
    assert!(e.to_string().contains("KV pool"), "{e}");
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 2,
        block_size: 4,
        n_kv_heads: 1,
        head_dim: 8,
    })
    .unwrap();
    let bad = StepInputs {
        tokens: vec![1],
        positions: vec![0],
        slot_mapping: vec![8],
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: 1,
            start_pos: 0,
        }],
        block_tables: vec![0],
        max_blocks: 1,
        logit_rows: vec![0],
    };
    let e = b.begin_step(&bad).unwrap_err();
    assert!(matches!(e, BackendError::BadStep(_)), "{e}");
    drop(other);
}
