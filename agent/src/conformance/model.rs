//! The model-level checks: one whole step of the real model (a prefill chunk, decode tokens with
//! history and a new sequence in one step) against the reference's logits, and greedy
//! generation of the reference prompts against llama.cpp's tokens up to each prompt's first
//! near-tie. Steps are made as the agent makes them: a `StepPlan`, read and checked by
//! `crate::step_input` into the device's inputs.

use npu_backend::Backend;
use npu_backend_cpu::kernels::scan;
use npu_gguf::GgufFile;
use npu_protocol::{SeqStep, StepPlan};

use super::{Class, Report, Tolerance};
use crate::model::{Model, ModelOptions, StepOutput};
use crate::step_input::{StepLimits, StepRead};

/// A reference prompt and llama.cpp's greedy tokens for it.
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyRef {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// The first step where llama.cpp's top two logits are within 0.15 (tokens after it may
    /// differ on any backend).
    pub first_near_tie: Option<usize>,
}

const BLOCK: u32 = 16;
/// Blocks each sequence owns (its table is `[i * BLOCKS_PER_SEQ, ...)`).
const BLOCKS_PER_SEQ: u32 = 8;

fn options(max_seqs: usize) -> ModelOptions {
    ModelOptions {
        max_tokens: 256,
        max_logit_rows: max_seqs,
        num_blocks: max_seqs * BLOCKS_PER_SEQ as usize,
        block_size: BLOCK as usize,
    }
}

/// Sequence `slot`'s share of a step: `tokens` from `start`, on its own blocks.
fn seq(slot: u32, start: u32, tokens: &[u32], sample: bool) -> SeqStep {
    let end = start + tokens.len() as u32;
    let table: Vec<u32> = (0..end.div_ceil(BLOCK))
        .map(|b| slot * BLOCKS_PER_SEQ + b)
        .collect();
    SeqStep {
        slot,
        tokens: tokens.to_vec(),
        start_pos: start,
        slot_mapping: (start..end)
            .map(|p| table[(p / BLOCK) as usize] * BLOCK + p % BLOCK)
            .collect(),
        block_table: table,
        sample,
        n_prompt_tokens: tokens.len() as u32,
    }
}

/// Runs `plan` on `model`: read and checked into the device's inputs, then one forward.
fn run<B: Backend>(
    model: &mut Model<B>,
    read: &mut StepRead,
    plan: &StepPlan,
    greedy: bool,
    out: &mut StepOutput,
) -> Result<(), String> {
    let o = model.opts;
    let lim = StepLimits {
        max_tokens: o.max_tokens,
        max_slots: o.max_logit_rows,
        max_blocks_per_seq: BLOCKS_PER_SEQ as usize,
        num_blocks: o.num_blocks,
        block_size: o.block_size,
        vocab: model.cfg.vocab,
        long_context: None,
    };
    read.read(plan, &lim, |_| true).map_err(|e| e.to_string())?;
    model
        .forward(&read.inputs, greedy, out)
        .map_err(|e| e.to_string())
}

/// Greedy tokens of a step's output rows (device pick, or the host's as the sampler makes it).
fn picks(out: &StepOutput, vocab: usize) -> Vec<u32> {
    if out.picked_on_device {
        return out.ids.iter().map(|&i| i as u32).collect();
    }
    out.logits
        .chunks(vocab)
        .map(scan::argmax_sanitized)
        .collect()
}

