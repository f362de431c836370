//! Quantized Hugging Face checkpoints: which scheme a directory uses, the scale tensors of each
//! quantized weight, and its values widened to f32 (`w = (q - offset) * scale`, the scale per
//! tensor, per output channel or per block).
//!
//! Read: FP8 e4m3 with block scales (`quantization_config.quant_method: fp8`,
//! `weight_scale_inv` over `weight_block_size` blocks, as DeepSeek and Qwen3-FP8 ship), and
//! compressed-tensors' and msmodelslim's int8/FP8 weights with per-channel (or per-tensor)
//! scales and dynamic per-token activation scales (W8A8 dynamic). Refused by name: static
//! activation scales (`input_scale`: the checkpoint's activations were calibrated to a range the
//! engine would not clip to), packed int4 formats, and any other `quant_method`.

use std::collections::BTreeMap;
use std::path::Path;

use npu_hf::{Dtype, Shards, TensorMeta};
use serde_json::Value;

use crate::HparamsError;

fn unsupported(msg: String) -> HparamsError {
    HparamsError::Unsupported(msg)
}

fn inconsistent(msg: String) -> HparamsError {
    HparamsError::Inconsistent(msg)
}

/// A directory's quantization scheme.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scheme {
    /// Float weights only.
    None,
    /// `quant_method: fp8` (block scales `weight_scale_inv`, or per-tensor).
    Fp8 { block: Option<(usize, usize)> },
    /// `quant_method: compressed-tensors`, int8 or FP8 weights, dynamic activations.
    Compressed { block: Option<(usize, usize)> },
    /// msmodelslim's `quant_model_description.json` (W8A8_DYNAMIC, W8A16).
    Msmodelslim { kind: String },
}

/// The scales of one quantized weight.
#[derive(Debug, Clone)]
pub(crate) struct Scales {
    scale: TensorMeta,
    offset: Option<TensorMeta>,
    /// Rows and columns one scale covers.
    block: (usize, usize),
}

/// The suffixes of a quantized weight's side tensors, and their kind.
const SIDE: [(&str, &str); 4] = [
    (".weight_scale_inv", "weight_scale_inv"),
    (".weight_scale", "weight_scale"),
    (".weight_offset", "weight_offset"),
    (".weight_zero_point", "weight_zero_point"),
];

/// `Some((weight's module, kind))` for a scale or offset tensor.
pub(crate) fn side_tensor(name: &str) -> Option<(&str, &'static str)> {
    SIDE.iter()
        .find_map(|(suffix, kind)| name.strip_suffix(suffix).map(|base| (base, *kind)))
}

/// Refuses the tensors of static activation quantization.
pub(crate) fn refuse_static(name: &str) -> Result<(), HparamsError> {
    for s in [
        ".input_scale",
        ".input_offset",
        ".input_zero_point",
        ".deq_scale",
        ".quant_bias",
    ] {
        if name.ends_with(s) {
            return Err(unsupported(format!(
                "tensor {name:?}: static activation quantization (calibrated input scales) is \
                 not implemented; the engine reads weight-only and dynamic per-token schemes"
            )));
        }
    }
    Ok(())
}

fn block_of(v: Option<&Value>, key: &str) -> Result<Option<(usize, usize)>, HparamsError> {
    match v.filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(Value::Array(a)) if a.len() == 2 => {
            let d: Option<Vec<usize>> = a
                .iter()
                .map(|x| x.as_u64().filter(|&n| n > 0).map(|n| n as usize))
                .collect();
            match d.as_deref() {
                Some([r, c]) => Ok(Some((*r, *c))),
                _ => Err(inconsistent(format!(
                    "config.json: {key} must be two positive integers"
                ))),
            }
        }
        Some(v) => Err(inconsistent(format!(
            "config.json: {key} = {v} must be two positive integers"
        ))),
    }
}

