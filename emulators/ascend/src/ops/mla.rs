//! FusedInferAttentionScoreV3 in its MLA form: multi-head latent attention with the
//! up-projections absorbed, every query head over one KV head whose key is a token's latent
//! (D = 512) plus its rotated key (`keyRopeOptional`, 64), whose value is the latent, over a
//! paged cache. The only form of V3 this emulation implements: without the rope inputs V3 is V2's
//! operator (FusedInferAttentionScoreV2 is emulated), and that use is refused as not
//! implemented.
//!
//! Sources: ops-transformer `attention/fused_infer_attention_score/docs/
//! aclnnFusedInferAttentionScoreV3.md` (the signature, "queryRope和keyRope输入时即为MLA场景",
//! the TND limits for query d 512) and torch_npu's `npu_fused_infer_attention_score` page (the
//! same operator; its MLA limits name the head counts). What they document for query d = 512 on
//! Atlas A2/A3, and this emulation refuses otherwise (ACLNN_ERR_PARAM_INVALID):
//! - queryRope and keyRope both set or both null; FLOAT16/BFLOAT16, queryRope of query's type,
//!   keyRope of key's; query, key, value, queryRope, keyRope and attentionOut contiguous (×);
//!   ND format (NZ caches are documented; not implemented here);
//! - query's d 512 (d 128 is the MLA form without page attention, not implemented here); query's
//!   n (numHeads) 32, 64 or 128; key's n (numKeyValueHeads) 1 and d 512; queryRope's shape that of
//!   query with d 64, keyRope's that of key with d 64; query's s (per batch entry) 1 to 16;
//! - page attention required: blockTable (INT32, (B, ≥ maxBlockNumPerSeq)), actualSeqLengthsKv,
//!   blockSize 16 or 128, caches (blockNum, blockSize, 512) for key and value (BnBsH; BnNBsD is
//!   not implemented here) and (blockNum, blockSize, 64) for keyRope, blockNum at least the
//!   blocks the lengths need;
//! - inputLayout BSH, BSND or TND implemented (BNSD, BNSD_NBSD, BSND_NBSD, BSH_NBSD and TND_NTD
//!   are documented, not implemented here); actualSeqLengths with Q_S > 1 only in TND (there it
//!   is required: cumulative, non-decreasing, ending at T; B is its length);
//! - sparse: Q_S = 1 only sparseMode 0 without a mask; Q_S > 1 only sparseMode 3 with the
//!   2048×2048 lower-triangular mask (right-down causal from each entry's actual lengths);
//! - no pse, left padding, tensor lists of more than one tensor, shared prefix, antiquant or
//!   quantization parameters, keyRopeAntiquantScale (reserved: null), softmaxLse;
//!   innerPrecise 0 or 1 at Q_S = 1 (0..=3 otherwise);
//! - the page is first published for CANN 8.1.RC1: an older emulated release refuses the call.
//!
//! The computation is the CPU reference's: per head, scores `scale · (q·latent + q_rope·rope)` in
//! f32 over the visible keys, softmax in f32, the probabilities rounded to the 16-bit type (the
//! cube unit's inputs) weighing the latents (the value); a query that sees no key gets zeros.

use core::ffi::{c_char, CStr};

use npu_ffi::types::*;

use super::contiguity::{satisfies, Rule};
use super::{
    dot, dtype_in, invalid, kernel_common, nd, prepare, read, read_f32, write, Io, Kernel,
};
use crate::state::*;
use crate::view::{f16_at, read_elem, DType, View};

const OP: &str = "aclnnFusedInferAttentionScoreV3";
/// The latent (query, key and value d) and rope widths of the MLA form with page attention.
const NOPE_D: i64 = 512;
const ROPE_D: i64 = 64;
/// The query head counts the MLA form takes (torch_npu: "n为32、64、128").
const HEADS: [i64; 3] = [32, 64, 128];
/// The block sizes its page attention takes ("block_size支持16、128").
const BLOCK_SIZES: [i64; 2] = [16, 128];
/// The most queries per batch entry ("query的s为1-16").
const MAX_Q_S: i64 = 16;

#[derive(Clone)]
struct Mla {
    /// ins: query, key, value, queryRope, keyRope, blockTable; outs: attentionOut.
    io: Io,
    n: usize,
    scale: f64,
    /// sparseMode 3 (Q_S > 1); else every key of the entry.
    causal: bool,
    block_size: usize,
    /// Per batch entry: its first query row (rows of N heads), its query count, its KV length.
    entries: Vec<(usize, usize, usize)>,
}

