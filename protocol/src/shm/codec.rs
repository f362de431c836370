//! Writes step plans and step results into a segment's regions and reads them back. Writing
//! checks every capacity first and refuses what does not fit; reading copies the data out and
//! validates every count, offset and slot, so a corrupt segment gives an error, never a panic.

use bytemuck::{Pod, Zeroable};

use super::layout::{
    PlanMeta, RawAdmission, RawKvCopy, RawLogitBias, RawSamplingParams, RawSeqResult,
    RawTokenLogprob, Region, ResultMeta, SeqDesc, ShmLayout, PLAN_MASKS_FOLLOW,
};
use super::lora::{check_lora, lora_from_raw};
use super::ShmError;
use crate::source::{PlanSource, SeqRef, U32s};
use crate::step::{
    Admission, CopyDirection, KvCopy, SamplingParams, SeqResult, StepPlan, StepResult, StepTiming,
    StepTransfer, TokenLogprob, TokenMask, MAX_DRAFT_TOKENS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE,
    MAX_LORA_PATH, MAX_STEP_DRAFT_TOKENS,
};

/// Byte-level access to one region of the segment.
struct RegionBytes<'a> {
    bytes: &'a [u8],
    region: Region,
}

impl RegionBytes<'_> {
    fn get<T: Pod>(&self, index: usize) -> Result<T, ShmError> {
        let size = std::mem::size_of::<T>();
        let start = index.checked_mul(size).ok_or_else(|| self.out_of_range())?;
        let chunk = self
            .bytes
            .get(start..start + size)
            .ok_or_else(|| self.out_of_range())?;
        Ok(bytemuck::pod_read_unaligned(chunk))
    }

    fn out_of_range(&self) -> ShmError {
        ShmError::Corrupt(format!("read past the end of the {:?} region", self.region))
    }
}

struct RegionBytesMut<'a> {
    bytes: &'a mut [u8],
    region: Region,
}

impl RegionBytesMut<'_> {
    fn put<T: Pod>(&mut self, index: usize, value: &T) -> Result<(), ShmError> {
        let size = std::mem::size_of::<T>();
        let start = index * size;
        let region = self.region;
        self.bytes
            .get_mut(start..start + size)
            .ok_or(ShmError::Internal(region))?
            .copy_from_slice(bytemuck::bytes_of(value));
        Ok(())
    }

    fn put_u32s(&mut self, start: usize, values: &[u32]) -> Result<(), ShmError> {
        let region = self.region;
        let dst = self
            .bytes
            .get_mut(start * 4..(start + values.len()) * 4)
            .ok_or(ShmError::Internal(region))?;
        for (d, v) in dst.chunks_exact_mut(4).zip(values) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
}

fn region<'a>(
    layout: &ShmLayout,
    seg: &'a [u8],
    which: Region,
) -> Result<RegionBytes<'a>, ShmError> {
    let r = layout.region(which);
    let bytes = seg
        .get(r.offset as usize..(r.offset + r.size) as usize)
        .ok_or(ShmError::Internal(which))?;
    Ok(RegionBytes {
        bytes,
        region: which,
    })
}

/// Splits the segment into mutable views of the regions, in `Region::ALL` order.
fn regions_mut<'a>(
    layout: &ShmLayout,
    seg: &'a mut [u8],
) -> Result<Vec<RegionBytesMut<'a>>, ShmError> {
    let mut out = Vec::with_capacity(Region::ALL.len());
    let mut rest = seg;
    let mut consumed = 0u64;
    for which in Region::ALL {
        let r = layout.region(which);
        let skip = (r.offset - consumed) as usize;
        if rest.len() < skip + r.size as usize {
            return Err(ShmError::Internal(which));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
        let (bytes, tail) = tail.split_at_mut(r.size as usize);
        rest = tail;
        consumed = r.offset + r.size;
        out.push(RegionBytesMut {
            bytes,
            region: which,
        });
    }
    Ok(out)
}

fn exceeds(what: &'static str, got: usize, cap: u32) -> Result<(), ShmError> {
    if got > cap as usize {
        return Err(ShmError::CapacityExceeded { what, got, cap });
    }
    Ok(())
}

