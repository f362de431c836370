//! `npu-serving bench-model --lora-adapters N`: batched decode with LoRA adapters against the
//! base model alone, in the same run. N random PEFT adapters of `--lora-rank` (targeting every
//! projection; bf16, as PEFT saves a bf16 model's adapters, and kept so) are written for the model, read back and placed in N slots; `--batches`' largest
//! batch of streams is prefilled once, then decode steps alternate in rounds between: every
//! stream on the base model, the streams spread over the adapters in contiguous groups (what a
//! scheduler sorting by adapter gives: one group per adapter), and spread one by one (stream i on
//! adapter i mod N: a group per stream, the worst case). Median step of each round, best round
//! of each, and the ratios of tokens per second to the base's. CPU backend only (CUDA has
//! `Capability::Lora` too, checked on its emulation, not timed here).

use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use super::bench_model::{BenchModelArgs, SplitMix};
use crate::model::lora::synth::{write_peft, SynthAdapter};
use crate::model::lora::{Target, BASE};
use crate::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_model::Checkpoint;

const BLOCK: u32 = 16;
const PROMPT: usize = 32;

#[derive(Debug, Serialize, Default)]
pub struct LoraReport {
    pub adapters: usize,
    pub rank: usize,
    pub streams: usize,
    pub decode_steps_per_round: usize,
    /// Decode tokens per second of each round's median step: base, grouped, interleaved.
    pub base_tok_s_rounds: Vec<f64>,
    pub grouped_tok_s_rounds: Vec<f64>,
    pub interleaved_tok_s_rounds: Vec<f64>,
    /// Best rounds' tokens per second over the base's best.
    pub grouped_ratio: f64,
    pub interleaved_ratio: f64,
    pub backend: String,
    pub wall_s: f64,
}

struct Streams {
    /// Tokens in the cache per stream, and the last token (to feed next).
    pos: Vec<u32>,
    last: Vec<u32>,
    blocks_per_seq: u32,
}

impl Streams {
    fn step(&self, feed: &[Vec<u32>]) -> StepInputs {
        let mut s = StepInputs {
            max_blocks: self.blocks_per_seq as usize,
            ..StepInputs::default()
        };
        for (i, toks) in feed.iter().enumerate() {
            let start = self.pos[i];
            let row0 = s.tokens.len() as u32;
            let table: Vec<u32> = (0..self.blocks_per_seq)
                .map(|b| i as u32 * self.blocks_per_seq + b)
                .collect();
            for (k, &t) in toks.iter().enumerate() {
                let p = start + k as u32;
                s.tokens.push(t);
                s.positions.push(p);
                s.slot_mapping
                    .push(table[(p / BLOCK) as usize] * BLOCK + p % BLOCK);
            }
            s.seqs.push(SeqSpan {
                q_row: row0,
                n_q: toks.len() as u32,
                start_pos: start,
            });
            s.block_tables.extend(&table);
            s.logit_rows.push(row0 + toks.len() as u32 - 1);
        }
        s
    }
}

fn picks(out: &StepOutput, vocab: usize) -> Vec<u32> {
    if out.picked_on_device {
        return out.ids.iter().map(|&i| i as u32).collect();
    }
    out.logits
        .chunks(vocab)
        .map(|row| {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = i;
                }
            }
            best as u32
        })
        .collect()
}

/// Adapter `a` of the bench: random, rank `rank`, every projection, bf16.
fn adapter_spec(rank: usize, a: usize) -> SynthAdapter {
    SynthAdapter {
        rank,
        alpha: 2.0 * rank as f32,
        use_rslora: false,
        targets: Target::ALL.to_vec(),
        seed: 100 + a as u64,
        a_range: 0.05,
        b_range: 0.05,
        bf16: true,
    }
}

