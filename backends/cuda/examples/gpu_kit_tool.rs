//! The GPU check kit's helper (scripts/gpu-kit.sh builds it, scripts/gpu-check.sh runs it on the
//! device machine, which has no Rust and no network):
//!
//! ```text
//! gpu_kit_tool donor --from MODEL.gguf|default --out DONOR.gguf
//!     a GGUF holding only MODEL's tokenizer (tokenizer.* metadata; `default`: the default
//!     model, fetched when absent): the donor that `npu-serving synth-model --tokenizer-from`
//!     needs, without the model's weights
//! gpu_kit_tool prompt REFS.jsonl N
//!     the prompt text of line N of a reference file
//! gpu_kit_tool shaped --shape 1b|8b --donor DONOR.gguf --out OUT.gguf [--seed N]
//!                     [--quant q4_0|q4_k_m]
//!     a random-weight Llama GGUF of a 1B-class (hidden 2048, 16 layers, 32/8 heads, ff 8192) or
//!     8B-class (hidden 4096, 32 layers, 32/8 heads, ff 14336) shape: Q4_0 matrices, Q8_0
//!     token embedding and output head (or llama.cpp's Q4_K_M mixture: Q4_K, Q6_K for some
//!     value and down projections and the head), the donor's tokenizer and vocabulary
//! gpu_kit_tool ids GENERATE.json
//!     the output ids of `npu-serving generate --json`, comma-separated
//! gpu_kit_tool fidelity --cpu-gen A --cpu-score B --dev-gen C --dev-score D
//!                       [--margin 0.15] [--ref FAMILY.jsonl --line N] [--info]
//!     one line of agreement between the device and the CPU backend (and llama.cpp's recorded
//!     greedy tokens): greedy tokens equal up to the first near tie (a top-1/top-2 gap below
//!     the margin, the CPU backend's, the device's, or llama.cpp's), teacher-forced top-1 equal
//!     wherever the CPU backend is decided; exit status 1 when they disagree (`--info`: the
//!     line is reported, not judged)
//! gpu_kit_tool bench-row --label L --npu BENCH.json [--llama-bench LB.json]
//!                        [--llama-batched LBB.txt]
//!     one markdown table row: prefill 512 and decode at batch 1 and 32, npu-serving beside
//!     llama.cpp on the same file, then graph replays per decode step and the batch-1 weight
//!     read rate (GB/s)
//! gpu_kit_tool gemv-bench [--device N] [--rounds N] [--formats q4_0,q8_0,q4_k,q6_k]
//!     the quantized products of an 8B-class Llama's matrix shapes alone on the device, plain
//!     and wide GEMV (`NPU_SERVING_CUDA_GEMV`), as a markdown section of weight GB/s
//!     (`support/gemv_bench.rs`; on the emulation: cut-down shapes, not a measurement)
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[path = "support/gemv_bench.rs"]
mod gemv_bench;

use npu_gguf::writer::GgufWriter;
use npu_gguf::{GgmlType, GgufFile, MetaValue};
use serde_json::Value;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    arg(args, name).ok_or_else(|| format!("missing {name}"))
}

fn read_json(p: &str) -> Result<Value, String> {
    let s = std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"))?;
    // `generate --json` prints the object on one line; anything else on stdout comes before.
    let line = s
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("{p}: no JSON object"))?;
    serde_json::from_str(line).map_err(|e| format!("{p}: {e}"))
}

