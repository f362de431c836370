//! Speed of the CUDA backend on a GPU, per matmul mode: prefill (one 512-token prompt in chunks
//! of 128) and decode (batches of 1, 8 and 32 sequences at 128 tokens of context), on the default
//! model and, with `--random-1b`, on a random-weight model with a 1B-class Llama layout (hidden
//! 2048, 16 layers, 32/8 heads, ff 8192, vocab 128256, Q4_0 weights, Q8_0 embeddings) written
//! with the project's GGUF writer. Ratios are against the `quantized` mode of the same run.
//!
//! ```sh
//! cargo run --release -p npu-backend-cuda --example cuda_bench -- [--random-1b] [--model PATH]
//! cargo run --release -p npu-backend-cuda --example cuda_bench -- --write-random-1b  # no GPU
//! ```
//! Without a usable GPU it prints why and exits.

#[path = "../tests/common/llama.rs"]
#[allow(dead_code)]
mod llama;

use std::path::{Path, PathBuf};
use std::time::Instant;

use npu_backend::{Backend, DType, SeqSpan, StepInputs};
use npu_backend_cuda::{CudaBackend, CudaConfig, MatmulMode};
use npu_gguf::writer::GgufWriter;
use npu_gguf::{GgmlType, GgufFile, MetaValue};

const BS: usize = 16;

fn step_for(seqs: &[(usize, usize)], tokens: u32, max_blocks: usize, logits: bool) -> StepInputs {
    // seqs: (start position, new tokens); sequence i owns blocks i*max_blocks.. .
    let mut s = StepInputs {
        max_blocks,
        ..Default::default()
    };
    for (i, &(start, n)) in seqs.iter().enumerate() {
        s.seqs.push(SeqSpan {
            q_row: s.tokens.len() as u32,
            n_q: n as u32,
            start_pos: start as u32,
        });
        for p in start..start + n {
            s.tokens.push((p as u32 * 7 + i as u32) % tokens);
            s.positions.push(p as u32);
            s.slot_mapping
                .push(((i * max_blocks + p / BS) * BS + p % BS) as u32);
        }
        s.block_tables
            .extend((0..max_blocks).map(|b| (i * max_blocks + b) as u32));
        if logits {
            s.logit_rows.push(s.tokens.len() as u32 - 1);
        }
    }
    s
}

struct Figures {
    prefill: f64,
    decode: Vec<(usize, f64)>,
}

fn bench(path: &Path, mode: MatmulMode, dt: DType) -> Result<Figures, String> {
    let cfg = CudaConfig {
        act_dtype: dt,
        matmul: mode,
        ..CudaConfig::default()
    };
    let mut b = CudaBackend::new(0, cfg).map_err(|e| e.to_string())?;
    let f = GgufFile::open(path).map_err(|e| e.to_string())?;
    let max_blocks = 512 / BS + 4;
    let batches = [1usize, 8, 32];
    let mut m = llama::Llama::load(&f, &mut b, 512, 32, 32 * max_blocks, BS);
    let vocab = m.cfg.vocab as u32;
    // Prefill: 512 tokens in chunks of 128 (warm-up pass first).
    let mut prefill = 0.0;
    for pass in 0..2 {
        let t0 = Instant::now();
        for c in 0..4 {
            let s = step_for(&[(c * 128, 128)], vocab, max_blocks, c == 3);
            m.step(&mut b, &s);
        }
        b.synchronize().map_err(|e| e.to_string())?;
        if pass == 1 {
            prefill = 512.0 / t0.elapsed().as_secs_f64();
        }
    }
    let mut decode = Vec::new();
    for &n in &batches {
        let ctx: Vec<(usize, usize)> = (0..n).map(|_| (0, 128)).collect();
        m.step(&mut b, &step_for(&ctx, vocab, max_blocks, true));
        let steps = 32;
        let t0 = Instant::now();
        for k in 0..steps {
            let seqs: Vec<(usize, usize)> = (0..n).map(|_| (128 + k, 1)).collect();
            m.step(&mut b, &step_for(&seqs, vocab, max_blocks, true));
        }
        decode.push((n, (n * steps) as f64 / t0.elapsed().as_secs_f64()));
    }
    Ok(Figures { prefill, decode })
}

