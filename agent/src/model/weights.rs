//! Loads a model's tensors (a GGUF file's, or a Hugging Face directory's under GGUF's names:
//! `npu_model::Checkpoint`) onto a Backend, checking every shape, and fusing Q/K/V and
//! gate/up projections into single matrices where the backend's format allows. Tensors are
//! handed over as the file stores them; the backend picks its own format. The tensors a family
//! adds to the Llama block (per-head Q/K norms, Gemma's post-norms) are read where its
//! `ModelConfig` says it has them; Q/K/V biases wherever the file has them (any family, as
//! llama.cpp: each of the three optional, a missing one adding zeros).
//!
//! Every tensor the file holds must be read: `ModelConfig::from_gguf` already refused, by name,
//! a tensor the family does not use, and the loader checks at the end that it read all the
//! others (a tensor left unread could be maths the engine skips).
//!
//! A rank of a tensor-parallel group (`RankShard`) loads only its shard, Megatron style: the
//! rows of Q/K/V, gate/up and each expert's gate/up that its heads and FFN columns produce
//! (a slice of the mapped file), the columns of the attention output and of the down
//! projections that its heads and FFN columns feed (each row's column range copied), its rows
//! of the output head; norms and the MoE router whole. It holds no embedding table: the rows a
//! step needs are read from the file as the step runs (`HostEmbedding`).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashSet;
use std::ops::Range;

use npu_backend::{Backend, HostTensor};
use npu_gguf::{GgmlType, TensorInfo};
use npu_model::shard::RankShard;
use npu_model::Checkpoint;

use super::{ModelConfig, ModelError};

/// A projection stored as one matrix, or as several whose outputs go to consecutive columns.
pub enum Proj<M> {
    Fused(M),
    /// (matrix, first output column, output columns).
    Split(Vec<(M, usize, usize)>),
}

pub struct Layer<B: Backend> {
    pub attn_norm: B::Buffer,
    pub attn: Attn<B>,
    pub wo: B::Matrix,
    /// RMS norm of the attention output before its residual add (Gemma 3).
    pub post_attn_norm: Option<B::Buffer>,
    pub ffn_norm: B::Buffer,
    pub ffn: Ffn<B>,
    /// RMS norm of the FFN output before its residual add (Gemma 3).
    pub post_ffn_norm: Option<B::Buffer>,
}

/// A layer's attention projections.
pub enum Attn<B: Backend> {
    /// Q, K and V projections (fused where the backend can), with their optional biases and
    /// per-head norms.
    Heads {
        qkv: Proj<B::Matrix>,
        qkv_bias: Option<B::Buffer>,
        /// Per-head RMS norm weights of the queries and keys (`head_dim` each).
        q_norm: Option<B::Buffer>,
        k_norm: Option<B::Buffer>,
    },
    /// Multi-head latent attention (DeepSeek; see `super::mla`).
    Latent(Box<super::mla::MlaWeights<B>>),
}

/// A layer's feed-forward block.
pub enum Ffn<B: Backend> {
    /// One gated FFN for every token: gate and up (`2 * ff` outputs), then down.
    Dense {
        gate_up: Proj<B::Matrix>,
        down: B::Matrix,
    },
    /// Routed experts (Qwen3-MoE): the router (one logit per expert), then each expert's
    /// gate+up (`2 * expert_ff` outputs) and down projections.
    Moe {
        router: B::Matrix,
        gate_up: Vec<B::Matrix>,
        down: Vec<B::Matrix>,
        /// The per-expert bias added to the scores experts are chosen by (DeepSeek-V3).
        selection_bias: Option<B::Buffer>,
        /// The shared experts' gated FFN run on every token beside the routed ones.
        shared: Option<(Proj<B::Matrix>, B::Matrix)>,
        /// The routed experts `gate_up` and `down` hold (`gate_up[i]` is expert `held.start +
        /// i`): all of them, or a rank's range when a tensor-parallel group splits whole
        /// experts (`ExpertSplit::WholeExperts`).
        held: std::ops::Range<usize>,
    },
}