impl Scheme {
    /// The scheme of a directory, from `config.json`'s `quantization_config` or msmodelslim's
    /// description file; a scheme the engine does not reproduce is refused naming the key.
    pub(crate) fn detect(dir: &Path, cfg: &Value) -> Result<Self, HparamsError> {
        if let Some(desc) = npu_hf::read_json(dir, "quant_model_description.json")? {
            let kind = desc
                .get("model_quant_type")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            return match kind.as_str() {
                "W8A8_DYNAMIC" | "W8A16" => Ok(Self::Msmodelslim { kind }),
                other => Err(unsupported(format!(
                    "quant_model_description.json: model_quant_type = {other:?} is not read \
                     (supported: W8A8_DYNAMIC, W8A16; static W8A8 calibrates activation \
                     ranges the engine does not reproduce)"
                ))),
            };
        }
        let Some(q) = cfg.get("quantization_config").filter(|v| !v.is_null()) else {
            return Ok(Self::None);
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        match method {
            "fp8" => {
                if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
                    if fmt != "e4m3" {
                        return Err(unsupported(format!(
                            "config.json: quantization_config.fmt = {fmt:?} (supported: e4m3)"
                        )));
                    }
                }
                let act = q.get("activation_scheme").and_then(Value::as_str);
                if act.is_some_and(|a| a != "dynamic") {
                    return Err(unsupported(format!(
                        "config.json: quantization_config.activation_scheme = {:?}: static \
                         activation scales are not implemented (supported: dynamic)",
                        act.unwrap_or_default()
                    )));
                }
                let block = block_of(
                    q.get("weight_block_size"),
                    "quantization_config.weight_block_size",
                )?;
                Ok(Self::Fp8 { block })
            }
            "compressed-tensors" => {
                let format = q.get("format").and_then(Value::as_str).unwrap_or("");
                if !matches!(
                    format,
                    "int-quantized" | "float-quantized" | "naive-quantized"
                ) {
                    return Err(unsupported(format!(
                        "config.json: quantization_config.format = {format:?} (supported: \
                         int-quantized, float-quantized, naive-quantized)"
                    )));
                }
                let mut block = None;
                let groups = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        inconsistent(
                            "config.json: quantization_config.config_groups is missing".into(),
                        )
                    })?;
                for (g, spec) in groups {
                    let key = format!("quantization_config.config_groups.{g}");
                    let w = spec.get("weights").filter(|v| !v.is_null());
                    if let Some(w) = w {
                        let bits = w.get("num_bits").and_then(Value::as_u64);
                        if bits != Some(8) {
                            return Err(unsupported(format!(
                                "config.json: {key}.weights.num_bits = {bits:?} (supported: 8)"
                            )));
                        }
                        let strategy = w.get("strategy").and_then(Value::as_str).unwrap_or("");
                        if !matches!(strategy, "channel" | "tensor" | "block") {
                            return Err(unsupported(format!(
                                "config.json: {key}.weights.strategy = {strategy:?} (supported: \
                                 channel, tensor, block)"
                            )));
                        }
                        if strategy == "block" {
                            block = block_of(
                                w.get("block_structure"),
                                &format!("{key}.weights.block_structure"),
                            )?;
                        }
                    }
                    if let Some(a) = spec.get("input_activations").filter(|v| !v.is_null()) {
                        if a.get("dynamic").and_then(Value::as_bool) != Some(true) {
                            return Err(unsupported(format!(
                                "config.json: {key}.input_activations.dynamic is not true: \
                                 static activation scales are not implemented"
                            )));
                        }
                    }
                }
                Ok(Self::Compressed { block })
            }
            other => Err(unsupported(format!(
                "config.json: quantization_config.quant_method = {other:?} is not read \
                 (supported: fp8, compressed-tensors int8/fp8, msmodelslim W8A8_DYNAMIC)"
            ))),
        }
    }

    /// A note for the start-up log.
    pub(crate) fn note(&self) -> String {
        match self {
            Self::None => String::new(),
            Self::Fp8 { .. } => "; FP8 e4m3 weights with block scales".into(),
            Self::Compressed { .. } => "; compressed-tensors 8-bit weights".into(),
            Self::Msmodelslim { kind } => format!("; msmodelslim {kind}"),
        }
    }

    /// The scales of `weight` from its side tensors (`None`: a float weight).
    pub(crate) fn scales(
        &self,
        weight: &TensorMeta,
        mut side: BTreeMap<&'static str, TensorMeta>,
    ) -> Result<Option<Scales>, HparamsError> {
        let name = &weight.name;
        let quantized = matches!(weight.dtype, Dtype::I8 | Dtype::F8E4M3);
        if !quantized {
            if let Some(kind) = side.keys().next() {
                return Err(inconsistent(format!(
                    "tensor {name:?} is {} but has a {kind} tensor",
                    weight.dtype
                )));
            }
            return Ok(None);
        }
        if *self == Self::None {
            return Err(unsupported(format!(
                "tensor {name:?} is {}, but config.json has no quantization_config (and there \
                 is no quant_model_description.json) saying how to read it",
                weight.dtype
            )));
        }
        let [out, inp] = weight.shape[..] else {
            return Err(inconsistent(format!(
                "quantized tensor {name:?} has shape {:?}; a matrix is [out, in]",
                weight.shape
            )));
        };
        let scale = match (side.remove("weight_scale_inv"), side.remove("weight_scale")) {
            (Some(s), None) | (None, Some(s)) => s,
            (None, None) => {
                return Err(inconsistent(format!(
                    "quantized tensor {name:?} has no weight_scale or weight_scale_inv tensor"
                )))
            }
            (Some(_), Some(_)) => {
                return Err(inconsistent(format!(
                    "tensor {name:?} has both weight_scale and weight_scale_inv"
                )))
            }
        };
        let offset = side
            .remove("weight_offset")
            .or_else(|| side.remove("weight_zero_point"));
        if !matches!(scale.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(inconsistent(format!(
                "{}: a scale of dtype {}",
                scale.name, scale.dtype
            )));
        }
        let n: usize = scale.shape.iter().product();
        let block = if n == 1 {
            (out, inp)
        } else if n == out && (scale.shape.len() == 1 || scale.shape.get(1) == Some(&1)) {
            (1, inp)
        } else if scale.shape.len() == 2 {
            let (br, bc) = match self {
                Self::Fp8 { block: Some(b) } | Self::Compressed { block: Some(b) } => *b,
                _ => (128, 128),
            };
            if scale.shape != [out.div_ceil(br), inp.div_ceil(bc)] {
                return Err(inconsistent(format!(
                    "{}: shape {:?} does not give one scale per {br}x{bc} block of a {out}x{inp} \
                     weight",
                    scale.name, scale.shape
                )));
            }
            (br, bc)
        } else {
            return Err(inconsistent(format!(
                "{}: shape {:?} is neither per tensor, per output channel ({out}) nor per block",
                scale.name, scale.shape
            )));
        };
        if let Some(o) = &offset {
            let on: usize = o.shape.iter().product();
            if on != n {
                return Err(inconsistent(format!(
                    "{}: {on} offsets for {n} scales",
                    o.name
                )));
            }
        }
        Ok(Some(Scales {
            scale,
            offset,
            block,
        }))
    }
}

