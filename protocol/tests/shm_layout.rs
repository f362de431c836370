//! Layout of the shared-memory segment: record sizes, region offsets, the layout hash, and the
//! capacities that are refused.

use std::mem::{offset_of, size_of};

use npu_protocol::shm::layout::{
    PlanMeta, RawAdmission, RawKvCopy, RawSeqResult, RawTokenLogprob, ResultMeta, SeqDesc,
    REGION_ALIGN,
};
use npu_protocol::shm::{Region, ShmCapacities, ShmError, ShmHeader, ShmLayout, SHM_MAGIC};
use npu_protocol::{MAX_LOGIT_BIAS, MAX_LORA_PATH, MAX_STEP_DRAFT_TOKENS};

fn small_caps() -> ShmCapacities {
    ShmCapacities {
        max_masks: 2,
        mask_words: 3,
        max_slots: 8,
        max_seqs_per_step: 4,
        max_tokens_per_step: 100,
        max_blocks_per_seq: 6,
        max_admissions: 3,
        max_forget: 5,
        max_top_n: 2,
        max_kv_copies: 3,
    }
}

#[test]
fn header_fields_sit_where_the_protocol_says() {
    assert_eq!(size_of::<ShmHeader>(), 312);
    assert_eq!(offset_of!(ShmHeader, magic), 0);
    assert_eq!(offset_of!(ShmHeader, version), 8);
    assert_eq!(offset_of!(ShmHeader, header_size), 12);
    assert_eq!(offset_of!(ShmHeader, total_size), 16);
    assert_eq!(offset_of!(ShmHeader, layout_hash), 24);
    assert_eq!(offset_of!(ShmHeader, caps), 32);
    assert_eq!(offset_of!(ShmHeader, plan_seq), 72);
    assert_eq!(offset_of!(ShmHeader, result_seq), 80);
    assert_eq!(offset_of!(ShmHeader, regions), 88);
    assert_eq!(&SHM_MAGIC.to_le_bytes()[..6], b"NPUSHM");
}

#[test]
fn regions_of_a_small_layout_have_the_expected_offsets_and_sizes() {
    let layout = ShmLayout::new(small_caps()).unwrap();
    let expect = [
        (Region::PlanMeta, 320, 40),
        (Region::SeqDescs, 384, 4 * 40),
        (Region::Tokens, 576, 400),
        (Region::SlotMapping, 1024, 400),
        (Region::BlockTables, 1472, 4 * 6 * 4),
        // An admission: slot, parameters and a table of MAX_LOGIT_BIAS (token, bias) pairs,
        // and its LoRA adapter's id and path.
        (
            Region::Admissions,
            1600,
            3 * (64 + 8 * MAX_LOGIT_BIAS as u64 + MAX_LORA_PATH as u64),
        ),
        (Region::Forget, 11008, 5 * 4),
        (Region::KvCopies, 11072, 3 * 16),
        // Token masks: a slot each, and their words.
        (Region::MaskSlots, 11136, 2 * 4),
        (Region::MaskWords, 11200, 2 * 3 * 4),
        (Region::ResultMeta, 11264, 80),
        (Region::SeqResults, 11392, 4 * 24),
        (Region::TopLogprobs, 11520, 4 * 2 * 8),
        // Tokens sampled after drafts: a fixed number per step.
        (Region::ExtraTokens, 11584, MAX_STEP_DRAFT_TOKENS as u64 * 8),
    ];
    for (region, offset, size) in expect {
        let r = layout.region(region);
        assert_eq!((r.offset, r.size), (offset, size), "{region:?}");
    }
    assert_eq!(layout.total_size(), 12096);
    assert_eq!(size_of::<PlanMeta>(), 40);
    assert_eq!(size_of::<SeqDesc>(), 40);
    assert_eq!(
        size_of::<RawAdmission>(),
        64 + 8 * MAX_LOGIT_BIAS + MAX_LORA_PATH
    );
    assert_eq!(size_of::<ResultMeta>(), 80);
    assert_eq!(size_of::<RawKvCopy>(), 16);
    assert_eq!(size_of::<RawSeqResult>(), 24);
    assert_eq!(size_of::<RawTokenLogprob>(), 8);
}