/// The token embedding table.
pub enum Embedding<B: Backend> {
    /// On the device, whole.
    Device(B::Embedding),
    /// Left in the file: each step's rows are read and dequantized on the host (the ranks of
    /// a tensor-parallel group, so that none holds the whole table).
    Host(Box<HostEmbedding>),
}

/// An embedding table read from a mapped checkpoint row by row, as steps need them (or held
/// converted, when the checkpoint's bytes are not the table's: a quantize-at-load).
pub struct HostEmbedding {
    file: Checkpoint,
    /// The table's bytes when they had to be converted.
    held: Option<Vec<u8>>,
    name: String,
    rows: usize,
    cols: usize,
}

impl HostEmbedding {
    /// Maps the checkpoint afresh (a mapping of its own, so that what loading the weights paged
    /// in is not kept resident by it).
    pub fn open(f: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Self, ModelError> {
        let file = f.reopen()?;
        let held = match tensor(&Src::new(&file), name, &[cols, rows])?.1 {
            Cow::Owned(v) => Some(v),
            Cow::Borrowed(_) => None,
        };
        Ok(Self {
            file,
            held,
            name: name.to_string(),
            rows,
            cols,
        })
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `out` row i = the dequantized row of `tokens[i]`.
    pub fn lookup(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ModelError> {
        let (info, mapped) = self.file.tensor(&self.name)?;
        let data: &[u8] = self.held.as_deref().unwrap_or(&mapped);
        let rb = info.ty.row_bytes(self.cols).ok_or_else(|| {
            ModelError::Inconsistent(format!("{}: rows of partial blocks", self.name))
        })?;
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(self.cols)) {
            let t = t as usize;
            let src = data
                .get(t * rb..(t + 1) * rb)
                .filter(|_| t < self.rows)
                .ok_or_else(|| {
                    ModelError::Inconsistent(format!(
                        "token id {t} is beyond the vocabulary ({})",
                        self.rows
                    ))
                })?;
            npu_gguf::quants::dequantize_row(info.ty, src, row)
                .map_err(|e| ModelError::Inconsistent(format!("{}: {e}", self.name)))?;
        }
        Ok(())
    }
}

pub struct Weights<B: Backend> {
    pub embed: Embedding<B>,
    pub layers: Vec<Layer<B>>,
    pub out_norm: B::Buffer,
    pub head: B::Matrix,
}

impl<M> Proj<M> {
    /// The matrices of the projection.
    pub fn matrices(&self) -> Vec<&M> {
        match self {
            Proj::Fused(m) => vec![m],
            Proj::Split(parts) => parts.iter().map(|(m, _, _)| m).collect(),
        }
    }
}

impl<B: Backend> Weights<B> {
    /// Every matrix one decode token reads: each layer's projections, then the output head.
    pub fn matrices(&self) -> Vec<&B::Matrix> {
        let mut all = Vec::new();
        for l in &self.layers {
            match &l.attn {
                Attn::Heads { qkv, .. } => all.extend(qkv.matrices()),
                Attn::Latent(m) => all.extend(m.matrices()),
            }
            all.push(&l.wo);
            match &l.ffn {
                Ffn::Dense { gate_up, down } => {
                    all.extend(gate_up.matrices());
                    all.push(down);
                }
                // A decode token reads its routed experts only; all are listed here.
                Ffn::Moe {
                    router,
                    gate_up,
                    down,
                    shared,
                    ..
                } => {
                    all.push(router);
                    all.extend(gate_up);
                    all.extend(down);
                    if let Some((gu, d)) = shared {
                        all.extend(gu.matrices());
                        all.push(d);
                    }
                }
            }
        }
        all.push(&self.head);
        all
    }
}

/// The checkpoint being loaded, and the names of the tensors read from it.
pub(super) struct Src<'a> {
    file: &'a Checkpoint,
    read: RefCell<HashSet<String>>,
}

impl<'a> Src<'a> {
    fn new(file: &'a Checkpoint) -> Self {
        Self {
            file,
            read: RefCell::new(HashSet::new()),
        }
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.file.stored_info(name).is_some()
    }