/// A random-weight GGUF with a 1B-class Llama layout, written under the system temp directory.
fn random_1b() -> Result<PathBuf, String> {
    let path = std::env::temp_dir().join("npu-serving-random-1b-q4_0.gguf");
    if path.is_file() {
        return Ok(path);
    }
    let (h, layers, heads, kv, ff, vocab) = (2048u64, 16u64, 32u64, 8u64, 8192u64, 128256u64);
    let hd = h / heads;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut blocks = |ty: GgmlType, rows: u64, cols: u64| -> Vec<u8> {
        let nb = (rows * cols / 32) as usize;
        let mut out = Vec::with_capacity(nb * ty.block_bytes());
        for _ in 0..nb {
            out.extend(half::f16::from_f32(0.002 + (rnd() % 100) as f32 * 1e-4).to_le_bytes());
            let n = if ty == GgmlType::Q8_0 { 32 } else { 16 };
            out.extend((0..n).map(|_| rnd() as u8));
        }
        out
    };
    let mut w = GgufWriter::new();
    let u = |v: u64| MetaValue::U32(v as u32);
    w.add_meta("general.architecture", MetaValue::String("llama".into()));
    w.add_meta("llama.block_count", u(layers));
    w.add_meta("llama.embedding_length", u(h));
    w.add_meta("llama.feed_forward_length", u(ff));
    w.add_meta("llama.attention.head_count", u(heads));
    w.add_meta("llama.attention.head_count_kv", u(kv));
    w.add_meta("llama.vocab_size", u(vocab));
    w.add_meta("llama.rope.freq_base", MetaValue::F32(500000.0));
    w.add_meta(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    w.add_tensor(
        "token_embd.weight",
        GgmlType::Q8_0,
        &[h, vocab],
        blocks(GgmlType::Q8_0, vocab, h),
    );
    let ones = vec![1.0f32; h as usize];
    for l in 0..layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        let q4 = GgmlType::Q4_0;
        w.add_f32_tensor(n("attn_norm.weight"), &[h], &ones);
        w.add_f32_tensor(n("ffn_norm.weight"), &[h], &ones);
        w.add_tensor(n("attn_q.weight"), q4, &[h, h], blocks(q4, h, h));
        w.add_tensor(
            n("attn_k.weight"),
            q4,
            &[h, kv * hd],
            blocks(q4, kv * hd, h),
        );
        w.add_tensor(
            n("attn_v.weight"),
            q4,
            &[h, kv * hd],
            blocks(q4, kv * hd, h),
        );
        w.add_tensor(n("attn_output.weight"), q4, &[h, h], blocks(q4, h, h));
        w.add_tensor(n("ffn_gate.weight"), q4, &[h, ff], blocks(q4, ff, h));
        w.add_tensor(n("ffn_up.weight"), q4, &[h, ff], blocks(q4, ff, h));
        w.add_tensor(n("ffn_down.weight"), q4, &[ff, h], blocks(q4, h, ff));
    }
    w.add_f32_tensor("output_norm.weight", &[h], &ones);
    w.write_to(&path).map_err(|e| e.to_string())?;
    Ok(path)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--write-random-1b") {
        // Only write (or find) the random model and print its layout: no GPU needed.
        let p = random_1b().expect("writing the random 1B-class model");
        let f = GgufFile::open(&p).expect("reading it back");
        let c = npu_model::ModelConfig::from_gguf(&f).expect("its hyper-parameters");
        println!("{}: {c:?}", p.display());
        return;
    }
    if let Err(e) = CudaBackend::new(0, CudaConfig::default()) {
        println!("cuda_bench: no usable CUDA GPU here, nothing measured: {e}");
        return;
    }
    let mut models = Vec::new();
    match args.iter().position(|a| a == "--model") {
        Some(i) => models.push(PathBuf::from(&args[i + 1])),
        None => models.push(npu_gguf::store::resolve_model(None).expect("the default model")),
    }
    if args.iter().any(|a| a == "--random-1b") {
        models.push(random_1b().expect("writing the random 1B-class model"));
    }
    for path in &models {
        println!("model {}", path.display());
        println!("| mode | prefill tok/s | decode b1 | decode b8 | decode b32 |");
        println!("|---|---|---|---|---|");
        let mut base: Option<Figures> = None;
        for mode in [
            MatmulMode::Quantized,
            MatmulMode::Auto,
            MatmulMode::Dequantized,
        ] {
            match bench(path, mode, DType::F32) {
                Ok(fig) => {
                    let ratio = |v: f64, b: f64| format!("{v:.0} ({:.2}x)", v / b);
                    let bp = base.as_ref().map(|b| b.prefill).unwrap_or(fig.prefill);
                    let mut row = format!("| {} | {} |", mode.name(), ratio(fig.prefill, bp));
                    for (i, (_, v)) in fig.decode.iter().enumerate() {
                        let bv = base.as_ref().map(|b| b.decode[i].1).unwrap_or(*v);
                        row.push_str(&format!(" {} |", ratio(*v, bv)));
                    }
                    println!("{row}");
                    if base.is_none() {
                        base = Some(fig);
                    }
                }
                Err(e) => println!("| {} | failed: {e} |", mode.name()),
            }
        }
    }
}
