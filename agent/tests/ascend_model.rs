//! The real default model (SmolLM2-135M-Instruct Q4_1) on the Ascend backend, run by the agent's
//! own model (`npu_agent::model::Model`) as an agent runs it: its logits against the CPU
//! backend's on the same steps, and its greedy tokens (picked on the device) against the CPU
//! backend's and llama.cpp's up to each one's first near-tie — with 128-token blocks (prefill
//! through the prompt branch of FusedInferAttentionScore) and 16-token blocks (token-wise through
//! the incremental branch). Built with the `ascend` feature; runs over the CANN install that
//! `ASCEND_HOME_PATH` names, else over the emulation `scripts/ascend-emulator.sh` builds.

#![cfg(feature = "ascend")]

mod common;

use std::path::PathBuf;

use common::{model_path, refs};
use npu_agent::model::{Model, ModelOptions, StepOutput};
use npu_backend::{Backend, SeqSpan, StepInputs};
use npu_backend_ascend::{Acl, AscendBackend, AscendConfig};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_gguf::GgufFile;

/// Where a gap between the top two logits counts as a near-tie (as everywhere in the project).
const NEAR_TIE: f32 = 0.15;

/// The CANN install: `ASCEND_HOME_PATH`, else the emulation (built on first use).
fn cann_root() -> PathBuf {
    if let Some(p) = std::env::var_os("ASCEND_HOME_PATH") {
        return PathBuf::from(p);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/ascend-emulator.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .expect("run ascend-emulator.sh");
    assert!(
        out.status.success(),
        "ascend-emulator.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn options(block_size: usize) -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 1,
        num_blocks: 2048 / block_size,
        block_size,
        kv_memory_fraction: None,
    }
}

fn ascend(f: &GgufFile, block_size: usize) -> Model<AscendBackend> {
    ascend_with(f, block_size, AscendConfig::default())
}

fn ascend_with(f: &GgufFile, block_size: usize, cfg: AscendConfig) -> Model<AscendBackend> {
    let acl = Acl::init(&npu_ffi::SearchPaths::root(&cann_root())).expect("CANN loads");
    let b = AscendBackend::with_runtime(acl, cfg).expect("device 0 opens");
    Model::load(f, b, options(block_size)).expect("the model loads on the Ascend backend")
}

fn cpu(f: &GgufFile, f32_reference: bool) -> Model<CpuBackend> {
    let b = CpuBackend::new(CpuConfig {
        threads: 0,
        f32_reference,
    });
    Model::load(f, b, options(128)).unwrap()
}

/// The step that feeds `new` tokens of one sequence after `start` cached ones, on blocks
/// `0, 1, 2, …` of the pool (so each token's slot is its position).
fn seq_step(new: &[u32], start: usize, max_blocks: usize) -> StepInputs {
    let n = new.len();
    StepInputs {
        tokens: new.to_vec(),
        positions: (start..start + n).map(|p| p as u32).collect(),
        slot_mapping: (start..start + n).map(|p| p as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: start as u32,
        }],
        block_tables: (0..max_blocks as u32).collect(),
        max_blocks,
        logit_rows: vec![n as u32 - 1],
    }
}

fn logits<B: npu_backend::Backend>(m: &mut Model<B>, s: &StepInputs) -> Vec<f32> {
    let mut out = StepOutput::default();
    m.forward(s, false, &mut out).unwrap();
    assert!(!out.picked_on_device);
    out.logits
}

/// (top-1 index, gap to the second).
fn top2(l: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::MIN, f32::MIN);
    for (i, &v) in l.iter().enumerate() {
        if v > best.1 {
            best = (i, v, best.1);
        } else if v > best.2 {
            best.2 = v;
        }
    }
    (best.0, best.1 - best.2)
}