    /// Notes a tensor as used without reading it here (the rope factors, read with the
    /// hyper-parameters).
    fn mark(&self, name: &str) {
        self.read.borrow_mut().insert(name.to_string());
    }

    /// Refuses the file when it holds a tensor that was not read.
    fn check_all_read(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        let read = self.read.borrow();
        match self
            .file
            .tensor_names()
            .into_iter()
            .find(|t| !read.contains(t))
        {
            None => Ok(()),
            Some(t) => Err(ModelError::Unsupported(format!(
                "{} model: tensor {t:?} is in the file, but the engine does not use it",
                cfg.arch.name(),
            ))),
        }
    }
}

/// Looks up a tensor and checks its shape (ggml order: row length first).
pub(super) fn tensor<'a>(
    f: &Src<'a>,
    name: &str,
    dims: &[usize],
) -> Result<(TensorInfo, Cow<'a, [u8]>), ModelError> {
    let (info, data) = f.file.tensor(name)?;
    f.mark(name);
    let got: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
    let mut want = dims.to_vec();
    // Trailing dimensions of 1 are the same shape.
    let mut g = got.clone();
    while g.len() > 1 && g.last() == Some(&1) {
        g.pop();
    }
    while want.len() > 1 && want.last() == Some(&1) {
        want.pop();
    }
    if g != want {
        return Err(ModelError::Inconsistent(format!(
            "tensor {name} has shape {got:?}, expected {dims:?}"
        )));
    }
    Ok((info, data))
}

/// A weight matrix as the loader holds it: the checkpoint's mapped bytes, or bytes converted
/// from them.
pub(super) struct Part<'a> {
    pub(super) ty: GgmlType,
    pub(super) data: Cow<'a, [u8]>,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl Part<'_> {
    pub(super) fn host(&self) -> HostTensor<'_> {
        HostTensor {
            ty: self.ty,
            data: &self.data,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// A weight matrix of `rows` outputs and `cols` inputs.
pub(super) fn part<'a>(
    f: &Src<'a>,
    name: &str,
    cols: usize,
    rows: usize,
) -> Result<Part<'a>, ModelError> {
    let (info, data) = tensor(f, name, &[cols, rows])?;
    Ok(Part {
        ty: info.ty,
        data,
        rows,
        cols,
    })
}

/// Output rows `r` of a weight matrix: a slice of its bytes.
pub(super) fn rows_of<'a>(
    t: Part<'a>,
    r: &Range<usize>,
    name: &str,
) -> Result<Part<'a>, ModelError> {
    if *r == (0..t.rows) {
        return Ok(t);
    }
    let rb = t.ty.row_bytes(t.cols).ok_or_else(|| {
        ModelError::Inconsistent(format!("tensor {name}: rows of partial blocks"))
    })?;
    let range = r.start * rb..r.end * rb;
    if r.end > t.rows || range.end > t.data.len() {
        return Err(ModelError::Inconsistent(format!(
            "tensor {name}: rows {r:?} of {}",
            t.rows
        )));
    }
    let data = match t.data {
        Cow::Borrowed(d) => Cow::Borrowed(&d[range]),
        Cow::Owned(d) => Cow::Owned(d[range].to_vec()),
    };
    Ok(Part {
        data,
        rows: r.len(),
        ..t
    })
}

