//! Real POSIX shared-memory segments: creation rules, round trips of plans and results between
//! two mappings, every capacity overflow refused, and corrupt segments refused without panics.

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;

use npu_protocol::shm::layout::RawAdmission;
use npu_protocol::shm::{
    segment_name, Region, ShmCapacities, ShmError, ShmHeader, ShmLayout, ShmSegment,
};
use npu_protocol::{
    Admission, KvCopy, LoraRequest, PlanSource, SamplingParams, SeqResult, SeqStep, StepPlan,
    StepResult, StepTiming, StepTransfer, TokenLogprob, TokenMask, MAX_LOGIT_BIAS, MAX_LORA_PATH,
};
use proptest::prelude::*;

type PlanEdit = fn(&mut StepPlan);
type ResultEdit = fn(&mut StepResult);

fn caps() -> ShmCapacities {
    ShmCapacities {
        max_masks: 2,
        mask_words: 3,
        max_slots: 8,
        max_seqs_per_step: 4,
        max_tokens_per_step: 64,
        max_blocks_per_seq: 5,
        max_admissions: 3,
        max_forget: 4,
        max_top_n: 3,
        max_kv_copies: 3,
    }
}

fn new_segment() -> ShmSegment {
    let layout = ShmLayout::new(caps()).unwrap();
    ShmSegment::create(&segment_name(7).unwrap(), &layout).unwrap()
}

fn shm_path(seg: &ShmSegment) -> String {
    format!("/dev/shm{}", seg.name())
}

/// Overwrites bytes of the segment through its /dev/shm file, as a stray writer would.
fn poke(seg: &ShmSegment, offset: u64, bytes: &[u8]) {
    let mut f = OpenOptions::new().write(true).open(shm_path(seg)).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
}

fn seq(slot: u32, tokens: Vec<u32>, start_pos: u32, blocks: Vec<u32>) -> SeqStep {
    let slot_mapping = tokens
        .iter()
        .enumerate()
        .map(|(i, _)| 100 + i as u32)
        .collect();
    SeqStep {
        slot,
        n_prompt_tokens: tokens.len() as u32,
        n_draft: 0,
        tokens,
        start_pos,
        block_table: blocks,
        slot_mapping,
        sample: true,
    }
}

fn sample_plan() -> StepPlan {
    StepPlan {
        // Slot 1 samples under a grammar: tokens 0, 33 and 95 allowed.
        masks: vec![TokenMask {
            slot: 1,
            words: vec![1, 2, 1 << 31],
        }],
        step_id: 41,
        forget: vec![5, 6],
        admit: vec![Admission {
            slot: 1,
            params: SamplingParams {
                do_sample: true,
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                presence_penalty: 0.2,
                frequency_penalty: 0.3,
                seed: u64::MAX - 3,
                top_n: 3,
                logit_bias: vec![(7, -100.0), (11, 2.5), (49_151, 100.0)],
            },
            lora: Some(LoraRequest {
                id: 3,
                path: "/adapters/sql-\u{fc}ber".into(),
            }),
        }],
        kv_copies: vec![
            KvCopy::to_host(3, 9),
            KvCopy::to_handoff(5, 7),
            KvCopy::from_handoff(7, 4),
        ],
        seqs: vec![
            seq(1, vec![10, 11, 12], 0, vec![4]),
            seq(2, vec![99], 17, vec![0, 3]),
        ],
    }
}

fn sample_result() -> StepResult {
    StepResult {
        step_id: 41,
        seqs: vec![SeqResult {
            slot: 1,
            token: TokenLogprob {
                token: 77,
                logprob: -0.25,
            },
            top: vec![
                TokenLogprob {
                    token: 77,
                    logprob: -0.25,
                },
                TokenLogprob {
                    token: 3,
                    logprob: -2.5,
                },
            ],
            extra: Vec::new(),
        }],
        timing: StepTiming {
            forward_us: 10,
            sample_us: 2,
            total_us: 13,
        },
        transfer: StepTransfer {
            input_bytes: 123,
            block_table_bytes: 8,
            swap_out_bytes: 1 << 33,
            swap_in_bytes: 7,
            copy_us: 5,
        },
        failed: Vec::new(),
    }
}