/// A whole step against the reference: logits within the step tolerance, and the same top-1
/// wherever the reference's top two are more than 1.0 apart.
pub fn check_step<B: Backend, R: Backend>(
    dev: B,
    reference: R,
    file: &GgufFile,
    report: &mut Report,
) {
    let tol = Tolerance::for_dtype(dev.act_dtype());
    let dm = Model::load(file, dev, options(3));
    let rm = Model::load(file, reference, options(3));
    let (mut dm, mut rm) = match (dm, rm) {
        (Ok(d), Ok(r)) => (d, r),
        (Err(e), _) => return report.error("model step: load the model", &e),
        (_, Err(e)) => return report.error("model step: load the model (reference)", &e),
    };
    let vocab = dm.cfg.vocab;
    let prompt: Vec<u32> = (0..30).map(|i| 200 + i * 37).collect();
    let plans = [
        StepPlan {
            step_id: 1,
            seqs: vec![
                seq(0, 0, &prompt[..20], true),
                seq(1, 0, &prompt[..7], false),
            ],
            ..Default::default()
        },
        StepPlan {
            step_id: 2,
            seqs: vec![
                seq(0, 20, &[504], true),
                seq(1, 7, &prompt[7..17], true),
                seq(2, 0, &prompt[3..8], true),
            ],
            ..Default::default()
        },
    ];
    let (mut dr, mut rr) = (StepRead::default(), StepRead::default());
    let (mut dout, mut rout) = (StepOutput::default(), StepOutput::default());
    for (i, plan) in plans.iter().enumerate() {
        let name = format!("model step {}: logits", i + 1);
        if let Err(e) = run(&mut rm, &mut rr, plan, false, &mut rout) {
            report.error(format!("{name} (reference)"), &e);
            return;
        }
        if let Err(e) = run(&mut dm, &mut dr, plan, false, &mut dout) {
            report.error(&name, &e);
            return;
        }
        report.compare(&name, &dout.logits, &rout.logits, tol.of(Class::Step));
        let mut disagree = Vec::new();
        for (row, (d, r)) in dout
            .logits
            .chunks(vocab)
            .zip(rout.logits.chunks(vocab))
            .enumerate()
        {
            let top = scan::argmax_sanitized(r) as usize;
            let second = r
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != top)
                .map(|(_, &v)| v)
                .fold(f32::NEG_INFINITY, f32::max);
            if r[top] - second > 1.0 && scan::argmax_sanitized(d) as usize != top {
                disagree.push(row);
            }
        }
        report.verdict(
            format!("model step {}: top-1 where decided", i + 1),
            disagree.is_empty(),
            if disagree.is_empty() {
                String::new()
            } else {
                format!("rows {disagree:?} pick another token")
            },
        );
    }
}

/// Greedy generation of every reference prompt (all in one batch), against llama.cpp's tokens
/// up to each prompt's first near-tie; greedy steps let the backend pick on the device.
pub fn check_greedy<B: Backend>(dev: B, file: &GgufFile, refs: &[GreedyRef], report: &mut Report) {
    if refs.is_empty() {
        report.verdict("greedy vs llama.cpp", false, "no reference prompts given");
        return;
    }
    let mut model = match Model::load(file, dev, options(refs.len())) {
        Ok(m) => m,
        Err(e) => return report.error("greedy: load the model", &e),
    };
    let vocab = model.cfg.vocab;
    let steps = refs.iter().map(|r| r.output_ids.len()).max().unwrap_or(0);
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); refs.len()];
    let mut read = StepRead::default();
    let mut out = StepOutput::default();
    let mut on_device = false;
    for step in 0..steps {
        let seqs = refs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if step == 0 {
                    seq(i as u32, 0, &r.prompt_ids, true)
                } else {
                    let start = (r.prompt_ids.len() + step - 1) as u32;
                    let mut s = seq(i as u32, start, &got[i][step - 1..step], true);
                    s.n_prompt_tokens = 0;
                    s
                }
            })
            .collect();
        let plan = StepPlan {
            step_id: step as u64,
            admit: Vec::new(),
            forget: Vec::new(),
            kv_copies: Vec::new(),
            seqs,
        };
        if let Err(e) = run(&mut model, &mut read, &plan, true, &mut out) {
            return report.error(format!("greedy step {step}"), &e);
        }
        on_device |= out.picked_on_device;
        for (g, t) in got.iter_mut().zip(picks(&out, vocab)) {
            g.push(t);
        }
    }
    let mut bad = Vec::new();
    for (i, (r, g)) in refs.iter().zip(&got).enumerate() {
        let n = r.first_near_tie.unwrap_or(r.output_ids.len()).min(g.len());
        if g[..n] != r.output_ids[..n] {
            bad.push(i);
        }
    }
    report.verdict(
        format!(
            "greedy vs llama.cpp, {} prompts ({})",
            refs.len(),
            if on_device {
                "device pick"
            } else {
                "logits read back"
            }
        ),
        bad.is_empty(),
        if bad.is_empty() {
            String::new()
        } else {
            format!("prompts {bad:?} differ before their first near-tie")
        },
    );
}
