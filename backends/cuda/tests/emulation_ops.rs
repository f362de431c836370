//! Each op of the CUDA backend run on the CPU EMULATION of its kernels (the same .cu sources
//! compiled as C++, see src/emu), checked against the CPU backend's reference kernels. This
//! verifies the kernels' arithmetic and indexing and the backend's checks and parameter packing;
//! it is not a GPU run (tests/gpu_conformance.rs runs the same cases on a GPU).

mod common;

use common::conformance;
use common::emulated;

#[test]
fn embed_dequantizes_each_table_format_on_lookup() {
    conformance::embed_dequantizes_each_table_format_on_lookup(&emulated);
}

#[test]
fn rms_norm_matches_the_reference() {
    conformance::rms_norm_matches_the_reference(&emulated);
}

#[test]
fn fused_launches_match_the_unfused_ones() {
    conformance::fused_launches_match_the_unfused_ones(&emulated);
}

#[test]
fn gemv_folds_match_the_unfused_ones() {
    conformance::gemv_folds_match_the_unfused_ones(&emulated);
}

#[test]
fn gemv_rope_fold_matches_the_unfused_ones() {
    conformance::gemv_rope_fold_matches_the_unfused_ones(&emulated);
}

#[test]
fn fused_ffn_matches_the_gemv_folds() {
    conformance::fused_ffn_matches_the_gemv_folds(&emulated);
}

#[test]
fn attention_out_fold_matches_the_separate_launches() {
    conformance::attention_out_fold_matches_the_separate_launches(&emulated);
}

#[test]
fn attention_writes_the_output_projections_activations() {
    conformance::attention_writes_the_output_projections_activations(&emulated);
}

#[test]
fn rope_matches_the_reference_in_both_styles() {
    conformance::rope_matches_the_reference_in_both_styles(&emulated);
}

#[test]
fn swiglu_add_and_bias_match_the_reference() {
    conformance::swiglu_add_and_bias_match_the_reference(&emulated);
}

#[test]
fn gather_and_argmax_pick_the_right_rows() {
    conformance::gather_and_argmax_pick_the_right_rows(&emulated);
}

#[test]
fn paged_attention_mixes_prefill_chunks_and_decodes_with_gqa() {
    conformance::paged_attention_mixes_prefill_chunks_and_decodes_with_gqa(&emulated);
}

#[test]
fn paged_attention_splits_long_contexts() {
    conformance::paged_attention_splits_long_contexts(&emulated);
}

#[test]
fn paged_attention_slides_a_window() {
    conformance::paged_attention_slides_a_window(&emulated);
}

#[test]
fn int8_kv_pool_is_sized_and_copied_as_the_cpus() {
    conformance::int8_kv_pool_is_sized_and_copied_as_the_cpus(&emulated);
}

#[test]
fn int8_kv_writes_leave_the_cpus_bytes() {
    conformance::int8_kv_writes_leave_the_cpus_bytes(&emulated);
}

#[test]
fn int8_paged_attention_matches_the_cpu_backend() {
    conformance::int8_paged_attention_matches_the_cpu_backend(&emulated);
}

#[test]
fn head_norm_geglu_and_scale_match_the_reference() {
    conformance::head_norm_geglu_and_scale_match_the_reference(&emulated);
}

#[test]
fn rope_factors_and_per_layer_bases_match_the_reference() {
    conformance::rope_factors_and_per_layer_bases_match_the_reference(&emulated);
}

#[test]
fn kv_blocks_copy_on_the_device() {
    conformance::kv_blocks_copy_on_the_device(&emulated);
}

#[test]
fn matmul_paths_match_their_references() {
    conformance::matmul_paths_match_their_references(&emulated);
}

#[test]
fn wide_gemv_matches_the_plain_one() {
    conformance::wide_gemv_matches_the_plain_one(&emulated);
}

#[test]
fn quantized_matmul_is_batch_invariant() {
    conformance::quantized_matmul_is_batch_invariant(&emulated);
}