impl Kernel for Mla {
    kernel_common!("aclnnFusedInferAttentionScoreV3");

    fn workspace(&self) -> u64 {
        let max_kv = self.entries.iter().map(|e| e.2).max().unwrap_or(0).max(1);
        (self.n * max_kv * 4 + 1024) as u64
    }

    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let [q, kc, vc, qr, kr, bt] = [0, 1, 2, 3, 4, 5].map(|i| &self.io.ins[i]);
        let (n, bs) = (self.n, self.block_size);
        let (nope, rope) = (NOPE_D as usize, ROPE_D as usize);
        let qv = read_f32(st, q)?;
        let qrv = read_f32(st, qr)?;
        let bf16 = q.dtype == DType::Bf16;
        let round16 = |x: f32| {
            if bf16 {
                half::bf16::from_f32(x).to_f32()
            } else {
                half::f16::from_f32(x).to_f32()
            }
        };
        let table: Vec<i64> = read(st, bt)?.into_iter().map(|v| v as i64).collect();
        let max_blocks = bt.dims[1] as usize;
        let num_blocks = kc.dims[0];
        let kb = st.bytes(kc.addr, kc.storage_bytes())?;
        let vb = st.bytes(vc.addr, vc.storage_bytes())?;
        let rb = st.bytes(kr.addr, kr.storage_bytes())?;
        // Rows 0..len of one entry's cache of `width`, through its blocks, as f32.
        let gather = |bytes: &[u8], v: &View, blocks: &[i64], len: usize, width: usize| {
            let mut out = Vec::with_capacity(len * width);
            for j in 0..len {
                let base =
                    v.offset + blocks[j / bs] * v.strides[0] + (j % bs) as i64 * v.strides[1];
                for c in 0..width as i64 {
                    let p = (base + c * v.strides[2]) as usize;
                    out.push(if v.dtype == DType::F16 {
                        f16_at(bytes, p)
                    } else {
                        read_elem(bytes, v.dtype, p) as f32
                    });
                }
            }
            out
        };
        let mut out = vec![0.0f64; self.io.outs[0].numel()];
        let mut scores = Vec::new();
        let mut acc = vec![0.0f32; nope];
        for (bi, &(row0, q_len, kv_len)) in self.entries.iter().enumerate() {
            let need = kv_len.div_ceil(bs);
            let mut blocks = Vec::with_capacity(need);
            for t in 0..need {
                let blk = table[bi * max_blocks + t];
                if blk < 0 || blk >= num_blocks {
                    return fail(
                        ACL_ERROR_RT_AICORE_EXCEPTION,
                        format!("{OP}: blockTable[{bi}][{t}] = {blk} is outside [0, {num_blocks})"),
                    );
                }
                blocks.push(blk);
            }
            let keys = gather(kb, kc, &blocks, kv_len, nope);
            let values = gather(vb, vc, &blocks, kv_len, nope);
            let ropes = gather(rb, kr, &blocks, kv_len, rope);
            for i in 0..q_len {
                // Right-down causal: query i of the entry sits at cache position c.
                let seen = if self.causal {
                    (kv_len as i64 - q_len as i64 + i as i64 + 1).clamp(0, kv_len as i64) as usize
                } else {
                    kv_len
                };
                for hd in 0..n {
                    let at = (row0 + i) * n + hd;
                    let qn = &qv[at * nope..(at + 1) * nope];
                    let qp = &qrv[at * rope..(at + 1) * rope];
                    scores.clear();
                    scores.extend((0..seen).map(|j| {
                        let s = dot(qn, &keys[j * nope..(j + 1) * nope])
                            + dot(qp, &ropes[j * rope..(j + 1) * rope]);
                        s * self.scale as f32
                    }));
                    let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for sc in scores.iter_mut() {
                        *sc = (*sc - mx).exp();
                        sum += *sc;
                    }
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    for (j, p) in scores.iter().enumerate() {
                        let w = round16(p / sum);
                        for (a, v) in acc.iter_mut().zip(&values[j * nope..(j + 1) * nope]) {
                            *a += w * v;
                        }
                    }
                    for (o, a) in out[at * nope..(at + 1) * nope].iter_mut().zip(&acc) {
                        *o = *a as f64;
                    }
                }
            }
        }
        write(st, &self.io.outs[0], &out)
    }
}