#[test]
fn created_segment_is_private_exclusive_and_unlinked_on_drop() {
    let seg = new_segment();
    let path = shm_path(&seg);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), seg.layout().total_size());
    let again = ShmSegment::create(seg.name(), seg.layout());
    assert!(matches!(again, Err(ShmError::Os { .. })), "{again:?}");
    drop(seg);
    assert!(!std::path::Path::new(&path).exists());
}

#[test]
fn explicit_unlink_removes_the_name_once() {
    let mut seg = new_segment();
    let path = shm_path(&seg);
    seg.unlink().unwrap();
    assert!(!std::path::Path::new(&path).exists());
    seg.unlink().unwrap();
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::Os { .. })
    ));
}

#[test]
fn names_are_checked() {
    let layout = ShmLayout::new(caps()).unwrap();
    for bad in ["no-slash", "/", "/a/b", "/nul\0byte"] {
        assert!(
            matches!(
                ShmSegment::create(bad, &layout),
                Err(ShmError::InvalidName { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        ShmSegment::open("/npu-serving-test-never-created"),
        Err(ShmError::Os { .. })
    ));
}

#[test]
fn plan_and_result_cross_between_two_mappings() {
    let mut server = new_segment();
    let mut agent = ShmSegment::open(server.name()).unwrap();
    assert_eq!(agent.layout(), server.layout());

    let plan = sample_plan();
    assert_eq!(server.write_plan(&plan).unwrap(), 1);
    assert_eq!(agent.plan_seq(), 1);
    assert_eq!(agent.read_plan().unwrap(), plan);
    // Read in place, the plan says the same, sequence by sequence.
    {
        let view = agent.plan_view().unwrap();
        assert_eq!(view.step_id(), plan.step_id);
        assert_eq!(view.n_seqs(), plan.seqs.len());
        assert_eq!(PlanSource::n_tokens(&view), plan.n_tokens());
        assert_eq!(view.forget().to_vec(), plan.forget);
        assert_eq!(view.admissions(), &plan.admit[..]);
        assert_eq!(view.kv_copies(), &plan.kv_copies[..]);
        for (i, want) in plan.seqs.iter().enumerate() {
            let got = view.seq(i);
            assert_eq!(got.tokens.to_vec(), want.tokens);
            assert_eq!(got.slot_mapping.to_vec(), want.slot_mapping);
            assert_eq!(got.block_table.to_vec(), want.block_table);
            assert_eq!(
                (got.slot, got.start_pos, got.sample, got.n_prompt_tokens),
                (want.slot, want.start_pos, want.sample, want.n_prompt_tokens)
            );
        }
        assert_eq!(view.to_plan(), plan);
    }

    // Before the agent answers, the result region holds nothing for this plan.
    assert!(matches!(
        server.read_result(),
        Err(ShmError::StaleResult {
            plan_seq: 1,
            result_seq: 0
        })
    ));
    agent.write_result(&sample_result()).unwrap();
    assert_eq!(server.read_result().unwrap(), sample_result());

    // The next plan makes the old result stale again.
    let mut next = plan.clone();
    next.step_id = 42;
    next.admit.clear();
    assert_eq!(server.write_plan(&next).unwrap(), 2);
    assert_eq!(agent.read_plan().unwrap(), next);
    assert!(matches!(
        server.read_result(),
        Err(ShmError::StaleResult { .. })
    ));
}

#[test]
fn an_empty_plan_round_trips() {
    let mut seg = new_segment();
    let plan = StepPlan {
        step_id: 3,
        ..Default::default()
    };
    seg.write_plan(&plan).unwrap();
    assert_eq!(seg.read_plan().unwrap(), plan);
}

/// Each case breaks exactly one capacity or rule of `sample_plan`.
#[test]
fn every_plan_overflow_is_refused_and_leaves_the_previous_plan_intact() {
    let mut seg = new_segment();
    let good = sample_plan();
    seg.write_plan(&good).unwrap();
    let cases: Vec<(&str, PlanEdit)> = vec![
        ("sequences", |p| {
            p.seqs = (0..5).map(|s| seq(s, vec![1], 0, vec![0])).collect()
        }),
        ("tokens", |p| p.seqs[0] = seq(1, vec![1; 64], 0, vec![0])),
        ("blocks", |p| p.seqs[1].block_table = vec![0; 6]),
        ("admissions", |p| {
            p.admit = vec![p.admit[0].clone(); 4];
        }),
        ("forget", |p| p.forget = vec![0; 5]),
        ("kv copies", |p| {
            p.kv_copies = vec![KvCopy::to_host(0, 0); 4]
        }),
        ("sequence slot", |p| p.seqs[0].slot = 8),
        ("admission slot", |p| p.admit[0].slot = 8),
        ("forget slot", |p| p.forget[1] = 8),
        ("admission top_n", |p| p.admit[0].params.top_n = 4),
        ("admission logit biases", |p| {
            p.admit[0].params.logit_bias = vec![(1, 1.0); MAX_LOGIT_BIAS + 1]
        }),
        ("slot mapping length", |p| {
            p.seqs[0].slot_mapping.pop();
        }),
        ("prompt tokens", |p| p.seqs[1].n_prompt_tokens = 2),
        ("token masks", |p| p.masks = vec![p.masks[0].clone(); 3]),
        ("token mask words", |p| p.masks[0].words.push(0)),
        ("token mask of a slot not sampling", |p| p.masks[0].slot = 5),
        ("admission LoRA id 0", |p| {
            p.admit[0].lora.as_mut().unwrap().id = 0
        }),
        ("admission LoRA path empty", |p| {
            p.admit[0].lora.as_mut().unwrap().path.clear()
        }),
        ("admission LoRA path too long", |p| {
            p.admit[0].lora.as_mut().unwrap().path = "a".repeat(MAX_LORA_PATH + 1)
        }),
    ];
    for (what, break_it) in cases {
        let mut bad = good.clone();
        break_it(&mut bad);
        let err = seg.write_plan(&bad).expect_err(what);
        assert!(
            matches!(
                err,
                ShmError::CapacityExceeded { .. } | ShmError::BadSlot { .. } | ShmError::BadPlan(_)
            ),
            "{what}: {err:?}"
        );
        assert_eq!(
            seg.plan_seq(),
            1,
            "{what}: a refused plan bumped the sequence"
        );
        assert_eq!(
            seg.read_plan().unwrap(),
            good,
            "{what}: a refused plan wrote data"
        );
    }
}

#[test]
fn every_result_overflow_is_refused() {
    let mut seg = new_segment();
    let good = sample_result();
    let cases: Vec<(&str, ResultEdit)> = vec![
        ("sequences", |r| r.seqs = vec![r.seqs[0].clone(); 5]),
        ("top-n", |r| r.seqs[0].top = vec![r.seqs[0].token; 4]),
        ("slot", |r| r.seqs[0].slot = 8),
    ];
    for (what, break_it) in cases {
        let mut bad = good.clone();
        break_it(&mut bad);
        let err = seg.write_result(&bad).expect_err(what);
        assert!(
            matches!(
                err,
                ShmError::CapacityExceeded { .. } | ShmError::BadSlot { .. }
            ),
            "{what}: {err:?}"
        );
    }
    // At full capacity everything still fits.
    let mut full = good.clone();
    full.seqs = vec![good.seqs[0].clone(); 4];
    for s in &mut full.seqs {
        s.top = vec![s.token; 3];
    }
    seg.write_result(&full).unwrap();
    assert_eq!(seg.read_result().unwrap(), full);
}

#[test]
fn corrupt_headers_are_refused_on_open() {
    let header_field = |f: &str| -> u64 {
        match f {
            "magic" => std::mem::offset_of!(ShmHeader, magic) as u64,
            "version" => std::mem::offset_of!(ShmHeader, version) as u64,
            "hash" => std::mem::offset_of!(ShmHeader, layout_hash) as u64,
            "caps" => std::mem::offset_of!(ShmHeader, caps) as u64,
            _ => unreachable!(),
        }
    };
    let seg = new_segment();
    poke(&seg, header_field("magic"), b"GARBAGE!");
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::BadMagic { .. })
    ));

    let seg = new_segment();
    poke(&seg, header_field("version"), &99u32.to_le_bytes());
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::VersionMismatch { found: 99, .. })
    ));

    let seg = new_segment();
    poke(&seg, header_field("hash"), &1u64.to_le_bytes());
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::LayoutMismatch(_))
    ));

    // Capacities grown in place: the recomputed hash no longer matches.
    let seg = new_segment();
    poke(&seg, header_field("caps"), &4096u32.to_le_bytes());
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::LayoutMismatch(_))
    ));

    // A segment shorter than its layout.
    let seg = new_segment();
    let f = OpenOptions::new().write(true).open(shm_path(&seg)).unwrap();
    f.set_len(seg.layout().total_size() - 64).unwrap();
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::TooSmall { .. })
    ));
    f.set_len(16).unwrap();
    assert!(matches!(
        ShmSegment::open(seg.name()),
        Err(ShmError::TooSmall { .. })
    ));
}

