//! The batched forward step: the new tokens of many sequences (prefill chunks and decode tokens
//! alike) go through every layer together; each layer writes its new K/V by slot mapping and reads
//! history through the block tables; only the rows that need logits reach the output head.

use npu_backend::legacy::{AttnGeometry, Backend, KvSpec, StepMeta};
use npu_gguf::GgufFile;

use super::weights::{Proj, Weights};
use super::{ModelConfig, ModelError};

/// Capacities fixed when the model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// Most new tokens in one step.
    pub max_tokens: usize,
    /// Most sequences that want logits in one step.
    pub max_logit_rows: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

struct Buffers<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    qkv: B::Buf,
    attn: B::Buf,
    tmp: B::Buf,
    gate_up: B::Buf,
    h: B::Buf,
    lx: B::Buf,
    lxn: B::Buf,
    logits: B::Buf,
}

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub opts: ModelOptions,
    weights: Weights<B>,
    backend: B,
    bufs: Buffers<B>,
    geometry: AttnGeometry,
}

impl<B: Backend> Model<B> {
    pub fn load(f: &GgufFile, mut backend: B, opts: ModelOptions) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_gguf(f)?;
        if opts.max_tokens == 0
            || opts.max_logit_rows == 0
            || opts.num_blocks == 0
            || opts.block_size == 0
        {
            return Err(ModelError::BadStep(format!(
                "model options must be non-zero: {opts:?}"
            )));
        }
        let weights = Weights::load(f, &cfg, &mut backend)?;
        backend.init_kv(KvSpec {
            n_layers: cfg.n_layers,
            num_blocks: opts.num_blocks,
            block_size: opts.block_size,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
        })?;
        let t = opts.max_tokens;
        let l = opts.max_logit_rows;
        let h = cfg.hidden;
        let bufs = Buffers {
            x: backend.alloc(t * h)?,
            xn: backend.alloc(t * h)?,
            qkv: backend.alloc(t * cfg.qkv_width())?,
            attn: backend.alloc(t * cfg.attn_width())?,
            tmp: backend.alloc(t * h)?,
            gate_up: backend.alloc(t * 2 * cfg.ff)?,
            h: backend.alloc(t * cfg.ff)?,
            lx: backend.alloc(l * h)?,
            lxn: backend.alloc(l * h)?,
            logits: backend.alloc(l * cfg.vocab)?,
        };
        let geometry = AttnGeometry {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            rope: cfg.rope,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        Ok(Self {
            cfg,
            opts,
            weights,
            backend,
            bufs,
            geometry,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// True when some weights were re-quantized on load.
    pub fn lossy_weights(&self) -> bool {
        self.weights.lossy
    }

    /// Runs one step. `logits` receives `meta.logit_rows.len()` rows of `vocab` values.
    pub fn forward(&mut self, meta: &StepMeta, logits: &mut Vec<f32>) -> Result<(), ModelError> {
        self.check(meta)?;
        let b = &mut self.backend;
        let w = &self.weights;
        let bufs = &mut self.bufs;
        let cfg = &self.cfg;
        let g = &self.geometry;
        let t = meta.tokens.len();
        let h = cfg.hidden;
        let qkv_w = cfg.qkv_width();
        b.begin_step(meta)?;
        b.embed(&w.embed, &mut bufs.x)?;
        for (li, layer) in w.layers.iter().enumerate() {
            b.rms_norm(&bufs.x, &layer.attn_norm, h, cfg.rms_eps, t, &mut bufs.xn)?;
            project(b, &bufs.xn, t, &layer.qkv, &mut bufs.qkv, qkv_w)?;
            if let Some(bias) = &layer.qkv_bias {
                b.add_bias(&mut bufs.qkv, bias, t, 0, qkv_w)?;
            }
            b.rope(&mut bufs.qkv, qkv_w, g)?;
            b.kv_write(&bufs.qkv, qkv_w, g, li)?;
            b.attention(&bufs.qkv, qkv_w, g, li, &mut bufs.attn)?;
            b.matmul(&bufs.attn, t, &layer.wo, &mut bufs.tmp, 0, h)?;
            b.add_assign(&mut bufs.x, &bufs.tmp, t * h)?;
            b.rms_norm(&bufs.x, &layer.ffn_norm, h, cfg.rms_eps, t, &mut bufs.xn)?;
            project(
                b,
                &bufs.xn,
                t,
                &layer.gate_up,
                &mut bufs.gate_up,
                2 * cfg.ff,
            )?;
            b.swiglu(&bufs.gate_up, cfg.ff, t, &mut bufs.h)?;
            b.matmul(&bufs.h, t, &layer.down, &mut bufs.tmp, 0, h)?;
            b.add_assign(&mut bufs.x, &bufs.tmp, t * h)?;
        }
        let n = meta.logit_rows.len();
        logits.resize(n * cfg.vocab, 0.0);
        if n == 0 {
            return Ok(());
        }
        b.gather_logit_rows(&bufs.x, h, &mut bufs.lx)?;
        b.rms_norm(&bufs.lx, &w.out_norm, h, cfg.rms_eps, n, &mut bufs.lxn)?;
        b.matmul(&bufs.lxn, n, &w.head, &mut bufs.logits, 0, cfg.vocab)?;
        b.download(&bufs.logits, &mut logits[..n * cfg.vocab])?;
        Ok(())
    }

    /// Checks a step against the capacities (the backend checks slots and blocks).
    fn check(&self, m: &StepMeta) -> Result<(), ModelError> {
        let t = m.tokens.len();
        let bad = |s: String| Err(ModelError::BadStep(s));
        if t == 0 {
            return bad("a step needs at least one token".into());
        }
        if t > self.opts.max_tokens {
            return bad(format!(
                "{t} tokens exceed the step capacity {}",
                self.opts.max_tokens
            ));
        }
        if m.positions.len() != t || m.slot_mapping.len() != t {
            return bad("positions and slot mapping must have one entry per token".into());
        }
        if m.logit_rows.len() > self.opts.max_logit_rows {
            return bad(format!(
                "{} logit rows exceed the capacity {}",
                m.logit_rows.len(),
                self.opts.max_logit_rows
            ));
        }
        if m.logit_rows.iter().any(|&r| r as usize >= t) {
            return bad("a logit row is beyond the step's tokens".into());
        }
        if m.block_tables.len() != m.seqs.len() * m.max_blocks {
            return bad("block tables must hold max_blocks entries per sequence".into());
        }
        let mut next_row = 0u32;
        for (i, s) in m.seqs.iter().enumerate() {
            if s.q_row != next_row || s.n_q == 0 {
                return bad(format!(
                    "sequence {i}: rows must be consecutive and non-empty"
                ));
            }
            next_row += s.n_q;
            let end = s.start_pos as usize + s.n_q as usize;
            if end.div_ceil(self.opts.block_size) > m.max_blocks {
                return bad(format!(
                    "sequence {i}: {end} positions need more than its {} blocks",
                    m.max_blocks
                ));
            }
            for j in 0..s.n_q as usize {
                let row = s.q_row as usize + j;
                let pos = s.start_pos as usize + j;
                if m.positions[row] as usize != pos {
                    return bad(format!(
                        "sequence {i}: token {j} has position {} not {pos}",
                        m.positions[row]
                    ));
                }
                let block = m.block_tables[i * m.max_blocks + pos / self.opts.block_size] as usize;
                let want = block * self.opts.block_size + pos % self.opts.block_size;
                if m.slot_mapping[row] as usize != want {
                    return bad(format!(
                        "sequence {i}: token {j} maps to slot {} but its block table gives {want}",
                        m.slot_mapping[row]
                    ));
                }
            }
        }
        if next_row as usize != t {
            return bad("sequences do not cover the step's tokens".into());
        }
        Ok(())
    }
}

/// Runs a (possibly split) projection into consecutive columns of `out` (rows `ld` apart).
fn project<B: Backend>(
    b: &mut B,
    x: &B::Buf,
    rows: usize,
    p: &Proj<B::Matrix>,
    out: &mut B::Buf,
    ld: usize,
) -> Result<(), ModelError> {
    match p {
        Proj::Fused(m) => b.matmul(x, rows, m, out, 0, ld)?,
        Proj::Split(parts) => {
            for (m, col) in parts {
                b.matmul(x, rows, m, out, *col, ld)?;
            }
        }
    }
    Ok(())
}
