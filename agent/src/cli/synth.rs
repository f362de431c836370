//! `npu-serving synth-model`: writes a tiny random-weight GGUF of one model family in llama.cpp's
//! conventions, with a donor model's tokenizer (see `npu_gguf::synth`). The same family, seed,
//! weight type and donor give a byte-identical file; its sha256 is printed. With `--hf-dir` it
//! also writes the model's Hugging Face twin (see `synth_hf`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use npu_gguf::synth::{self, Family};
use npu_gguf::GgufFile;

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Family: llama, llama3 (llama with rope_freqs and tied embeddings), qwen2, qwen3,
    /// qwen3moe or gemma3.
    #[arg(long, required_unless_present_any = ["variant", "list_variants", "from"])]
    pub arch: Option<String>,
    /// A model of the fidelity sweep by name (its family, shape, seed and weight type; see
    /// --list-variants) instead of --arch/--seed/--type.
    #[arg(long, conflicts_with_all = ["arch", "list_variants"])]
    pub variant: Option<String>,
    /// Print the fidelity sweep's model names, one a line, and exit.
    #[arg(long)]
    pub list_variants: bool,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Weight type of the matrices: f32 (the default), f16, q8_0 or q4_k (norms, biases and the
    /// router stay f32). With --variant: the variant's shape and values in this type instead of
    /// its own (so `llama-quantize` can make the quantized file from the same values).
    #[arg(long = "type")]
    pub weight_type: Option<String>,
    /// GGUF whose tokenizer.* metadata is copied (default: the default model, fetched when
    /// absent).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Also write the model's Hugging Face twin into this directory (config.json, safetensors,
    /// tokenizer.json, tokenizer_config.json, generation_config.json), as transformers would
    /// save it, so that llama.cpp's convert_hf_to_gguf.py gives the same model back. Quantized
    /// models are written dequantized (their f32 values).
    #[arg(long)]
    pub hf_dir: Option<PathBuf>,
    /// Element type of the twin's weights: f32 (the default; exact), bf16 or f16 (every value
    /// rounded to nearest even; what the GGUF holds in f32, the norms, biases and router, stays
    /// f32).
    #[arg(long, default_value = "f32", requires = "hf_dir")]
    pub hf_dtype: String,
    /// Split the twin's weights into shards of at most this many bytes (with
    /// model.safetensors.index.json), as save_pretrained's max_shard_size does.
    #[arg(long, requires = "hf_dir")]
    pub max_shard_bytes: Option<u64>,
    /// Write the Hugging Face twin of this existing GGUF file (a llama, qwen2, qwen3, qwen3moe
    /// or gemma3 model in F32/F16/BF16, or quantized, written dequantized) into --hf-dir instead
    /// of making a model: the speed figures' checkpoints (scripts/bench-hf-dir.sh).
    #[arg(long, requires = "hf_dir", conflicts_with_all = ["arch", "variant", "list_variants"])]
    pub from: Option<PathBuf>,
    /// Where to write the model.
    #[arg(required_unless_present_any = ["list_variants", "from"])]
    pub out: Option<PathBuf>,
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    if a.list_variants {
        for v in synth::sweep::variants() {
            println!("{}", v.name);
        }
        return Ok(());
    }
    if let (Some(from), Some(dir)) = (&a.from, &a.hf_dir) {
        let dtype = super::synth_hf::HfDtype::from_name(&a.hf_dtype)?;
        let gguf = GgufFile::open(from)?;
        super::synth_hf::write_hf_twin(&gguf, dir, dtype, a.max_shard_bytes)
            .with_context(|| format!("writing the Hugging Face twin into {}", dir.display()))?;
        println!("hugging face twin  {}", dir.display());
        return Ok(());
    }
    let out = a.out.context("no output path given")?;
    let donor_path = npu_gguf::store::resolve_model(a.tokenizer_from.as_deref())?;
    let donor = GgufFile::open(&donor_path)?;
    let bytes = match (&a.variant, &a.arch) {
        (Some(name), _) => {
            let v = synth::sweep::variant(name)
                .with_context(|| format!("no sweep variant {name:?} (see --list-variants)"))?;
            let ty = match &a.weight_type {
                Some(t) => synth::weight_type(t)?,
                None => v.ty,
            };
            synth::synth_model_shaped(v.family, v.shape, v.seed, ty, &donor)?
        }
        (None, Some(arch)) => {
            let family = Family::from_name(arch)?;
            let ty = synth::weight_type(a.weight_type.as_deref().unwrap_or("f32"))?;
            synth::synth_model(family, a.seed, ty, &donor)?
        }
        (None, None) => anyhow::bail!("give --arch or --variant"),
    };
    let dtype = super::synth_hf::HfDtype::from_name(&a.hf_dtype)?;
    std::fs::write(&out, &bytes).with_context(|| format!("writing {}", out.display()))?;
    println!("{}  {}", synth::sha256_hex(&bytes), out.display());
    if let Some(dir) = &a.hf_dir {
        let gguf = GgufFile::open(&out)?;
        super::synth_hf::write_hf_twin(&gguf, dir, dtype, a.max_shard_bytes)
            .with_context(|| format!("writing the Hugging Face twin into {}", dir.display()))?;
        println!("hugging face twin  {}", dir.display());
    }
    Ok(())
}
