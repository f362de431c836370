//! A GGUF image through everything that reads one at load: the reader (header, metadata, tensor
//! table, data bounds), the hyper-parameters and each family's checks, the tokenizer and chat
//! template the file carries, and the model loader on the CPU backend (tensor names, types and
//! shapes against the family, then the weights themselves), with the KV pool kept tiny. Nothing
//! may be sized by a number the file cannot back: an allocation past the input's size is a
//! finding (AFL's memory limit catches it).

use npu_agent::model::{Model, ModelConfig, ModelOptions};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;
use npu_tokenizer::Tokenizer;

pub fn run(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data) else {
        return;
    };
    for key in file.keys() {
        let _ = file.get(key).map(|v| v.type_name());
    }
    if let Ok(tok) = Tokenizer::from_gguf(&file) {
        let ids = tok.encode("Hello, world! 123").unwrap_or_default();
        let _ = tok.decode(&ids, false);
        let _ = tok
            .chat_template()
            .map(|t| t.render(&[npu_tokenizer::ChatMessage::user("hi")], true));
    }
    let _ = load_model(&file);
}

/// The hyper-parameters' checks, then the model loader on the CPU backend with a tiny KV pool:
/// the error of the first that refuses the file.
pub fn load_model(file: &GgufFile) -> Result<(), String> {
    ModelConfig::from_gguf(file).map_err(|e| e.to_string())?;
    let backend = CpuBackend::new(CpuConfig {
        threads: 1,
        f32_reference: false,
    });
    let opts = ModelOptions {
        max_tokens: 4,
        max_logit_rows: 1,
        num_blocks: 2,
        block_size: 16,
        kv_memory_fraction: None,
    };
    Model::load(file, backend, opts)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
