//! The agent link as the server reads it: control frames off the socket (length-prefixed,
//! typed), the step result an agent writes into the shared-memory segment, taken in by the
//! scheduler against the plan in flight, and a segment header opened by its reader; also the plan
//! region as an agent reads it. A corrupt or hostile agent may cost its own requests (the error
//! takes it down and they are recomputed elsewhere); it must never panic the server or break the
//! scheduler's invariants.
//!
//! Input: a mode byte (0 frames, 1 a step result, 2 a header, 3 a plan), then the bytes.

use npu_protocol::frame::{Frame, FrameReader};
use npu_protocol::shm::{
    decode_plan, decode_result, PlanView, Region, ShmCapacities, ShmHeader, ShmLayout,
};
use npu_protocol::{PlanSource, SamplingParams, StepPlan};
use npu_scheduler::{GenerateRequest, Scheduler, SchedulerConfig};

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode & 3 {
        0 => frames(rest),
        1 => result(rest),
        2 => header(rest),
        _ => plan(rest),
    }
}

fn frames(bytes: &[u8]) {
    let _ = Frame::decode(bytes);
    // The same bytes as a stream arriving in pieces of 1, 2, 3... bytes.
    let mut reader = FrameReader::new();
    let mut rest = bytes;
    let mut piece = 1;
    let mut decoded = Vec::new();
    while !rest.is_empty() {
        let n = piece.min(rest.len());
        reader.push(&rest[..n]);
        rest = &rest[n..];
        piece += 1;
        loop {
            match reader.next_frame() {
                Ok(Some(frame)) => decoded.push(frame),
                Ok(None) => break,
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    return;
                }
            }
        }
    }
    // What decodes re-encodes to a frame that decodes the same.
    for frame in decoded {
        let bytes = frame.encode();
        match Frame::decode(&bytes) {
            Ok(Some((again, n))) => {
                assert_eq!(n, bytes.len());
                assert_eq!(format!("{again:?}"), format!("{frame:?}"));
            }
            other => panic!("{frame:?} re-encoded does not decode: {other:?}"),
        }
    }
}

pub fn caps() -> ShmCapacities {
    ShmCapacities {
        max_slots: 8,
        max_seqs_per_step: 4,
        max_tokens_per_step: 64,
        max_blocks_per_seq: 16,
        max_admissions: 4,
        max_forget: 4,
        max_top_n: 3,
        max_kv_copies: 4,
        max_masks: 2,
        mask_words: 4,
    }
}

/// A segment image of `layout` with `bytes` written from the start of `first` onwards (the
/// regions after it follow in the image).
fn image(layout: &ShmLayout, first: Region, bytes: &[u8]) -> Vec<u8> {
    let mut img = vec![0u8; layout.total_size() as usize];
    let header = layout.header();
    img[..std::mem::size_of::<ShmHeader>()].copy_from_slice(bytemuck::bytes_of(&header));
    let at = layout.region(first).offset as usize;
    let n = bytes.len().min(img.len() - at);
    img[at..at + n].copy_from_slice(&bytes[..n]);
    img
}

/// A scheduler with three requests and one step in flight.
pub fn scheduler_with_step() -> (Scheduler, StepPlan) {
    let cfg = SchedulerConfig {
        num_blocks: 16,
        block_size: 4,
        max_running: 4,
        max_new_prompts_per_step: 4,
        max_tokens_per_step: 64,
        max_slots: Some(8),
        max_blocks_per_seq: 16,
        max_model_len: 64,
        max_generate_length: None,
        prefix_cache: true,
        eos_ids: vec![0],
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).expect("a valid scheduler config");
    for (id, len) in [(1u64, 5usize), (2, 9), (3, 1)] {
        let req = GenerateRequest {
            id,
            prompt_ids: (1..=len as u32).collect(),
            params: SamplingParams::greedy(),
            max_new_tokens: 4,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            speculative: true,
        };
        s.add(&req).expect("request admitted");
    }
    let plan = s.schedule().expect("a step to run");
    (s, plan)
}

fn result(bytes: &[u8]) {
    let layout = ShmLayout::new(caps()).expect("a valid layout");
    let img = image(&layout, Region::ResultMeta, bytes);
    let Ok(mut res) = decode_result(&layout, &img) else {
        return;
    };
    // Whatever the agent claims, the scheduler checks it against the step in flight.
    let (mut s, plan) = scheduler_with_step();
    let step_id = plan.step_id;
    let wrong_step = s.on_result(&res).is_err();
    res.step_id = step_id;
    let _ = s.on_result(&res);
    s.check_invariants()
        .unwrap_or_else(|e| panic!("after {res:?} (wrong step refused: {wrong_step}): {e}"));
    // The same result for the next step too (now decoding).
    if let Some(plan) = s.schedule() {
        res.step_id = plan.step_id;
        let _ = s.on_result(&res);
        s.check_invariants()
            .unwrap_or_else(|e| panic!("second step, after {res:?}: {e}"));
    }
}

fn header(bytes: &[u8]) {
    let size = std::mem::size_of::<ShmHeader>();
    let layout = ShmLayout::new(caps()).expect("a valid layout");
    // Start from a valid header so that mutations reach past the magic and hash checks.
    let mut raw = bytemuck::bytes_of(&layout.header()).to_vec();
    let (len_bytes, body) = bytes.split_at(bytes.len().min(8));
    for (i, b) in body.iter().take(size).enumerate() {
        raw[i] ^= b;
    }
    let mut len = [0u8; 8];
    len[..len_bytes.len()].copy_from_slice(len_bytes);
    let mapped = layout.total_size() ^ u64::from_le_bytes(len);
    let header: ShmHeader = bytemuck::pod_read_unaligned(&raw);
    if let Ok(opened) = ShmLayout::from_header(&header, mapped) {
        assert!(opened.total_size() <= mapped, "a layout past its mapping");
        for r in opened.regions() {
            assert!(
                r.offset
                    .checked_add(r.size)
                    .is_some_and(|end| end <= mapped),
                "region {r:?} outside a mapping of {mapped} bytes"
            );
        }
    }
}

fn plan(bytes: &[u8]) {
    let layout = ShmLayout::new(caps()).expect("a valid layout");
    let img = image(&layout, Region::PlanMeta, bytes);
    let decoded = decode_plan(&layout, &img);
    if let Ok(view) = PlanView::parse(&layout, &img) {
        let plan = view.to_plan();
        if let Ok(decoded) = &decoded {
            assert_eq!(&plan, decoded, "the plan read in place and copied differ");
        }
    }
}
