//! Hugging Face model directories as files: the safetensors shards (`safetensors`, with the
//! index that shards them), the JSON files a directory carries (`config.json`,
//! `generation_config.json`, ...), where a model named `ORG/NAME` lies in the local hub cache
//! (`hub`), and a writer of safetensors files for tools and tests (`writer`). What the files
//! mean as a model (hyper-parameters, tensor names) is `npu-model`'s business, not this crate's.

pub mod generation;
pub mod hub;
pub mod safetensors;
pub mod writer;