/// Input columns `c` of every row of a weight matrix, copied into `buf` (None: all of them,
/// nothing copied). The cut must fall on the type's blocks (the shard plan checks it).
fn cols_of(
    t: HostTensor<'_>,
    c: &Range<usize>,
    name: &str,
    buf: &mut Vec<u8>,
) -> Result<Option<(usize, usize)>, ModelError> {
    if *c == (0..t.cols) {
        return Ok(None);
    }
    let bl = t.ty.block_len();
    let bad = || {
        ModelError::Inconsistent(format!(
            "tensor {name}: columns {c:?} of {} do not fall on its {bl}-column {} blocks",
            t.cols,
            t.ty.name()
        ))
    };
    if !c.start.is_multiple_of(bl) || !c.end.is_multiple_of(bl) || c.end > t.cols {
        return Err(bad());
    }
    let rb = t.ty.row_bytes(t.cols).ok_or_else(bad)?;
    let (from, len) = (
        c.start / bl * t.ty.block_bytes(),
        c.len() / bl * t.ty.block_bytes(),
    );
    buf.clear();
    buf.reserve(len * t.rows);
    for row in t.data.chunks_exact(rb).take(t.rows) {
        buf.extend_from_slice(&row[from..from + len]);
    }
    Ok(Some((c.len(), len)))
}

/// The columns `c` of `t` as a tensor (borrowing `buf` when they had to be copied).
pub(super) fn with_cols<'a>(
    t: &'a Part<'_>,
    c: &Range<usize>,
    name: &str,
    buf: &'a mut Vec<u8>,
) -> Result<HostTensor<'a>, ModelError> {
    let t = t.host();
    Ok(match cols_of(t, c, name, buf)? {
        None => t,
        Some((cols, _)) => HostTensor {
            data: buf.as_slice(),
            cols,
            ..t
        },
    })
}

pub(super) fn vector<B: Backend>(
    f: &Src<'_>,
    b: &mut B,
    name: &str,
    len: usize,
) -> Result<B::Buffer, ModelError> {
    let (info, data) = tensor(f, name, &[len])?;
    Ok(b.load_vector(HostTensor {
        ty: info.ty,
        data: &data,
        rows: 1,
        cols: len,
    })?)
}

pub(super) fn matrix<B: Backend>(
    b: &mut B,
    parts: &[HostTensor],
) -> Result<Proj<B::Matrix>, ModelError> {
    if let Some(m) = b.load_matrix(parts)? {
        return Ok(Proj::Fused(m));
    }
    let mut out = Vec::new();
    let mut col = 0;
    for p in parts {
        out.push((single(b, *p)?, col, p.rows));
        col += p.rows;
    }
    Ok(Proj::Split(out))
}

pub(super) fn single<B: Backend>(b: &mut B, p: HostTensor) -> Result<B::Matrix, ModelError> {
    b.load_matrix(&[p])?.ok_or_else(|| {
        ModelError::Unsupported(format!(
            "a {} weight matrix with {} inputs",
            p.ty.name(),
            p.cols
        ))
    })
}

impl<B: Backend> Weights<B> {
    /// The whole model.
    pub fn load(f: &Checkpoint, cfg: &ModelConfig, b: &mut B) -> Result<Self, ModelError> {
        Self::load_shard(f, cfg, &RankShard::whole(cfg), b)
    }