fn check_slot(what: &'static str, slot: u32, max_slots: u32) -> Result<(), ShmError> {
    if slot >= max_slots {
        return Err(ShmError::BadSlot {
            what,
            slot,
            max_slots,
        });
    }
    Ok(())
}

/// Checks that `plan` fits the layout; nothing is written when it does not.
pub(crate) fn check_plan(layout: &ShmLayout, plan: &StepPlan) -> Result<(), ShmError> {
    let caps = layout.capacities();
    exceeds(
        "sequences per step",
        plan.seqs.len(),
        caps.max_seqs_per_step,
    )?;
    exceeds("tokens per step", plan.n_tokens(), caps.max_tokens_per_step)?;
    exceeds("admissions per step", plan.admit.len(), caps.max_admissions)?;
    for adm in &plan.admit {
        exceeds(
            "logit biases per request",
            adm.params.logit_bias.len(),
            MAX_LOGIT_BIAS as u32,
        )?;
    }
    exceeds(
        "forgotten slots per step",
        plan.forget.len(),
        caps.max_forget,
    )?;
    exceeds(
        "KV block copies per step",
        plan.kv_copies.len(),
        caps.max_kv_copies,
    )?;
    for &slot in &plan.forget {
        check_slot("forget", slot, caps.max_slots)?;
    }
    exceeds("token masks per step", plan.masks.len(), caps.max_masks)?;
    let follow = plan.masks_follow();
    for m in &plan.masks {
        if !follow && m.words.len() != caps.mask_words as usize {
            return Err(ShmError::BadPlan(format!(
                "slot {}: a token mask of {} words, the segment's are {}",
                m.slot,
                m.words.len(),
                caps.mask_words
            )));
        }
        if !plan.seqs.iter().any(|s| s.slot == m.slot && s.sample) {
            return Err(ShmError::BadPlan(format!(
                "slot {}: a token mask without a sequence that samples in this step",
                m.slot
            )));
        }
    }
    for adm in &plan.admit {
        check_slot("admission", adm.slot, caps.max_slots)?;
        if let Some(l) = &adm.lora {
            check_lora(adm.slot, l.id, &l.path)?;
        }
        exceeds(
            "top_n of an admission",
            adm.params.top_n as usize,
            caps.max_top_n,
        )?;
    }
    for seq in &plan.seqs {
        check_slot("sequence", seq.slot, caps.max_slots)?;
        exceeds(
            "blocks per sequence",
            seq.block_table.len(),
            caps.max_blocks_per_seq,
        )?;
        if seq.slot_mapping.len() != seq.tokens.len() {
            return Err(ShmError::BadPlan(format!(
                "slot {}: {} slot-mapping entries for {} tokens",
                seq.slot,
                seq.slot_mapping.len(),
                seq.tokens.len()
            )));
        }
        if seq.n_prompt_tokens as usize > seq.tokens.len() {
            return Err(ShmError::BadPlan(format!(
                "slot {}: n_prompt_tokens {} exceeds its {} tokens",
                seq.slot,
                seq.n_prompt_tokens,
                seq.tokens.len()
            )));
        }
        if !drafts_fit(
            seq.n_draft,
            seq.tokens.len() as u32,
            seq.n_prompt_tokens,
            seq.sample,
        ) {
            return Err(ShmError::BadPlan(format!(
                "slot {}: {} drafted tokens with {} tokens, {} of them prompt, sample {} (drafts \
                 follow a generated or prompt token, at most {MAX_DRAFT_TOKENS}, only when \
                 sampling)",
                seq.slot,
                seq.n_draft,
                seq.tokens.len(),
                seq.n_prompt_tokens,
                seq.sample
            )));
        }
    }
    exceeds(
        "drafted tokens per step",
        plan.n_draft(),
        MAX_STEP_DRAFT_TOKENS as u32,
    )?;
    Ok(())
}

/// Whether `n_draft` drafted tokens may end a sequence of `n_tokens` tokens, `n_prompt` of
/// them prompt: at most `MAX_DRAFT_TOKENS`, never prompt, at least one real token before them,
/// and only in a sequence that samples.
fn drafts_fit(n_draft: u32, n_tokens: u32, n_prompt: u32, sample: bool) -> bool {
    n_draft == 0
        || (sample
            && n_draft as usize <= MAX_DRAFT_TOKENS
            && n_draft < n_tokens
            && n_prompt <= n_tokens - n_draft)
}