/// Teacher-forced along llama.cpp's tokens, the Ascend backend's logits against the CPU backend's
/// plain-arithmetic reference (f32, weights dequantized exactly) and against the CPU backend as
/// it serves (8-bit activations, as llama.cpp): the f16 device path stays within a small
/// fraction of a logit of exact arithmetic, and picks the CPU backend's top-1 wherever that is
/// decided (its top-2 gap at least 0.15; the 8-bit activations move logits by up to ~0.8, so at
/// smaller gaps the two may pick differently).
#[test]
fn logits_follow_exact_arithmetic_and_the_cpu_backend() {
    let f = GgufFile::open(model_path()).unwrap();
    let mut npu = ascend(&f, 128);
    let (mut exact, mut served) = (cpu(&f, true), cpu(&f, false));
    let (mut worst, mut ratio, mut decided, mut steps) = (0f32, f32::MAX, 0, 0);
    for r in refs() {
        let mut tokens = r.prompt_ids.clone();
        let mut start = 0;
        for (i, &next) in r.output_ids.iter().take(16).enumerate() {
            let s = seq_step(&tokens[start..], start, 16);
            let got = logits(&mut npu, &s);
            let want = logits(&mut exact, &s);
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>();
            let snr = (want.iter().map(|v| v * v).sum::<f32>() / err).sqrt();
            worst = worst.max(diff);
            ratio = ratio.min(snr);
            let (top, gap) = top2(&want);
            let (npu_top, _) = top2(&got);
            if gap >= 0.05 {
                assert_eq!(
                    npu_top, top,
                    "{:?} step {i}: top-1 differs from exact arithmetic (gap {gap})",
                    r.prompt
                );
            }
            let (cpu_top, cpu_gap) = top2(&logits(&mut served, &s));
            if cpu_gap >= NEAR_TIE {
                decided += 1;
                assert_eq!(
                    npu_top, cpu_top,
                    "{:?} step {i}: top-1 differs from the CPU backend's (its gap {cpu_gap})",
                    r.prompt
                );
            }
            steps += 1;
            start = tokens.len();
            tokens.push(next);
        }
    }
    eprintln!(
        "{steps} steps: largest |ascend - exact| logit difference {worst:.4}, smallest signal/error {ratio:.0}; the CPU backend's top-1 matched at all {decided} steps where it was decided"
    );
    assert!(decided > 0, "no step was decided");
    assert!(
        worst < 0.25,
        "a logit differs from exact arithmetic by {worst}"
    );
    assert!(
        ratio > 50.0,
        "logits differ from exact arithmetic by more than 2% (RMS)"
    );
}

/// Greedy generation on the CPU: tokens and the top-2 gap of each step's logits.
fn cpu_greedy(m: &mut Model<CpuBackend>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut tokens = prompt.to_vec();
    let (mut start, mut gaps) = (0, Vec::new());
    for _ in 0..n {
        let s = seq_step(&tokens[start..], start, 16);
        let (top, gap) = top2(&logits(m, &s));
        gaps.push(gap);
        start = tokens.len();
        tokens.push(top as u32);
    }
    (tokens[prompt.len()..].to_vec(), gaps)
}

/// Greedy generation on the device (its argmax; only ids and log-probabilities read back), with
/// the aclnn calls of each step.
fn device_greedy(
    npu: &mut Model<AscendBackend>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<String>) {
    let mut tokens = prompt.to_vec();
    let mut start = 0;
    let mut stats = Vec::new();
    let mut out = StepOutput::default();
    let max_blocks = npu.opts.num_blocks;
    for _ in 0..n {
        let s = seq_step(&tokens[start..], start, max_blocks);
        npu.forward(&s, true, &mut out).unwrap();
        assert!(
            out.picked_on_device,
            "the Ascend backend picks on the device"
        );
        let st = npu.backend().step_stats();
        stats.push(format!(
            "{} first phases + {} launches ({} of reused executors)",
            st.prepares, st.launches, st.reused_launches
        ));
        start = tokens.len();
        tokens.push(out.ids[0] as u32);
    }
    (tokens[prompt.len()..].to_vec(), stats)
}

