//! Multi-head latent attention (DeepSeek-V2/V3), as llama.cpp's `deepseek2` graph runs it with
//! the up-projections absorbed: the query (through its low-rank pair, or whole) splits per head
//! into a part without rotation and a rotated part; each head's unrotated part is taken into
//! the latent space by that head's key up-projection (`attn_k_b`); every head then attends
//! over the same cached rows (a token's normalised latent and its rotated key, one row per
//! token: the paged cache stores latents, not per-head keys and values); each head's output,
//! a latent, comes back through its value up-projection (`attn_v_b`) before the output
//! projection. The loader reorders the query's output rows so that all heads' unrotated parts
//! come first and all rotated parts after (one rope call turns the queries' rotated parts and
//! the new key's together).

use npu_backend::{AttnGeometry, Backend, DType, HostTensor, View, ViewMut};
use npu_model::{MlaSpec, ModelConfig};

use super::runner::project;
use super::weights::{
    matrix, moe_ffn, part, rows_of, single, vector, with_cols, Attn, Experts, Ffn, Layer, Part,
    Proj, Src,
};
use super::ModelError;
use npu_model::shard::RankShard;

/// One layer's latent attention weights.
pub struct MlaWeights<B: Backend> {
    /// The query's low-rank projection and the norm of its output (None: a full projection).
    pub q_a: Option<(B::Matrix, B::Buffer)>,
    /// The query's rows: all heads' unrotated parts (`qk_nope` each), and all heads' rotated
    /// parts (`qk_rope` each).
    pub q_nope: Proj<B::Matrix>,
    pub q_rope: Proj<B::Matrix>,
    /// `attn_kv_a_mqa`'s latent rows, and its rotated key's rows.
    pub kv_a: B::Matrix,
    pub k_rope: B::Matrix,
    pub kv_a_norm: B::Buffer,
    /// Per head: the key up-projection as a matrix of `kv_lora_rank` outputs over `qk_nope`
    /// inputs (absorbed into the query), and the value up-projection (`v_head_dim` outputs
    /// over `kv_lora_rank` inputs).
    pub k_b: Vec<B::Matrix>,
    pub v_b: Vec<B::Matrix>,
}

impl<B: Backend> MlaWeights<B> {
    /// Every matrix of the attention (the output projection apart).
    pub fn matrices(&self) -> Vec<&B::Matrix> {
        let mut all = Vec::new();
        if let Some((a, _)) = &self.q_a {
            all.push(a);
        }
        all.extend(self.q_nope.matrices());
        all.extend(self.q_rope.matrices());
        all.push(&self.kv_a);
        all.push(&self.k_rope);
        all.extend(&self.k_b);
        all.extend(&self.v_b);
        all
    }
}

/// Rows `ranges` of a weight matrix, as tensors borrowing its bytes.
fn row_slices<'p>(
    t: &'p Part<'_>,
    ranges: &[std::ops::Range<usize>],
    name: &str,
) -> Result<Vec<HostTensor<'p>>, ModelError> {
    let rb = t.ty.row_bytes(t.cols).ok_or_else(|| {
        ModelError::Inconsistent(format!("tensor {name}: rows of partial blocks"))
    })?;
    ranges
        .iter()
        .map(|r| {
            let bytes = t.data.get(r.start * rb..r.end * rb).ok_or_else(|| {
                ModelError::Inconsistent(format!("tensor {name}: rows {r:?} of {}", t.rows))
            })?;
            Ok(HostTensor {
                ty: t.ty,
                data: bytes,
                rows: r.len(),
                cols: t.cols,
            })
        })
        .collect()
}