pub(crate) fn write_plan(
    layout: &ShmLayout,
    seg: &mut [u8],
    plan: &StepPlan,
) -> Result<(), ShmError> {
    check_plan(layout, plan)?;
    let max_blocks = layout.capacities().max_blocks_per_seq as usize;
    let mut regions = regions_mut(layout, seg)?;
    let mut token_at = 0usize;
    for (i, seq) in plan.seqs.iter().enumerate() {
        let desc = SeqDesc {
            slot: seq.slot,
            n_tokens: seq.tokens.len() as u32,
            start_pos: seq.start_pos,
            n_prompt_tokens: seq.n_prompt_tokens,
            sample: seq.sample as u32,
            token_offset: token_at as u32,
            n_blocks: seq.block_table.len() as u32,
            block_offset: (i * max_blocks) as u32,
            n_draft: seq.n_draft,
            reserved: 0,
        };
        regions[Region::SeqDescs as usize].put(i, &desc)?;
        regions[Region::Tokens as usize].put_u32s(token_at, &seq.tokens)?;
        regions[Region::SlotMapping as usize].put_u32s(token_at, &seq.slot_mapping)?;
        regions[Region::BlockTables as usize].put_u32s(i * max_blocks, &seq.block_table)?;
        token_at += seq.tokens.len();
    }
    for (i, adm) in plan.admit.iter().enumerate() {
        let mut raw = RawAdmission {
            slot: adm.slot,
            lora_id: 0,
            params: raw_params(&adm.params),
            lora_path_len: 0,
            reserved: 0,
            lora_path: [0; MAX_LORA_PATH],
        };
        if let Some(l) = &adm.lora {
            raw.lora_id = l.id;
            raw.lora_path_len = l.path.len() as u32;
            raw.lora_path[..l.path.len()].copy_from_slice(l.path.as_bytes());
        }
        regions[Region::Admissions as usize].put(i, &raw)?;
    }
    regions[Region::Forget as usize].put_u32s(0, &plan.forget)?;
    for (i, copy) in plan.kv_copies.iter().enumerate() {
        let raw = RawKvCopy {
            direction: match copy.direction {
                CopyDirection::DeviceToHost => 0,
                CopyDirection::HostToDevice => 1,
                CopyDirection::DeviceToHandoff => 2,
                CopyDirection::HandoffToDevice => 3,
            },
            device_block: copy.device_block,
            host_block: copy.host_block,
            reserved: 0,
        };
        regions[Region::KvCopies as usize].put(i, &raw)?;
    }
    let mask_words = layout.capacities().mask_words as usize;
    for (i, m) in plan.masks.iter().enumerate() {
        regions[Region::MaskSlots as usize].put_u32s(i, &[m.slot])?;
        regions[Region::MaskWords as usize].put_u32s(i * mask_words, &m.words)?;
    }
    let follow = plan.masks_follow();
    let meta = PlanMeta {
        step_id: plan.step_id,
        n_seqs: plan.seqs.len() as u32,
        n_tokens: token_at as u32,
        n_block_entries: plan.seqs.iter().map(|s| s.block_table.len() as u32).sum(),
        n_admissions: plan.admit.len() as u32,
        n_forget: plan.forget.len() as u32,
        n_kv_copies: plan.kv_copies.len() as u32,
        n_masks: plan.masks.len() as u32,
        flags: if follow { PLAN_MASKS_FOLLOW } else { 0 },
    };
    regions[Region::PlanMeta as usize].put(0, &meta)
}

/// A plan as it lies in the segment, its structure checked (counts against the capacities,
/// offsets, slots, admission parameters, copy directions): sequence descriptors, admissions and
/// KV copies are copied out, tokens, slot mappings and block tables are read from the mapping
/// when asked.
#[derive(Debug)]
pub struct PlanView<'a> {
    step_id: u64,
    descs: Vec<SeqDesc>,
    admit: Vec<Admission>,
    kv_copies: Vec<KvCopy>,
    mask_slots: Vec<u32>,
    /// Empty while the words follow the plan (`masks_follow`).
    mask_words: &'a [u8],
    masks_follow: bool,
    forget: &'a [u8],
    tokens: &'a [u8],
    mapping: &'a [u8],
    blocks: &'a [u8],
}

