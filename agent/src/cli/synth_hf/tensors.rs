//! The weights of a Hugging Face twin: each GGUF tensor dequantized to f32 and laid out as the
//! transformers module holds it (`[out, in]` matrices, Llama's q/k rows in Hugging Face's rotary
//! order, Gemma's norms minus one, Qwen3-MoE's experts one module each), in `state_dict` order.

use npu_gguf::quants::dequantize_row;
use npu_gguf::{GgmlType, GgufFile};

use super::{tensor_err, Arch, HfDtype, HfTwinError, Hp};

/// One tensor to write, in the chosen dtype.
pub(super) struct Out {
    pub(super) name: String,
    /// The element type written (f32 vectors stay f32 in a 16-bit twin).
    pub(super) dtype: HfDtype,
    pub(super) shape: Vec<usize>,
    pub(super) data: Vec<u8>,
}

/// A GGUF tensor's values as f32, row-major over its ggml dims reversed (Hugging Face's
/// `[out, in]` of a matrix).
pub(super) fn tensor_f32(g: &GgufFile, name: &str) -> Result<Vec<f32>, HfTwinError> {
    let (info, bytes) = g
        .tensor(name)
        .map_err(|e| tensor_err(name, e.to_string()))?;
    if !matches!(
        info.ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4K
    ) && info.ty.block_len() == 0
    {
        return Err(tensor_err(name, format!("type {}", info.ty.name())));
    }
    let row_len = info.row_len();
    let row_bytes = info
        .ty
        .row_bytes(row_len)
        .ok_or_else(|| tensor_err(name, format!("rows of {row_len} are not whole blocks")))?;
    let mut out = vec![0f32; info.n_elements() as usize];
    if row_len == 0 {
        return Ok(out);
    }
    for (src, dst) in bytes
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(row_len))
    {
        dequantize_row(info.ty, src, dst).map_err(|e| tensor_err(name, e.to_string()))?;
    }
    Ok(out)
}

/// Hugging Face's row order of a Llama q/k projection (or bias) from llama.cpp's: the converter
/// maps HF row `h*hd + s*hd/2 + j` to GGUF row `h*hd + 2j + s` (its `LlamaModel.permute`); this
/// is the inverse. `rows` holds `n_head * hd` rows of `row_len` values.
pub fn unpermute_rows(v: &[f32], n_head: usize, row_len: usize) -> Vec<f32> {
    let rows = v.len() / row_len.max(1);
    let hd = rows / n_head.max(1);
    let mut out = vec![0f32; v.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for j in 0..hd / 2 {
                let hf = h * hd + s * (hd / 2) + j;
                let gg = h * hd + 2 * j + s;
                out[hf * row_len..(hf + 1) * row_len]
                    .copy_from_slice(&v[gg * row_len..(gg + 1) * row_len]);
            }
        }
    }
    out
}

/// Gemma's Hugging Face norm weight `w - 1`, refused unless `(w - 1) + 1 == w` in f32 for
/// every value (the converter adds the one back in f32).
pub fn gemma_norm_minus_one(name: &str, w: &[f32]) -> Result<Vec<f32>, HfTwinError> {
    w.iter()
        .enumerate()
        .map(|(index, &value)| {
            let m = value - 1.0;
            let back = m + 1.0;
            if back.to_bits() == value.to_bits() {
                Ok(m)
            } else {
                Err(HfTwinError::GemmaNorm {
                    name: name.to_string(),
                    index,
                    value,
                    bits: value.to_bits(),
                    back,
                })
            }
        })
        .collect()
}