/// Each case corrupts one u32 field of a valid plan or result in place:
/// (what, region, byte offset inside the region, new value).
#[test]
fn corrupt_plans_and_results_are_refused_on_read() {
    let desc = |i: u64, field: u64| i * 40 + field * 4;
    let params_top_n = std::mem::offset_of!(RawAdmission, params) as u64 + 40;
    let n_bias = std::mem::offset_of!(RawAdmission, params) as u64 + 44;
    let first_bias = std::mem::offset_of!(RawAdmission, params) as u64 + 52;
    let temperature = std::mem::offset_of!(RawAdmission, params) as u64 + 4;
    let frequency_penalty = std::mem::offset_of!(RawAdmission, params) as u64 + 28;
    let lora_id = std::mem::offset_of!(RawAdmission, lora_id) as u64;
    let lora_len = std::mem::offset_of!(RawAdmission, lora_path_len) as u64;
    let lora_path = std::mem::offset_of!(RawAdmission, lora_path) as u64;
    let plan_cases = [
        ("n_seqs over capacity", Region::PlanMeta, 8, 5),
        ("n_seqs beyond data", Region::PlanMeta, 8, 3),
        ("n_tokens over capacity", Region::PlanMeta, 12, 65),
        ("n_block_entries", Region::PlanMeta, 16, 2),
        ("n_admissions over", Region::PlanMeta, 20, 4),
        ("n_forget over", Region::PlanMeta, 24, 9),
        ("n_kv_copies over", Region::PlanMeta, 28, 4),
        ("copy direction", Region::KvCopies, 16, 4),
        ("sequence slot", Region::SeqDescs, desc(0, 0), 8),
        ("sequence tokens", Region::SeqDescs, desc(0, 1), 60),
        ("prompt tokens", Region::SeqDescs, desc(1, 3), 2),
        ("sample flag", Region::SeqDescs, desc(0, 4), 2),
        ("token offset", Region::SeqDescs, desc(1, 5), 1),
        ("n_blocks", Region::SeqDescs, desc(1, 6), 6),
        ("block offset", Region::SeqDescs, desc(1, 7), 0),
        ("drafts past the limit", Region::SeqDescs, desc(0, 8), 17),
        (
            "drafts as long as the tokens",
            Region::SeqDescs,
            desc(1, 8),
            1,
        ),
        ("admission slot", Region::Admissions, 0, 9),
        ("admission do_sample", Region::Admissions, 8, 7),
        ("admission top_n", Region::Admissions, params_top_n, 4),
        (
            "admission logit bias count",
            Region::Admissions,
            n_bias,
            MAX_LOGIT_BIAS as u32 + 1,
        ),
        (
            "admission logit bias value (NaN)",
            Region::Admissions,
            first_bias,
            f32::NAN.to_bits(),
        ),
        (
            "admission logit bias value (above 100)",
            Region::Admissions,
            first_bias,
            100.5f32.to_bits(),
        ),
        (
            "admission temperature (NaN)",
            Region::Admissions,
            temperature,
            f32::NAN.to_bits(),
        ),
        (
            "admission frequency penalty (infinite)",
            Region::Admissions,
            frequency_penalty,
            f32::INFINITY.to_bits(),
        ),
        ("forget slot", Region::Forget, 4, 100),
        (
            "LoRA path with adapter id 0",
            Region::Admissions,
            lora_id,
            0,
        ),
        ("LoRA path length 0", Region::Admissions, lora_len, 0),
        (
            "LoRA path length past the array",
            Region::Admissions,
            lora_len,
            MAX_LORA_PATH as u32 + 1,
        ),
        (
            "LoRA path not UTF-8",
            Region::Admissions,
            lora_path,
            u32::MAX,
        ),
    ];
    for (what, region, at, value) in plan_cases {
        let mut seg = new_segment();
        seg.write_plan(&sample_plan()).unwrap();
        let offset = seg.layout().region(region).offset + at;
        poke(&seg, offset, &u32::to_le_bytes(value));
        let err = seg.read_plan().expect_err(what);
        assert!(matches!(err, ShmError::Corrupt(_)), "{what}: {err:?}");
    }

    let result_cases = [
        ("n_seqs", Region::ResultMeta, 8, 5),
        ("slot", Region::SeqResults, 0, 8),
        ("n_top", Region::SeqResults, 12, 4),
        (
            "n_extra over a sequence's drafts",
            Region::SeqResults,
            16,
            17,
        ),
        ("extra offset", Region::SeqResults, 20, 3),
    ];
    for (what, region, at, value) in result_cases {
        let mut seg = new_segment();
        seg.write_plan(&sample_plan()).unwrap();
        seg.write_result(&sample_result()).unwrap();
        let offset = seg.layout().region(region).offset + at;
        poke(&seg, offset, &u32::to_le_bytes(value));
        let err = seg.read_result().expect_err(what);
        assert!(matches!(err, ShmError::Corrupt(_)), "{what}: {err:?}");
    }
}

