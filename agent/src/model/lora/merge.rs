//! An adapter merged into a model's weights, written as a new GGUF file: each targeted matrix
//! becomes `W + scale * B A` (in f32, the file's rows in the engine's order, as the adapter's
//! B is held). The merged file is what the adapter applied at run time must agree with (the
//! fidelity check of multi-LoRA); only F32 and F16 matrices are merged (a quantized one is
//! refused by name: merging into it would change its rounding, not only add the adapter).

use std::path::Path;

use half::f16;
use npu_gguf::writer::GgufWriter;
use npu_gguf::{GgmlType, GgufFile};

use super::adapter::{HostAdapter, Target};

/// The GGUF name of a layer's targeted matrix.
fn gguf_name(il: usize, t: Target) -> String {
    let g = match t {
        Target::Q => "attn_q",
        Target::K => "attn_k",
        Target::V => "attn_v",
        Target::O => "attn_output",
        Target::Gate => "ffn_gate",
        Target::Up => "ffn_up",
        Target::Down => "ffn_down",
    };
    format!("blk.{il}.{g}.weight")
}

/// Writes `base` with `ad` merged into `out`. Errors name the tensor that could not be merged.
pub fn merge_into_gguf(base: &GgufFile, ad: &HostAdapter, out: &Path) -> Result<(), String> {
    let mut w = GgufWriter::new();
    for key in base.keys() {
        let v = base
            .get(key)
            .ok_or_else(|| format!("metadata key {key} vanished"))?;
        if key == "general.alignment" {
            let a = v.as_u64().ok_or("general.alignment is not a number")?;
            w.set_alignment(a as u32);
            continue;
        }
        w.add_meta(key.clone(), v.clone());
    }
    let mut merged = 0usize;
    for info in base.tensors() {
        let data = base.tensor_data(info);
        let target = ad.layers.iter().enumerate().find_map(|(il, l)| {
            Target::ALL
                .into_iter()
                .find(|t| l[t.index()].is_some() && gguf_name(il, *t) == info.name)
                .map(|t| (il, t))
        });
        let Some((il, t)) = target else {
            w.add_tensor(info.name.clone(), info.ty, &info.dims, data.to_vec());
            continue;
        };
        let lr = ad.layers[il][t.index()].as_ref().expect("found above");
        let (n_in, n_out) = (info.row_len(), info.n_rows());
        let r = ad.rank;
        if lr.a.len() != r * n_in || lr.b_t.len() != r * n_out {
            return Err(format!(
                "{}: {n_out}x{n_in} does not match the adapter's {}",
                info.name,
                t.peft_name()
            ));
        }
        let mut wv: Vec<f32> = match info.ty {
            GgmlType::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            GgmlType::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(format!(
                    "{} is {}: only F32 and F16 matrices are merged",
                    info.name,
                    other.name()
                ))
            }
        };
        for o in 0..n_out {
            let row = &mut wv[o * n_in..(o + 1) * n_in];
            for k in 0..r {
                let bk = ad.scale * lr.b_t[k * n_out + o];
                let ak = &lr.a[k * n_in..(k + 1) * n_in];
                for (x, a) in row.iter_mut().zip(ak) {
                    *x += bk * a;
                }
            }
        }
        // Merged weights are written as F32 (an F16 file's matrix widens: nothing rounds away).
        w.add_f32_tensor(info.name.clone(), &info.dims, &wv);
        merged += 1;
    }
    if merged == 0 {
        return Err("the adapter targets no matrix of the model".into());
    }
    w.write_to(out)
        .map_err(|e| format!("writing {}: {e}", out.display()))?;
    Ok(())
}
