//! `npu-serving synth-model`: writes a tiny random-weight GGUF of one model family in llama.cpp's
//! conventions, with a donor model's tokenizer (see `npu_gguf::synth`). The same family, seed,
//! weight type and donor give a byte-identical file; its sha256 is printed.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Family: llama, llama3 (llama with rope_freqs and tied embeddings), qwen2, qwen3,
    /// qwen3moe or gemma3.
    #[arg(long)]
    pub arch: String,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Weight type of the matrices: f32, f16 or q8_0 (norms, biases and the router stay f32).
    #[arg(long = "type", default_value = "f32")]
    pub weight_type: String,
    /// GGUF whose tokenizer.* metadata is copied (default: the default model, fetched when
    /// absent).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Where to write the model.
    pub out: PathBuf,
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    let family = Family::from_name(&a.arch)?;
    let ty = synth::weight_type(&a.weight_type)?;
    let donor_path = npu_gguf::store::resolve_model(a.tokenizer_from.as_deref())?;
    let donor = GgufFile::open(&donor_path)?;
    let bytes = synth::synth_model(family, a.seed, ty, &donor)?;
    std::fs::write(&a.out, &bytes).with_context(|| format!("writing {}", a.out.display()))?;
    println!("{}  {}", synth::sha256_hex(&bytes), a.out.display());
    Ok(())
}
