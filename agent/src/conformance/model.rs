//! The model-level checks: one whole step of the real model (a prefill chunk, decode tokens with
//! history and a new sequence in one step) against the reference's logits, and greedy
//! generation and teacher-forced top-1 tokens of the reference prompts against the CPU backend
//! and llama.cpp, up to each prompt's first near-tie (see `check_greedy`). Steps are made as the agent makes them: a `StepPlan`, read and checked by
//! `crate::step_input` into the device's inputs.

use npu_backend::{Backend, SeqSpan, StepInputs};
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
    /// llama.cpp's top-1/top-2 logit gap at each step.
    pub gaps: Vec<f32>,
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
        kv_memory_fraction: None,
    }
}

/// Options for the greedy checks: room for every reference prompt with all of llama.cpp's
/// tokens in one step (teacher forcing), and a logit row for each of those tokens.
fn greedy_options(refs: &[GreedyRef]) -> ModelOptions {
    let tokens: usize = refs
        .iter()
        .map(|r| r.prompt_ids.len() + r.output_ids.len())
        .sum();
    let rows: usize = refs.iter().map(|r| r.output_ids.len()).sum();
    ModelOptions {
        max_tokens: tokens.max(256),
        max_logit_rows: rows.max(refs.len()),
        num_blocks: refs.len() * BLOCKS_PER_SEQ as usize,
        block_size: BLOCK as usize,
        kv_memory_fraction: None,
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
        n_draft: 0,
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

/// Where the top two logits of a step count as a near-tie (the product's rule): below this gap
/// a different but valid arithmetic may pick the other token.
pub const NEAR_TIE: f32 = 0.15;

/// The top-1 index of a row read as the sampler reads it (NaN as -inf), and its gap to the
/// runner-up.
fn top2(row: &[f32]) -> (u32, f32) {
    let top = scan::argmax_sanitized(row) as usize;
    let val = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let second = row
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != top)
        .map(|(_, &v)| val(v))
        .fold(f32::NEG_INFINITY, f32::max);
    (top as u32, val(row[top]) - second)
}

/// What greedy generation of the reference prompts gave: per prompt and step, the token picked
/// and (when the logits were read back) the top-1/top-2 gap.
struct Run {
    picks: Vec<Vec<u32>>,
    gaps: Vec<Vec<f32>>,
    on_device: bool,
}

/// Greedy generation of every reference prompt (all in one batch) for as many steps as the
/// shortest reference has tokens, each step feeding the token picked at the step before.
/// `greedy` lets the backend pick on the device (no gaps then).
fn generate<B: Backend>(
    model: &mut Model<B>,
    refs: &[GreedyRef],
    greedy: bool,
) -> Result<Run, String> {
    let vocab = model.cfg.vocab;
    let steps = refs.iter().map(|r| r.output_ids.len()).min().unwrap_or(0);
    let mut res = Run {
        picks: vec![Vec::new(); refs.len()],
        gaps: vec![Vec::new(); refs.len()],
        on_device: false,
    };
    let mut read = StepRead::default();
    let mut out = StepOutput::default();
    for step in 0..steps {
        let seqs = refs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if step == 0 {
                    return seq(i as u32, 0, &r.prompt_ids, true);
                }
                let start = (r.prompt_ids.len() + step - 1) as u32;
                let mut s = seq(i as u32, start, &res.picks[i][step - 1..step], true);
                s.n_prompt_tokens = 0;
                s
            })
            .collect();
        let plan = StepPlan {
            step_id: step as u64,
            seqs,
            ..Default::default()
        };
        run(model, &mut read, &plan, greedy, &mut out).map_err(|e| format!("step {step}: {e}"))?;
        res.on_device |= out.picked_on_device;
        if out.picked_on_device {
            for (p, t) in res.picks.iter_mut().zip(picks(&out, vocab)) {
                p.push(t);
            }
            continue;
        }
        for ((p, g), row) in res
            .picks
            .iter_mut()
            .zip(res.gaps.iter_mut())
            .zip(out.logits.chunks(vocab))
        {
            let (top, gap) = top2(row);
            p.push(top);
            g.push(gap);
        }
    }
    Ok(res)
}

/// Teacher forcing in one step: every reference prompt followed by llama.cpp's tokens (its own
/// sequence on its own blocks, all prefilled together), with the logits of every position that
/// predicts one of those tokens. Per prompt and token: (top-1, top-1/top-2 gap).
fn teacher_forced<B: Backend>(
    model: &mut Model<B>,
    refs: &[GreedyRef],
) -> Result<Vec<Vec<(u32, f32)>>, String> {
    let vocab = model.cfg.vocab;
    let mut s = StepInputs {
        max_blocks: BLOCKS_PER_SEQ as usize,
        ..StepInputs::default()
    };
    for (i, r) in refs.iter().enumerate() {
        let tokens: Vec<u32> = r.prompt_ids.iter().chain(&r.output_ids).copied().collect();
        let n = tokens.len() as u32;
        let table: Vec<u32> = (0..BLOCKS_PER_SEQ)
            .map(|b| i as u32 * BLOCKS_PER_SEQ + b)
            .collect();
        if n > BLOCKS_PER_SEQ * BLOCK {
            return Err(format!("prompt {i}: {n} tokens do not fit its blocks"));
        }
        let row0 = s.tokens.len() as u32;
        s.seqs.push(SeqSpan {
            q_row: row0,
            n_q: n,
            start_pos: 0,
        });
        s.positions.extend(0..n);
        s.slot_mapping
            .extend((0..n).map(|p| table[(p / BLOCK) as usize] * BLOCK + p % BLOCK));
        s.block_tables.extend(&table);
        let first = row0 + r.prompt_ids.len() as u32 - 1;
        s.logit_rows
            .extend(first..first + r.output_ids.len() as u32);
        s.tokens.extend(tokens);
    }
    let mut out = StepOutput::default();
    model
        .forward(&s, false, &mut out)
        .map_err(|e| e.to_string())?;
    let mut rows = out.logits.chunks(vocab).map(top2);
    Ok(refs
        .iter()
        .map(|r| rows.by_ref().take(r.output_ids.len()).collect())
        .collect())
}