    /// The part of the model `shard` computes (`cfg` is the whole model's).
    pub fn load_shard(
        f: &Checkpoint,
        cfg: &ModelConfig,
        shard: &RankShard,
        b: &mut B,
    ) -> Result<Self, ModelError> {
        let file = f;
        let f = &Src::new(file);
        if cfg.rope.factors.is_some() && f.has("rope_freqs.weight") {
            f.mark("rope_freqs.weight");
        }
        let h = cfg.hidden;
        let hd = cfg.head_dim;
        let qd = cfg.n_heads * hd;
        let kvd = cfg.n_kv_heads * hd;
        let qr = shard.q_heads.start * hd..shard.q_heads.end * hd;
        let kvr = shard.kv_heads.start * hd..shard.kv_heads.end * hd;
        let emb = part(f, "token_embd.weight", h, cfg.vocab)?;
        let embed = if shard.is_split() {
            Embedding::Host(Box::new(HostEmbedding::open(
                file,
                "token_embd.weight",
                cfg.vocab,
                h,
            )?))
        } else {
            Embedding::Device(b.load_embedding(emb.host())?)
        };
        let mut buf = Vec::new();
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            if let Some(mla) = cfg.mla {
                layers.push(super::mla::load_layer(f, b, cfg, mla, shard, i, &mut buf)?);
                release_layer(file, i);
                continue;
            }
            let q = rows_of(part(f, &n("attn_q.weight"), h, qd)?, &qr, &n("attn_q"))?;
            let k = rows_of(part(f, &n("attn_k.weight"), h, kvd)?, &kvr, &n("attn_k"))?;
            let v = rows_of(part(f, &n("attn_v.weight"), h, kvd)?, &kvr, &n("attn_v"))?;
            let qkv = matrix(b, &[q.host(), k.host(), v.host()])?;
            let qkv_bias = if cfg.qkv_bias {
                // The three biases (this rank's heads) as one f32 vector (the backend converts
                // it as it likes). Each is optional, as llama.cpp reads them: a file may bias
                // some projections and not others, or some layers and not others; a missing
                // one adds zeros.
                let mut bias = Vec::with_capacity(qr.len() + 2 * kvr.len());
                let [qb, kb, vb] = npu_model::QKV_BIASES;
                for (name, len, r) in [(qb, qd, &qr), (kb, kvd, &kvr), (vb, kvd, &kvr)] {
                    let mut all = vec![0f32; len];
                    if f.has(&n(name)) {
                        let (info, data) = tensor(f, &n(name), &[len])?;
                        npu_gguf::quants::dequantize_row(info.ty, &data, &mut all).map_err(
                            |e| ModelError::Inconsistent(format!("tensor {}: {e}", n(name))),
                        )?;
                    }
                    bias.extend_from_slice(&all[r.clone()]);
                }
                Some(b.load_vector(HostTensor {
                    ty: GgmlType::F32,
                    data: bytemuck::cast_slice(&bias),
                    rows: 1,
                    cols: bias.len(),
                })?)
            } else {
                None
            };
            // The norms are per head, the same weights for every head: whole on every rank.
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(vector(f, b, &n("attn_q_norm.weight"), hd)?),
                    Some(vector(f, b, &n("attn_k_norm.weight"), hd)?),
                )
            } else {
                (None, None)
            };
            let post = |b: &mut B, name: &str| -> Result<Option<B::Buffer>, ModelError> {
                if cfg.post_norms {
                    Ok(Some(vector(f, b, &n(name), h)?))
                } else {
                    Ok(None)
                }
            };
            let post_attn_norm = post(b, "post_attention_norm.weight")?;
            let post_ffn_norm = post(b, "post_ffw_norm.weight")?;
            let wo = part(f, &n("attn_output.weight"), qd, h)?;
            let wo = single(b, with_cols(&wo, &qr, &n("attn_output"), &mut buf)?)?;
            let ffn = match cfg.moe {
                None => {
                    let ffr = &shard.ff;
                    let gate = rows_of(part(f, &n("ffn_gate.weight"), h, cfg.ff)?, ffr, "gate")?;
                    let up = rows_of(part(f, &n("ffn_up.weight"), h, cfg.ff)?, ffr, "up")?;
                    let down = part(f, &n("ffn_down.weight"), cfg.ff, h)?;
                    Ffn::Dense {
                        gate_up: matrix(b, &[gate.host(), up.host()])?,
                        down: single(b, with_cols(&down, ffr, &n("ffn_down"), &mut buf)?)?,
                    }
                }
                Some(moe) => moe_ffn(f, b, &n, h, moe, shard, &mut buf)?,
            };
            let attn_norm = vector(f, b, &n("attn_norm.weight"), h)?;
            let ffn_norm = vector(f, b, &n("ffn_norm.weight"), h)?;
            release_layer(file, i);
            layers.push(Layer {
                attn_norm,
                attn: Attn::Heads {
                    qkv,
                    qkv_bias,
                    q_norm,
                    k_norm,
                },
                wo,
                post_attn_norm,
                ffn_norm,
                ffn,
                post_ffn_norm,
            });
        }
        let out_norm = vector(f, b, "output_norm.weight", h)?;
        let head_part = if f.has("output.weight") {
            part(f, "output.weight", h, cfg.vocab)?
        } else {
            emb
        };
        let head = single(b, rows_of(head_part, &shard.vocab, "output head")?.host())?;
        for name in ["token_embd.weight", "output.weight", "output_norm.weight"] {
            file.release(name);
        }
        f.check_all_read(cfg)?;
        Ok(Self {
            embed,
            layers,
            out_norm,
            head,
        })
    }
}

