//! The byte layout of an agent's shared-memory segment: the `#[repr(C)]` header and region
//! records, the capacities they are sized from, and the region offsets and layout hash that both
//! sides compute the same way from those capacities.

use bytemuck::{Pod, Zeroable};
use serde::{Deserialize, Serialize};

use super::ShmError;
use crate::step::{MAX_LOGIT_BIAS, MAX_LORA_PATH, MAX_STEP_DRAFT_TOKENS, MAX_TOP_N};

/// "NPUSHM" + two version-independent bytes, read as a little-endian u64.
pub const SHM_MAGIC: u64 = u64::from_le_bytes(*b"NPUSHM\x00\x01");
/// Version of the segment layout and of the control frames; both sides must agree exactly.
pub const PROTOCOL_VERSION: u32 = 9;
/// Every region starts on this boundary (a cache line).
pub const REGION_ALIGN: u64 = 64;
/// Largest segment we agree to create or open.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 30;
/// Largest value any single capacity may take (keeps every offset computation far from overflow).
pub const MAX_CAPACITY: u32 = 1 << 20;

/// Fixed capacities of the regions, from the serving config. Writing more than these is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShmCapacities {
    /// Request slots on the agent; every slot number must be below this.
    pub max_slots: u32,
    /// Most sequences in one step (and so most sequence results).
    pub max_seqs_per_step: u32,
    /// Most new tokens in one step, summed over its sequences.
    pub max_tokens_per_step: u32,
    /// Most KV blocks in one sequence's block table.
    pub max_blocks_per_seq: u32,
    /// Most admissions carried by one step.
    pub max_admissions: u32,
    /// Most slots forgotten by one step.
    pub max_forget: u32,
    /// Most top-n alternatives per sequence result (at most `MAX_TOP_N`).
    pub max_top_n: u32,
    /// Most KV block copies (device<->host) carried by one step.
    pub max_kv_copies: u32,
    /// Most token masks (constrained sequences) in one step; 0: no structured output.
    pub max_masks: u32,
    /// u32 words of one token mask (the vocabulary's tokens, 32 a word).
    pub mask_words: u32,
}

impl Default for ShmCapacities {
    fn default() -> Self {
        Self {
            max_slots: 256,
            max_seqs_per_step: 256,
            max_tokens_per_step: 8192,
            max_blocks_per_seq: 512,
            max_admissions: 256,
            max_forget: 256,
            max_top_n: MAX_TOP_N as u32,
            max_kv_copies: 1024,
            max_masks: 0,
            mask_words: 0,
        }
    }
}

/// The segment header, at offset 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct ShmHeader {
    pub magic: u64,
    pub version: u32,
    pub header_size: u32,
    pub total_size: u64,
    pub layout_hash: u64,
    pub caps: RawCapacities,
    /// Bumped by every `write_plan` (read and written atomically).
    pub plan_seq: u64,
    /// Set to the plan_seq a result answers by `write_result` (read and written atomically).
    pub result_seq: u64,
    pub regions: [RegionRecord; REGION_COUNT],
}

/// Byte offset of `ShmHeader::plan_seq`.
pub const PLAN_SEQ_OFFSET: usize = 72;
/// Byte offset of `ShmHeader::result_seq`.
pub const RESULT_SEQ_OFFSET: usize = 80;

/// The capacities as stored in the header.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct RawCapacities {
    pub max_slots: u32,
    pub max_seqs_per_step: u32,
    pub max_tokens_per_step: u32,
    pub max_blocks_per_seq: u32,
    pub max_admissions: u32,
    pub max_forget: u32,
    pub max_top_n: u32,
    pub max_kv_copies: u32,
    pub max_masks: u32,
    pub mask_words: u32,
}

/// Where one region lives in the segment.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct RegionRecord {
    pub offset: u64,
    pub size: u64,
}

/// Counts of the plan currently in the segment.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct PlanMeta {
    pub step_id: u64,
    pub n_seqs: u32,
    pub n_tokens: u32,
    pub n_block_entries: u32,
    pub n_admissions: u32,
    pub n_forget: u32,
    pub n_kv_copies: u32,
    pub n_masks: u32,
    /// `PLAN_MASKS_FOLLOW`, or 0.
    pub flags: u32,
}

/// `PlanMeta::flags`: the mask words are not in the segment with the plan; the server writes
/// them while the step runs and announces them with a `Masks` frame.
pub const PLAN_MASKS_FOLLOW: u32 = 1;