/// Layer `i` of a deepseek2 model, `shard`'s part of it: latent attention (its query heads;
/// the latent's projection whole, as every rank caches the whole latent), then the dense FFN
/// (the leading layers) or the routed and shared experts (their columns of `shard`).
pub(super) fn load_layer<B: Backend>(
    f: &Src<'_>,
    b: &mut B,
    cfg: &ModelConfig,
    m: MlaSpec,
    shard: &RankShard,
    i: usize,
    buf: &mut Vec<u8>,
) -> Result<Layer<B>, ModelError> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (h, heads) = (cfg.hidden, cfg.n_heads);
    let mine = shard.q_heads.clone();
    let qk = m.qk_nope + m.qk_rope;
    let (q_a, q_in) = if m.q_lora_rank > 0 {
        let a = single(b, part(f, &n("attn_q_a.weight"), h, m.q_lora_rank)?.host())?;
        let norm = vector(f, b, &n("attn_q_a_norm.weight"), m.q_lora_rank)?;
        (Some((a, norm)), m.q_lora_rank)
    } else {
        (None, h)
    };
    let q_name = if m.q_lora_rank > 0 {
        n("attn_q_b.weight")
    } else {
        n("attn_q.weight")
    };
    let q = part(f, &q_name, q_in, heads * qk)?;
    let nope: Vec<_> = mine
        .clone()
        .map(|hd| hd * qk..hd * qk + m.qk_nope)
        .collect();
    let rope: Vec<_> = mine
        .clone()
        .map(|hd| hd * qk + m.qk_nope..(hd + 1) * qk)
        .collect();
    let q_nope = matrix(b, &row_slices(&q, &nope, &q_name)?)?;
    let q_rope = matrix(b, &row_slices(&q, &rope, &q_name)?)?;
    let kv_name = n("attn_kv_a_mqa.weight");
    let kv = part(f, &kv_name, h, m.cache_row())?;
    let latent = m.kv_lora_rank;
    let kv_parts = row_slices(&kv, &[0..latent, latent..m.cache_row()], &kv_name)?;
    let kv_a = single(b, kv_parts[0])?;
    let k_rope = single(b, kv_parts[1])?;
    let kv_a_norm = vector(f, b, &n("attn_kv_a_norm.weight"), latent)?;
    let k_bs = Experts::read(f, &n("attn_k_b.weight"), m.qk_nope, latent, heads)?;
    let v_bs = Experts::read(f, &n("attn_v_b.weight"), latent, m.v_head_dim, heads)?;
    let mut k_b = Vec::with_capacity(mine.len());
    let mut v_b = Vec::with_capacity(mine.len());
    for hd in mine.clone() {
        k_b.push(single(b, k_bs.expert(hd)?.host())?);
        v_b.push(single(b, v_bs.expert(hd)?.host())?);
    }
    let wo = part(f, &n("attn_output.weight"), heads * m.v_head_dim, h)?;
    let wo_cols = mine.start * m.v_head_dim..mine.end * m.v_head_dim;
    let wo = single(b, with_cols(&wo, &wo_cols, &n("attn_output"), buf)?)?;
    let moe = cfg.moe.ok_or_else(|| {
        ModelError::Inconsistent("a deepseek2 model without its experts' settings".into())
    })?;
    let ffn = if moe.is_moe_layer(i) {
        moe_ffn(f, b, &n, h, moe, shard, buf)?
    } else {
        let ffr = &shard.ff;
        let gate = rows_of(part(f, &n("ffn_gate.weight"), h, cfg.ff)?, ffr, "gate")?;
        let up = rows_of(part(f, &n("ffn_up.weight"), h, cfg.ff)?, ffr, "up")?;
        let down = part(f, &n("ffn_down.weight"), cfg.ff, h)?;
        Ffn::Dense {
            gate_up: matrix(b, &[gate.host(), up.host()])?,
            down: single(b, with_cols(&down, ffr, &n("ffn_down"), buf)?)?,
        }
    };
    Ok(Layer {
        attn_norm: vector(f, b, &n("attn_norm.weight"), h)?,
        attn: Attn::Latent(Box::new(MlaWeights {
            q_a,
            q_nope,
            q_rope,
            kv_a,
            k_rope,
            kv_a_norm,
            k_b,
            v_b,
        })),
        wo,
        post_attn_norm: None,
        ffn_norm: vector(f, b, &n("ffn_norm.weight"), h)?,
        ffn,
        post_ffn_norm: None,
    })
}

/// The step buffers latent attention needs beyond the shared ones.
pub(super) struct MlaBuffers<B: Backend> {
    /// The query's low-rank projection, and it normalised.
    qa: B::Buffer,
    qan: B::Buffer,
    /// The latent as projected, and normalised (what the cache stores).
    latent_raw: B::Buffer,
    latent: B::Buffer,
    /// Each head's query in the latent space, and its attention output there.
    q_latent: B::Buffer,
    o_latent: B::Buffer,
}

impl<B: Backend> MlaBuffers<B> {
    pub(super) fn alloc(
        b: &mut B,
        act: DType,
        t: usize,
        cfg: &ModelConfig,
    ) -> Result<Option<Self>, ModelError> {
        let Some(m) = cfg.mla else {
            return Ok(None);
        };
        let hl = cfg.n_heads * m.kv_lora_rank;
        let ql = m.q_lora_rank.max(1);
        Ok(Some(Self {
            qa: b.alloc(act, t * ql)?,
            qan: b.alloc(act, t * ql)?,
            latent_raw: b.alloc(act, t * m.kv_lora_rank)?,
            latent: b.alloc(act, t * m.kv_lora_rank)?,
            q_latent: b.alloc(act, t * hl)?,
            o_latent: b.alloc(act, t * hl)?,
        }))
    }
}