/// The backend holds its copies of layer `i`: its mapped pages may go.
fn release_layer(file: &Checkpoint, i: usize) {
    let prefix = format!("blk.{i}.");
    for name in file.tensor_names() {
        if name.starts_with(&prefix) {
            file.release(&name);
        }
    }
}

/// A 3-D expert tensor (`[cols, rows, n_experts]` in ggml order), read once for all experts.
pub(super) struct Experts<'a> {
    name: String,
    ty: GgmlType,
    data: Cow<'a, [u8]>,
    cols: usize,
    rows: usize,
    n_experts: usize,
}

impl<'a> Experts<'a> {
    pub(super) fn read(
        f: &Src<'a>,
        name: &str,
        cols: usize,
        rows: usize,
        n_experts: usize,
    ) -> Result<Self, ModelError> {
        let (info, data) = tensor(f, name, &[cols, rows, n_experts])?;
        Ok(Self {
            name: name.to_string(),
            ty: info.ty,
            data,
            cols,
            rows,
            n_experts,
        })
    }

    /// Expert `e`'s matrix: a slice of the tensor's bytes.
    pub(super) fn expert(&self, e: usize) -> Result<Part<'_>, ModelError> {
        let name = &self.name;
        let row_bytes = self.ty.row_bytes(self.cols).ok_or_else(|| {
            ModelError::Inconsistent(format!(
                "tensor {name}: rows of {} values do not fill whole {} blocks",
                self.cols,
                self.ty.name()
            ))
        })?;
        let bytes = row_bytes * self.rows;
        let slice = self.data.get(e * bytes..(e + 1) * bytes).ok_or_else(|| {
            ModelError::Inconsistent(format!(
                "tensor {name} is shorter than {} experts",
                self.n_experts
            ))
        })?;
        Ok(Part {
            ty: self.ty,
            data: Cow::Borrowed(slice),
            rows: self.rows,
            cols: self.cols,
        })
    }
}

