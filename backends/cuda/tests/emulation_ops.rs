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
fn kv_blocks_copy_on_the_device() {
    conformance::kv_blocks_copy_on_the_device(&emulated);
}

#[test]
fn matmul_paths_match_their_references() {
    conformance::matmul_paths_match_their_references(&emulated);
}

#[test]
fn uploads_and_reads_strided_windows() {
    conformance::uploads_and_reads_strided_windows(&emulated);
}

#[test]
fn ops_refuse_bad_shapes_steps_and_foreign_buffers() {
    conformance::ops_refuse_bad_shapes_steps_and_foreign_buffers(&emulated);
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
