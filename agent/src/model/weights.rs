//! Loads a Llama-family model's tensors from GGUF onto a Backend, checking every shape, and fusing
//! Q/K/V and gate/up projections into single matrices where their formats allow.

use npu_backend::legacy::{Backend, TensorPart};
use npu_gguf::{GgufFile, TensorInfo};

use super::{ModelConfig, ModelError};

/// A projection stored as one matrix, or as several whose outputs go to consecutive columns.
pub enum Proj<M> {
    Fused(M),
    /// (matrix, first output column).
    Split(Vec<(M, usize)>),
}

pub struct Layer<B: Backend> {
    pub attn_norm: B::Buf,
    pub qkv: Proj<B::Matrix>,
    pub qkv_bias: Option<B::Buf>,
    pub wo: B::Matrix,
    pub ffn_norm: B::Buf,
    pub gate_up: Proj<B::Matrix>,
    pub down: B::Matrix,
}

pub struct Weights<B: Backend> {
    pub embed: B::Embedding,
    pub layers: Vec<Layer<B>>,
    pub out_norm: B::Buf,
    pub head: B::Matrix,
    /// Some weights were re-quantized on load (formats without an exact packed form).
    pub lossy: bool,
}

/// Looks up a tensor and checks its shape (ggml order: row length first).
fn tensor<'a>(
    f: &'a GgufFile,
    name: &str,
    dims: &[usize],
) -> Result<(&'a TensorInfo, &'a [u8]), ModelError> {
    let (info, data) = f.tensor(name)?;
    let got: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
    let mut want = dims.to_vec();
    // Trailing dimensions of 1 are the same shape.
    let mut g = got.clone();
    while g.len() > 1 && g.last() == Some(&1) {
        g.pop();
    }
    while want.len() > 1 && want.last() == Some(&1) {
        want.pop();
    }
    if g != want {
        return Err(ModelError::Inconsistent(format!(
            "tensor {name} has shape {got:?}, expected {dims:?}"
        )));
    }
    Ok((info, data))
}

fn part<'a>(
    f: &'a GgufFile,
    name: &str,
    k: usize,
    rows: usize,
) -> Result<TensorPart<'a>, ModelError> {
    let (info, data) = tensor(f, name, &[k, rows])?;
    Ok(TensorPart {
        ty: info.ty,
        data,
        rows,
    })
}

fn vector<B: Backend>(
    f: &GgufFile,
    b: &mut B,
    name: &str,
    len: usize,
) -> Result<B::Buf, ModelError> {
    let (info, data) = tensor(f, name, &[len])?;
    let mut v = vec![0f32; len];
    npu_gguf::quants::dequantize_row(info.ty, data, &mut v);
    let mut buf = b.alloc(len)?;
    b.upload(&mut buf, &v)?;
    Ok(buf)
}

fn matrix<B: Backend>(
    b: &mut B,
    parts: &[TensorPart],
    k: usize,
) -> Result<Proj<B::Matrix>, ModelError> {
    if let Some(m) = b.load_matrix(parts, k)? {
        return Ok(Proj::Fused(m));
    }
    let mut out = Vec::new();
    let mut col = 0;
    for p in parts {
        let m = b.load_matrix(std::slice::from_ref(p), k)?.ok_or_else(|| {
            ModelError::Unsupported(format!("a {} weight matrix with {k} inputs", p.ty.name()))
        })?;
        out.push((m, col));
        col += p.rows;
    }
    Ok(Proj::Split(out))
}

fn single<B: Backend>(b: &mut B, p: TensorPart, k: usize) -> Result<B::Matrix, ModelError> {
    b.load_matrix(&[p], k)?.ok_or_else(|| {
        ModelError::Unsupported(format!("a {} weight matrix with {k} inputs", p.ty.name()))
    })
}

impl<B: Backend> Weights<B> {
    pub fn load(f: &GgufFile, cfg: &ModelConfig, b: &mut B) -> Result<Self, ModelError> {
        let h = cfg.hidden;
        let qd = cfg.n_heads * cfg.head_dim;
        let kvd = cfg.n_kv_heads * cfg.head_dim;
        let (emb_info, emb_data) = tensor(f, "token_embd.weight", &[h, cfg.vocab])?;
        let emb_part = TensorPart {
            ty: emb_info.ty,
            data: emb_data,
            rows: cfg.vocab,
        };
        let embed = b.load_embedding(emb_part, h)?;
        let mut lossy = false;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let q = part(f, &n("attn_q.weight"), h, qd)?;
            let k = part(f, &n("attn_k.weight"), h, kvd)?;
            let v = part(f, &n("attn_v.weight"), h, kvd)?;
            let qkv = matrix(b, &[q, k, v], h)?;
            let qkv_bias = if cfg.qkv_bias {
                let mut bias = vec![0f32; qd + 2 * kvd];
                for (name, at, len) in [
                    ("attn_q.bias", 0, qd),
                    ("attn_k.bias", qd, kvd),
                    ("attn_v.bias", qd + kvd, kvd),
                ] {
                    let (info, data) = tensor(f, &n(name), &[len])?;
                    npu_gguf::quants::dequantize_row(info.ty, data, &mut bias[at..at + len]);
                }
                let mut buf = b.alloc(bias.len())?;
                b.upload(&mut buf, &bias)?;
                Some(buf)
            } else {
                None
            };
            let wo = single(b, part(f, &n("attn_output.weight"), qd, h)?, qd)?;
            let gate = part(f, &n("ffn_gate.weight"), h, cfg.ff)?;
            let up = part(f, &n("ffn_up.weight"), h, cfg.ff)?;
            let gate_up = matrix(b, &[gate, up], h)?;
            let down = single(b, part(f, &n("ffn_down.weight"), cfg.ff, h)?, cfg.ff)?;
            for p in [q, k, v, gate, up] {
                lossy |=
                    npu_backend_cpu::quant::packed::PackFormat::for_type(p.ty).is_some_and(|x| x.1);
            }
            layers.push(Layer {
                attn_norm: vector(f, b, &n("attn_norm.weight"), h)?,
                qkv,
                qkv_bias,
                wo,
                ffn_norm: vector(f, b, &n("ffn_norm.weight"), h)?,
                gate_up,
                down,
            });
        }
        let out_norm = vector(f, b, "output_norm.weight", h)?;
        let head_part = if f.tensor_info("output.weight").is_some() {
            part(f, "output.weight", h, cfg.vocab)?
        } else {
            emb_part
        };
        lossy |=
            npu_backend_cpu::quant::packed::PackFormat::for_type(head_part.ty).is_some_and(|x| x.1);
        let head = single(b, head_part, h)?;
        Ok(Self {
            embed,
            layers,
            out_norm,
            head,
            lossy,
        })
    }
}
