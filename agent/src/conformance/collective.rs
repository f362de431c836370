//! The collectives of tensor parallelism (`npu_backend::Collective`) on a backend: two ranks,
//! each with its own backend instance and thread, joined through a fresh shared-memory group
//! region. Checked: the all-reduce sum of device rows (in place, the same values on both ranks),
//! the all-gather of device rows, the gather of device rows into rank 0's host memory, the
//! gather of host values into rank 0; `matmul_all_reduce_sum` (a row-parallel product and its
//! all-reduce, fused where the library has the operator) against `matmul` then `all_reduce_sum`
//! bit for bit and against the host sum of both ranks' products; and one whole model step split
//! over the two ranks against the reference's whole-model logits (step tolerance).
//!
//! `make` builds a rank's collective from its shared-memory member and its backend: the staged
//! one (`HostStaged`, [`staged`]) for any backend, or a device library's own — HCCL on Ascend
//! ([`hccl`], on the strict emulation in CI). A deliberately wrong one fails (the suite's test).
//! [`check_mismatch`] is the negative case for a device library: ranks calling different
//! collectives must each fail with an error naming the mismatch, not hang.

use std::time::{Duration, Instant};

use npu_backend::{
    Backend, BackendError, Collective, HostSlice, HostSliceMut, Readback, View, ViewMut,
};
use npu_gguf::GgufFile;
use npu_model::shard::shard;
use npu_model::ModelConfig;
use npu_protocol::shm::{segment_name, GroupMember, GroupRegion, GROUP_REGION_ID_BASE};

use super::{Class, Report, Tolerance};
use crate::model::{Model, ModelOptions, StepOutput};

/// Builds a rank's collective over its group member, on its backend.
pub type MakeCollective<B> =
    dyn Fn(GroupMember, &mut B) -> Result<Box<dyn Collective<B>>, String> + Sync;

/// The staged collective: any backend, through host memory and the group's region.
pub fn staged<B: Backend + 'static>(
    m: GroupMember,
    _b: &mut B,
) -> Result<Box<dyn Collective<B>>, String> {
    Ok(Box::new(npu_backend::HostStaged::new(
        crate::tp::ShmCollective::from_member(m),
    )))
}

/// HCCL's collective (no fallback: a group that cannot form it is an error).
#[cfg(feature = "ascend")]
pub fn hccl(
    m: GroupMember,
    b: &mut npu_backend_ascend::AscendBackend,
) -> Result<Box<dyn Collective<npu_backend_ascend::AscendBackend>>, String> {
    let host = Box::new(crate::tp::ShmCollective::from_member(m));
    crate::collectives::hccl(b, host)
        .map(|c| Box::new(c) as Box<dyn Collective<_>>)
        .map_err(|(why, _)| why)
}

/// Joins rank `r` of the region `name`.
fn join(name: &str, r: usize) -> Result<GroupMember, String> {
    GroupRegion::open(name)
        .map_err(|e| e.to_string())?
        .join(
            r as u32,
            Duration::from_secs(60),
            Instant::now() + Duration::from_secs(60),
        )
        .map_err(|e| e.to_string())
}