/// Where one step's latent attention reads and writes: the normalised input rows, the query
/// buffer (the model's `qkv`: unrotated parts, rotated parts, the new key's rotated part) and
/// the output (the model's `attn`: each head's value, `v_head_dim` wide).
pub(super) struct MlaStep<'a, B: Backend> {
    pub xn: &'a B::Buffer,
    pub q: &'a mut B::Buffer,
    pub out: &'a mut B::Buffer,
    pub bufs: &'a mut MlaBuffers<B>,
}

/// Layer `li`'s latent attention of the step's `t` rows into `s.out` (before the output
/// projection).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention<B: Backend>(
    b: &mut B,
    w: &MlaWeights<B>,
    m: MlaSpec,
    g: &AttnGeometry,
    s: MlaStep<'_, B>,
    eps: f32,
    t: usize,
    h: usize,
    li: usize,
) -> Result<(), ModelError> {
    let heads = g.n_heads;
    let (nope, rope, latent, vd) = (m.qk_nope, m.qk_rope, m.kv_lora_rank, m.v_head_dim);
    let (q_rope_at, k_rope_at) = (heads * nope, heads * (nope + rope));
    let x = View::rows(s.xn, t, h)?;
    let mut q = ViewMut::rows(s.q, t, k_rope_at + rope)?;
    let bufs = s.bufs;
    match &w.q_a {
        Some((a, norm)) => {
            let ql = m.q_lora_rank;
            b.matmul(x, a, ViewMut::rows(&mut bufs.qa, t, ql)?)?;
            b.rms_norm(
                View::rows(&bufs.qa, t, ql)?,
                norm,
                eps,
                ViewMut::rows(&mut bufs.qan, t, ql)?,
            )?;
            let qa = View::rows(&bufs.qan, t, ql)?;
            project(b, qa, &w.q_nope, &mut q.col_range(0, q_rope_at)?)?;
            project(b, qa, &w.q_rope, &mut q.col_range(q_rope_at, heads * rope)?)?;
        }
        None => {
            project(b, x, &w.q_nope, &mut q.col_range(0, q_rope_at)?)?;
            project(b, x, &w.q_rope, &mut q.col_range(q_rope_at, heads * rope)?)?;
        }
    }
    b.matmul(x, &w.k_rope, q.col_range(k_rope_at, rope)?)?;
    // The queries' rotated parts and the new key's, turned together.
    let g_rope = AttnGeometry {
        n_heads: heads,
        n_kv_heads: 1,
        head_dim: rope,
        rope: g.rope,
        scale: g.scale,
        window: None,
    };
    b.rope(q.col_range(q_rope_at, (heads + 1) * rope)?, &g_rope)?;
    b.matmul(x, &w.kv_a, ViewMut::rows(&mut bufs.latent_raw, t, latent)?)?;
    b.rms_norm(
        View::rows(&bufs.latent_raw, t, latent)?,
        &w.kv_a_norm,
        eps,
        ViewMut::rows(&mut bufs.latent, t, latent)?,
    )?;
    let q = q.as_view();
    b.kv_write_latent(
        View::rows(&bufs.latent, t, latent)?,
        q.col_range(k_rope_at, rope)?,
        li,
    )?;
    for (hd, k_b) in w.k_b.iter().enumerate() {
        b.matmul(
            q.col_range(hd * nope, nope)?,
            k_b,
            ViewMut::rows(&mut bufs.q_latent, t, heads * latent)?.col_range(hd * latent, latent)?,
        )?;
    }
    b.attention_latent(
        View::rows(&bufs.q_latent, t, heads * latent)?,
        q.col_range(q_rope_at, heads * rope)?,
        g,
        latent,
        li,
        ViewMut::rows(&mut bufs.o_latent, t, heads * latent)?,
    )?;
    let o = View::rows(&bufs.o_latent, t, heads * latent)?;
    for (hd, v_b) in w.v_b.iter().enumerate() {
        b.matmul(
            o.col_range(hd * latent, latent)?,
            v_b,
            ViewMut::rows(s.out, t, heads * vd)?.col_range(hd * vd, vd)?,
        )?;
    }
    Ok(())
}