/// The first step of a prompt that is a near-tie for llama.cpp (its gaps) or for the CPU backend
/// (`cpu_gaps`, along its own greedy path): tokens after it may differ on any valid backend.
fn first_near_tie(r: &GreedyRef, cpu_gaps: &[f32]) -> usize {
    let llama = r.first_near_tie.unwrap_or(r.output_ids.len());
    let cpu = cpu_gaps
        .iter()
        .position(|&g| g < NEAR_TIE)
        .unwrap_or(cpu_gaps.len());
    llama.min(cpu)
}

/// The greedy fidelity check, against the CPU backend (`reference`) and llama.cpp:
/// - greedy generation of every reference prompt (all in one batch; the backend may pick on the
///   device) equals the CPU backend's tokens, and llama.cpp's, up to the first near-tie of
///   either (top-1/top-2 gap below `NEAR_TIE`: llama.cpp's gap, or the CPU backend's own). An
///   f16 device legitimately parts from the CPU backend's 8-bit activations at such a step (at
///   step 6 of "The capital of France is" the CPU backend's gap is 0.008);
/// - teacher-forced along llama.cpp's tokens (one prefill step of every prompt with all its
///   tokens), the top-1 token equals the CPU backend's at every position where neither
///   llama.cpp's nor the CPU backend's gap is a near-tie.
pub fn check_greedy<B: Backend, R: Backend>(
    dev: B,
    reference: R,
    file: &GgufFile,
    refs: &[GreedyRef],
    report: &mut Report,
) {
    if refs.is_empty() {
        report.verdict(
            "greedy vs the CPU backend",
            false,
            "no reference prompts given",
        );
        return;
    }
    let opts = greedy_options(refs);
    let mut model = match Model::load(file, dev, opts) {
        Ok(m) => m,
        Err(e) => return report.error("greedy: load the model", &e),
    };
    let mut cpu = match Model::load(file, reference, opts) {
        Ok(m) => m,
        Err(e) => return report.error("greedy: load the model (reference)", &e),
    };
    let (cpu_greedy, cpu_forced) = match (
        generate(&mut cpu, refs, false),
        teacher_forced(&mut cpu, refs),
    ) {
        (Ok(g), Ok(f)) => (g, f),
        (Err(e), _) | (_, Err(e)) => return report.error("greedy (reference)", &e),
    };
    let got = match generate(&mut model, refs, true) {
        Ok(g) => g,
        Err(e) => return report.error("greedy", &e),
    };
    let (mut vs_cpu, mut vs_llama, mut compared) = (Vec::new(), Vec::new(), 0);
    for (i, r) in refs.iter().enumerate() {
        let g = &got.picks[i];
        let n = first_near_tie(r, &cpu_greedy.gaps[i]).min(g.len());
        compared += n;
        if g[..n] != cpu_greedy.picks[i][..n] {
            vs_cpu.push(i);
        }
        if g[..n] != r.output_ids[..n] {
            vs_llama.push(i);
        }
    }
    let how = if got.on_device {
        "device pick"
    } else {
        "logits read back"
    };
    let differ = |bad: &[usize]| {
        if bad.is_empty() {
            format!("{compared} tokens compared")
        } else {
            format!("prompts {bad:?} differ before their first near-tie")
        }
    };
    report.verdict(
        format!("greedy vs the CPU backend, {} prompts ({how})", refs.len()),
        vs_cpu.is_empty(),
        differ(&vs_cpu),
    );
    report.verdict(
        format!("greedy vs llama.cpp, {} prompts ({how})", refs.len()),
        vs_llama.is_empty(),
        differ(&vs_llama),
    );
    let forced = match teacher_forced(&mut model, refs) {
        Ok(f) => f,
        Err(e) => return report.error("teacher-forced", &e),
    };
    let (mut wrong, mut decided) = (Vec::new(), 0);
    for (i, r) in refs.iter().enumerate() {
        for (s, (&(got, _), &(want, gap))) in forced[i].iter().zip(&cpu_forced[i]).enumerate() {
            let llama_gap = r.gaps.get(s).copied().unwrap_or(f32::INFINITY);
            if gap < NEAR_TIE || llama_gap < NEAR_TIE {
                continue;
            }
            decided += 1;
            if got != want {
                wrong.push((i, s));
            }
        }
    }
    report.verdict(
        "teacher-forced top-1 vs the CPU backend where decided",
        wrong.is_empty() && decided > 0,
        if wrong.is_empty() {
            format!("{decided} decided steps")
        } else {
            format!("(prompt, step) {wrong:?} pick another token")
        },
    );
}
