//! FusedInferAttentionScoreV2 in its page-attention mode (the only mode this emulation
//! implements; others are refused as not implemented): query in BSH (B, S, N·D) or BSND layout,
//! key/value caches as one-tensor lists of shape (blockNum, blockSize, KV_N·D), an INT32 block
//! table (B, maxBlocksPerSeq), per-batch `actualSeqLengthsKv` (required) and, for S > 1,
//! per-batch `actualSeqLengths`. S = 1 takes the incremental (IncreFlashAttention) branch,
//! where blockSize must be a non-zero multiple of 16 up to 512 for FLOAT16/BFLOAT16 caches;
//! S > 1 takes the prompt branch, where blockSize must be a multiple of 128 in [128, 512].
//!
//! Masks, as documented:
//! - S = 1: sparseMode, preTokens and nextTokens have no effect ("Q_S为1时…无效"); an
//!   attenMask of shape (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S), BOOL/INT8/UINT8, masks
//!   each batch entry's keys where it holds 1 (INT8/UINT8 values must be 0 or 1; the emulation
//!   fails the kernel otherwise), and with page attention KV_S must be at least
//!   maxBlockNumPerSeq · blockSize (the blocks the longest actualSeqLengthsKv needs).
//! - S > 1: sparseMode 0 without a mask (none), 3 (rightDownCausal) and 4 (band), both with the
//!   documented 2048×2048 lower-triangular mask, are implemented; 0 with a full mask, 1 and 2
//!   are refused as not implemented. Both count from the bottom-right corner of each batch
//!   entry's actual lengths: query row i of an entry with q queries and L cached tokens sits at
//!   c = L − q + i; mode 3 sees cache positions 0..=c, mode 4 sees c − preTokens ..= c +
//!   nextTokens (clipped to 0..L), and needs preTokens + nextTokens ≥ 0.
//!
//! INT8 caches (keyAntiquantMode = valueAntiquantMode = 5, "per-token叠加per head并使用page
//! attention模式管理scale/offset", S = 1 only): FLOAT32 key and value scales of shape
//! (blockNum, KV_N, blockSize), one per cached token and KV head; blockSize a non-zero multiple
//! of 32 up to 512. A cached value is `int8 · scale`, rounded to the query's 16-bit type (the
//! cube unit's input). Offsets, the other modes and mode 5 with S > 1 (documented: modes 0
//! and 1 only, and without page attention) are refused.
//!
//! A query that sees no key gets zeros (as an empty KV does). Scores and softmax are computed
//! in f32; the probabilities are rounded to the 16-bit type before they weigh V (the cube unit's
//! inputs).

use core::ffi::{c_char, CStr};

use npu_ffi::types::*;

use super::{dot, dtype_in, invalid, kernel_common, prepare, read, read_f32, write, Io, Kernel};
use crate::state::*;
use crate::view::{f16_at, read_elem, DType, View};

/// Which keys each query sees (beyond the entry's KV length).
#[derive(Clone, Copy)]
enum Masking {
    /// Every cached key.
    None,
    /// Cache positions 0..=c (sparseMode 3).
    Causal,
    /// c − pre ..= c + next (sparseMode 4).
    Band { pre: i64, next: i64 },
    /// The incremental branch's per-entry mask (ins[4]): keys where it holds 0.
    PerKey,
}

#[derive(Clone)]
struct Fia {
    io: Io,
    n: i64,
    kv_n: i64,
    d: i64,
    scale: f64,
    masking: Masking,
    block_size: i64,
    q_lens: Vec<i64>,
    kv_lens: Vec<i64>,
    /// INT8 caches with mode-5 scales: the index in `io.ins` of the key scales (the value
    /// scales follow), each (blockNum, KV_N, blockSize) FLOAT32.
    scales_at: Option<usize>,
}

impl Kernel for Fia {
    kernel_common!("aclnnFusedInferAttentionScoreV2");

    fn workspace(&self) -> u64 {
        let max_kv = self.kv_lens.iter().copied().max().unwrap_or(0).max(1);
        (self.n * max_kv * 4 + 1024) as u64
    }