/// The entries of a BSH/BSND or TND query: (first row, queries, KV length) each.
fn entries(
    layout: &str,
    q: &View,
    q_lens: Option<Vec<i64>>,
    kv_lens: Vec<i64>,
) -> Result<Vec<(usize, usize, usize)>, Fail> {
    if layout == "TND" {
        let Some(cum) = q_lens else {
            return invalid(OP, "inputLayout TND requires actualSeqLengthsOptional");
        };
        if cum.is_empty() || kv_lens.len() != cum.len() {
            return invalid(
                OP,
                format!(
                    "TND with page attention: actualSeqLengthsKv has {} values for the {} batch \
                     entries actualSeqLengths gives",
                    kv_lens.len(),
                    cum.len()
                ),
            );
        }
        let mut out = Vec::with_capacity(cum.len());
        let mut prev = 0i64;
        for (b, (&c, &kv)) in cum.iter().zip(&kv_lens).enumerate() {
            let s = c - prev;
            if !(1..=MAX_Q_S).contains(&s) {
                return invalid(OP, format!("TND: batch entry {b} has {s} queries (actualSeqLengths must be cumulative, each entry's s 1 to {MAX_Q_S})"));
            }
            out.push((prev as usize, s as usize, kv as usize));
            prev = c;
        }
        if prev != q.dims[0] {
            return invalid(
                OP,
                format!(
                    "TND: actualSeqLengths ends at {prev}, query holds T = {}",
                    q.dims[0]
                ),
            );
        }
        return Ok(out);
    }
    let (b, s) = (q.dims[0], q.dims[1]);
    if q_lens.is_some() && s > 1 {
        return invalid(
            OP,
            format!("with rope inputs and Q_S > 1, actualSeqLengths is supported only in inputLayout TND, not {layout}"),
        );
    }
    let kv = match kv_lens.len() {
        1 => vec![kv_lens[0]; b as usize],
        l if l as i64 >= b => kv_lens[..b as usize].to_vec(),
        l => {
            return invalid(
                OP,
                format!("actualSeqLengthsKvOptional has {l} values for B = {b}"),
            )
        }
    };
    Ok(kv
        .into_iter()
        .enumerate()
        .map(|(i, l)| (i * s as usize, s as usize, l as usize))
        .collect())
}