fn arb_params() -> impl Strategy<Value = SamplingParams> {
    (
        any::<bool>(),
        (0.0f32..4.0, 0u32..100, 0.0f32..=1.0, 0.0f32..1.0),
        (0.5f32..2.0, -2.0f32..2.0, -2.0f32..2.0),
        any::<u64>(),
        0u32..=3,
    )
        .prop_map(
            |(do_sample, (t, k, p, m), (rep, pres, freq), seed, top_n)| SamplingParams {
                do_sample,
                temperature: t,
                top_k: k,
                top_p: p,
                min_p: m,
                repetition_penalty: rep,
                presence_penalty: pres,
                frequency_penalty: freq,
                seed,
                top_n,
                logit_bias: Vec::new(),
            },
        )
}

fn arb_seq() -> impl Strategy<Value = SeqStep> {
    (
        0u32..8,
        prop::collection::vec(any::<u32>(), 0..20),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..=5),
        any::<bool>(),
        any::<u32>(),
    )
        .prop_flat_map(|(slot, tokens, start_pos, blocks, sample, salt)| {
            let n = tokens.len();
            (
                prop::collection::vec(any::<u32>(), n),
                0..=n as u32,
                Just((slot, tokens, start_pos, blocks, sample, salt)),
            )
        })
        .prop_map(
            |(slot_mapping, n_prompt_tokens, (slot, tokens, start_pos, blocks, sample, _))| {
                SeqStep {
                    slot,
                    tokens,
                    start_pos,
                    block_table: blocks,
                    slot_mapping,
                    sample,
                    n_prompt_tokens,
                    n_draft: 0,
                }
            },
        )
}