/// One float of a float or offset tensor.
fn float_values(meta: &TensorMeta, bytes: &[u8]) -> Result<Vec<f32>, HparamsError> {
    Ok(match meta.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::I8 => bytes.iter().map(|&b| b as i8 as f32).collect(),
        Dtype::F8E4M3 => bytes.iter().map(|&b| fp8_e4m3(b)).collect(),
        Dtype::I32 => bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32)
            .collect(),
        other => {
            return Err(unsupported(format!(
                "tensor {:?} is {other}, which the engine does not read",
                meta.name
            )))
        }
    })
}

/// An FP8 e4m3 (`float8_e4m3fn`: no infinities, 0x7F/0xFF NaN) value.
pub(crate) fn fp8_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (b >> 3) & 0x0F;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp as i32 - 7)
    }
}

/// A tensor's values in f32: as stored for floats, `(q - offset) * scale` for quantized ones.
pub(crate) fn to_f32(
    meta: &TensorMeta,
    bytes: &[u8],
    scales: Option<&Scales>,
    shards: &Shards,
) -> Result<Vec<f32>, HparamsError> {
    let mut v = float_values(meta, bytes)?;
    let Some(s) = scales else {
        return Ok(v);
    };
    let scale = float_values(&s.scale, shards.data(&s.scale))?;
    let offset = match &s.offset {
        Some(o) => Some(float_values(o, shards.data(o))?),
        None => None,
    };
    if scale.iter().any(|x| !x.is_finite()) {
        return Err(inconsistent(format!(
            "{}: a scale that is not finite",
            s.scale.name
        )));
    }
    let inp = meta.shape[1];
    let (br, bc) = s.block;
    let per_row = inp.div_ceil(bc);
    for (r, row) in v.chunks_exact_mut(inp).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            let i = (r / br) * per_row + c / bc;
            let off = offset.as_ref().map_or(0.0, |o| o[i]);
            *x = (*x - off) * scale[i];
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_e4m3_decodes_as_the_format_defines() {
        assert_eq!(fp8_e4m3(0x00), 0.0);
        assert_eq!(fp8_e4m3(0x38), 1.0); // exp 7, man 0
        assert_eq!(fp8_e4m3(0x7E), 448.0); // the largest
        assert_eq!(fp8_e4m3(0xB8), -1.0);
        assert_eq!(fp8_e4m3(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert!(fp8_e4m3(0x7F).is_nan());
    }

    #[test]
    fn side_tensors_are_recognised() {
        assert_eq!(
            side_tensor("model.layers.0.mlp.up_proj.weight_scale_inv"),
            Some(("model.layers.0.mlp.up_proj", "weight_scale_inv"))
        );
        assert!(refuse_static("model.layers.0.mlp.up_proj.input_scale").is_err());
        assert!(refuse_static("model.layers.0.mlp.up_proj.weight").is_ok());
    }
}