/// 32 greedy tokens per reference prompt, picked on the device, equal to exact arithmetic's (the
/// CPU backend's f32 reference) and to the CPU backend's as it serves, each up to its own first
/// near tie (top-2 gap below 0.15), and to llama.cpp's up to the first near tie of either —
/// with 128-token blocks (prefill through the prompt branch) and 16-token blocks (token-wise).
#[test]
fn greedy_tokens_match_the_cpu_backend_up_to_near_ties_on_both_attention_paths() {
    let f = GgufFile::open(model_path()).unwrap();
    let refs = refs();
    let mut served = cpu(&f, false);
    let cpu_runs: Vec<(Vec<u32>, Vec<f32>)> = refs
        .iter()
        .map(|r| cpu_greedy(&mut served, &r.prompt_ids, 32))
        .collect();
    let mut exact = cpu(&f, true);
    let exact_runs: Vec<(Vec<u32>, Vec<f32>)> = refs
        .iter()
        .map(|r| cpu_greedy(&mut exact, &r.prompt_ids, 32))
        .collect();
    for block_size in [128, 16] {
        let mut npu = ascend(&f, block_size);
        for ((r, (want, gaps)), (exact_want, exact_gaps)) in
            refs.iter().zip(&cpu_runs).zip(&exact_runs)
        {
            let t0 = std::time::Instant::now();
            let (got, stats) = device_greedy(&mut npu, &r.prompt_ids, 32);
            let sure = gaps.iter().position(|&g| g < NEAR_TIE).unwrap_or(32);
            let same = got.iter().zip(want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "block size {block_size}, {:?}: 32 tokens in {:.1}s, {same} as the CPU backend (its first near tie at {sure}), {} as llama.cpp; aclnn calls: prefill {}, decode {}",
                r.prompt,
                t0.elapsed().as_secs_f64(),
                got.iter().zip(&r.output_ids).take_while(|(a, b)| a == b).count(),
                stats[0],
                stats[31]
            );
            assert_eq!(
                &got[..sure],
                &want[..sure],
                "block size {block_size}, {:?}: differs from the CPU backend before its first near tie (step {sure})",
                r.prompt
            );
            let n = r.first_near_tie.unwrap_or(32).min(sure);
            assert_eq!(
                &got[..n],
                &r.output_ids[..n],
                "{:?}: differs from llama.cpp",
                r.prompt
            );
            let exact_sure = exact_gaps.iter().position(|&g| g < NEAR_TIE).unwrap_or(32);
            assert_eq!(
                &got[..exact_sure],
                &exact_want[..exact_sure],
                "block size {block_size}, {:?}: differs from exact arithmetic before its first near tie (step {exact_sure})",
                r.prompt
            );
            eprintln!(
                "  {} tokens as exact arithmetic (its first near tie at {exact_sure})",
                got.iter()
                    .zip(exact_want)
                    .take_while(|(a, b)| a == b)
                    .count()
            );
        }
    }
}

