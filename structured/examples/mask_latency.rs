//! How long the grammar work of a constrained request takes on this machine, over a model's
//! vocabulary: indexing the vocabulary (once per server), compiling a schema with its first mask
//! (once per request, on the HTTP thread) and each following mask (once per generated token, on
//! the engine thread between steps).
//!
//!   cargo run --release -p npu-structured --example mask_latency -- MODEL.gguf SCHEMA.json

use std::time::Instant;

use npu_gguf::GgufFile;
use npu_structured::{Commit, ConstraintSpec, Grammars};
use npu_tokenizer::Tokenizer;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (model, schema) = match args.as_slice() {
        [_, m, s] => (m, s),
        _ => {
            eprintln!("usage: mask_latency MODEL.gguf SCHEMA.json");
            std::process::exit(2);
        }
    };
    let gguf = GgufFile::open(model).expect("model");
    let tok = Tokenizer::for_model(&gguf, model.as_ref()).expect("tokenizer");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(schema).expect("schema")).expect("JSON");
    let t = Instant::now();
    let g = Grammars::new(&tok).expect("grammars");
    println!(
        "vocabulary of {} tokens indexed in {:.1} ms",
        tok.vocab_size(),
        ms(t)
    );
    let spec = ConstraintSpec::JsonSchema(schema);
    let mut first = Vec::new();
    let mut per_token = Vec::new();
    for round in 0..5u64 {
        let t = Instant::now();
        let mut c = g.compile(&spec).expect("compiles");
        first.push(ms(t));
        // Walk the grammar with the first allowed non-end token after a few pseudo-random picks.
        let mut state = round + 1;
        for _ in 0..200 {
            let t = Instant::now();
            let mask = c.mask().expect("mask");
            per_token.push(ms(t));
            let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
                .filter(|&t| mask[(t / 32) as usize] & (1 << (t % 32)) != 0)
                .filter(|t| !tok.is_eos(*t))
                .collect();
            if allowed.is_empty() {
                break;
            }
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            let pick = allowed[(state >> 33) as usize % allowed.len()];
            if c.commit(pick).expect("commit") == Commit::Done {
                break;
            }
        }
    }
    first.sort_by(f64::total_cmp);
    per_token.sort_by(f64::total_cmp);
    let pct = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q) as usize];
    println!(
        "compile + first mask: median {:.2} ms, max {:.2} ms (5 compiles)",
        pct(&first, 0.5),
        pct(&first, 1.0)
    );
    println!(
        "each following mask: median {:.3} ms, p99 {:.3} ms over {} tokens",
        pct(&per_token, 0.5),
        pct(&per_token, 0.99),
        per_token.len()
    );
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