/// One sequence of a plan; its tokens and slot mapping live at `token_offset` of the flat
/// token and slot-mapping arrays, its block table at `block_offset` of the flat block array.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct SeqDesc {
    pub slot: u32,
    pub n_tokens: u32,
    pub start_pos: u32,
    pub n_prompt_tokens: u32,
    /// 1: sample after this chunk; 0: do not.
    pub sample: u32,
    pub token_offset: u32,
    pub n_blocks: u32,
    pub block_offset: u32,
    /// Trailing tokens that are drafts (speculative decoding; 0 without).
    pub n_draft: u32,
    pub reserved: u32,
}

/// `SamplingParams` as stored in the segment.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawSamplingParams {
    pub do_sample: u32,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
    pub top_n: u32,
    /// Entries of `logit_bias` in use.
    pub n_logit_bias: u32,
    pub logit_bias: [RawLogitBias; MAX_LOGIT_BIAS],
}

/// One `logit_bias` entry of an admission.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawLogitBias {
    pub token: u32,
    pub bias: f32,
}

/// One admission: a slot, the sampling parameters it keeps until forgotten, and the LoRA
/// adapter it runs under (`lora_id` 0: the base model, with no path).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawAdmission {
    pub slot: u32,
    pub lora_id: u32,
    pub params: RawSamplingParams,
    /// Bytes of `lora_path` in use (UTF-8).
    pub lora_path_len: u32,
    pub reserved: u32,
    pub lora_path: [u8; MAX_LORA_PATH],
}

/// One KV block copy of a plan.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawKvCopy {
    /// 0: device -> host; 1: host -> device.
    pub direction: u32,
    pub device_block: u32,
    pub host_block: u32,
    pub reserved: u32,
}

/// Counts, timing and transfers of the result currently in the segment.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct ResultMeta {
    pub step_id: u64,
    pub n_seqs: u32,
    pub reserved: u32,
    pub forward_us: u64,
    pub sample_us: u64,
    pub total_us: u64,
    pub input_bytes: u64,
    pub block_table_bytes: u64,
    pub swap_out_bytes: u64,
    pub swap_in_bytes: u64,
    pub copy_us: u64,
}

/// One sequence result; its alternatives live at `index * max_top_n` of the top array, the
/// tokens it sampled after its drafts at `extra_offset` of the extra-token array.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawSeqResult {
    pub slot: u32,
    pub token: u32,
    pub logprob: f32,
    pub n_top: u32,
    pub n_extra: u32,
    pub extra_offset: u32,
}

/// A token and its log-probability as stored in the segment.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RawTokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

const _: () = assert!(std::mem::size_of::<ShmHeader>() == 312);
const _: () = assert!(std::mem::size_of::<RawCapacities>() == 40);
const _: () = assert!(std::mem::size_of::<RegionRecord>() == 16);
const _: () = assert!(std::mem::size_of::<PlanMeta>() == 40);
const _: () = assert!(std::mem::size_of::<SeqDesc>() == 40);
const _: () = assert!(std::mem::size_of::<RawLogitBias>() == 8);
const _: () = assert!(std::mem::size_of::<RawSamplingParams>() == 48 + 8 * MAX_LOGIT_BIAS);
const _: () =
    assert!(std::mem::size_of::<RawAdmission>() == 64 + 8 * MAX_LOGIT_BIAS + MAX_LORA_PATH);
const _: () = assert!(std::mem::size_of::<RawKvCopy>() == 16);
const _: () = assert!(std::mem::size_of::<ResultMeta>() == 80);
const _: () = assert!(std::mem::size_of::<RawSeqResult>() == 24);
const _: () = assert!(std::mem::size_of::<RawTokenLogprob>() == 8);
const _: () = assert!(std::mem::offset_of!(ShmHeader, plan_seq) == PLAN_SEQ_OFFSET);
const _: () = assert!(std::mem::offset_of!(ShmHeader, result_seq) == RESULT_SEQ_OFFSET);
const _: () = assert!(std::mem::offset_of!(ShmHeader, regions) == 88);

/// The regions of a segment, in the order they are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    PlanMeta = 0,
    SeqDescs,
    Tokens,
    SlotMapping,
    BlockTables,
    Admissions,
    Forget,
    KvCopies,
    MaskSlots,
    MaskWords,
    ResultMeta,
    SeqResults,
    TopLogprobs,
    ExtraTokens,
}

pub const REGION_COUNT: usize = 14;