fn u32s(v: &Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// A GGUF with only the tokenizer of `from`.
fn donor(from: &Path, out: &Path) -> Result<(), String> {
    let f = GgufFile::open(from).map_err(|e| format!("{}: {e}", from.display()))?;
    let mut w = GgufWriter::new();
    w.add_meta(
        "general.architecture",
        MetaValue::String(f.get_str("general.architecture").unwrap_or("llama").into()),
    );
    w.add_meta(
        "general.name",
        MetaValue::String("tokenizer donor (no weights)".into()),
    );
    let mut n = 0;
    for k in f.keys() {
        if k.starts_with("tokenizer.") {
            w.add_meta(k.clone(), f.get(k).cloned().expect("a listed key"));
            n += 1;
        }
    }
    if n == 0 {
        return Err(format!("{} has no tokenizer.* metadata", from.display()));
    }
    w.write_to(out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    println!(
        "{}: {n} tokenizer keys of {}",
        out.display(),
        from.display()
    );
    Ok(())
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Random blocks of `ty` (Q4_0, Q8_0, Q4_K or Q6_K) for a `rows x cols` matrix whose values have
/// a standard deviation of about `std`: random quants (and K-quant sub-block scales), then the
/// block scale (and Q4_K's minimum scale) set so the values have that spread.
fn blocks(rng: &mut XorShift, ty: GgmlType, rows: u64, cols: u64, std: f32) -> Vec<u8> {
    // (values a block, bytes a block, spread of the random quants times their scales, where
    // the f16 scale sits in the block)
    let (vals, bb, qstd, at) = match ty {
        GgmlType::Q4_0 => (32, 18, 4.6f32, 0),
        GgmlType::Q8_0 => (32, 34, 74.0, 0),
        // d * sc * q - dmin * m, with sc, m 6-bit and q 4-bit; dmin = 7.5 d centres it.
        GgmlType::Q4K => (256, 144, 258.0, 0),
        // d * scale * (q - 32), scale int8, q 6-bit; d is the block's last two bytes.
        GgmlType::Q6K => (256, 210, 1366.0, 208),
        _ => unreachable!("Q4_0, Q8_0, Q4_K and Q6_K only"),
    };
    let nb = (rows * cols / vals) as usize;
    let mut out = vec![0u8; nb * bb];
    rng.fill(&mut out);
    let d = std / qstd;
    let dh = half::f16::from_f32(d).to_le_bytes();
    let mh = half::f16::from_f32(7.5 * d).to_le_bytes();
    for b in out.chunks_mut(bb) {
        b[at..at + 2].copy_from_slice(&dh);
        if ty == GgmlType::Q4K {
            b[2..4].copy_from_slice(&mh);
        }
    }
    out
}

/// The matrix formats of a shaped model: Q4_0 throughout (Q8_0 embedding and head), or
/// llama.cpp's Q4_K_M mixture (Q4_K, with Q6_K for the value projection and the down projection
/// of the layers its `use_more_bits` picks, and for the output head).
#[derive(Clone, Copy, PartialEq)]
enum ShapedQuant {
    Q4_0,
    Q4KM,
}

impl ShapedQuant {
    fn parse(s: &str) -> Result<Self, String> {
        match s {
            "q4_0" => Ok(Self::Q4_0),
            "q4_k_m" => Ok(Self::Q4KM),
            other => Err(format!("unknown --quant {other:?} (q4_0 or q4_k_m)")),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4KM => "Q4_K_M",
        }
    }
    /// general.file_type: MOSTLY_Q4_0 (2) or MOSTLY_Q4_K_M (15).
    fn file_type(self) -> u64 {
        match self {
            Self::Q4_0 => 2,
            Self::Q4KM => 15,
        }
    }
    /// The format of layer `l`'s (of `n`) matrix `name`.
    fn matrix(self, name: &str, l: u64, n: u64) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4KM => {
                let more_bits = l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2;
                if (name == "attn_v.weight" || name == "ffn_down.weight") && more_bits {
                    GgmlType::Q6K
                } else {
                    GgmlType::Q4K
                }
            }
        }
    }
    fn embedding(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q8_0,
            Self::Q4KM => GgmlType::Q4K,
        }
    }
    fn head(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q8_0,
            Self::Q4KM => GgmlType::Q6K,
        }
    }
}

