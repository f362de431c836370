//! Unit tests of the Hugging Face twin writer: the Llama q/k row order against the converter's
//! permutation, Gemma's norm check, and whole twins of tiny models (configs, tensors, refusals).

use super::*;
use npu_gguf::synth::{self, Family, RopeFactors, Shape};
use npu_gguf::writer::GgufWriter;
use npu_gguf::MetaValue;

/// convert_hf_to_gguf.py's `LlamaModel.permute` (HF row order to llama.cpp's), on rows of
/// `row_len` values: `reshape(n_head, 2, hd/2, row).swapaxes(1, 2).reshape(...)`.
fn converter_permute(v: &[f32], n_head: usize, row_len: usize) -> Vec<f32> {
    let rows = v.len() / row_len;
    let hd = rows / n_head;
    let mut out = Vec::with_capacity(v.len());
    for h in 0..n_head {
        for j in 0..hd / 2 {
            for s in 0..2 {
                let src = h * hd + s * (hd / 2) + j;
                out.extend_from_slice(&v[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

#[test]
fn llama_rows_round_trip_through_the_converters_permutation() {
    for (n_head, hd, row_len) in [(4, 8, 3), (1, 32, 5), (2, 4, 1), (8, 16, 1)] {
        let v: Vec<f32> = (0..n_head * hd * row_len).map(|i| i as f32).collect();
        let hf = unpermute_rows(&v, n_head, row_len);
        assert_ne!(hf, v, "a real reordering for {n_head}x{hd}");
        assert_eq!(converter_permute(&hf, n_head, row_len), v);
    }
}

#[test]
fn gemma_norm_check_refuses_a_value_that_w_minus_one_loses() {
    let ok = gemma_norm_minus_one("n", &[1.0, 4.25, 0.8, 27.3]).unwrap();
    assert_eq!(ok[1], 3.25);
    // 1e-9 - 1 rounds to -1 in f32, and -1 + 1 is 0, not 1e-9.
    let e = gemma_norm_minus_one("model.norm.weight", &[1.0, 1e-9]).unwrap_err();
    match &e {
        HfTwinError::GemmaNorm { index, back, .. } => {
            assert_eq!(*index, 1);
            assert_eq!(*back, 0.0);
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("model.norm.weight[1]"), "{e}");
}

#[test]
fn dtypes_round_to_nearest_even() {
    // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one, 1.0.
    let x = 1.0 + 2f32.powi(-8);
    assert_eq!(
        HfDtype::Bf16.encode(&[x]),
        half::bf16::from_f32(1.0).to_le_bytes()
    );
    assert_eq!(
        HfDtype::F16.encode(&[0.5]),
        half::f16::from_f32(0.5).to_le_bytes()
    );
    assert_eq!(HfDtype::F32.encode(&[x]), x.to_le_bytes());
    assert!(HfDtype::from_name("q8_0").is_err());
}

/// A tiny "gpt2" donor: the 256 byte-level symbols, "ab", and two control tokens.
fn donor() -> GgufFile {
    let mut w = GgufWriter::new();
    let mut tokens = vec!["<|endoftext|>".to_string(), "<|im_start|>".to_string()];
    tokens.extend((33u8..=126).map(|b| (b as char).to_string()));
    tokens.push("ab".into());
    let mut types = vec![MetaValue::I32(3), MetaValue::I32(3)];
    types.extend((2..tokens.len()).map(|_| MetaValue::I32(1)));
    let s = |x: &str| MetaValue::String(x.into());
    w.add_meta("tokenizer.ggml.model", s("gpt2"));
    w.add_meta("tokenizer.ggml.pre", s("smollm"));
    w.add_meta(
        "tokenizer.ggml.tokens",
        MetaValue::Array(tokens.iter().map(|t| s(t)).collect()),
    );
    w.add_meta("tokenizer.ggml.token_type", MetaValue::Array(types));
    w.add_meta("tokenizer.ggml.merges", MetaValue::Array(vec![s("a b")]));
    w.add_meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1));
    w.add_meta("tokenizer.ggml.eos_token_id", MetaValue::U32(0));
    w.add_meta("tokenizer.chat_template", s("{{ messages }}"));
    GgufFile::from_bytes("donor", &w.to_bytes().unwrap()).unwrap()
}

fn tiny(family: Family, factors: RopeFactors) -> GgufFile {
    let shape = Shape {
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        ff: 32,
        expert_ff: if family == Family::Qwen3Moe { 16 } else { 0 },
        rope_factors: factors,
        ..family.shape()
    };
    let bytes =
        synth::synth_model_shaped(family, shape, 3, npu_gguf::GgmlType::F32, &donor()).unwrap();
    GgufFile::from_bytes(family.name(), &bytes).unwrap()
}

fn read(dir: &Path, file: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("npu-hf-twin-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn gemma3_twin_has_the_text_config_and_norms_minus_one() {
    let g = tiny(Family::Gemma3, RopeFactors::None);
    let dir = temp_dir("gemma3");
    write_hf_twin(&g, &dir, HfDtype::F32, None).unwrap();
    let c = read(&dir, "config.json");
    assert_eq!(c["model_type"], "gemma3_text");
    assert_eq!(c["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(c["layer_types"][5], "full_attention");
    assert_eq!(c["layer_types"][4], "sliding_attention");
    assert_eq!(c["rms_norm_eps"], json!(1e-6));
    assert_eq!(c["query_pre_attn_scalar"], 16);
    assert_eq!(c["tie_word_embeddings"], true);
    let st = npu_hf::Shards::open(&dir).unwrap();
    let t = st
        .get("model.layers.0.post_feedforward_layernorm.weight")
        .unwrap();
    let hf: Vec<f32> = st
        .data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let gg = tensor_f32(&g, "blk.0.post_ffw_norm.weight").unwrap();
    assert!(hf.iter().zip(&gg).all(|(a, b)| a + 1.0 == *b));
    assert!(st.get("lm_head.weight").is_none());
    let tc = read(&dir, "tokenizer_config.json");
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["add_bos_token"], false);
    let tj = read(&dir, "tokenizer.json");
    assert_eq!(tj["model"]["merges"][0], json!(["a", "b"]));
    assert_eq!(tj["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    assert_eq!(tj["added_tokens"].as_array().unwrap().len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama3_formula_factors_become_rope_scaling_and_arbitrary_ones_are_refused() {
    let g = tiny(Family::Llama3, RopeFactors::Formula);
    let dir = temp_dir("llama3");
    write_hf_twin(&g, &dir, HfDtype::Bf16, Some(4096)).unwrap();
    let c = read(&dir, "config.json");
    assert_eq!(c["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(c["rope_scaling"]["original_max_position_embeddings"], 128);
    assert_eq!(c["torch_dtype"], "bfloat16");
    assert!(
        dir.join("model.safetensors.index.json").is_file(),
        "sharded"
    );
    let st = npu_hf::Shards::open(&dir).unwrap();
    assert!(st.get("model.layers.0.self_attn.q_proj.weight").is_some());
    std::fs::remove_dir_all(&dir).unwrap();

    let g = tiny(Family::Llama3, RopeFactors::Arbitrary);
    let e = write_hf_twin(&g, &temp_dir("arb"), HfDtype::F32, None).unwrap_err();
    assert!(matches!(e, HfTwinError::RopeFactors(_)), "{e}");
}

#[test]
fn qwen3moe_experts_are_written_one_module_each() {
    let g = tiny(Family::Qwen3Moe, RopeFactors::None);
    let dir = temp_dir("moe");
    write_hf_twin(&g, &dir, HfDtype::F32, None).unwrap();
    let c = read(&dir, "config.json");
    assert_eq!(c["model_type"], "qwen3_moe");
    assert_eq!(c["num_experts"], 8);
    assert_eq!(c["moe_intermediate_size"], 16);
    let st = npu_hf::Shards::open(&dir).unwrap();
    let down = st
        .get("model.layers.1.mlp.experts.7.down_proj.weight")
        .unwrap();
    assert_eq!(down.shape, vec![32, 16]);
    // Expert 7's slice of the stack, as is.
    let all = tensor_f32(&g, "blk.1.ffn_down_exps.weight").unwrap();
    let want: Vec<u8> = HfDtype::F32.encode(&all[7 * 512..8 * 512]);
    assert_eq!(st.data(down), &want[..]);
    assert_eq!(
        st.get("model.layers.0.mlp.gate.weight").unwrap().shape,
        vec![8, 32]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