#[test]
fn uploads_and_reads_strided_windows() {
    conformance::uploads_and_reads_strided_windows(&emulated);
}

#[test]
fn ops_refuse_bad_shapes_steps_and_foreign_buffers() {
    conformance::ops_refuse_bad_shapes_steps_and_foreign_buffers(&emulated);
}

#[test]
fn moe_routes_and_runs_experts_as_the_reference() {
    conformance::moe_routes_and_runs_experts_as_the_reference(&emulated);
}

#[test]
fn scored_routing_matches_the_reference() {
    conformance::scored_routing_matches_the_reference(&emulated);
}

#[test]
fn latent_attention_matches_the_reference() {
    conformance::latent_attention_matches_the_reference(&emulated);
}

#[test]
fn latent_pool_refusals() {
    conformance::latent_pool_refusals(&emulated);
}

#[test]
fn lora_groups_match_the_cpu_backend() {
    conformance::lora_groups_match_the_cpu_backend(&emulated);
}

#[test]
fn packed_kquant_gemvs_match_the_f16_path() {
    conformance::packed_kquant_gemvs_match_the_f16_path(&emulated);
}

#[test]
fn tiled_kquant_gemm_matches_the_gemv() {
    conformance::tiled_kquant_gemm_matches_the_gemv(&emulated);
}

/// Every kernel of the program is launched, and checked, by some case above: no op runs a
/// kernel the conformance cases never exercise.
#[test]
fn every_kernel_has_a_conformance_case() {
    if emulated(
        npu_backend::DType::F32,
        npu_backend_cuda::MatmulMode::Quantized,
    )
    .is_none()
    {
        return;
    }
    for (_, case) in conformance::CASES {
        case(&emulated);
    }
    let launched = npu_backend_cuda::emu::kernels_launched_in_process();
    let missing: Vec<String> = npu_backend_cuda::kernels::kernel_names()
        .into_iter()
        // f16 weights with f16 activations go to cuBLAS as they are: no dequantization.
        .filter(|n| n != "dequant_f16w_f16" && !launched.contains(n))
        .collect();
    assert!(missing.is_empty(), "kernels no case launched: {missing:?}");
}

/// A step may begin before the KV pool exists: token ops run, KV ops say there is no pool, and
/// making the pool forgets that step (a KV op then needs a step checked against the pool). A
/// step's tokens may belong to no sequence: token ops run, attention refuses.
#[test]
fn token_ops_run_before_the_kv_pool_exists() {
    use npu_backend::{Backend, DType, KvSpec, SeqSpan, StepInputs, View, ViewMut};
    use npu_model::{Rope, RopeStyle};
    let Some(mut b) = emulated(DType::F32, npu_backend_cuda::MatmulMode::Auto) else {
        return;
    };
    let s = StepInputs {
        tokens: vec![1, 2],
        positions: vec![0, 1],
        slot_mapping: vec![0, 1],
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: 2,
            start_pos: 0,
        }],
        block_tables: vec![0],
        max_blocks: 1,
        logit_rows: vec![1],
    };
    b.begin_step(&s).unwrap();
    let g = npu_backend::AttnGeometry {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 32,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: 32,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0,
        window: None,
    };
    let mut qk = b.alloc(DType::F32, 2 * 64).unwrap();
    b.rope(ViewMut::rows(&mut qk, 2, 64).unwrap(), &g).unwrap();
    let kv = b.alloc(DType::F32, 2 * 32).unwrap();
    let e = b
        .kv_write(
            View::rows(&kv, 2, 32).unwrap(),
            View::rows(&kv, 2, 32).unwrap(),
            &g,
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("KV pool is not initialised"), "{e}");
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 4,
        block_size: 16,
        n_kv_heads: 1,
        head_dim: 32,
    })
    .unwrap();
    let e = b
        .kv_write(
            View::rows(&kv, 2, 32).unwrap(),
            View::rows(&kv, 2, 32).unwrap(),
            &g,
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("no step has begun"), "{e}");
    b.begin_step(&s).unwrap();
    b.kv_write(
        View::rows(&kv, 2, 32).unwrap(),
        View::rows(&kv, 2, 32).unwrap(),
        &g,
        0,
    )
    .unwrap();
    // Tokens that belong to no sequence: token ops run, attention says why not.
    let lone = StepInputs {
        seqs: Vec::new(),
        block_tables: Vec::new(),
        logit_rows: Vec::new(),
        ..s
    };
    b.begin_step(&lone).unwrap();
    b.rope(ViewMut::rows(&mut qk, 2, 64).unwrap(), &g).unwrap();
    let mut out = b.alloc(DType::F32, 2 * 32).unwrap();
    let e = b
        .attention(
            View::rows(&qk, 2, 32).unwrap(),
            &g,
            0,
            ViewMut::rows(&mut out, 2, 32).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("without sequences"), "{e}");
}