/// A random-weight Llama of a 1B- or 8B-class shape with the donor's tokenizer.
fn shaped(
    shape: &str,
    quant: ShapedQuant,
    donor: &Path,
    out: &Path,
    seed: u64,
) -> Result<(), String> {
    let (h, layers, heads, kv, ff): (u64, u64, u64, u64, u64) = match shape {
        "1b" => (2048, 16, 32, 8, 8192),
        "8b" => (4096, 32, 32, 8, 14336),
        other => return Err(format!("unknown shape {other:?} (1b or 8b)")),
    };
    let d = GgufFile::open(donor).map_err(|e| format!("{}: {e}", donor.display()))?;
    let vocab = d
        .get("tokenizer.ggml.tokens")
        .and_then(MetaValue::as_array)
        .map(|a| a.len() as u64)
        .ok_or_else(|| format!("{} has no tokenizer.ggml.tokens", donor.display()))?;
    let hd = h / heads;
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
    let mut w = GgufWriter::new();
    let u = |v: u64| MetaValue::U32(v as u32);
    w.add_meta("general.architecture", MetaValue::String("llama".into()));
    w.add_meta(
        "general.name",
        MetaValue::String(format!(
            "random-weight {shape}-class llama ({})",
            quant.name()
        )),
    );
    w.add_meta("general.file_type", u(quant.file_type()));
    w.add_meta("llama.block_count", u(layers));
    w.add_meta("llama.context_length", u(8192));
    w.add_meta("llama.embedding_length", u(h));
    w.add_meta("llama.feed_forward_length", u(ff));
    w.add_meta("llama.attention.head_count", u(heads));
    w.add_meta("llama.attention.head_count_kv", u(kv));
    w.add_meta("llama.rope.dimension_count", u(hd));
    w.add_meta("llama.vocab_size", u(vocab));
    w.add_meta("llama.rope.freq_base", MetaValue::F32(500000.0));
    w.add_meta(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    for k in d.keys() {
        if k.starts_with("tokenizer.") {
            w.add_meta(k.clone(), d.get(k).cloned().expect("a listed key"));
        }
    }
    let s = |k: u64| 0.5 / (k as f32).sqrt();
    w.add_tensor(
        "token_embd.weight",
        quant.embedding(),
        &[h, vocab],
        blocks(&mut rng, quant.embedding(), vocab, h, 1.0),
    );
    let ones = vec![1.0f32; h as usize];
    for l in 0..layers {
        let n = |x: &str| format!("blk.{l}.{x}");
        w.add_f32_tensor(n("attn_norm.weight"), &[h], &ones);
        w.add_f32_tensor(n("ffn_norm.weight"), &[h], &ones);
        for (name, rows, cols) in [
            ("attn_q.weight", h, h),
            ("attn_k.weight", kv * hd, h),
            ("attn_v.weight", kv * hd, h),
            ("attn_output.weight", h, h),
            ("ffn_gate.weight", ff, h),
            ("ffn_up.weight", ff, h),
            ("ffn_down.weight", h, ff),
        ] {
            let ty = quant.matrix(name, l, layers);
            w.add_tensor(
                n(name),
                ty,
                &[cols, rows],
                blocks(&mut rng, ty, rows, cols, s(cols)),
            );
        }
    }
    w.add_f32_tensor("output_norm.weight", &[h], &ones);
    w.add_tensor(
        "output.weight",
        quant.head(),
        &[h, vocab],
        blocks(&mut rng, quant.head(), vocab, h, s(h)),
    );
    w.write_to(out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "{}: {shape}-class llama ({}), hidden {h}, {layers} layers, {heads}/{kv} heads, ff {ff}, vocab \
         {vocab}, {:.2} GB",
        out.display(),
        quant.name(),
        bytes as f64 / 1e9
    );
    Ok(())
}

/// Agreement of a device run with the CPU backend's (and llama.cpp's reference).
fn fidelity(args: &[String]) -> Result<bool, String> {
    let cpu_gen = read_json(&need(args, "--cpu-gen")?)?;
    let dev_gen = read_json(&need(args, "--dev-gen")?)?;
    let cpu_score = read_json(&need(args, "--cpu-score")?)?;
    let dev_score = read_json(&need(args, "--dev-score")?)?;
    let margin: f32 = arg(args, "--margin")
        .map(|m| m.parse().map_err(|_| format!("bad --margin {m}")))
        .transpose()?
        .unwrap_or(0.15);
    let cpu_ids = u32s(&cpu_gen, "output_ids");
    let dev_ids = u32s(&dev_gen, "output_ids");
    let pos = |v: &Value| -> Vec<(u32, f32, f32)> {
        v["positions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| {
                        (
                            p["top1_id"].as_u64().unwrap_or(u64::MAX) as u32,
                            p["gap"].as_f64().unwrap_or(0.0) as f32,
                            p["logprob"].as_f64().unwrap_or(f64::NAN) as f32,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let (cs, ds) = (pos(&cpu_score), pos(&dev_score));
    if cs.len() != cpu_ids.len() || ds.len() != cpu_ids.len() {
        return Err(format!(
            "scores of {} and {} positions for {} tokens",
            cs.len(),
            ds.len(),
            cpu_ids.len()
        ));
    }
    // llama.cpp's recorded greedy run, when given.
    let reference = match (arg(args, "--ref"), arg(args, "--line")) {
        (Some(r), Some(n)) => {
            let text = std::fs::read_to_string(&r).map_err(|e| format!("{r}: {e}"))?;
            let n: usize = n.parse().map_err(|_| format!("bad --line {n}"))?;
            let line = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .nth(n)
                .ok_or_else(|| format!("{r}: no line {n}"))?;
            let v: Value = serde_json::from_str(line).map_err(|e| format!("{r}: {e}"))?;
            Some((
                u32s(&v, "output_ids"),
                v["first_near_tie"].as_u64().map(|x| x as usize),
            ))
        }
        _ => None,
    };
    let n = cpu_ids.len();
    // Greedy: up to the first near tie of the CPU backend or the device (teacher-forced along
    // the CPU's path, which is the device's up to the first difference).
    let tie = (0..n)
        .find(|&i| cs[i].1 < margin || ds[i].1 < margin)
        .unwrap_or(n);
    let same = dev_ids
        .iter()
        .zip(&cpu_ids)
        .take_while(|(a, b)| a == b)
        .count();
    let greedy_ok = same >= tie.min(dev_ids.len()) && dev_ids.len() >= tie;
    // Teacher-forced: top-1 equal wherever the CPU backend is decided.
    let decided: Vec<usize> = (0..n).filter(|&i| cs[i].1 >= margin).collect();
    let top1_same = decided.iter().filter(|&&i| cs[i].0 == ds[i].0).count();
    let tf_ok = top1_same == decided.len();
    let max_dlp = (0..n)
        .map(|i| (cs[i].2 - ds[i].2).abs())
        .fold(0f32, f32::max);
    let mut line = format!(
        "greedy {same}/{n} as the CPU backend (checked up to step {tie}, the first near tie); \
         teacher-forced top-1 {top1_same}/{} where the CPU backend is decided; max |Δ logprob| \
         {max_dlp:.4}",
        decided.len()
    );
    let mut ref_ok = true;
    if let Some((ref_ids, ref_tie)) = reference {
        let ref_same = dev_ids
            .iter()
            .zip(&ref_ids)
            .take_while(|(a, b)| a == b)
            .count();
        let upto = tie.min(ref_tie.unwrap_or(ref_ids.len())).min(ref_ids.len());
        ref_ok = ref_same >= upto;
        line.push_str(&format!(
            "; llama.cpp's greedy tokens {ref_same}/{} (checked up to step {upto})",
            ref_ids.len()
        ));
    }
    let ok = greedy_ok && tf_ok && ref_ok;
    if args.iter().any(|a| a == "--info") {
        // Reported, not judged (16-bit activations).
        println!("INFO {line}");
        return Ok(true);
    }
    println!("{} {line}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

/// A markdown row: prefill 512, decode batch 1 and 32 for npu-serving and llama.cpp.
fn bench_row(args: &[String]) -> Result<(), String> {
    let label = need(args, "--label")?;
    let f = |v: Option<f64>| {
        v.filter(|&x| x > 0.0)
            .map_or("—".to_string(), |x| format!("{x:.0}"))
    };
    let npu = arg(args, "--npu").and_then(|p| read_json(&p).ok());
    let n = |k: &str| npu.as_ref().and_then(|v| v[k].as_f64());
    // llama-bench -o json: a list of tests with n_prompt, n_gen, avg_ts.
    let lb = arg(args, "--llama-bench")
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| serde_json::from_str::<Value>(&s).ok());
    let lb_ts = |pp: u64, tg: u64| {
        lb.as_ref().and_then(|v| {
            v.as_array()?
                .iter()
                .find(|t| t["n_prompt"].as_u64() == Some(pp) && t["n_gen"].as_u64() == Some(tg))
                .and_then(|t| t["avg_ts"].as_f64())
        })
    };
    // llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
    let lbb = arg(args, "--llama-batched")
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let lbb_tg = |b: u64| {
        lbb.lines().find_map(|l| {
            let c: Vec<&str> = l.split('|').map(str::trim).collect();
            (c.len() > 8 && c[3].parse::<u64>().ok() == Some(b))
                .then(|| c[8].parse::<f64>().ok())
                .flatten()
        })
    };
    // Graph replays per counted decode step, and the weight bytes a batch-1 step reads times the
    // batch-1 rate (`--count-steps`; absent where not counted).
    let replays =
        n("graph_replays_per_decode_step").map_or("—".to_string(), |r| format!("{r:.1}"));
    let weight_gb_s = n("weight_bytes_per_decode_step")
        .zip(n("decode_tok_s_b1"))
        .map(|(b, t)| b * t / 1e9);
    println!(
        "| {label} | {} | {} | {} | {} | {} | {} | {replays} | {} |",
        f(n("prefill_tok_s_512")),
        f(lb_ts(512, 0)),
        f(n("decode_tok_s_b1")),
        f(lb_ts(0, 128).or(lbb_tg(1))),
        f(n("decode_tok_s_b32")),
        f(lbb_tg(32)),
        f(weight_gb_s),
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("donor") => need(&args, "--from").and_then(|from| {
            let from = if from == "default" {
                npu_gguf::store::resolve_model(None).map_err(|e| e.to_string())?
            } else {
                PathBuf::from(from)
            };
            donor(&from, &PathBuf::from(need(&args, "--out")?))
        }),
        Some("shaped") => (|| {
            let seed = arg(&args, "--seed")
                .map(|s| s.parse().map_err(|_| format!("bad --seed {s}")))
                .transpose()?
                .unwrap_or(1);
            let quant = ShapedQuant::parse(&arg(&args, "--quant").unwrap_or("q4_0".into()))?;
            shaped(
                &need(&args, "--shape")?,
                quant,
                Path::new(&need(&args, "--donor")?),
                Path::new(&need(&args, "--out")?),
                seed,
            )
        })(),
        Some("ids") => args
            .get(1)
            .ok_or_else(|| "ids FILE".to_string())
            .and_then(|p| read_json(p))
            .map(|v| {
                let ids: Vec<String> = u32s(&v, "output_ids")
                    .iter()
                    .map(|i| i.to_string())
                    .collect();
                println!("{}", ids.join(","));
            }),
        Some("prompt") => (|| {
            let p = args.get(1).ok_or("prompt REFS.jsonl N")?;
            let n: usize = args
                .get(2)
                .and_then(|n| n.parse().ok())
                .ok_or("prompt REFS.jsonl N")?;
            let text = std::fs::read_to_string(p).map_err(|e| format!("{p}: {e}"))?;
            let line = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .nth(n)
                .ok_or_else(|| format!("{p}: no line {n}"))?;
            let v: Value = serde_json::from_str(line).map_err(|e| format!("{p}: {e}"))?;
            print!("{}", v["prompt"].as_str().ok_or("no prompt")?);
            Ok(())
        })(),
        Some("fidelity") => match fidelity(&args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Some("bench-row") => bench_row(&args),
        Some("gemv-bench") => gemv_bench::run(&args),
        _ => Err(
            "usage: gpu_kit_tool donor|shaped|ids|fidelity|bench-row|gemv-bench ... (see the source)"
                .into(),
        ),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_kit_tool: {e}");
            ExitCode::FAILURE
        }
    }
}