/// An MoE layer's router and selection bias (whole) and experts (each expert's gate and up
/// fused into one matrix): the experts of `shard` (all, or its range of whole experts), each
/// its FFN columns of `shard`, and the shared experts' (their columns of `shard`).
pub(super) fn moe_ffn<B: Backend>(
    f: &Src<'_>,
    b: &mut B,
    n: &dyn Fn(&str) -> String,
    h: usize,
    moe: npu_model::MoeSpec,
    shard: &RankShard,
    buf: &mut Vec<u8>,
) -> Result<Ffn<B>, ModelError> {
    let ffr = &shard.expert_ff;
    let (ne, ff) = (moe.n_experts, moe.expert_ff);
    let router = single(b, part(f, &n("ffn_gate_inp.weight"), h, ne)?.host())?;
    let gates = Experts::read(f, &n("ffn_gate_exps.weight"), h, ff, ne)?;
    let ups = Experts::read(f, &n("ffn_up_exps.weight"), h, ff, ne)?;
    let downs = Experts::read(f, &n("ffn_down_exps.weight"), ff, h, ne)?;
    let held = shard.experts.clone();
    if held.is_empty() || held.end > ne {
        return Err(ModelError::Inconsistent(format!(
            "the shard holds experts {held:?} of a layer of {ne}"
        )));
    }
    // Each projection of every held expert in one call (a backend may store them side by side
    // for one grouped matmul).
    let mut gu_parts = Vec::with_capacity(held.len());
    let mut down_parts = Vec::with_capacity(held.len());
    for e in held.clone() {
        let gate = rows_of(gates.expert(e)?, ffr, "gate")?;
        let up = rows_of(ups.expert(e)?, ffr, "up")?;
        gu_parts.push((gate, up));
        down_parts.push(downs.expert(e)?);
    }
    let gate_up = b
        .load_experts(
            &gu_parts
                .iter()
                .map(|(g, u)| vec![g.host(), u.host()])
                .collect::<Vec<_>>(),
        )?
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "expert gate ({}) and up ({}) projections the backend cannot fuse",
                gates.ty.name(),
                ups.ty.name()
            ))
        })?;
    // Columns of `ffr` (a tensor-parallel shard) are copied out, one buffer per expert.
    let mut down_bufs: Vec<Vec<u8>> = down_parts.iter().map(|_| Vec::new()).collect();
    let mut down_hosts = Vec::with_capacity(held.len());
    for (d, db) in down_parts.iter().zip(down_bufs.iter_mut()) {
        down_hosts.push(vec![with_cols(d, ffr, &n("ffn_down_exps"), db)?]);
    }
    let down = b.load_experts(&down_hosts)?.ok_or_else(|| {
        ModelError::Unsupported(format!(
            "a {} weight matrix with {} inputs",
            downs.ty.name(),
            ffr.len()
        ))
    })?;
    let selection_bias = match f.has(&n("exp_probs_b.bias")) {
        true => Some(vector(f, b, &n("exp_probs_b.bias"), ne)?),
        false => None,
    };
    let shared = match moe.shared_ff {
        0 => None,
        sff => {
            let sr = &shard.shared_ff;
            let gate = rows_of(part(f, &n("ffn_gate_shexp.weight"), h, sff)?, sr, "gate")?;
            let up = rows_of(part(f, &n("ffn_up_shexp.weight"), h, sff)?, sr, "up")?;
            let down = part(f, &n("ffn_down_shexp.weight"), sff, h)?;
            let down = single(b, with_cols(&down, sr, &n("ffn_down_shexp"), buf)?)?;
            Some((matrix(b, &[gate.host(), up.host()])?, down))
        }
    };
    Ok(Ffn::Moe {
        router,
        gate_up,
        down,
        selection_bias,
        shared,
        held,
    })
}

#[cfg(test)]
mod tests {
    use npu_backend::{Backend, HostSliceMut, Readback, View};
    use npu_backend_cpu::{CpuBackend, CpuConfig};
    use npu_gguf::writer::GgufWriter;
    use npu_gguf::{GgufFile, MetaValue};

    use super::{ModelConfig, ModelError, Weights};