/// Bytes of `count` u32 values from the start of a region.
fn u32_bytes<'a>(r: &RegionBytes<'a>, count: usize) -> Result<&'a [u8], ShmError> {
    let len = count.checked_mul(4).ok_or_else(|| r.out_of_range())?;
    r.bytes.get(..len).ok_or_else(|| r.out_of_range())
}

impl<'a> PlanView<'a> {
    /// Validates the plan region of `seg` (a segment image laid out as `layout`) and reads the
    /// plan in place.
    pub fn parse(layout: &ShmLayout, seg: &'a [u8]) -> Result<Self, ShmError> {
        let caps = *layout.capacities();
        let meta: PlanMeta = region(layout, seg, Region::PlanMeta)?.get(0)?;
        let corrupt = |what: &'static str, got: u32, cap: u32| -> Result<(), ShmError> {
            if got > cap {
                return Err(ShmError::Corrupt(format!(
                    "plan header says {got} {what}, capacity is {cap}"
                )));
            }
            Ok(())
        };
        corrupt("sequences", meta.n_seqs, caps.max_seqs_per_step)?;
        corrupt("tokens", meta.n_tokens, caps.max_tokens_per_step)?;
        corrupt("admissions", meta.n_admissions, caps.max_admissions)?;
        corrupt("forgotten slots", meta.n_forget, caps.max_forget)?;
        corrupt("KV block copies", meta.n_kv_copies, caps.max_kv_copies)?;
        corrupt("token masks", meta.n_masks, caps.max_masks)?;
        if meta.flags & !PLAN_MASKS_FOLLOW != 0 {
            return Err(ShmError::Corrupt(format!(
                "plan flags {:#x}: only {PLAN_MASKS_FOLLOW:#x} (mask words follow) is defined",
                meta.flags
            )));
        }
        let masks_follow = meta.flags & PLAN_MASKS_FOLLOW != 0;
        if masks_follow && meta.n_masks == 0 {
            return Err(ShmError::Corrupt(
                "the plan says its mask words follow but has no masks".into(),
            ));
        }
        let desc_region = region(layout, seg, Region::SeqDescs)?;
        let tokens = u32_bytes(
            &region(layout, seg, Region::Tokens)?,
            meta.n_tokens as usize,
        )?;
        let mapping = u32_bytes(
            &region(layout, seg, Region::SlotMapping)?,
            meta.n_tokens as usize,
        )?;
        let block_region = region(layout, seg, Region::BlockTables)?;
        let blocks = block_region.bytes;
        let mut descs = Vec::with_capacity(meta.n_seqs as usize);
        let mut token_at = 0u32;
        let mut n_block_entries = 0u32;
        let mut n_draft = 0u32;
        for i in 0..meta.n_seqs as usize {
            let d: SeqDesc = desc_region.get(i)?;
            check_slot("sequence", d.slot, caps.max_slots).map_err(to_corrupt)?;
            if d.token_offset != token_at
                || d.n_tokens > meta.n_tokens - token_at
                || d.n_prompt_tokens > d.n_tokens
                || d.sample > 1
                || !drafts_fit(d.n_draft, d.n_tokens, d.n_prompt_tokens, d.sample == 1)
            {
                return Err(ShmError::Corrupt(format!(
                    "sequence {i}: token_offset {} n_tokens {} n_prompt_tokens {} sample {} \
                     n_draft {} (next token offset {token_at}, {} tokens in the plan)",
                    d.token_offset,
                    d.n_tokens,
                    d.n_prompt_tokens,
                    d.sample,
                    d.n_draft,
                    meta.n_tokens
                )));
            }
            n_draft += d.n_draft;
            if d.n_blocks > caps.max_blocks_per_seq
                || d.block_offset as u64 != i as u64 * caps.max_blocks_per_seq as u64
            {
                return Err(ShmError::Corrupt(format!(
                    "sequence {i}: block_offset {} n_blocks {} (capacity {} per sequence)",
                    d.block_offset, d.n_blocks, caps.max_blocks_per_seq
                )));
            }
            let end = (d.block_offset as usize + d.n_blocks as usize) * 4;
            if end > blocks.len() {
                return Err(block_region.out_of_range());
            }
            token_at += d.n_tokens;
            n_block_entries += d.n_blocks;
            descs.push(d);
        }
        if n_draft as usize > MAX_STEP_DRAFT_TOKENS {
            return Err(ShmError::Corrupt(format!(
                "the plan drafts {n_draft} tokens, at most {MAX_STEP_DRAFT_TOKENS} fit a step"
            )));
        }
        if token_at != meta.n_tokens || n_block_entries != meta.n_block_entries {
            return Err(ShmError::Corrupt(format!(
                "plan header says {} tokens and {} block entries, its sequences hold {token_at} and \
                 {n_block_entries}",
                meta.n_tokens, meta.n_block_entries
            )));
        }
        let adm_region = region(layout, seg, Region::Admissions)?;
        let mut admit = Vec::with_capacity(meta.n_admissions as usize);
        for i in 0..meta.n_admissions as usize {
            let raw: RawAdmission = adm_region.get(i)?;
            check_slot("admission", raw.slot, caps.max_slots).map_err(to_corrupt)?;
            admit.push(Admission {
                slot: raw.slot,
                params: params_from_raw(&raw.params, caps.max_top_n)?,
                lora: lora_from_raw(&raw)?,
            });
        }
        let forget_region = region(layout, seg, Region::Forget)?;
        let forget = u32_bytes(&forget_region, meta.n_forget as usize)?;
        for slot in U32s::Le(forget).iter() {
            check_slot("forget", slot, caps.max_slots).map_err(to_corrupt)?;
        }
        let copy_region = region(layout, seg, Region::KvCopies)?;
        let mut kv_copies = Vec::with_capacity(meta.n_kv_copies as usize);
        for i in 0..meta.n_kv_copies as usize {
            let raw: RawKvCopy = copy_region.get(i)?;
            let direction = match raw.direction {
                0 => CopyDirection::DeviceToHost,
                1 => CopyDirection::HostToDevice,
                2 => CopyDirection::DeviceToHandoff,
                3 => CopyDirection::HandoffToDevice,
                other => {
                    return Err(ShmError::Corrupt(format!(
                        "KV copy {i}: direction {other} (allowed 0 = to host, 1 = to device, \
                         2 = to the handoff region, 3 = from the handoff region)"
                    )))
                }
            };
            kv_copies.push(KvCopy {
                direction,
                device_block: raw.device_block,
                host_block: raw.host_block,
            });
        }
        let mask_slots = U32s::Le(u32_bytes(
            &region(layout, seg, Region::MaskSlots)?,
            meta.n_masks as usize,
        )?)
        .to_vec();
        for (i, &slot) in mask_slots.iter().enumerate() {
            if !descs.iter().any(|d| d.slot == slot && d.sample == 1) {
                return Err(ShmError::Corrupt(format!(
                    "token mask {i}: slot {slot} does not sample in this step"
                )));
            }
        }
        let n_words = if masks_follow { 0 } else { meta.n_masks };
        let mask_words = u32_bytes(
            &region(layout, seg, Region::MaskWords)?,
            n_words as usize * caps.mask_words as usize,
        )?;
        Ok(Self {
            step_id: meta.step_id,
            descs,
            admit,
            kv_copies,
            mask_slots,
            mask_words,
            masks_follow,
            forget,
            tokens,
            mapping,
            blocks,
        })
    }
}