/// Review finding 6: in `auto` mode a long step dequantizes each matrix into a scratch area as
/// large as the largest matrix in the activation dtype (2 GiB for a 128k x 4096 head in f32).
/// It is made while the matrices load, before the KV pool is sized from the free memory, so
/// the first long prompt allocates nothing on the device.
#[test]
fn auto_mode_takes_its_weight_scratch_while_loading() {
    use npu_backend::{Backend, DType, HostTensor, View, ViewMut};
    use npu_backend_cuda::MatmulMode;
    let Some(mut b) = emulated(DType::F32, MatmulMode::Auto) else {
        return;
    };
    let mut rng = common::Rng::new(3);
    let (n, k) = (512, 256);
    let before = b.mem_info().unwrap().free;
    let data = common::random_tensor(&mut rng, npu_gguf::GgmlType::Q4_0, n, k);
    let m = b
        .load_matrix(&[HostTensor {
            ty: npu_gguf::GgmlType::Q4_0,
            data: &data,
            rows: n,
            cols: k,
        }])
        .unwrap()
        .unwrap();
    let loaded = b.mem_info().unwrap().free;
    assert!(
        before - loaded >= (n * k * 4) as u64,
        "the scratch of a {n}x{k} matrix in f32 is taken at load ({} bytes taken)",
        before - loaded
    );
    let rows = 40; // beyond the GEMV limit: dequantize + GEMM
    let x = common::put(&mut b, DType::F32, &rng.vec(rows * k, -1.0, 1.0), rows, k);
    let mut out = b.alloc(DType::F32, rows * n).unwrap();
    let ready = b.mem_info().unwrap().free;
    b.matmul(
        View::rows(&x, rows, k).unwrap(),
        &m,
        ViewMut::rows(&mut out, rows, n).unwrap(),
    )
    .unwrap();
    b.synchronize().unwrap();
    assert_eq!(
        b.mem_info().unwrap().free,
        ready,
        "the first long matmul allocated device memory"
    );
}

/// Review finding 9: a head size the attention kernel cannot read (odd, or over 256) is refused
/// when the KV pool is made, as the model loads, not at its first step.
#[test]
fn kv_pools_of_heads_attention_cannot_read_are_refused_when_made() {
    use npu_backend::{Backend, BackendError, DType, KvSpec};
    use npu_backend_cuda::MatmulMode;
    let Some(mut b) = emulated(DType::F32, MatmulMode::Quantized) else {
        return;
    };
    for head_dim in [300, 63] {
        let e = b
            .init_kv(KvSpec {
                n_layers: 1,
                num_blocks: 4,
                block_size: 16,
                n_kv_heads: 1,
                head_dim,
            })
            .unwrap_err();
        assert!(matches!(e, BackendError::Unsupported { .. }), "{e}");
        assert!(
            e.to_string().contains(&format!("heads of {head_dim}")),
            "{e}"
        );
    }
    b.init_kv(KvSpec {
        n_layers: 1,
        num_blocks: 4,
        block_size: 16,
        n_kv_heads: 1,
        head_dim: 256,
    })
    .unwrap();
}
