//! The collectives of tensor parallelism (`npu_backend::Collective`) on a backend: two ranks,
//! each with its own backend instance and thread, joined through a fresh shared-memory group
//! region. Checked: the all-reduce sum of device rows (in place, the same values on both ranks),
//! the all-gather of device rows, the gather of device rows into rank 0's host memory, the
//! gather of host values into rank 0; and one whole model step split over the two ranks against
//! the reference's whole-model logits (step tolerance).
//!
//! `make_collective` builds a rank's collective from its shared-memory member: the staged one
//! (`HostStaged`) for every backend today; a device library's own (NCCL, HCCL) would be checked
//! by passing its constructor instead. A deliberately wrong one fails (the suite's test).

use std::time::{Duration, Instant};

use npu_backend::{
    Backend, BackendError, Collective, HostSlice, HostSliceMut, Readback, View, ViewMut,
};
use npu_gguf::hparams::shard::shard;
use npu_gguf::hparams::ModelConfig;
use npu_gguf::GgufFile;
use npu_protocol::shm::{segment_name, GroupMember, GroupRegion, GROUP_REGION_ID_BASE};

use super::{Class, Report, Tolerance};
use crate::model::{Model, ModelOptions, StepOutput};

/// Builds rank `rank`'s collective over its group member.
pub type MakeCollective<B> = dyn Fn(GroupMember) -> Box<dyn Collective<B>> + Sync;

/// The staged collective: any backend, through host memory and the group's region.
pub fn staged<B: Backend + 'static>(m: GroupMember) -> Box<dyn Collective<B>> {
    Box::new(npu_backend::HostStaged::new(
        crate::tp::ShmCollective::from_member(m),
    ))
}

const ROWS: usize = 3;
const COLS: usize = 40;

/// Rank `r`'s test rows.
fn rows_of(r: usize) -> Vec<f32> {
    (0..ROWS * COLS)
        .map(|i| ((i * 37 + r * 101) % 53) as f32 * 0.25 - 6.0 + r as f32 * 0.125)
        .collect()
}

/// What each rank found: (all-reduced rows, all-gathered rows, rank 0's gathered rows, rank
/// 0's gathered host values, rank 0's step logits).
type RankOut = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// A rank's collective results: (all-reduced, all-gathered, gathered to host, host values).
type OpsOut = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn rank_run<B: Backend>(b: &mut B, comm: &mut dyn Collective<B>) -> Result<OpsOut, BackendError> {
    let r = comm.rank();
    let act = b.act_dtype();
    let mut x = b.alloc(act, ROWS * COLS)?;
    b.upload(
        HostSlice::F32(&rows_of(r)),
        ViewMut::rows(&mut x, ROWS, COLS)?,
    )?;
    comm.all_reduce_sum(b, ViewMut::rows(&mut x, ROWS, COLS)?)?;
    let mut reduced = vec![0f32; ROWS * COLS];
    b.read_back(&mut [Readback {
        src: View::rows(&x, ROWS, COLS)?,
        dst: HostSliceMut::F32(&mut reduced),
    }])?;
    b.upload(
        HostSlice::F32(&rows_of(r)),
        ViewMut::rows(&mut x, ROWS, COLS)?,
    )?;
    let mut all = b.alloc(act, 2 * ROWS * COLS)?;
    comm.all_gather(
        b,
        View::rows(&x, ROWS, COLS)?,
        ViewMut::rows(&mut all, 2 * ROWS, COLS)?,
    )?;
    let mut gathered = vec![0f32; 2 * ROWS * COLS];
    b.read_back(&mut [Readback {
        src: View::rows(&all, 2 * ROWS, COLS)?,
        dst: HostSliceMut::F32(&mut gathered),
    }])?;
    let mut to_host = vec![0f32; if r == 0 { 2 * ROWS * COLS } else { 0 }];
    comm.gather_to_host(b, View::rows(&x, ROWS, COLS)?, &mut to_host)?;
    let mine: Vec<f32> = (0..5).map(|i| (r * 10 + i) as f32).collect();
    let mut host = vec![0f32; if r == 0 { 10 } else { 0 }];
    comm.gather_host_to_root(b, &mine, &mut host)?;
    Ok((reduced, gathered, to_host, host))
}

/// One prefill step of the first reference-like prompt on rank `r`'s shard.
fn rank_step<B: Backend>(
    file: &GgufFile,
    b: B,
    comm: Box<dyn Collective<B>>,
    tokens: &[u32],
) -> Result<Vec<f32>, String> {
    let mc = ModelConfig::from_gguf(file).map_err(|e| e.to_string())?;
    let sh = shard(&mc, Some(file), comm.size(), comm.rank()).map_err(|e| e.to_string())?;
    let mut model =
        Model::load_shard(file, b, step_options(), Some((sh, comm))).map_err(|e| e.to_string())?;
    let mut out = StepOutput::default();
    model
        .forward(&step_inputs(tokens), false, &mut out)
        .map_err(|e| e.to_string())?;
    Ok(out.logits)
}