#[test]
fn regions_are_aligned_ordered_and_disjoint_for_the_default_layout() {
    let layout = ShmLayout::new(ShmCapacities::default()).unwrap();
    let mut end = size_of::<ShmHeader>() as u64;
    for region in Region::ALL {
        let r = layout.region(region);
        assert_eq!(r.offset % REGION_ALIGN, 0, "{region:?}");
        assert!(r.offset >= end, "{region:?} overlaps the previous region");
        // The token-mask regions are empty without structured output (the default).
        let masks = matches!(region, Region::MaskSlots | Region::MaskWords);
        assert!(r.size > 0 || masks, "{region:?}");
        end = r.offset + r.size;
    }
    assert!(layout.total_size() >= end);
}

#[test]
fn the_header_describes_its_layout_and_reads_back() {
    let layout = ShmLayout::new(small_caps()).unwrap();
    let header = layout.header();
    assert_eq!(header.layout_hash, layout.hash());
    let again = ShmLayout::from_header(&header, layout.total_size()).unwrap();
    assert_eq!(again, layout);
}

#[test]
fn layout_hash_is_stable_and_changes_with_every_capacity() {
    let base = ShmLayout::new(small_caps()).unwrap();
    assert_eq!(base.hash(), ShmLayout::new(small_caps()).unwrap().hash());
    let tweaks: [fn(&mut ShmCapacities); 10] = [
        |c| c.max_slots += 1,
        |c| c.max_seqs_per_step += 1,
        |c| c.max_tokens_per_step += 1,
        |c| c.max_blocks_per_seq += 1,
        |c| c.max_admissions += 1,
        |c| c.max_forget += 1,
        |c| c.max_top_n += 1,
        |c| c.max_kv_copies += 1,
        |c| c.max_masks += 1,
        |c| c.mask_words += 1,
    ];
    for (i, tweak) in tweaks.iter().enumerate() {
        let mut caps = small_caps();
        tweak(&mut caps);
        let other = ShmLayout::new(caps).unwrap();
        assert_ne!(
            other.hash(),
            base.hash(),
            "tweak {i} left the hash unchanged"
        );
    }
}

#[test]
fn zero_oversized_and_inconsistent_capacities_are_refused() {
    let cases: [fn(&mut ShmCapacities); 6] = [
        |c| c.max_slots = 0,
        |c| c.max_kv_copies = u32::MAX,
        |c| c.max_tokens_per_step = 0,
        |c| c.max_blocks_per_seq = u32::MAX,
        |c| c.max_top_n = npu_protocol::MAX_TOP_N as u32 + 1,
        // Each capacity is allowed alone, but the segment would exceed the size limit.
        |c| {
            c.max_seqs_per_step = 1 << 20;
            c.max_blocks_per_seq = 1 << 20;
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let mut caps = small_caps();
        case(&mut caps);
        match ShmLayout::new(caps) {
            Err(ShmError::BadCapacities(msg)) => assert!(!msg.is_empty()),
            other => panic!("case {i}: expected BadCapacities, got {other:?}"),
        }
    }
}

#[test]
fn from_header_refuses_each_kind_of_mismatch() {
    let layout = ShmLayout::new(small_caps()).unwrap();
    let good = layout.header();

    let mut h = good;
    h.magic ^= 1;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::BadMagic { .. })
    ));

    let mut h = good;
    h.version += 1;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::VersionMismatch { found, expected }) if found == expected + 1
    ));

    let mut h = good;
    h.layout_hash ^= 0x10;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::LayoutMismatch(_))
    ));

    let mut h = good;
    h.caps.max_tokens_per_step += 1;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::LayoutMismatch(_))
    ));

    let mut h = good;
    h.regions[3].offset += 64;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::LayoutMismatch(_))
    ));

    let mut h = good;
    h.header_size = 128;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::LayoutMismatch(_))
    ));

    let mut h = good;
    h.caps.max_slots = 0;
    assert!(matches!(
        ShmLayout::from_header(&h, layout.total_size()),
        Err(ShmError::BadCapacities(_))
    ));

    assert!(matches!(
        ShmLayout::from_header(&good, layout.total_size() - 1),
        Err(ShmError::TooSmall { .. })
    ));
}