    fn run(&self, st: &mut State) -> Result<(), Fail> {
        let (q, kc, vc, bt) = (
            &self.io.ins[0],
            &self.io.ins[1],
            &self.io.ins[2],
            &self.io.ins[3],
        );
        let b = q.dims[0] as usize;
        let s = q.dims[1] as usize;
        let (n, kv_n, d) = (self.n as usize, self.kv_n as usize, self.d as usize);
        let h = n * d;
        let kvd = kv_n * d;
        let bs = self.block_size as usize;
        let qv = read_f32(st, q)?;
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
        let (k_scales, v_scales) = match self.scales_at {
            Some(at) => (
                read_f32(st, &self.io.ins[at])?,
                read_f32(st, &self.io.ins[at + 1])?,
            ),
            None => (Vec::new(), Vec::new()),
        };
        let kb = st.bytes(kc.addr, kc.storage_bytes())?;
        let vb = st.bytes(vc.addr, vc.storage_bytes())?;
        // Rows 0..len of one sequence's cache, gathered through its block table, as f32. INT8
        // rows are dequantized with their (block, KV head, slot) scale and rounded to the
        // query's 16-bit type, which the cube unit takes.
        let gather = |bytes: &[u8], v: &View, sc: &[f32], blocks: &[i64], len: usize| {
            let mut out = Vec::with_capacity(len * kvd);
            for j in 0..len {
                let base =
                    v.offset + blocks[j / bs] * v.strides[0] + (j % bs) as i64 * v.strides[1];
                for c in 0..kvd as i64 {
                    let p = (base + c * v.strides[2]) as usize;
                    out.push(match v.dtype {
                        DType::F16 => f16_at(bytes, p),
                        DType::I8 => {
                            let at =
                                (blocks[j / bs] as usize * kv_n + c as usize / d) * bs + j % bs;
                            round16(read_elem(bytes, DType::I8, p) as f32 * sc[at])
                        }
                        _ => read_elem(bytes, v.dtype, p) as f32,
                    });
                }
            }
            out
        };
        // The incremental branch's mask, one row of `mask_s` values per batch entry.
        let (mask, mask_s) = match self.masking {
            Masking::PerKey => {
                let m = &self.io.ins[4];
                let vals = super::read(st, m)?;
                if m.dtype != DType::Bool {
                    if let Some(v) = vals.iter().find(|&&v| v != 0.0 && v != 1.0) {
                        return fail(
                            ACL_ERROR_RT_AICORE_EXCEPTION,
                            format!("aclnnFusedInferAttentionScoreV2: attenMask holds {v}; INT8/UINT8 masks must hold 0 or 1"),
                        );
                    }
                }
                (vals, *m.dims.last().expect("rank checked") as usize)
            }
            _ => (Vec::new(), 0),
        };
        let group = n / kv_n;
        let scale = self.scale as f32;
        let mut visible: Vec<usize> = Vec::new();
        let mut out = vec![0.0f64; b * s * h];
        let mut scores = Vec::new();
        let mut acc = vec![0.0f32; d];
        for bi in 0..b {
            let kv_len = self.kv_lens[bi] as usize;
            let q_len = if s == 1 { 1 } else { self.q_lens[bi] as usize };
            let need = kv_len.div_ceil(bs);
            let mut blocks = Vec::with_capacity(need);
            for t in 0..need {
                let blk = table[bi * max_blocks + t];
                if blk < 0 || blk >= num_blocks {
                    return fail(
                        ACL_ERROR_RT_AICORE_EXCEPTION,
                        format!("aclnnFusedInferAttentionScoreV2: blockTable[{bi}][{t}] = {blk} is outside [0, {num_blocks})"),
                    );
                }
                blocks.push(blk);
            }
            let keys = gather(kb, kc, &k_scales, &blocks, kv_len);
            let values = gather(vb, vc, &v_scales, &blocks, kv_len);
            for i in 0..q_len {
                // Position of this query on the bottom-right diagonal.
                let c = kv_len as i64 - q_len as i64 + i as i64;
                let last = kv_len as i64 - 1;
                visible.clear();
                match self.masking {
                    Masking::None => visible.extend(0..kv_len),
                    Masking::Causal => visible.extend(0..(c.min(last) + 1).max(0) as usize),
                    Masking::Band { pre, next } => {
                        let lo = c.saturating_sub(pre).max(0);
                        let hi = c.saturating_add(next).min(last);
                        if lo <= hi {
                            visible.extend(lo as usize..=hi as usize);
                        }
                    }
                    Masking::PerKey => {
                        visible.extend((0..kv_len).filter(|&j| mask[bi * mask_s + j] == 0.0))
                    }
                }
                for hd in 0..n {
                    let kvh = hd / group;
                    let row = (bi * s + i) * h + hd * d;
                    let qrow = &qv[row..row + d];
                    scores.clear();
                    scores.extend(visible.iter().map(|&j| {
                        dot(qrow, &keys[j * kvd + kvh * d..j * kvd + kvh * d + d]) * scale
                    }));
                    let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for sc in scores.iter_mut() {
                        *sc = (*sc - mx).exp();
                        sum += *sc;
                    }
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    for (&j, p) in visible.iter().zip(&scores) {
                        // The probabilities meet V on the cube unit, in the query's 16-bit type.
                        let w = round16(p / sum);
                        let vrow = &values[j * kvd + kvh * d..j * kvd + kvh * d + d];
                        for (a, v) in acc.iter_mut().zip(vrow) {
                            *a += w * v;
                        }
                    }
                    for (o, a) in out[row..row + d].iter_mut().zip(&acc) {
                        *o = *a as f64;
                    }
                }
            }
        }
        write(st, &self.io.outs[0], &out)
    }
}