fn step_options() -> ModelOptions {
    ModelOptions {
        max_tokens: 64,
        max_logit_rows: 2,
        num_blocks: 8,
        block_size: 16,
        kv_memory_fraction: None,
    }
}

fn step_inputs(tokens: &[u32]) -> npu_backend::StepInputs {
    let n = tokens.len() as u32;
    npu_backend::StepInputs {
        tokens: tokens.to_vec(),
        positions: (0..n).collect(),
        slot_mapping: (0..n).collect(),
        seqs: vec![npu_backend::SeqSpan {
            q_row: 0,
            n_q: n,
            start_pos: 0,
        }],
        block_tables: (0..4).collect(),
        max_blocks: 4,
        logit_rows: vec![n / 2, n - 1],
    }
}

/// Runs the checks on two ranks of backend `B` (`devs`), with collectives made by `make`,
/// against host arithmetic and, for the model step, against `reference` running the whole
/// model.
pub fn check_collectives<B: Backend, R: Backend>(
    devs: (B, B),
    make: &MakeCollective<B>,
    reference: R,
    file: &GgufFile,
    report: &mut Report,
) {
    let tol = Tolerance::for_dtype(devs.0.act_dtype());
    let name = match segment_name(GROUP_REGION_ID_BASE + 0x0fff) {
        Ok(n) => n,
        Err(e) => return report.error("collectives: name a group region", &e),
    };
    let region = match GroupRegion::create(&name, 2, 4096) {
        Ok(r) => r,
        Err(e) => return report.error("collectives: create a group region", &e),
    };
    let tokens: Vec<u32> = (0..11u32).map(|i| 100 + i * 37).collect();
    let outs: Vec<Result<RankOut, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = [devs.0, devs.1]
            .into_iter()
            .enumerate()
            .map(|(r, mut b)| {
                let name = name.clone();
                let tokens = &tokens;
                s.spawn(move || -> Result<RankOut, String> {
                    let join = |r: usize| {
                        GroupRegion::open(&name)
                            .map_err(|e| e.to_string())?
                            .join(
                                r as u32,
                                Duration::from_secs(60),
                                Instant::now() + Duration::from_secs(60),
                            )
                            .map_err(|e| e.to_string())
                    };
                    let mut comm = make(join(r)?);
                    let (a, g, h, v) =
                        rank_run(&mut b, comm.as_mut()).map_err(|e| e.to_string())?;
                    // The model step on a second group of the same region: the first member is
                    // done with it, the ranks go on in step.
                    let logits = rank_step(file, b, comm, tokens)?;
                    Ok((a, g, h, v, logits))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    drop(region);
    let (r0, r1) = match (&outs[0], &outs[1]) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return report.error("collectives (2 ranks)", e),
    };
    let (a, b) = (rows_of(0), rows_of(1));
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let elementwise = tol.bound(Class::Elementwise);
    report.compare_within("all_reduce_sum, rank 0 (2 ranks)", &r0.0, &sum, elementwise);
    report.compare_within("all_reduce_sum, rank 1 (2 ranks)", &r1.0, &sum, elementwise);
    report.verdict(
        "all_reduce_sum: the same values on both ranks",
        r0.0 == r1.0,
        if r0.0 == r1.0 { "" } else { "the ranks differ" },
    );
    let both: Vec<f32> = a.iter().chain(&b).copied().collect();
    let exact = tol.bound(Class::Exact);
    report.compare_within("all_gather, rank 0", &r0.1, &both, exact);
    report.compare_within("all_gather, rank 1", &r1.1, &both, exact);
    report.compare_within("gather_to_host into rank 0", &r0.2, &both, exact);
    let host: Vec<f32> = (0..5).chain(10..15).map(|v| v as f32).collect();
    report.verdict(
        "gather_host_to_root into rank 0",
        r0.3 == host,
        format!("{:?}", r0.3),
    );
    // The whole model on the reference.
    let want = (|| -> Result<Vec<f32>, String> {
        let mut m = Model::load(file, reference, step_options()).map_err(|e| e.to_string())?;
        let mut out = StepOutput::default();
        m.forward(&step_inputs(&tokens), false, &mut out)
            .map_err(|e| e.to_string())?;
        Ok(out.logits)
    })();
    match want {
        Ok(want) => report.compare(
            "model step split over 2 ranks: logits",
            &r0.4,
            &want,
            tol.of(Class::Step),
        ),
        Err(e) => report.error("model step on the reference", &e),
    }
    report.verdict(
        "model step: rank 1 answers no logits",
        r1.4.is_empty(),
        format!("{} values", r1.4.len()),
    );
}