/// Gemma 3's residual stream passes f16's range (its ninth layer, on the 270M model): the
/// backend computes it in bf16, chosen when the model loads. Gemma 3 270M Q4_K_M (the real
/// file) against llama.cpp's references: teacher-forced along llama.cpp's tokens (one prefill
/// step with a logit row per position), the top-1 is llama.cpp's wherever llama.cpp's gap is
/// beyond bf16's margin of the device's logits ([`bf16_margin`]); greedy tokens picked on the
/// device equal llama.cpp's up to the first step within that margin.
#[test]
fn gemma3_runs_in_bf16_and_matches_llama_cpp() {
    const N: usize = 16;
    let f = GgufFile::open(common::gemma3_path()).unwrap();
    let acl = Acl::init(&npu_ffi::SearchPaths::root(&cann_root())).expect("CANN loads");
    let b = AscendBackend::with_runtime(acl, AscendConfig::default()).expect("device 0 opens");
    let opts = ModelOptions {
        max_logit_rows: N,
        ..options(16)
    };
    let mut npu = Model::load(&f, b, opts).expect("Gemma 3 loads on the Ascend backend");
    assert_eq!(npu.backend().act_dtype(), npu_backend::DType::BF16);
    let (mut decided, mut steps, mut greedy_checked, mut worst_loss) = (0, 0, 0, 0f32);
    for r in common::gemma3_refs() {
        let n = r.output_ids.len().min(N);
        let t0 = std::time::Instant::now();
        // Teacher-forced: the prompt and llama.cpp's tokens in one step, a logit row for the
        // prompt's last position and each of llama.cpp's tokens but the last.
        let mut tokens = r.prompt_ids.clone();
        tokens.extend(&r.output_ids[..n - 1]);
        let mut s = seq_step(&tokens, 0, npu.opts.num_blocks);
        let p = r.prompt_ids.len() as u32;
        s.logit_rows = (p - 1..p - 1 + n as u32).collect();
        let rows = logits(&mut npu, &s);
        let vocab = rows.len() / n;
        let mut sure = n;
        for i in 0..n {
            let l = &rows[i * vocab..(i + 1) * vocab];
            let want = r.output_ids[i] as usize;
            let margin = bf16_margin(l);
            let (top, _) = top2(l);
            // How much of llama.cpp's gap the device lost: its gap minus the device's margin of
            // llama.cpp's token over the best other.
            let other = (0..vocab)
                .filter(|&j| j != want)
                .map(|j| l[j])
                .fold(f32::NEG_INFINITY, f32::max);
            worst_loss = worst_loss.max(r.gaps[i] as f32 - (l[want] - other));
            if (r.gaps[i] as f32) < margin {
                sure = sure.min(i);
                continue;
            }
            decided += 1;
            assert_eq!(
                top, want,
                "{:?} step {i}: teacher-forced top-1 differs from llama.cpp's (its gap {}, \
                 margin {margin}, logit {} vs llama.cpp's token's {})",
                r.prompt, r.gaps[i], l[top], l[want]
            );
        }
        steps += n;
        let (got, _) = device_greedy(&mut npu, &r.prompt_ids, n);
        let same = got
            .iter()
            .zip(&r.output_ids)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "gemma3 in bf16, {:?}: {same} of {n} greedy tokens as llama.cpp's (its first step \
             within bf16's margin at {sure}, first near tie at {:?}), {:.1}s",
            r.prompt,
            r.first_near_tie,
            t0.elapsed().as_secs_f64()
        );
        assert_eq!(
            &got[..sure],
            &r.output_ids[..sure],
            "{:?}: greedy tokens differ from llama.cpp's before a step within bf16's margin",
            r.prompt
        );
        greedy_checked += sure;
    }
    eprintln!(
        "gemma3 in bf16: teacher-forced top-1 as llama.cpp's at all {decided} of {steps} steps \
         beyond bf16's margin (largest loss of a llama.cpp gap {worst_loss:.3}); \
         {greedy_checked} greedy tokens checked"
    );
    assert!(decided * 2 >= steps, "{decided} of {steps} steps decided");
}

/// The near-tie margin of a step computed with bf16 activations: 1/32 of the top logit (8 units
/// of bf16's rounding error, 2^-8, of it), never below [`NEAR_TIE`].
fn bf16_margin(row: &[f32]) -> f32 {
    let top = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    NEAR_TIE.max(top.abs() / 32.0)
}

/// An explicit `activations: Some(F16)` keeps f16 for every model: Gemma 3 is then refused at
/// load, naming why, instead of answering token 0 for everything.
#[test]
fn gemma3_is_refused_on_f16_activations() {
    let f = GgufFile::open(common::gemma3_path()).unwrap();
    let acl = Acl::init(&npu_ffi::SearchPaths::root(&cann_root())).expect("CANN loads");
    let b = AscendBackend::with_runtime(
        acl,
        AscendConfig {
            activations: Some(npu_backend::DType::F16),
            ..AscendConfig::default()
        },
    )
    .expect("device 0 opens");
    let e = Model::load(&f, b, options(16))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("gemma3") && e.contains("f16"), "{e}");
}

/// Executor reuse (on by default, for the operators of its allowlist) changes no bit: the
/// logits of a prompt step and of decode steps equal, bit for bit, those of a backend that
/// prepares every call afresh.
#[test]
fn reused_executors_give_the_logits_of_fresh_ones_bit_for_bit() {
    let f = GgufFile::open(model_path()).unwrap();
    let prompt = refs()[0].prompt_ids.clone();
    let run = |reuse: bool| {
        let mut m = ascend_with(
            &f,
            16,
            AscendConfig {
                reuse_executors: reuse,
                ..AscendConfig::default()
            },
        );
        let mut tokens = prompt.clone();
        let mut start = 0;
        let mut all = Vec::new();
        for _ in 0..4 {
            let l = logits(&mut m, &seq_step(&tokens[start..], start, 16));
            start = tokens.len();
            tokens.push(top2(&l).0 as u32);
            all.push(l.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
        }
        (all, m.backend().last_step_stats())
    };
    let (on, stats) = run(true);
    let (off, _) = run(false);
    assert!(stats.reused_launches > 0, "{stats:?}");
    assert!(on == off, "logits differ with and without executor reuse");
}