impl PlanSource for PlanView<'_> {
    fn step_id(&self) -> u64 {
        self.step_id
    }
    fn forget(&self) -> U32s<'_> {
        U32s::Le(self.forget)
    }
    fn admissions(&self) -> &[Admission] {
        &self.admit
    }
    fn kv_copies(&self) -> &[KvCopy] {
        &self.kv_copies
    }
    fn n_seqs(&self) -> usize {
        self.descs.len()
    }
    fn seq(&self, i: usize) -> SeqRef<'_> {
        let d = &self.descs[i];
        // Offsets were checked in `parse`.
        let t = d.token_offset as usize * 4..(d.token_offset + d.n_tokens) as usize * 4;
        let b = d.block_offset as usize * 4..(d.block_offset + d.n_blocks) as usize * 4;
        SeqRef {
            slot: d.slot,
            tokens: U32s::Le(&self.tokens[t.clone()]),
            start_pos: d.start_pos,
            block_table: U32s::Le(&self.blocks[b]),
            slot_mapping: U32s::Le(&self.mapping[t]),
            sample: d.sample == 1,
            n_prompt_tokens: d.n_prompt_tokens,
            n_draft: d.n_draft,
        }
    }
    fn n_tokens(&self) -> usize {
        self.tokens.len() / 4
    }
    fn n_masks(&self) -> usize {
        self.mask_slots.len()
    }
    fn masks_follow(&self) -> bool {
        self.masks_follow
    }
    fn mask(&self, i: usize) -> (u32, U32s<'_>) {
        // Sized in `parse`: n_masks whole masks of the segment's words (none while they follow).
        let w = self.mask_words.len() / self.mask_slots.len().max(1);
        (
            self.mask_slots[i],
            U32s::Le(&self.mask_words[i * w..(i + 1) * w]),
        )
    }
}