impl Region {
    pub const ALL: [Region; REGION_COUNT] = [
        Region::PlanMeta,
        Region::SeqDescs,
        Region::Tokens,
        Region::SlotMapping,
        Region::BlockTables,
        Region::Admissions,
        Region::Forget,
        Region::KvCopies,
        Region::MaskSlots,
        Region::MaskWords,
        Region::ResultMeta,
        Region::SeqResults,
        Region::TopLogprobs,
        Region::ExtraTokens,
    ];
}

/// Capacities plus everything derived from them: region offsets, total size and layout hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmLayout {
    caps: ShmCapacities,
    regions: [RegionRecord; REGION_COUNT],
    total_size: u64,
    hash: u64,
}

impl ShmLayout {
    /// Computes the layout for these capacities; refuses zero, oversized or inconsistent ones.
    pub fn new(caps: ShmCapacities) -> Result<Self, ShmError> {
        validate_caps(&caps)?;
        let c = |v: u32| v as u64;
        let sizes: [u64; REGION_COUNT] = [
            size_of_u64::<PlanMeta>(),
            c(caps.max_seqs_per_step) * size_of_u64::<SeqDesc>(),
            c(caps.max_tokens_per_step) * 4,
            c(caps.max_tokens_per_step) * 4,
            c(caps.max_seqs_per_step) * c(caps.max_blocks_per_seq) * 4,
            c(caps.max_admissions) * size_of_u64::<RawAdmission>(),
            c(caps.max_forget) * 4,
            c(caps.max_kv_copies) * size_of_u64::<RawKvCopy>(),
            c(caps.max_masks) * 4,
            c(caps.max_masks) * c(caps.mask_words) * 4,
            size_of_u64::<ResultMeta>(),
            c(caps.max_seqs_per_step) * size_of_u64::<RawSeqResult>(),
            c(caps.max_seqs_per_step) * c(caps.max_top_n) * size_of_u64::<RawTokenLogprob>(),
            MAX_STEP_DRAFT_TOKENS as u64 * size_of_u64::<RawTokenLogprob>(),
        ];
        let mut regions = [RegionRecord::zeroed(); REGION_COUNT];
        let mut at = align_up(size_of_u64::<ShmHeader>());
        for (record, size) in regions.iter_mut().zip(sizes) {
            *record = RegionRecord { offset: at, size };
            at = align_up(at + size);
        }
        if at > MAX_SEGMENT_BYTES {
            return Err(ShmError::BadCapacities(format!(
                "the segment would need {at} bytes, more than the limit of {MAX_SEGMENT_BYTES}"
            )));
        }
        let hash = layout_hash(&caps, &regions, at);
        Ok(Self {
            caps,
            regions,
            total_size: at,
            hash,
        })
    }

    pub fn capacities(&self) -> &ShmCapacities {
        &self.caps
    }

    pub fn region(&self, region: Region) -> RegionRecord {
        self.regions[region as usize]
    }

    pub fn regions(&self) -> &[RegionRecord; REGION_COUNT] {
        &self.regions
    }

    /// Bytes the segment needs.
    pub fn total_size(&self) -> u64 {
        self.total_size
    }

    /// A hash over the protocol version, every record size, the capacities and the offsets:
    /// two processes agree on the layout exactly when their hashes are equal.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The header a segment with this layout starts with (sequence numbers zero).
    pub fn header(&self) -> ShmHeader {
        ShmHeader {
            magic: SHM_MAGIC,
            version: PROTOCOL_VERSION,
            header_size: std::mem::size_of::<ShmHeader>() as u32,
            total_size: self.total_size,
            layout_hash: self.hash,
            caps: RawCapacities::from(self.caps),
            plan_seq: 0,
            result_seq: 0,
            regions: self.regions,
        }
    }

    /// Checks a header read from a segment of `mapped_len` bytes against what its own capacities
    /// imply, and returns the layout. Any disagreement is an error.
    pub fn from_header(header: &ShmHeader, mapped_len: u64) -> Result<Self, ShmError> {
        if header.magic != SHM_MAGIC {
            return Err(ShmError::BadMagic {
                found: header.magic,
            });
        }
        if header.version != PROTOCOL_VERSION {
            return Err(ShmError::VersionMismatch {
                found: header.version,
                expected: PROTOCOL_VERSION,
            });
        }
        if header.header_size as usize != std::mem::size_of::<ShmHeader>() {
            return Err(ShmError::LayoutMismatch(format!(
                "header size {} (expected {})",
                header.header_size,
                std::mem::size_of::<ShmHeader>()
            )));
        }
        let layout = Self::new(ShmCapacities::from(header.caps))?;
        if header.layout_hash != layout.hash {
            return Err(ShmError::LayoutMismatch(format!(
                "layout hash {:#018x} in the header, {:#018x} computed from its capacities",
                header.layout_hash, layout.hash
            )));
        }
        if header.regions != layout.regions || header.total_size != layout.total_size {
            return Err(ShmError::LayoutMismatch(
                "region offsets or total size differ from those the capacities imply".into(),
            ));
        }
        if mapped_len < layout.total_size {
            return Err(ShmError::TooSmall {
                size: mapped_len,
                needed: layout.total_size,
            });
        }
        Ok(layout)
    }
}