fn arb_plan() -> impl Strategy<Value = StepPlan> {
    (
        any::<u64>(),
        prop::collection::vec(0u32..8, 0..=4),
        prop::collection::vec((0u32..8, arb_params()), 0..=3),
        prop::collection::vec(arb_seq(), 0..=4),
        prop::collection::vec((any::<bool>(), any::<u32>(), any::<u32>()), 0..=3),
    )
        .prop_map(|(step_id, forget, admit, seqs, copies)| StepPlan {
            masks: Vec::new(),
            step_id,
            forget,
            admit: admit
                .into_iter()
                .map(|(slot, params)| Admission {
                    lora: (slot % 2 == 1).then(|| LoraRequest {
                        id: slot | 1,
                        path: format!("/a/{slot}"),
                    }),
                    slot,
                    params,
                })
                .collect(),
            kv_copies: copies
                .into_iter()
                .map(|(out, d, h)| {
                    if out {
                        KvCopy::to_host(d, h)
                    } else {
                        KvCopy::to_device(h, d)
                    }
                })
                .collect(),
            seqs,
        })
}

fn arb_token() -> impl Strategy<Value = TokenLogprob> {
    (any::<u32>(), -30.0f32..=0.0).prop_map(|(token, logprob)| TokenLogprob { token, logprob })
}