pub(super) fn hf_tensors(g: &GgufFile, hp: &Hp, dtype: HfDtype) -> Result<Vec<Out>, HfTwinError> {
    let mut used: Vec<String> = vec!["rope_freqs.weight".into()];
    let mut out: Vec<Out> = Vec::new();
    let gemma = hp.arch == Arch::Gemma3;
    // One GGUF tensor as one HF tensor of the reversed dims.
    let one = |gguf_name: &str,
               hf_name: String,
               fix: &dyn Fn(Vec<f32>) -> Result<Vec<f32>, HfTwinError>,
               required: bool,
               (used, out): (&mut Vec<String>, &mut Vec<Out>)|
     -> Result<(), HfTwinError> {
        let Some(info) = g.tensor_info(gguf_name) else {
            return match required {
                true => Err(tensor_err(gguf_name, "missing")),
                false => Ok(()),
            };
        };
        let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let v = fix(tensor_f32(g, gguf_name)?)?;
        used.push(gguf_name.to_string());
        // What the GGUF holds in f32 (norms, biases, the MoE router) stays f32 in a 16-bit twin:
        // checkpoints may mix dtypes, and the converter writes these as f32 anyway, so the twin
        // converts back to the same file and loads as the same model.
        let dtype = if info.ty == GgmlType::F32 {
            HfDtype::F32
        } else {
            dtype
        };
        out.push(Out {
            name: hf_name,
            dtype,
            shape,
            data: dtype.encode(&v),
        });
        Ok(())
    };
    let keep = |v: Vec<f32>| Ok(v);
    let norm = |name: String| {
        move |v: Vec<f32>| -> Result<Vec<f32>, HfTwinError> {
            if gemma {
                gemma_norm_minus_one(&name, &v)
            } else {
                Ok(v)
            }
        }
    };
    let h = hp.hidden;
    one(
        "token_embd.weight",
        "model.embed_tokens.weight".into(),
        &keep,
        true,
        (&mut used, &mut out),
    )?;
    for i in 0..hp.layers {
        if let Some(d) = &hp.deepseek {
            super::deepseek::layer(g, hp, d, i, dtype, &mut used, &mut out)?;
            continue;
        }
        let gn = |t: &str| format!("blk.{i}.{t}");
        let hn = |t: &str| format!("model.layers.{i}.{t}");
        let llama = hp.arch == Arch::Llama;
        let (heads, kv) = (hp.heads, hp.kv_heads);
        for (t, proj, n_head) in [
            ("q", "q_proj", heads),
            ("k", "k_proj", kv),
            ("v", "v_proj", 0),
        ] {
            let fix_w = move |v: Vec<f32>| {
                Ok(if llama && n_head > 0 {
                    unpermute_rows(&v, n_head, h)
                } else {
                    v
                })
            };
            let fix_b = move |v: Vec<f32>| {
                Ok(if llama && n_head > 0 {
                    unpermute_rows(&v, n_head, 1)
                } else {
                    v
                })
            };
            one(
                &gn(&format!("attn_{t}.weight")),
                hn(&format!("self_attn.{proj}.weight")),
                &fix_w,
                true,
                (&mut used, &mut out),
            )?;
            one(
                &gn(&format!("attn_{t}.bias")),
                hn(&format!("self_attn.{proj}.bias")),
                &fix_b,
                false,
                (&mut used, &mut out),
            )?;
        }
        one(
            &gn("attn_output.weight"),
            hn("self_attn.o_proj.weight"),
            &keep,
            true,
            (&mut used, &mut out),
        )?;
        for t in ["q", "k"] {
            let hf = hn(&format!("self_attn.{t}_norm.weight"));
            one(
                &gn(&format!("attn_{t}_norm.weight")),
                hf.clone(),
                &norm(hf),
                matches!(hp.arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
                (&mut used, &mut out),
            )?;
        }
        if hp.experts > 0 {
            one(
                &gn("ffn_gate_inp.weight"),
                hn("mlp.gate.weight"),
                &keep,
                true,
                (&mut used, &mut out),
            )?;
            experts(g, hp, i, dtype, &mut used, &mut out)?;
        } else {
            for t in ["gate", "up", "down"] {
                one(
                    &gn(&format!("ffn_{t}.weight")),
                    hn(&format!("mlp.{t}_proj.weight")),
                    &keep,
                    true,
                    (&mut used, &mut out),
                )?;
            }
        }
        let norms: &[(&str, &str)] = if gemma {
            &[
                ("attn_norm", "input_layernorm"),
                ("post_attention_norm", "post_attention_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"),
            ]
        } else {
            &[
                ("attn_norm", "input_layernorm"),
                ("ffn_norm", "post_attention_layernorm"),
            ]
        };
        for (t, hf) in norms {
            let hf = hn(&format!("{hf}.weight"));
            one(
                &gn(&format!("{t}.weight")),
                hf.clone(),
                &norm(hf),
                true,
                (&mut used, &mut out),
            )?;
        }
    }
    one(
        "output_norm.weight",
        "model.norm.weight".into(),
        &norm("model.norm.weight".into()),
        true,
        (&mut used, &mut out),
    )?;
    one(
        "output.weight",
        "lm_head.weight".into(),
        &keep,
        false,
        (&mut used, &mut out),
    )?;
    if let Some(extra) = g.tensors().iter().find(|t| !used.contains(&t.name)) {
        return Err(tensor_err(
            &extra.name,
            "has no place in the Hugging Face model written",
        ));
    }
    Ok(out)
}

/// Qwen3-MoE's (and DeepSeek's routed) stacked experts (`ffn_{gate,up,down}_exps`, ggml dims
/// `[in, out, experts]`) as one `mlp.experts.E.{gate,up,down}_proj.weight` of `[out, in]` per
/// expert, in module order.
pub(super) fn experts(
    g: &GgufFile,
    hp: &Hp,
    layer: usize,
    dtype: HfDtype,
    used: &mut Vec<String>,
    out: &mut Vec<Out>,
) -> Result<(), HfTwinError> {
    let mut stacks = Vec::new();
    for t in ["gate", "up", "down"] {
        let name = format!("blk.{layer}.ffn_{t}_exps.weight");
        let info = g
            .tensor_info(&name)
            .ok_or_else(|| tensor_err(&name, "missing"))?;
        if info.dims.len() != 3 || info.dims[2] as usize != hp.experts {
            return Err(tensor_err(
                &name,
                format!("dims {:?} for {} experts", info.dims, hp.experts),
            ));
        }
        let shape = vec![info.dims[1] as usize, info.dims[0] as usize];
        stacks.push((t, shape, tensor_f32(g, &name)?));
        used.push(name);
    }
    for e in 0..hp.experts {
        for (t, shape, v) in &stacks {
            let n = shape[0] * shape[1];
            out.push(Out {
                dtype,
                name: format!("model.layers.{layer}.mlp.experts.{e}.{t}_proj.weight"),
                shape: shape.clone(),
                data: dtype.encode(&v[e * n..(e + 1) * n]),
            });
        }
    }
    Ok(())
}