/// Writes the words of the masks that follow the plan in `seg`: one per masked slot, in the
/// plan's order, each of the segment's width. Refused whole when the plan does not await them or
/// they do not match its masked slots.
pub(crate) fn write_mask_words(
    layout: &ShmLayout,
    seg: &mut [u8],
    masks: &[TokenMask],
) -> Result<(), ShmError> {
    let (meta, slots) = plan_mask_slots(layout, seg)?;
    if meta.flags & PLAN_MASKS_FOLLOW == 0 {
        return Err(ShmError::BadPlan(format!(
            "plan {} does not await mask words",
            meta.step_id
        )));
    }
    let words = layout.capacities().mask_words as usize;
    let given: Vec<u32> = masks.iter().map(|m| m.slot).collect();
    if given != slots {
        return Err(ShmError::BadPlan(format!(
            "mask words for slots {given:?}, plan {} awaits them for slots {slots:?}",
            meta.step_id
        )));
    }
    if let Some(m) = masks.iter().find(|m| m.words.len() != words) {
        return Err(ShmError::BadPlan(format!(
            "slot {}: a token mask of {} words, the segment's are {words}",
            m.slot,
            m.words.len()
        )));
    }
    let mut regions = regions_mut(layout, seg)?;
    for (i, m) in masks.iter().enumerate() {
        regions[Region::MaskWords as usize].put_u32s(i * words, &m.words)?;
    }
    Ok(())
}

/// The masks whose words followed the plan in `seg`, read once the server has announced them.
pub(crate) fn read_mask_words(layout: &ShmLayout, seg: &[u8]) -> Result<Vec<TokenMask>, ShmError> {
    let (meta, slots) = plan_mask_slots(layout, seg)?;
    if meta.flags & PLAN_MASKS_FOLLOW == 0 {
        return Err(ShmError::Corrupt(format!(
            "plan {} has no mask words to follow it",
            meta.step_id
        )));
    }
    let words = layout.capacities().mask_words as usize;
    let bytes = u32_bytes(
        &region(layout, seg, Region::MaskWords)?,
        slots.len() * words,
    )?;
    Ok(slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| TokenMask {
            slot,
            words: U32s::Le(&bytes[i * words * 4..(i + 1) * words * 4]).to_vec(),
        })
        .collect())
}

/// The plan header in `seg` and its masked slots (count checked against the capacity).
fn plan_mask_slots(layout: &ShmLayout, seg: &[u8]) -> Result<(PlanMeta, Vec<u32>), ShmError> {
    let meta: PlanMeta = region(layout, seg, Region::PlanMeta)?.get(0)?;
    let cap = layout.capacities().max_masks;
    if meta.n_masks > cap {
        return Err(ShmError::Corrupt(format!(
            "plan header says {} token masks, capacity is {cap}",
            meta.n_masks
        )));
    }
    let slots = U32s::Le(u32_bytes(
        &region(layout, seg, Region::MaskSlots)?,
        meta.n_masks as usize,
    )?)
    .to_vec();
    Ok((meta, slots))
}

pub(crate) fn read_plan(layout: &ShmLayout, seg: &[u8]) -> Result<StepPlan, ShmError> {
    Ok(PlanView::parse(layout, seg)?.to_plan())
}