fn arb_result() -> impl Strategy<Value = StepResult> {
    (
        any::<u64>(),
        prop::collection::vec(
            (
                0u32..8,
                arb_token(),
                prop::collection::vec(arb_token(), 0..=3),
                prop::collection::vec(arb_token(), 0..=4),
            ),
            0..=4,
        ),
        (any::<u64>(), any::<u64>(), any::<u64>()),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(step_id, seqs, (f, s, t), (ib, bt, ob, sb, cu))| StepResult {
                step_id,
                seqs: seqs
                    .into_iter()
                    .map(|(slot, token, top, extra)| SeqResult {
                        slot,
                        token,
                        top,
                        extra,
                    })
                    .collect(),
                timing: StepTiming {
                    forward_us: f,
                    sample_us: s,
                    total_us: t,
                },
                transfer: StepTransfer {
                    input_bytes: ib,
                    block_table_bytes: bt,
                    swap_out_bytes: ob,
                    swap_in_bytes: sb,
                    copy_us: cu,
                },
                failed: Vec::new(),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_plans_and_results_round_trip(plan in arb_plan(), result in arb_result()) {
        let mut server = new_segment();
        let mut agent = ShmSegment::open(server.name()).unwrap();
        if plan.n_tokens() > 64 {
            prop_assert!(
                matches!(
                    server.write_plan(&plan),
                    Err(ShmError::CapacityExceeded { what: "tokens per step", .. })
                ),
                "an over-long plan was not refused"
            );
        } else {
            server.write_plan(&plan).unwrap();
            prop_assert_eq!(agent.read_plan().unwrap(), plan);
        }
        agent.write_result(&result).unwrap();
        prop_assert_eq!(server.read_result().unwrap(), result);
    }

    #[test]
    fn garbage_in_the_regions_gives_errors_not_panics(
        plan in arb_plan(),
        junk in prop::collection::vec((0u64..1920, any::<u8>()), 1..64),
    ) {
        let mut seg = new_segment();
        let _ = seg.write_plan(&plan);
        seg.write_result(&StepResult::default()).unwrap();
        let header = std::mem::size_of::<ShmHeader>() as u64;
        let end = seg.layout().total_size();
        for (at, byte) in junk {
            let at = header + at % (end - header);
            poke(&seg, at, &[byte]);
        }
        // Any outcome but a panic is fine; a successful read must respect the capacities.
        if let Ok(p) = seg.read_plan() {
            prop_assert!(p.seqs.len() <= 4 && p.n_tokens() <= 64 && p.admit.len() <= 3);
            prop_assert!(p.kv_copies.len() <= 3);
            prop_assert!(p.seqs.iter().all(|s| s.slot < 8 && s.block_table.len() <= 5));
        }
        if let Ok(r) = seg.read_result() {
            prop_assert!(r.seqs.len() <= 4 && r.seqs.iter().all(|s| s.top.len() <= 3));
        }
    }
}

#[test]
fn drafted_tokens_cross_the_segment_and_misplaced_drafts_are_refused() {
    let mut seg = new_segment();
    let mut plan = sample_plan();
    // Slot 2 decodes: its last generated token and three drafts after it.
    plan.seqs[1] = seq(2, vec![99, 5, 6, 7], 17, vec![0, 3, 6]);
    plan.seqs[1].n_prompt_tokens = 0;
    plan.seqs[1].n_draft = 3;
    seg.write_plan(&plan).unwrap();
    assert_eq!(seg.read_plan().unwrap(), plan);

    let mut result = sample_result();
    result.seqs[0].extra = vec![
        TokenLogprob {
            token: 5,
            logprob: -0.5,
        },
        TokenLogprob {
            token: 8,
            logprob: -1.5,
        },
    ];
    seg.write_result(&result).unwrap();
    assert_eq!(seg.read_result().unwrap(), result);

    for (what, n_draft, n_prompt, sample) in [
        ("drafts over prompt tokens", 2, 3, true),
        ("no real token before the drafts", 4, 0, true),
        ("drafts in a sequence that does not sample", 1, 0, false),
    ] {
        let mut bad = plan.clone();
        bad.seqs[1].n_draft = n_draft;
        bad.seqs[1].n_prompt_tokens = n_prompt;
        bad.seqs[1].sample = sample;
        bad.masks.clear();
        let err = seg.write_plan(&bad).expect_err(what);
        assert!(matches!(err, ShmError::BadPlan(_)), "{what}: {err:?}");
    }
}

/// A plan may name its masked slots and send their words later (written while the agent runs
/// the forward pass): the words cross between mappings, and words that do not match the plan,
/// plans that mix the two kinds of masks, and corrupt flags are refused.
#[test]
fn mask_words_that_follow_the_plan_cross_the_segment_and_mismatches_are_refused() {
    let mut seg = new_segment();
    let agent = ShmSegment::open(seg.name()).unwrap();
    let mut plan = sample_plan();
    let words = std::mem::take(&mut plan.masks[0].words);
    assert!(plan.masks_follow());
    seg.write_plan(&plan).unwrap();
    let view = agent.plan_view().unwrap();
    assert!(view.masks_follow());
    assert_eq!(
        (view.n_masks(), view.mask(0).0, view.mask(0).1.len()),
        (1, 1, 0)
    );
    assert_eq!(agent.read_plan().unwrap(), plan);

    let words_for = |slot: u32, words: Vec<u32>| vec![TokenMask { slot, words }];
    for (what, masks) in [
        ("another slot", words_for(2, words.clone())),
        ("too few words", words_for(1, vec![1, 2])),
        ("a mask the plan has not", {
            let mut m = words_for(1, words.clone());
            m.push(TokenMask {
                slot: 2,
                words: words.clone(),
            });
            m
        }),
        ("no masks", Vec::new()),
    ] {
        let err = seg.write_mask_words(&masks).expect_err(what);
        assert!(matches!(err, ShmError::BadPlan(_)), "{what}: {err:?}");
    }
    seg.write_mask_words(&words_for(1, words.clone())).unwrap();
    assert_eq!(
        agent.read_mask_words().unwrap(),
        words_for(1, words.clone())
    );

    // A plan that carries its words awaits none; a plan mixing both kinds is refused.
    seg.write_plan(&sample_plan()).unwrap();
    assert!(!agent.plan_view().unwrap().masks_follow());
    let err = seg
        .write_mask_words(&words_for(1, words.clone()))
        .unwrap_err();
    assert!(matches!(err, ShmError::BadPlan(_)), "{err:?}");
    assert!(matches!(agent.read_mask_words(), Err(ShmError::Corrupt(_))));
    let mut mixed = sample_plan();
    mixed.masks.push(TokenMask {
        slot: 2,
        words: Vec::new(),
    });
    let err = seg.write_plan(&mixed).unwrap_err();
    assert!(matches!(err, ShmError::BadPlan(_)), "{err:?}");

    // Corrupt flags: an unknown bit, and words that follow a plan without masks.
    let flags = seg.layout().region(Region::PlanMeta).offset
        + std::mem::offset_of!(npu_protocol::shm::layout::PlanMeta, flags) as u64;
    seg.write_plan(&plan).unwrap();
    poke(&seg, flags, &u32::to_le_bytes(3));
    assert!(matches!(agent.read_plan(), Err(ShmError::Corrupt(_))));
    let mut unmasked = plan.clone();
    unmasked.masks.clear();
    seg.write_plan(&unmasked).unwrap();
    poke(&seg, flags, &u32::to_le_bytes(1));
    assert!(matches!(agent.read_plan(), Err(ShmError::Corrupt(_))));
}