/// # Safety
/// Pointer arguments follow the documented contract.
#[no_mangle]
pub unsafe extern "C" fn aclnnFusedInferAttentionScoreV3GetWorkspaceSize(
    query: *const aclTensor,
    key: *const aclTensorList,
    value: *const aclTensorList,
    pseShiftOptional: *const aclTensor,
    attenMaskOptional: *const aclTensor,
    actualSeqLengthsOptional: *const aclIntArray,
    actualSeqLengthsKvOptional: *const aclIntArray,
    deqScale1Optional: *const aclTensor,
    quantScale1Optional: *const aclTensor,
    deqScale2Optional: *const aclTensor,
    quantScale2Optional: *const aclTensor,
    quantOffset2Optional: *const aclTensor,
    antiquantScaleOptional: *const aclTensor,
    antiquantOffsetOptional: *const aclTensor,
    blockTableOptional: *const aclTensor,
    queryPaddingSizeOptional: *const aclTensor,
    kvPaddingSizeOptional: *const aclTensor,
    keyAntiquantScaleOptional: *const aclTensor,
    keyAntiquantOffsetOptional: *const aclTensor,
    valueAntiquantScaleOptional: *const aclTensor,
    valueAntiquantOffsetOptional: *const aclTensor,
    keySharedPrefixOptional: *const aclTensor,
    valueSharedPrefixOptional: *const aclTensor,
    actualSharedPrefixLenOptional: *const aclIntArray,
    queryRopeOptional: *const aclTensor,
    keyRopeOptional: *const aclTensor,
    keyRopeAntiquantScaleOptional: *const aclTensor,
    numHeads: i64,
    scaleValue: f64,
    _preTokens: i64,
    _nextTokens: i64,
    inputLayout: *mut c_char,
    numKeyValueHeads: i64,
    sparseMode: i64,
    innerPrecise: i64,
    blockSize: i64,
    antiquantMode: i64,
    softmaxLseFlag: bool,
    keyAntiquantMode: i64,
    valueAntiquantMode: i64,
    attentionOut: *const aclTensor,
    softmaxLse: *const aclTensor,
    workspaceSize: *mut u64,
    executor: *mut *mut aclOpExecutor,
) -> aclnnStatus {
    let unsupported = [
        ("pseShiftOptional", pseShiftOptional),
        ("deqScale1Optional", deqScale1Optional),
        ("quantScale1Optional", quantScale1Optional),
        ("deqScale2Optional", deqScale2Optional),
        ("quantScale2Optional", quantScale2Optional),
        ("quantOffset2Optional", quantOffset2Optional),
        ("antiquantScaleOptional", antiquantScaleOptional),
        ("antiquantOffsetOptional", antiquantOffsetOptional),
        ("queryPaddingSizeOptional", queryPaddingSizeOptional),
        ("kvPaddingSizeOptional", kvPaddingSizeOptional),
        ("keyAntiquantScaleOptional", keyAntiquantScaleOptional),
        ("keyAntiquantOffsetOptional", keyAntiquantOffsetOptional),
        ("valueAntiquantScaleOptional", valueAntiquantScaleOptional),
        ("valueAntiquantOffsetOptional", valueAntiquantOffsetOptional),
        ("keySharedPrefixOptional", keySharedPrefixOptional),
        ("valueSharedPrefixOptional", valueSharedPrefixOptional),
        (
            "keyRopeAntiquantScaleOptional",
            keyRopeAntiquantScaleOptional,
        ),
        ("softmaxLse", softmaxLse),
    ];
    let layout = if inputLayout.is_null() {
        None
    } else {
        // SAFETY: inputLayout is a NUL-terminated string (documented contract).
        Some(
            unsafe { CStr::from_ptr(inputLayout) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    prepare(OP, workspaceSize, executor, |st| {
        if !crate::install::emulated_release_at_least(8, 1) {
            return invalid(
                OP,
                format!(
                    "not in CANN {} (the operator's page is published from 8.1.RC1)",
                    crate::install::emulated_version()
                ),
            );
        }
        let q = st.tensor(query, "query")?;
        let out = st.tensor(attentionOut, "attentionOut")?;
        let keys = st.tensor_list(key, "key")?;
        let values = st.tensor_list(value, "value")?;
        let (qr, kr) = match (
            st.opt_tensor(queryRopeOptional, "queryRopeOptional")?,
            st.opt_tensor(keyRopeOptional, "keyRopeOptional")?,
        ) {
            (Some(a), Some(b)) => (a, b),
            (None, None) => {
                return invalid(
                    OP,
                    "without queryRopeOptional and keyRopeOptional (V2's form) is not \
                     implemented by this emulation: only the MLA form is",
                )
            }
            _ => {
                return invalid(
                    OP,
                    "queryRopeOptional and keyRopeOptional must be set together or not at all",
                )
            }
        };
        for (name, p) in unsupported {
            if !p.is_null() {
                return invalid(
                    OP,
                    format!("{name}: the MLA form (rope inputs) supports no pse, padding, prefix, antiquant, quantization or softmaxLse (pass nullptr)"),
                );
            }
        }
        if !actualSharedPrefixLenOptional.is_null() {
            return invalid(
                OP,
                "actualSharedPrefixLenOptional: the MLA form supports no shared prefix",
            );
        }
        if softmaxLseFlag || antiquantMode != 0 || keyAntiquantMode != 0 || valueAntiquantMode != 0
        {
            return invalid(
                OP,
                "the MLA form supports neither softmaxLse nor antiquant modes (pass false and 0)",
            );
        }
        if keys.len() != 1 || values.len() != 1 {
            return invalid(
                OP,
                "the MLA form with page attention supports no tensor list of more than one tensor",
            );
        }
        let (kc, vc) = (keys[0].clone(), values[0].clone());
        dtype_in(OP, "query", &q, &[DType::F16, DType::Bf16])?;
        for (w, v, like) in [
            ("queryRopeOptional", &qr, &q),
            ("key", &kc, &q),
            ("value", &vc, &q),
            ("keyRopeOptional", &kr, &kc),
            ("attentionOut", &out, &q),
        ] {
            if v.dtype != like.dtype {
                return invalid(
                    OP,
                    format!(
                        "{w} is {}; the MLA form needs {} (query's FLOAT16/BFLOAT16, keyRope's \
                         key's)",
                        v.dtype.name(),
                        like.dtype.name()
                    ),
                );
            }
        }
        for (w, v) in [
            ("query", &q),
            ("key", &kc),
            ("value", &vc),
            ("queryRopeOptional", &qr),
            ("keyRopeOptional", &kr),
            ("attentionOut", &out),
        ] {
            nd(OP, w, v)?;
            if !satisfies(v, Rule::Contiguous) {
                return invalid(
                    OP,
                    format!(
                        "{w} {} does not support non-contiguous tensors",
                        v.shape_string()
                    ),
                );
            }
        }
        let layout = layout.unwrap_or_default();
        // Query as (rows, N, D): BSH (B, S, N·D), BSND (B, S, N, D), TND (T, N, D).
        let (n, d) = match (layout.as_str(), q.rank()) {
            ("BSH", 3) => {
                if numHeads <= 0 || q.dims[2] % numHeads != 0 {
                    return invalid(OP, format!("query {:?} does not hold numHeads {numHeads} heads", q.dims));
                }
                (numHeads, q.dims[2] / numHeads)
            }
            ("BSND", 4) => (q.dims[2], q.dims[3]),
            ("TND", 3) => (q.dims[1], q.dims[2]),
            ("BSH" | "BSND" | "TND", _) => {
                return invalid(OP, format!("query {:?} does not fit inputLayout {layout}", q.dims))
            }
            ("BNSD" | "BNSD_NBSD" | "BSND_NBSD" | "BSH_NBSD" | "TND_NTD", _) => {
                return invalid(OP, format!("inputLayout {layout} is not implemented by this emulation's MLA form (BSH, BSND, TND are)"))
            }
            _ => {
                return invalid(OP, format!("inputLayout {layout:?} is not one the MLA form documents (BSH, BSND, BNSD, BNSD_NBSD, BSND_NBSD, BSH_NBSD, TND, TND_NTD)"))
            }
        };
        if n != numHeads {
            return invalid(
                OP,
                format!("query's N {n} differs from numHeads {numHeads}"),
            );
        }
        if d == 128 {
            return invalid(OP, "query d 128 with rope inputs (the MLA form without page attention, TND/NTD_TND only) is not implemented by this emulation");
        }
        if d != NOPE_D {
            return invalid(
                OP,
                format!("query's d is {d}: with rope inputs it must be 512 (or 128)"),
            );
        }
        if !HEADS.contains(&numHeads) {
            return invalid(OP, format!("numHeads {numHeads}: the MLA form with query d 512 takes 32, 64 or 128 query heads"));
        }
        if numKeyValueHeads != 1 {
            return invalid(
                OP,
                format!("numKeyValueHeads {numKeyValueHeads}: the MLA form needs key's n 1"),
            );
        }
        let mut want_qr = q.dims.clone();
        match layout.as_str() {
            "BSH" => *want_qr.last_mut().expect("rank 3") = n * ROPE_D,
            _ => *want_qr.last_mut().expect("rank checked") = ROPE_D,
        }
        if qr.dims != want_qr {
            return invalid(
                OP,
                format!(
                    "queryRopeOptional {:?} must be query's shape with d 64: {want_qr:?}",
                    qr.dims
                ),
            );
        }
        if out.dims != q.dims {
            return invalid(
                OP,
                format!(
                    "attentionOut {:?} must have query's shape {:?} (value's d 512)",
                    out.dims, q.dims
                ),
            );
        }
        let Some(bt) = st.opt_tensor(blockTableOptional, "blockTableOptional")? else {
            return invalid(
                OP,
                "the MLA form with query d 512 requires page attention (blockTableOptional)",
            );
        };
        if !BLOCK_SIZES.contains(&blockSize) {
            return invalid(
                OP,
                format!("blockSize {blockSize}: the MLA form's page attention takes 16 or 128"),
            );
        }
        if kc.rank() == 4 {
            return invalid(OP, "key of rank 4 (the BnNBsD cache layout) is not implemented by this emulation (BnBsH is)");
        }
        if kc.rank() != 3 || kc.dims[1] != blockSize || kc.dims[2] != NOPE_D {
            return invalid(
                OP,
                format!(
                    "key {:?} must be (blockNum, blockSize = {blockSize}, KV_N·D = 512)",
                    kc.dims
                ),
            );
        }
        if vc.dims != kc.dims {
            return invalid(
                OP,
                format!("value {:?} must have key's shape {:?}", vc.dims, kc.dims),
            );
        }
        if kr.dims != [kc.dims[0], blockSize, ROPE_D] {
            return invalid(
                OP,
                format!(
                    "keyRopeOptional {:?} must be key's shape with d 64: [{}, {blockSize}, 64]",
                    kr.dims, kc.dims[0]
                ),
            );
        }
        dtype_in(OP, "blockTableOptional", &bt, &[DType::I32])?;
        let Some(kv) = st.int_array(actualSeqLengthsKvOptional, "actualSeqLengthsKvOptional")?
        else {
            return invalid(OP, "page attention requires actualSeqLengthsKvOptional");
        };
        let q_lens = st.int_array(actualSeqLengthsOptional, "actualSeqLengthsOptional")?;
        if q_lens.as_ref().is_some_and(|v| v.iter().any(|&l| l < 0)) || kv.iter().any(|&l| l < 0) {
            return invalid(OP, "actual sequence lengths must be non-negative");
        }
        let q_s = if layout == "TND" { 0 } else { q.dims[1] };
        if layout != "TND" && !(1..=MAX_Q_S).contains(&q_s) {
            return invalid(
                OP,
                format!("query's s is {q_s}: the MLA form takes 1 to 16"),
            );
        }
        let entries = entries(&layout, &q, q_lens, kv)?;
        let b = entries.len() as i64;
        if b > 65536 {
            return invalid(OP, format!("B = {b} exceeds 65536"));
        }
        if bt.rank() != 2 || bt.dims[0] != b {
            return invalid(
                OP,
                format!(
                    "blockTableOptional {:?} must be 2-D with B = {b} rows",
                    bt.dims
                ),
            );
        }
        let mut blocks_needed = 0;
        for (i, e) in entries.iter().enumerate() {
            let l = e.2 as i64;
            if l > bt.dims[1] * blockSize {
                return invalid(OP, format!("actualSeqLengthsKv[{i}] = {l} exceeds the block table's {} blocks of {blockSize}", bt.dims[1]));
            }
            blocks_needed += (l + blockSize - 1) / blockSize;
        }
        if kc.dims[0] < blocks_needed {
            return invalid(
                OP,
                format!(
                    "blockNum {} is below the {blocks_needed} blocks the sequence lengths need",
                    kc.dims[0]
                ),
            );
        }
        let max_q = entries.iter().map(|e| e.1).max().unwrap_or(1);
        let mask = st.opt_tensor(attenMaskOptional, "attenMaskOptional")?;
        let causal = if max_q == 1 {
            if sparseMode != 0 || mask.is_some() {
                return invalid(OP, format!("with rope inputs and Q_S = 1, only sparseMode 0 without attenMask is supported (sparseMode {sparseMode}{})", if mask.is_some() { ", a mask" } else { "" }));
            }
            if !(0..=1).contains(&innerPrecise) {
                return invalid(
                    OP,
                    format!("innerPrecise {innerPrecise}: Q_S = 1 takes 0 or 1"),
                );
            }
            false
        } else {
            let Some(m) = &mask else {
                return invalid(OP, "with rope inputs and Q_S > 1, only sparseMode 3 with the 2048x2048 attenMask is supported (no mask given)");
            };
            if sparseMode != 3 {
                return invalid(OP, format!("sparseMode {sparseMode}: with rope inputs and Q_S > 1 only sparseMode 3 is supported"));
            }
            dtype_in(
                OP,
                "attenMaskOptional",
                m,
                &[DType::Bool, DType::I8, DType::U8],
            )?;
            if !matches!(
                m.dims.as_slice(),
                [2048, 2048] | [1, 2048, 2048] | [1, 1, 2048, 2048]
            ) {
                return invalid(OP, format!("sparseMode 3 needs attenMask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), got {:?}", m.dims));
            }
            if !satisfies(m, Rule::Contiguous) {
                return invalid(
                    OP,
                    "attenMaskOptional does not support non-contiguous tensors",
                );
            }
            if !(0..=3).contains(&innerPrecise) {
                return invalid(OP, format!("innerPrecise {innerPrecise} is not 0..=3"));
            }
            for (i, e) in entries.iter().enumerate() {
                if e.1 > e.2 {
                    return invalid(OP, format!("batch entry {i}: {} queries over {} keys (right-down causal needs actualSeqLengths <= actualSeqLengthsKv)", e.1, e.2));
                }
            }
            true
        };
        Ok(Box::new(Mla {
            io: Io {
                ins: vec![q, kc, vc, qr, kr, bt],
                outs: vec![out],
            },
            n: n as usize,
            scale: scaleValue,
            causal,
            block_size: blockSize as usize,
            entries,
        }))
    })
}

const _: npu_ffi::aclnn::ops::sig::aclnnFusedInferAttentionScoreV3GetWorkspaceSize =
    aclnnFusedInferAttentionScoreV3GetWorkspaceSize;
