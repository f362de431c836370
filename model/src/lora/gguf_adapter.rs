//! LoRA adapters in llama.cpp's GGUF form (`convert_lora_to_gguf.py`): `general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`, and per targeted matrix `NAME.lora_a` (ggml
//! dims `[in, rank]`: rank rows of the input count) and `NAME.lora_b` (`[rank, out]`: one row
//! of rank values per output). The converter has already put the rows in the engine's order (it
//! permutes Llama's Q/K as it does the base), so nothing is permuted here. The scale is
//! `alpha / rank` (1 when alpha is 0), as llama.cpp applies it.

use std::path::Path;

use crate::ModelConfig;
use half::{bf16, f16};
use npu_gguf::{GgmlType, GgufFile};

use super::adapter::{check_family, AdapterError, HostAdapter, LowRank, Target};

fn gguf_target(g: &str) -> Option<Target> {
    Some(match g {
        "attn_q" => Target::Q,
        "attn_k" => Target::K,
        "attn_v" => Target::V,
        "attn_output" => Target::O,
        "ffn_gate" => Target::Gate,
        "ffn_up" => Target::Up,
        "ffn_down" => Target::Down,
        _ => return None,
    })
}

fn values(f: &GgufFile, name: &str) -> Result<(Vec<f32>, Vec<u64>), String> {
    let (info, data) = f.tensor(name).map_err(|e| e.to_string())?;
    let v = match info.ty {
        GgmlType::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "tensor {name} of type {} is not supported",
                other.name()
            ))
        }
    };
    Ok((v, info.dims.clone()))
}

/// Reads a GGUF LoRA adapter for the model `cfg`, refusing a rank above `max_rank`.
pub fn read_gguf_lora(
    path: &Path,
    cfg: &ModelConfig,
    max_rank: usize,
) -> Result<HostAdapter, AdapterError> {
    let bad = |what: String| AdapterError::Bad {
        path: path.to_path_buf(),
        what,
    };
    let unsupported = |what: String| AdapterError::Unsupported {
        path: path.to_path_buf(),
        what,
    };
    check_family(cfg).map_err(unsupported)?;
    let f = GgufFile::open(path).map_err(|e| bad(e.to_string()))?;
    if f.get_str("general.type") != Some("adapter") {
        return Err(bad(format!(
            "general.type is {:?}, not \"adapter\"",
            f.get_str("general.type")
        )));
    }
    if f.get_str("adapter.type") != Some("lora") {
        return Err(unsupported(format!(
            "adapter.type {:?} (only \"lora\")",
            f.get_str("adapter.type")
        )));
    }
    let arch = f.get_str("general.architecture").unwrap_or_default();
    if arch != cfg.arch.name() {
        return Err(bad(format!(
            "general.architecture {arch:?}; the model is {:?}",
            cfg.arch.name()
        )));
    }
    let alpha = f
        .get_f64("adapter.lora.alpha")
        .ok_or_else(|| bad("no adapter.lora.alpha".into()))? as f32;
    let mut layers: Vec<[Option<LowRank>; 7]> =
        (0..cfg.n_layers).map(|_| Default::default()).collect();
    let mut rank = None;
    let mut all_bf16 = true;
    for info in f.tensors() {
        let name = &info.name;
        let Some(base) = name.strip_suffix(".lora_a") else {
            if let Some(base) = name.strip_suffix(".lora_b") {
                if f.tensor_info(&format!("{base}.lora_a")).is_none() {
                    return Err(bad(format!("{name} without its lora_a")));
                }
                continue;
            }
            return Err(unsupported(format!("tensor {name:?}")));
        };
        let target = base
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(il, rest)| {
                let il: usize = il.parse().ok()?;
                let t = gguf_target(rest.strip_suffix(".weight")?)?;
                Some((il, t))
            });
        let Some((il, t)) = target else {
            return Err(unsupported(format!("tensor {name:?}")));
        };
        if il >= cfg.n_layers {
            return Err(bad(format!(
                "tensor {name} is for layer {il}; the model has {}",
                cfg.n_layers
            )));
        }
        let b_name = format!("{base}.lora_b");
        let (a, a_dims) = values(&f, name).map_err(bad)?;
        let (b, b_dims) = values(&f, &b_name).map_err(bad)?;
        all_bf16 &= f.tensor_info(name).is_some_and(|i| i.ty == GgmlType::BF16)
            && f.tensor_info(&b_name)
                .is_some_and(|i| i.ty == GgmlType::BF16);
        let (n_in, n_out) = t.dims(cfg);
        let r = a_dims.get(1).copied().unwrap_or(0) as usize;
        if a_dims != [n_in as u64, r as u64] || b_dims != [r as u64, n_out as u64] {
            return Err(bad(format!(
                "{name} has dims {a_dims:?} and {b_name} {b_dims:?}; this model's {base} needs \
                 [{n_in}, r] and [r, {n_out}]"
            )));
        }
        if r == 0 || r > max_rank || rank.is_some_and(|x| x != r) {
            return Err(bad(format!(
                "{name} has rank {r} (one rank for all, 1..={max_rank}: max_lora_rank)"
            )));
        }
        rank = Some(r);
        // B's rows (one per output, rank values each) transposed to rank x out.
        let mut b_t = vec![0f32; r * n_out];
        for o in 0..n_out {
            for k in 0..r {
                b_t[k * n_out + o] = b[o * r + k];
            }
        }
        layers[il][t.index()] = Some(LowRank { a, b_t });
    }
    let rank = rank.ok_or_else(|| bad("no .lora_a tensor".into()))?;
    let scale = if alpha == 0.0 {
        1.0
    } else {
        alpha / rank as f32
    };
    Ok(HostAdapter {
        path: path.to_path_buf(),
        rank,
        alpha,
        scale,
        all_bf16,
        layers,
    })
}