    /// A one-layer llama of 32 wide (2 heads of 16, 1 KV head), FFN 32, vocabulary 8, all f32,
    /// with `extra` vectors beside its tensors.
    fn tiny_llama(extra: &[(&str, Vec<f32>)]) -> GgufFile {
        let mut w = GgufWriter::new();
        let u = MetaValue::U32;
        w.add_meta("general.architecture", MetaValue::String("llama".into()));
        for (k, v) in [
            ("block_count", 1),
            ("embedding_length", 32),
            ("feed_forward_length", 32),
            ("attention.head_count", 2),
            ("attention.head_count_kv", 1),
            ("vocab_size", 8),
        ] {
            w.add_meta(format!("llama.{k}"), u(v));
        }
        w.add_meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        );
        let mut t = |name: &str, dims: &[u64]| {
            let n = dims.iter().product::<u64>() as usize;
            let v: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 * 0.01).collect();
            w.add_f32_tensor(name, dims, &v);
        };
        t("token_embd.weight", &[32, 8]);
        t("output_norm.weight", &[32]);
        for name in ["attn_norm", "ffn_norm"] {
            t(&format!("blk.0.{name}.weight"), &[32]);
        }
        t("blk.0.attn_q.weight", &[32, 32]);
        t("blk.0.attn_k.weight", &[32, 16]);
        t("blk.0.attn_v.weight", &[32, 16]);
        t("blk.0.attn_output.weight", &[32, 32]);
        t("blk.0.ffn_gate.weight", &[32, 32]);
        t("blk.0.ffn_up.weight", &[32, 32]);
        t("blk.0.ffn_down.weight", &[32, 32]);
        for (name, v) in extra {
            w.add_f32_tensor(*name, &[v.len() as u64], v);
        }
        GgufFile::from_bytes("tiny-llama.gguf", &w.to_bytes().unwrap()).unwrap()
    }

    fn cpu() -> CpuBackend {
        CpuBackend::new(CpuConfig {
            threads: 1,
            f32_reference: false,
        })
    }

    /// A llama file with a K bias only: the biases are applied (llama.cpp reads Q/K/V biases on
    /// every family, each optional), the missing Q and V ones as zeros.
    #[test]
    fn qkv_biases_load_on_any_family_with_zeros_for_the_missing() {
        let k_bias: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let f = tiny_llama(&[("blk.0.attn_k.bias", k_bias.clone())]);
        let cfg = ModelConfig::from_gguf(&f).unwrap();
        assert!(cfg.qkv_bias);
        let mut b = cpu();
        let w = Weights::load(&(&f).into(), &cfg, &mut b).unwrap();
        let super::Attn::Heads { qkv_bias, .. } = &w.layers[0].attn else {
            panic!("a llama layer with latent attention")
        };
        let bias = qkv_bias.as_ref().expect("a bias vector");
        let mut got = vec![f32::NAN; 64];
        b.read_back(&mut [Readback {
            src: View::rows(bias, 1, 64).unwrap(),
            dst: HostSliceMut::F32(&mut got),
        }])
        .unwrap();
        let mut want = vec![0f32; 32];
        want.extend(&k_bias);
        want.extend([0f32; 16]);
        assert_eq!(got, want);
        // Without biases, none.
        let f = tiny_llama(&[]);
        let cfg = ModelConfig::from_gguf(&f).unwrap();
        assert!(!cfg.qkv_bias);
        let w = Weights::load(&(&f).into(), &cfg, &mut cpu()).unwrap();
        assert!(matches!(
            &w.layers[0].attn,
            super::Attn::Heads { qkv_bias: None, .. }
        ));
    }

    /// A tensor the loader did not read stops the load naming it, even past the
    /// hyper-parameters' own check (here: a config read from the file without it).
    #[test]
    fn a_tensor_left_unread_stops_the_load() {
        let cfg = ModelConfig::from_gguf(&tiny_llama(&[])).unwrap();
        let f = tiny_llama(&[("blk.0.attn_output.bias", vec![1.0; 32])]);
        let e = match Weights::load(&(&f).into(), &cfg, &mut cpu()) {
            Ok(_) => panic!("loaded a file with an unread tensor"),
            Err(e) => e,
        };
        assert!(matches!(e, ModelError::Unsupported(_)), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("\"blk.0.attn_output.bias\"") && e.contains("llama model"),
            "{e}"
        );
        // The file's own config refuses it first, saying why.
        let e = ModelConfig::from_gguf(&f).unwrap_err().to_string();
        assert!(e.contains("attention output bias"), "{e}");
    }
}