impl From<ShmCapacities> for RawCapacities {
    fn from(c: ShmCapacities) -> Self {
        Self {
            max_slots: c.max_slots,
            max_seqs_per_step: c.max_seqs_per_step,
            max_tokens_per_step: c.max_tokens_per_step,
            max_blocks_per_seq: c.max_blocks_per_seq,
            max_admissions: c.max_admissions,
            max_forget: c.max_forget,
            max_top_n: c.max_top_n,
            max_kv_copies: c.max_kv_copies,
            max_masks: c.max_masks,
            mask_words: c.mask_words,
        }
    }
}

impl From<RawCapacities> for ShmCapacities {
    fn from(c: RawCapacities) -> Self {
        Self {
            max_slots: c.max_slots,
            max_seqs_per_step: c.max_seqs_per_step,
            max_tokens_per_step: c.max_tokens_per_step,
            max_blocks_per_seq: c.max_blocks_per_seq,
            max_admissions: c.max_admissions,
            max_forget: c.max_forget,
            max_top_n: c.max_top_n,
            max_kv_copies: c.max_kv_copies,
            max_masks: c.max_masks,
            mask_words: c.mask_words,
        }
    }
}

fn validate_caps(caps: &ShmCapacities) -> Result<(), ShmError> {
    let named = [
        ("max_slots", caps.max_slots),
        ("max_seqs_per_step", caps.max_seqs_per_step),
        ("max_tokens_per_step", caps.max_tokens_per_step),
        ("max_blocks_per_seq", caps.max_blocks_per_seq),
        ("max_admissions", caps.max_admissions),
        ("max_forget", caps.max_forget),
    ];
    for (name, value) in named {
        if value == 0 || value > MAX_CAPACITY {
            return Err(ShmError::BadCapacities(format!(
                "{name} = {value}; allowed 1..={MAX_CAPACITY}"
            )));
        }
    }
    for (name, value) in [
        ("max_kv_copies", caps.max_kv_copies),
        ("max_masks", caps.max_masks),
        ("mask_words", caps.mask_words),
    ] {
        if value > MAX_CAPACITY {
            return Err(ShmError::BadCapacities(format!(
                "{name} = {value}; allowed 0..={MAX_CAPACITY}"
            )));
        }
    }
    if (caps.max_masks == 0) != (caps.mask_words == 0) {
        return Err(ShmError::BadCapacities(format!(
            "max_masks = {} with mask_words = {}: both zero or both set",
            caps.max_masks, caps.mask_words
        )));
    }
    if caps.max_top_n as usize > MAX_TOP_N {
        return Err(ShmError::BadCapacities(format!(
            "max_top_n = {}; allowed 0..={MAX_TOP_N}",
            caps.max_top_n
        )));
    }
    Ok(())
}

fn size_of_u64<T>() -> u64 {
    std::mem::size_of::<T>() as u64
}

fn align_up(v: u64) -> u64 {
    v.div_ceil(REGION_ALIGN) * REGION_ALIGN
}

/// FNV-1a over little-endian words: stable across builds, platforms and Rust versions.
fn layout_hash(caps: &ShmCapacities, regions: &[RegionRecord], total: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |v: u64| {
        for byte in v.to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    feed(SHM_MAGIC);
    feed(PROTOCOL_VERSION as u64);
    for size in [
        size_of_u64::<ShmHeader>(),
        size_of_u64::<PlanMeta>(),
        size_of_u64::<SeqDesc>(),
        size_of_u64::<RawAdmission>(),
        size_of_u64::<RawKvCopy>(),
        size_of_u64::<ResultMeta>(),
        size_of_u64::<RawSeqResult>(),
        size_of_u64::<RawTokenLogprob>(),
    ] {
        feed(size);
    }
    let raw = RawCapacities::from(*caps);
    for v in bytemuck::cast::<RawCapacities, [u32; 10]>(raw) {
        feed(v as u64);
    }
    for r in regions {
        feed(r.offset);
        feed(r.size);
    }
    feed(total);
    h
}