/// The negative case of a device library's collectives: rank 0 calls `all_reduce_sum` while
/// rank 1 calls `all_gather` (the same rows). Both must fail, each with an error naming both
/// calls (`names`: words each message must hold), within `bound` — not hang, not succeed.
pub fn check_mismatch<B: Backend>(
    devs: (&mut B, &mut B),
    make: &MakeCollective<B>,
    names: &[&str],
    bound: Duration,
    report: &mut Report,
) {
    let name = match segment_name(GROUP_REGION_ID_BASE + 0x0ffe) {
        Ok(n) => n,
        Err(e) => return report.error("mismatched collectives: name a group region", &e),
    };
    let region = match GroupRegion::create(&name, 2, 4096) {
        Ok(r) => r,
        Err(e) => return report.error("mismatched collectives: create a group region", &e),
    };
    let started = Instant::now();
    let outs: Vec<Result<String, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = [devs.0, devs.1]
            .into_iter()
            .enumerate()
            .map(|(r, b)| {
                let name = name.clone();
                s.spawn(move || -> Result<String, String> {
                    let mut comm = make(join(&name, r)?, b)?;
                    let act = b.act_dtype();
                    let e = |e: BackendError| e.to_string();
                    let mut x = b.alloc(act, ROWS * COLS).map_err(e)?;
                    b.upload(
                        HostSlice::F32(&rows_of(r)),
                        ViewMut::rows(&mut x, ROWS, COLS).map_err(e)?,
                    )
                    .map_err(e)?;
                    let called = if r == 0 {
                        comm.all_reduce_sum(b, ViewMut::rows(&mut x, ROWS, COLS).map_err(e)?)
                    } else {
                        let mut all = b.alloc(act, 2 * ROWS * COLS).map_err(e)?;
                        comm.all_gather(
                            b,
                            View::rows(&x, ROWS, COLS).map_err(e)?,
                            ViewMut::rows(&mut all, 2 * ROWS, COLS).map_err(e)?,
                        )
                    };
                    // The failure may show at the call or when the stream is synchronized.
                    let synced = called.and_then(|()| b.synchronize());
                    match synced {
                        Ok(()) => Err(format!("rank {r}'s mismatched collective succeeded")),
                        Err(e) => Ok(e.to_string()),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    drop(region);
    let took = started.elapsed();
    for (r, out) in outs.iter().enumerate() {
        match out {
            Ok(msg) => report.verdict(
                format!("mismatched collectives: rank {r} fails naming both calls"),
                names.iter().all(|n| msg.contains(n)),
                msg.clone(),
            ),
            Err(e) => report.verdict(
                format!("mismatched collectives: rank {r} fails naming both calls"),
                false,
                e.clone(),
            ),
        }
    }
    report.verdict(
        "mismatched collectives: the failure comes without waiting out a timeout",
        took < bound,
        format!(
            "{:.1} s (bound {:.0} s)",
            took.as_secs_f64(),
            bound.as_secs_f64()
        ),
    );
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
/// 0's gathered host values, rank 0's step logits, the collective's description, the product
/// checks).
type RankOut = (
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    String,
    Fused,
);

/// A rank's collective results: (all-reduced, all-gathered, gathered to host, host values).
type OpsOut = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Outputs of the row-parallel product: `matmul_all_reduce_sum`'s, `matmul` then
/// `all_reduce_sum`'s, and whether the first ran fused.
type Fused = (Vec<f32>, Vec<f32>, bool);

/// Outputs of the product test's matrix (its rows are output columns).
const OUTS: usize = 24;

/// Rank `r`'s slice of a row-parallel weight: OUTS rows of COLS inputs.
fn weight_of(r: usize) -> Vec<f32> {
    (0..OUTS * COLS)
        .map(|i| ((i * 29 + r * 7) % 31) as f32 * 0.0625 - 0.9)
        .collect()
}

/// `matmul_all_reduce_sum` of rank `r`'s rows and weight, and the two calls it stands for.
fn rank_product<B: Backend>(
    b: &mut B,
    comm: &mut dyn Collective<B>,
) -> Result<Fused, BackendError> {
    let r = comm.rank();
    let act = b.act_dtype();
    let wv = weight_of(r);
    let w = b
        .load_matrix(&[npu_backend::HostTensor {
            ty: npu_gguf::GgmlType::F32,
            data: bytemuck::cast_slice(&wv),
            rows: OUTS,
            cols: COLS,
        }])?
        .ok_or_else(|| BackendError::Unsupported {
            backend: "conformance",
            what: "an f32 matrix".into(),
        })?;
    let mut x = b.alloc(act, ROWS * COLS)?;
    b.upload(
        HostSlice::F32(&rows_of(r)),
        ViewMut::rows(&mut x, ROWS, COLS)?,
    )?;
    let (mut fused, mut two) = (b.alloc(act, ROWS * OUTS)?, b.alloc(act, ROWS * OUTS)?);
    let ran_fused = comm.matmul_all_reduce_sum(
        b,
        View::rows(&x, ROWS, COLS)?,
        &w,
        ViewMut::rows(&mut fused, ROWS, OUTS)?,
    )?;
    b.matmul(
        View::rows(&x, ROWS, COLS)?,
        &w,
        ViewMut::rows(&mut two, ROWS, OUTS)?,
    )?;
    comm.all_reduce_sum(b, ViewMut::rows(&mut two, ROWS, OUTS)?)?;
    let (mut f, mut t) = (vec![0f32; ROWS * OUTS], vec![0f32; ROWS * OUTS]);
    b.read_back(&mut [
        Readback {
            src: View::rows(&fused, ROWS, OUTS)?,
            dst: HostSliceMut::F32(&mut f),
        },
        Readback {
            src: View::rows(&two, ROWS, OUTS)?,
            dst: HostSliceMut::F32(&mut t),
        },
    ])?;
    Ok((f, t, ran_fused))
}

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
    let sh = shard(
        &mc,
        Some(&npu_model::Checkpoint::from(file)),
        comm.size(),
        comm.rank(),
    )
    .map_err(|e| e.to_string())?;
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
    let devs_act = devs.0.act_dtype();
    let tol = Tolerance::for_dtype(devs_act);
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
                    let mut comm = make(join(&name, r)?, &mut b)?;
                    let described = comm.describe();
                    let (a, g, h, v) =
                        rank_run(&mut b, comm.as_mut()).map_err(|e| e.to_string())?;
                    let p = rank_product(&mut b, comm.as_mut()).map_err(|e| e.to_string())?;
                    // The model step on a second group of the same region: the first member is
                    // done with it, the ranks go on in step.
                    let logits = rank_step(file, b, comm, tokens)?;
                    Ok((a, g, h, v, logits, described, p))
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
    report.verdict(
        "the collective says what carries it",
        !r0.5.is_empty(),
        r0.5.clone(),
    );
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
    // The row-parallel product: the bits of its two calls, the host's sum of both ranks'
    // products (of the rows and weights as the backend rounds them: step tolerance), and
    // whether it ran fused (HCCL: aclnnMatmulAllReduce; the others: the two calls).
    let round = |v: &[f32]| -> Vec<f32> {
        match devs_act {
            npu_backend::DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
            npu_backend::DType::BF16 => v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect(),
            _ => v.to_vec(),
        }
    };
    let product = |r: usize| -> Vec<f32> {
        let (x, w) = (round(&rows_of(r)), round(&weight_of(r)));
        (0..ROWS * OUTS)
            .map(|i| {
                let (row, col) = (i / OUTS, i % OUTS);
                (0..COLS)
                    .map(|c| x[row * COLS + c] as f64 * w[col * COLS + c] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let host_sum: Vec<f32> = product(0)
        .iter()
        .zip(product(1))
        .map(|(p, q)| p + q)
        .collect();
    for (r, out) in [(0, &r0.6), (1, &r1.6)] {
        report.verdict(
            format!("matmul_all_reduce_sum, rank {r}: the bits of matmul then all_reduce_sum"),
            out.0 == out.1,
            if out.2 {
                "fused (one operator)"
            } else {
                "two calls"
            },
        );
        report.compare(
            format!("matmul_all_reduce_sum, rank {r}: the host's sum of the products"),
            &out.0,
            &host_sum,
            tol.of(Class::Step),
        );
    }
    report.verdict(
        "matmul_all_reduce_sum: the same values on both ranks",
        r0.6 .0 == r1.6 .0,
        "",
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