/// Checks that `result` fits the layout; nothing is written when it does not.
pub(crate) fn check_result(layout: &ShmLayout, result: &StepResult) -> Result<(), ShmError> {
    let caps = layout.capacities();
    exceeds(
        "sequence results",
        result.seqs.len(),
        caps.max_seqs_per_step,
    )?;
    for seq in &result.seqs {
        check_slot("result", seq.slot, caps.max_slots)?;
        exceeds("top-n alternatives", seq.top.len(), caps.max_top_n)?;
        exceeds(
            "tokens sampled after drafts",
            seq.extra.len(),
            MAX_DRAFT_TOKENS as u32,
        )?;
    }
    exceeds(
        "tokens sampled after drafts in one step",
        result.seqs.iter().map(|s| s.extra.len()).sum(),
        MAX_STEP_DRAFT_TOKENS as u32,
    )?;
    Ok(())
}

pub(crate) fn write_result(
    layout: &ShmLayout,
    seg: &mut [u8],
    result: &StepResult,
) -> Result<(), ShmError> {
    check_result(layout, result)?;
    let max_top_n = layout.capacities().max_top_n as usize;
    let mut regions = regions_mut(layout, seg)?;
    let mut extra_at = 0usize;
    for (i, seq) in result.seqs.iter().enumerate() {
        let raw = RawSeqResult {
            slot: seq.slot,
            token: seq.token.token,
            logprob: seq.token.logprob,
            n_top: seq.top.len() as u32,
            n_extra: seq.extra.len() as u32,
            extra_offset: extra_at as u32,
        };
        regions[Region::SeqResults as usize].put(i, &raw)?;
        for t in &seq.extra {
            let raw = RawTokenLogprob {
                token: t.token,
                logprob: t.logprob,
            };
            regions[Region::ExtraTokens as usize].put(extra_at, &raw)?;
            extra_at += 1;
        }
        for (j, alt) in seq.top.iter().enumerate() {
            let raw = RawTokenLogprob {
                token: alt.token,
                logprob: alt.logprob,
            };
            regions[Region::TopLogprobs as usize].put(i * max_top_n + j, &raw)?;
        }
    }
    let meta = ResultMeta {
        step_id: result.step_id,
        n_seqs: result.seqs.len() as u32,
        reserved: 0,
        forward_us: result.timing.forward_us,
        sample_us: result.timing.sample_us,
        total_us: result.timing.total_us,
        input_bytes: result.transfer.input_bytes,
        block_table_bytes: result.transfer.block_table_bytes,
        swap_out_bytes: result.transfer.swap_out_bytes,
        swap_in_bytes: result.transfer.swap_in_bytes,
        copy_us: result.transfer.copy_us,
    };
    regions[Region::ResultMeta as usize].put(0, &meta)
}

pub(crate) fn read_result(layout: &ShmLayout, seg: &[u8]) -> Result<StepResult, ShmError> {
    let caps = *layout.capacities();
    let meta: ResultMeta = region(layout, seg, Region::ResultMeta)?.get(0)?;
    if meta.n_seqs > caps.max_seqs_per_step {
        return Err(ShmError::Corrupt(format!(
            "result header says {} sequences, capacity is {}",
            meta.n_seqs, caps.max_seqs_per_step
        )));
    }
    let results = region(layout, seg, Region::SeqResults)?;
    let top = region(layout, seg, Region::TopLogprobs)?;
    let extra_region = region(layout, seg, Region::ExtraTokens)?;
    let mut extra_at = 0u32;
    let mut seqs = Vec::with_capacity(meta.n_seqs as usize);
    for i in 0..meta.n_seqs as usize {
        let raw: RawSeqResult = results.get(i)?;
        check_slot("result", raw.slot, caps.max_slots).map_err(to_corrupt)?;
        if raw.n_top > caps.max_top_n {
            return Err(ShmError::Corrupt(format!(
                "result {i}: {} alternatives, capacity is {}",
                raw.n_top, caps.max_top_n
            )));
        }
        let mut alts = Vec::with_capacity(raw.n_top as usize);
        for j in 0..raw.n_top as usize {
            let t: RawTokenLogprob = top.get(i * caps.max_top_n as usize + j)?;
            alts.push(TokenLogprob {
                token: t.token,
                logprob: t.logprob,
            });
        }
        if raw.extra_offset != extra_at
            || raw.n_extra as usize > MAX_DRAFT_TOKENS
            || (extra_at + raw.n_extra) as usize > MAX_STEP_DRAFT_TOKENS
        {
            return Err(ShmError::Corrupt(format!(
                "result {i}: {} extra tokens at {} (next offset {extra_at}, at most \
                 {MAX_DRAFT_TOKENS} per sequence and {MAX_STEP_DRAFT_TOKENS} per step)",
                raw.n_extra, raw.extra_offset
            )));
        }
        let mut extra = Vec::with_capacity(raw.n_extra as usize);
        for j in 0..raw.n_extra {
            let t: RawTokenLogprob = extra_region.get((extra_at + j) as usize)?;
            extra.push(TokenLogprob {
                token: t.token,
                logprob: t.logprob,
            });
        }
        extra_at += raw.n_extra;
        seqs.push(SeqResult {
            slot: raw.slot,
            token: TokenLogprob {
                token: raw.token,
                logprob: raw.logprob,
            },
            top: alts,
            extra,
        });
    }
    Ok(StepResult {
        step_id: meta.step_id,
        seqs,
        timing: StepTiming {
            forward_us: meta.forward_us,
            sample_us: meta.sample_us,
            total_us: meta.total_us,
        },
        transfer: StepTransfer {
            input_bytes: meta.input_bytes,
            block_table_bytes: meta.block_table_bytes,
            swap_out_bytes: meta.swap_out_bytes,
            swap_in_bytes: meta.swap_in_bytes,
            copy_us: meta.copy_us,
        },
        // Failures travel in the StepDone frame.
        failed: Vec::new(),
    })
}