pub fn run(args: &BenchModelArgs, adapters: usize) -> anyhow::Result<()> {
    let t_start = Instant::now();
    let rank = args.lora_rank;
    let streams = args.batches.iter().copied().max().unwrap_or(32);
    let steps = args.decode_steps.max(8);
    let rounds = args.kv_rounds.max(1);
    let model_path = npu_model::resolve_model(args.model.as_deref())?;
    let ck = Checkpoint::open(&model_path)?;
    if let Some(dir) = &args.lora_write_to {
        let cfg = ck.config()?;
        for a in 0..adapters {
            let d = dir.join(format!("adapter{a}"));
            write_peft(&d, &cfg, &adapter_spec(rank, a)).map_err(anyhow::Error::msg)?;
            println!("{}", d.display());
        }
        return Ok(());
    }
    let blocks_per_seq = ((PROMPT + steps * 3 * rounds + 2) as u32).div_ceil(BLOCK);
    let backend = CpuBackend::new(CpuConfig {
        threads: args.threads as usize,
        f32_reference: false,
    });
    let opts = ModelOptions {
        max_tokens: (streams * PROMPT).max(256),
        max_logit_rows: streams,
        num_blocks: streams * blocks_per_seq as usize,
        block_size: BLOCK as usize,
        kv_memory_fraction: None,
    };
    let mut model = Model::load_checkpoint(&ck, backend, opts, None)?;
    let cfg = model.cfg.clone();
    model.enable_lora(adapters, rank)?;
    let dir = std::env::temp_dir().join(format!("npu-bench-lora-{}", std::process::id()));
    for a in 0..adapters {
        let d = dir.join(format!("adapter{a}"));
        write_peft(&d, &cfg, &adapter_spec(rank, a)).map_err(anyhow::Error::msg)?;
        let host = model.read_lora(&d)?;
        model.load_lora(a, &host)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let say = |s: &str| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    say(&format!(
        "{} on {}: {adapters} adapters of rank {rank}, {streams} streams, {rounds} rounds of \
         {steps} decode steps per mode",
        cfg.name,
        model.backend().describe()
    ));
    let mut rng = SplitMix(23);
    let prompts: Vec<Vec<u32>> = (0..streams)
        .map(|_| {
            (0..PROMPT)
                .map(|_| (rng.next() % cfg.vocab as u64) as u32)
                .collect()
        })
        .collect();
    let mut st = Streams {
        pos: vec![0; streams],
        last: vec![0; streams],
        blocks_per_seq,
    };
    let mut out = StepOutput::default();
    let step = st.step(&prompts);
    model.forward(&step, true, &mut out)?;
    st.last = picks(&out, cfg.vocab);
    for p in &mut st.pos {
        *p = PROMPT as u32;
    }
    let base = vec![BASE; streams];
    let per_group = streams.div_ceil(adapters);
    let grouped: Vec<u16> = (0..streams).map(|i| (i / per_group) as u16 + 1).collect();
    let interleaved: Vec<u16> = (0..streams).map(|i| (i % adapters) as u16 + 1).collect();
    let mut rep = LoraReport {
        adapters,
        rank,
        streams,
        decode_steps_per_round: steps,
        backend: model.backend().describe(),
        ..Default::default()
    };
    for _ in 0..rounds {
        for (mode, slots) in [(0, &base), (1, &grouped), (2, &interleaved)] {
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let feed: Vec<Vec<u32>> = st.last.iter().map(|&t| vec![t]).collect();
                let step = st.step(&feed);
                let t0 = Instant::now();
                model.set_step_lora(slots, streams)?;
                model
                    .forward(&step, true, &mut out)
                    .context("a decode step")?;
                times.push(t0.elapsed().as_secs_f64());
                st.last = picks(&out, cfg.vocab);
                for p in &mut st.pos {
                    *p += 1;
                }
            }
            times.sort_by(f64::total_cmp);
            let tok_s = streams as f64 / times[times.len() / 2];
            match mode {
                0 => rep.base_tok_s_rounds.push(tok_s),
                1 => rep.grouped_tok_s_rounds.push(tok_s),
                _ => rep.interleaved_tok_s_rounds.push(tok_s),
            }
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let b = best(&rep.base_tok_s_rounds);
    rep.grouped_ratio = best(&rep.grouped_tok_s_rounds) / b;
    rep.interleaved_ratio = best(&rep.interleaved_tok_s_rounds) / b;
    rep.wall_s = t_start.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::to_string(&rep)?);
    } else {
        println!(
            "decode, {streams} streams: base {:.1} tok/s; {adapters} adapters of rank {rank} \
             grouped {:.1} tok/s ({:.1}% of base), interleaved {:.1} tok/s ({:.1}% of base) \
             [best of {rounds} rounds, same run]",
            b,
            best(&rep.grouped_tok_s_rounds),
            100.0 * rep.grouped_ratio,
            best(&rep.interleaved_tok_s_rounds),
            100.0 * rep.interleaved_ratio
        );
    }
    Ok(())
}