/// # Safety
/// Pointer arguments follow the documented contract.
#[no_mangle]
pub unsafe extern "C" fn aclnnFusedInferAttentionScoreV2GetWorkspaceSize(
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
    numHeads: i64,
    scaleValue: f64,
    preTokens: i64,
    nextTokens: i64,
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
    let unimplemented = [
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
        ("keyAntiquantOffsetOptional", keyAntiquantOffsetOptional),
        ("valueAntiquantOffsetOptional", valueAntiquantOffsetOptional),
        ("keySharedPrefixOptional", keySharedPrefixOptional),
        ("valueSharedPrefixOptional", valueSharedPrefixOptional),
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
    prepare(
        "aclnnFusedInferAttentionScoreV2",
        workspaceSize,
        executor,
        |st| {
            let op = "aclnnFusedInferAttentionScoreV2";
            let q = st.tensor(query, "query")?;
            let out = st.tensor(attentionOut, "attentionOut")?;
            let keys = st.tensor_list(key, "key")?;
            let values = st.tensor_list(value, "value")?;
            for (name, p) in unimplemented {
                if !p.is_null() {
                    return invalid(
                        op,
                        format!("{name} is not implemented by this emulation (pass nullptr)"),
                    );
                }
            }
            if !actualSharedPrefixLenOptional.is_null() {
                return invalid(
                    op,
                    "actualSharedPrefixLenOptional is not implemented by this emulation",
                );
            }
            if softmaxLseFlag || antiquantMode != 0 {
                return invalid(op, "softmaxLseFlag and antiquantMode are not implemented by this emulation (pass false and 0)");
            }
            if !(0..=3).contains(&innerPrecise) {
                return invalid(op, format!("innerPrecise {innerPrecise} is not 0..=3"));
            }
            dtype_in(op, "query", &q, &[DType::F16, DType::Bf16])?;
            if out.dtype != q.dtype || out.dims != q.dims {
                return invalid(
                    op,
                    format!(
                        "attentionOut {} must match query {}",
                        out.shape_string(),
                        q.shape_string()
                    ),
                );
            }
            let Some(bt) = st.opt_tensor(blockTableOptional, "blockTableOptional")? else {
                return invalid(op, "only the page-attention mode (blockTableOptional set) is implemented by this emulation");
            };
            if keys.len() != 1 || values.len() != 1 {
                return invalid(
                    op,
                    "page attention does not support tensor lists of more than one tensor",
                );
            }
            let (kc, vc) = (keys[0].clone(), values[0].clone());
            super::contiguity::check(
                op,
                &[
                    ("query", &q),
                    ("key", &kc),
                    ("value", &vc),
                    ("attentionOut", &out),
                ],
            )?;
            let layout = layout.unwrap_or_default();
            let (b, s, n_from_shape, d_from_shape) = match (layout.as_str(), q.rank()) {
                ("BSH", 3) => (q.dims[0], q.dims[1], None, None),
                ("BSND", 4) => (q.dims[0], q.dims[1], Some(q.dims[2]), Some(q.dims[3])),
                ("BSH" | "BSND", _) => {
                    return invalid(
                        op,
                        format!("query {:?} does not fit inputLayout {layout}", q.dims),
                    )
                }
                ("BNSD" | "TND" | "BNSD_BSND" | "NTD_TND", _) => {
                    return invalid(
                        op,
                        format!(
                        "inputLayout {layout} is not implemented by this emulation (BSH, BSND are)"
                    ),
                    )
                }
                _ => {
                    return invalid(
                        op,
                        format!("inputLayout {layout:?} is not a documented layout"),
                    )
                }
            };
            if numHeads <= 0 || numHeads > 256 {
                return invalid(op, format!("numHeads {numHeads} must be in [1, 256]"));
            }
            let kv_n = if numKeyValueHeads == 0 {
                numHeads
            } else {
                numKeyValueHeads
            };
            if kv_n <= 0 || numHeads % kv_n != 0 || numHeads / kv_n > 64 {
                return invalid(op, format!("numHeads {numHeads} must be a multiple of numKeyValueHeads {kv_n}, at most 64 times it"));
            }
            let h = if q.rank() == 3 {
                q.dims[2]
            } else {
                q.dims[2] * q.dims[3]
            };
            if h % numHeads != 0 || n_from_shape.is_some_and(|n| n != numHeads) {
                return invalid(
                    op,
                    format!("query {:?} does not hold numHeads {numHeads} heads", q.dims),
                );
            }
            let d = d_from_shape.unwrap_or(h / numHeads);
            if d % 16 != 0 || d > 512 {
                return invalid(op, format!("head dim D = {d} must be a multiple of 16 (FLOAT16/BFLOAT16) and at most 512"));
            }
            let scales = antiquant_scales(
                st,
                [keyAntiquantScaleOptional, valueAntiquantScaleOptional],
                [keyAntiquantMode, valueAntiquantMode],
                s,
                &kc,
                kv_n,
                blockSize,
            )?;
            for (w, c) in [("key", &kc), ("value", &vc)] {
                if scales.is_none() && c.dtype == DType::I8 {
                    return invalid(op, format!("INT8 {w} cache without key/value antiquant scales: this emulation implements INT8 caches only with keyAntiquantMode = valueAntiquantMode = 5 and their scales"));
                }
                if scales.is_some() && c.dtype != DType::I8 {
                    return invalid(op, format!("{w} cache {}: keyAntiquantMode/valueAntiquantMode 5 (per-token叠加per head并使用page attention模式管理scale) takes INT8 key and value caches only", c.dtype.name()));
                }
                if c.dtype != q.dtype && c.dtype != DType::I8 {
                    return invalid(
                        op,
                        format!("{w} cache {} must have query's data type", c.dtype.name()),
                    );
                }
                if c.rank() != 3 || c.dims[2] != kv_n * d {
                    return invalid(op, format!("{w} cache {:?} must be (blockNum, blockSize, KV_N*D = {}) with inputLayout {layout}", c.dims, kv_n * d));
                }
            }
            if kc.dims != vc.dims {
                return invalid(op, "key and value caches must have one shape");
            }
            if s == 1 && scales.is_some() {
                if blockSize <= 0 || blockSize > 512 || blockSize % 32 != 0 {
                    return invalid(op, format!("blockSize {blockSize}: page attention with INT8 caches needs a non-zero multiple of 32 up to 512 (key、value 输入类型为INT8时需要32对齐)"));
                }
            } else if s == 1 {
                if blockSize <= 0 || blockSize > 512 || blockSize % 16 != 0 {
                    return invalid(op, format!("blockSize {blockSize}: page attention with FLOAT16/BFLOAT16 caches needs a non-zero multiple of 16 up to 512"));
                }
            } else if !(128..=512).contains(&blockSize) || blockSize % 128 != 0 {
                return invalid(op, format!("blockSize {blockSize}: page attention with query S > 1 needs a multiple of 128 in [128, 512]"));
            }
            if kc.dims[1] != blockSize {
                return invalid(
                    op,
                    format!(
                        "cache block dimension {} differs from blockSize {blockSize}",
                        kc.dims[1]
                    ),
                );
            }
            dtype_in(op, "blockTableOptional", &bt, &[DType::I32])?;
            if bt.rank() != 2 || bt.dims[0] != b {
                return invalid(
                    op,
                    format!(
                        "blockTableOptional {:?} must be 2-D with B = {b} rows",
                        bt.dims
                    ),
                );
            }
            let per_batch = |v: Vec<i64>, what: &str| -> Result<Vec<i64>, Fail> {
                match v.len() {
                    1 => Ok(vec![v[0]; b as usize]),
                    l if l as i64 >= b => Ok(v[..b as usize].to_vec()),
                    l => invalid(op, format!("{what} has {l} values for B = {b}")),
                }
            };
            let Some(kv) =
                st.int_array(actualSeqLengthsKvOptional, "actualSeqLengthsKvOptional")?
            else {
                return invalid(op, "page attention requires actualSeqLengthsKvOptional");
            };
            let kv_lens = per_batch(kv, "actualSeqLengthsKvOptional")?;
            for (i, &l) in kv_lens.iter().enumerate() {
                if l < 0 || l > bt.dims[1] * blockSize {
                    return invalid(op, format!("actualSeqLengthsKv[{i}] = {l} exceeds the block table's {} blocks of {blockSize}", bt.dims[1]));
                }
            }
            let blocks_needed: i64 = kv_lens
                .iter()
                .map(|l| (l + blockSize - 1) / blockSize)
                .sum();
            if kc.dims[0] < blocks_needed {
                return invalid(
                    op,
                    format!(
                        "blockNum {} is below the {blocks_needed} blocks the sequence lengths need",
                        kc.dims[0]
                    ),
                );
            }
            let q_lens = match st.int_array(actualSeqLengthsOptional, "actualSeqLengthsOptional")? {
                Some(v) if s > 1 => per_batch(v, "actualSeqLengthsOptional")?,
                _ => vec![s; b as usize],
            };
            for (i, &l) in q_lens.iter().enumerate() {
                if l < 0 || l > s || l > kv_lens[i] {
                    return invalid(op, format!("actualSeqLengths[{i}] = {l} must be within [0, min(S = {s}, actualSeqLengthsKv = {})]", kv_lens[i]));
                }
            }
            let mask = st.opt_tensor(attenMaskOptional, "attenMaskOptional")?;
            if let Some(m) = &mask {
                super::contiguity::check(op, &[("attenMaskOptional", m)])?;
            }
            let mask_types = [DType::Bool, DType::I8, DType::U8];
            let masking = if s == 1 {
                // The incremental branch: sparseMode, preTokens and nextTokens have no effect.
                match &mask {
                    None => Masking::None,
                    Some(m) => {
                        dtype_in(op, "attenMaskOptional", m, &mask_types)?;
                        let ok = match m.dims.as_slice() {
                            [mb, _] | [mb, 1, _] | [mb, 1, 1, _] => *mb == b,
                            _ => false,
                        };
                        if !ok {
                            return invalid(op, format!("with query S = 1, attenMask must be (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B = {b}, got {:?}", m.dims));
                        }
                        let max_blocks = kv_lens
                            .iter()
                            .map(|l| (l + blockSize - 1) / blockSize)
                            .max()
                            .unwrap_or(0);
                        let ms = *m.dims.last().expect("rank checked");
                        if ms < max_blocks * blockSize {
                            return invalid(op, format!("page attention needs the attenMask's KV_S ({ms}) to be at least maxBlockNumPerSeq * blockSize = {max_blocks} * {blockSize}"));
                        }
                        Masking::PerKey
                    }
                }
            } else {
                match (sparseMode, &mask) {
                    (0, None) => Masking::None,
                    (0, Some(_)) | (1, _) | (2, _) => {
                        return invalid(op, format!("sparseMode {sparseMode} with this mask is not implemented by this emulation (0 without mask, 3 and 4 are)"))
                    }
                    (3 | 4, None) => return invalid(op, format!("sparseMode {sparseMode} requires the 2048x2048 lower-triangular attenMaskOptional")),
                    (3 | 4, Some(m)) => {
                        dtype_in(op, "attenMaskOptional", m, &mask_types)?;
                        let ok = matches!(m.dims.as_slice(), [2048, 2048] | [1, 2048, 2048] | [1, 1, 2048, 2048]);
                        if !ok {
                            return invalid(op, format!("sparseMode {sparseMode} needs attenMask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), got {:?}", m.dims));
                        }
                        if sparseMode == 3 {
                            Masking::Causal
                        } else {
                            if preTokens.checked_add(nextTokens).is_none_or(|t| t < 0) {
                                return invalid(op, format!("sparseMode 4 (band) needs preTokens + nextTokens >= 0, got {preTokens} + {nextTokens}"));
                            }
                            Masking::Band { pre: preTokens, next: nextTokens }
                        }
                    }
                    (5..=8, _) => return invalid(op, format!("sparseMode {sparseMode} is documented as not supported yet")),
                    _ => return invalid(op, format!("sparseMode {sparseMode} is not documented (0..=8)")),
                }
            };
            let mut ins = vec![q, kc, vc, bt];
            if let (Masking::PerKey, Some(m)) = (masking, mask) {
                ins.push(m);
            }
            let scales_at = scales.map(|(ks, vs)| {
                ins.push(ks);
                ins.push(vs);
                ins.len() - 2
            });
            Ok(Box::new(Fia {
                io: Io {
                    ins,
                    outs: vec![out],
                },
                n: numHeads,
                kv_n,
                d,
                scale: scaleValue,
                masking,
                block_size: blockSize,
                q_lens,
                kv_lens,
                scales_at,
            }))
        },
    )
}

/// The key and value antiquant scales (keyAntiquantScaleOptional, valueAntiquantScaleOptional)
/// with their modes, checked against the page's "kv伪量化参数分离" rules; `None` when neither
/// scale is given. The emulation implements mode 5 only ("per-token叠加per head并使用page
/// attention模式管理scale/offset": one FLOAT32 scale per block, KV head and slot, shape
/// (blockNum, KV_N, blockSize), INT8 caches), symmetric (the offsets stay unimplemented).
fn antiquant_scales(
    st: &State,
    ptrs: [*const aclTensor; 2],
    modes: [i64; 2],
    s: i64,
    kc: &View,
    kv_n: i64,
    block_size: i64,
) -> Result<Option<(View, View)>, Fail> {
    let op = "aclnnFusedInferAttentionScoreV2";
    let [km, vm] = modes;
    for (w, m) in [("keyAntiquantMode", km), ("valueAntiquantMode", vm)] {
        if !(0..=5).contains(&m) {
            return invalid(op, format!("{w} {m} is not documented (0..=5)"));
        }
    }
    let ks = st.opt_tensor(ptrs[0], "keyAntiquantScaleOptional")?;
    let vs = st.opt_tensor(ptrs[1], "valueAntiquantScaleOptional")?;
    let (ks, vs) = match (ks, vs) {
        (None, None) => {
            if km != 0 || vm != 0 {
                return invalid(op, format!("keyAntiquantMode {km} / valueAntiquantMode {vm} without key/value antiquant scales is not implemented by this emulation (pass 0)"));
            }
            return Ok(None);
        }
        (Some(k), Some(v)) => (k, v),
        _ => return invalid(op, "keyAntiquantScale and valueAntiquantScale must both be null or both be set (要么都为空，要么都不为空)"),
    };
    if s > 1 {
        return invalid(op, format!("keyAntiquantMode {km} with query S = {s}: for Q_S >= 2 only modes 0 and 1 are documented (Q_S大于等于2时仅支持传入值为0、1), and their key/value antiquant scales exclude page attention; mode 5 needs Q_S = 1"));
    }
    if km != vm && !(km == 0 && vm == 1) {
        return invalid(op, format!("keyAntiquantMode {km} and valueAntiquantMode {vm} must agree (except key 0 with value 1)"));
    }
    if km != 5 {
        return invalid(op, format!("keyAntiquantMode {km} / valueAntiquantMode {vm} is not implemented by this emulation (mode 5 is)"));
    }
    let want = [kc.dims.first().copied().unwrap_or(0), kv_n, block_size];
    for (w, v) in [
        ("keyAntiquantScaleOptional", &ks),
        ("valueAntiquantScaleOptional", &vs),
    ] {
        if v.dtype != DType::F32 {
            return invalid(
                op,
                format!(
                    "{w} {}: mode 5's scales are FLOAT32 (数据类型固定为FLOAT32)",
                    v.dtype.name()
                ),
            );
        }
        if v.dims != want {
            return invalid(
                op,
                format!(
                    "{w} {:?}: mode 5's scales are (blockNum, KV_N, blockSize) = {want:?}",
                    v.dims
                ),
            );
        }
        if !v.is_contiguous() {
            return invalid(op, format!("{w} does not support non-contiguous tensors"));
        }
    }
    Ok(Some((ks, vs)))
}

const _: npu_ffi::aclnn::ops::sig::aclnnFusedInferAttentionScoreV2GetWorkspaceSize =
    aclnnFusedInferAttentionScoreV2GetWorkspaceSize;