fn to_corrupt(e: ShmError) -> ShmError {
    ShmError::Corrupt(e.to_string())
}

fn raw_params(p: &SamplingParams) -> RawSamplingParams {
    RawSamplingParams {
        do_sample: p.do_sample as u32,
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        top_n: p.top_n,
        n_logit_bias: p.logit_bias.len().min(MAX_LOGIT_BIAS) as u32,
        logit_bias: std::array::from_fn(|i| match p.logit_bias.get(i) {
            Some(&(token, bias)) => RawLogitBias { token, bias },
            None => RawLogitBias::zeroed(),
        }),
    }
}

fn params_from_raw(raw: &RawSamplingParams, max_top_n: u32) -> Result<SamplingParams, ShmError> {
    if raw.do_sample > 1 || raw.top_n > max_top_n || raw.n_logit_bias as usize > MAX_LOGIT_BIAS {
        return Err(ShmError::Corrupt(format!(
            "admission parameters: do_sample {} top_n {} (capacity {max_top_n}), {} logit biases \
             (at most {MAX_LOGIT_BIAS})",
            raw.do_sample, raw.top_n, raw.n_logit_bias
        )));
    }
    // The server sends only finite values (requests are validated): anything else is a damaged
    // segment, refused before the sampler divides by it.
    for (name, v) in [
        ("temperature", raw.temperature),
        ("top_p", raw.top_p),
        ("min_p", raw.min_p),
        ("repetition_penalty", raw.repetition_penalty),
        ("presence_penalty", raw.presence_penalty),
        ("frequency_penalty", raw.frequency_penalty),
    ] {
        if !v.is_finite() {
            return Err(ShmError::Corrupt(format!(
                "admission parameters: {name} is {v} (finite values only)"
            )));
        }
    }
    let logit_bias: Vec<(u32, f32)> = raw.logit_bias[..raw.n_logit_bias as usize]
        .iter()
        .map(|b| (b.token, b.bias))
        .collect();
    if let Some(&(token, bias)) = logit_bias
        .iter()
        .find(|(_, b)| !(b.is_finite() && b.abs() <= MAX_LOGIT_BIAS_VALUE))
    {
        return Err(ShmError::Corrupt(format!(
            "admission parameters: logit bias {bias} for token {token} (finite, at most \
             {MAX_LOGIT_BIAS_VALUE} in magnitude)"
        )));
    }
    Ok(SamplingParams {
        do_sample: raw.do_sample == 1,
        temperature: raw.temperature,
        top_k: raw.top_k,
        top_p: raw.top_p,
        min_p: raw.min_p,
        repetition_penalty: raw.repetition_penalty,
        presence_penalty: raw.presence_penalty,
        frequency_penalty: raw.frequency_penalty,
        seed: raw.seed,
        top_n: raw.top_n,
        logit_bias,
    })
}
