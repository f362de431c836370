//! A Llama step driven through the device seam (`npu_backend::Backend`), op by op as the agent's
//! model runs it: weights from the GGUF file as it stores them (Q/K/V and gate/up fused where the
//! backend can), embedding, per layer RMS norm, QKV projection, RoPE, KV write, paged attention,
//! output projection and residual, RMS norm, gate/up, SwiGLU, down projection and residual; then
//! the logit rows, final norm and head. Used by the tests to run the real model on the Ascend
//! backend over the emulation.

#![allow(dead_code)]

use npu_backend::*;
use npu_gguf::hparams::ModelConfig;
use npu_gguf::GgufFile;

pub enum Proj<M> {
    Fused(M),
    /// (matrix, first output column).
    Split(Vec<(M, usize)>),
}

pub struct Layer<B: Backend> {
    attn_norm: B::Buffer,
    qkv: Proj<B::Matrix>,
    wo: B::Matrix,
    ffn_norm: B::Buffer,
    gate_up: Proj<B::Matrix>,
    down: B::Matrix,
}

struct Bufs<B: Backend> {
    x: B::Buffer,
    xn: B::Buffer,
    qkv: B::Buffer,
    attn: B::Buffer,
    tmp: B::Buffer,
    gate_up: B::Buffer,
    h: B::Buffer,
    lx: B::Buffer,
    lxn: B::Buffer,
    logits: B::Buffer,
    ids: B::Buffer,
}

pub struct Llama<B: Backend> {
    pub cfg: ModelConfig,
    pub b: B,
    embed: B::Embedding,
    layers: Vec<Layer<B>>,
    out_norm: B::Buffer,
    head: B::Matrix,
    bufs: Bufs<B>,
    pub g: AttnGeometry,
    pub block_size: usize,
}

fn ht<'a>(f: &'a GgufFile, name: &str) -> HostTensor<'a> {
    let (info, data) = f.tensor(name).unwrap();
    HostTensor {
        ty: info.ty,
        data,
        rows: info.n_rows(),
        cols: info.row_len(),
    }
}

fn matrix<B: Backend>(b: &mut B, parts: &[HostTensor<'_>]) -> Proj<B::Matrix> {
    if let Some(m) = b.load_matrix(parts).unwrap() {
        return Proj::Fused(m);
    }
    let mut col = 0;
    Proj::Split(
        parts
            .iter()
            .map(|p| {
                let m = b.load_matrix(std::slice::from_ref(p)).unwrap().unwrap();
                col += p.rows;
                (m, col - p.rows)
            })
            .collect(),
    )
}

fn project<B: Backend>(
    b: &mut B,
    x: &B::Buffer,
    t: usize,
    k: usize,
    p: &Proj<B::Matrix>,
    out: &mut B::Buffer,
    width: usize,
) {
    match p {
        Proj::Fused(m) => b
            .matmul(
                View::rows(x, t, k).unwrap(),
                m,
                ViewMut::rows(out, t, width).unwrap(),
            )
            .unwrap(),
        Proj::Split(parts) => {
            for (m, col) in parts {
                let n = parts
                    .iter()
                    .map(|(_, c)| *c)
                    .filter(|c| c > col)
                    .min()
                    .unwrap_or(width)
                    - col;
                b.matmul(
                    View::rows(x, t, k).unwrap(),
                    m,
                    ViewMut::new(out, Layout::new(*col, t, n, width).unwrap()).unwrap(),
                )
                .unwrap();
            }
        }
    }
}

impl<B: Backend> Llama<B> {
    pub fn load(
        f: &GgufFile,
        mut b: B,
        num_blocks: usize,
        block_size: usize,
        max_tokens: usize,
    ) -> Self {
        let cfg = ModelConfig::from_gguf(f).unwrap();
        let embed = b.load_embedding(ht(f, "token_embd.weight")).unwrap();
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}");
                Layer {
                    attn_norm: b.load_vector(ht(f, &n("attn_norm.weight"))).unwrap(),
                    qkv: matrix(
                        &mut b,
                        &[
                            ht(f, &n("attn_q.weight")),
                            ht(f, &n("attn_k.weight")),
                            ht(f, &n("attn_v.weight")),
                        ],
                    ),
                    wo: b
                        .load_matrix(&[ht(f, &n("attn_output.weight"))])
                        .unwrap()
                        .unwrap(),
                    ffn_norm: b.load_vector(ht(f, &n("ffn_norm.weight"))).unwrap(),
                    gate_up: matrix(
                        &mut b,
                        &[ht(f, &n("ffn_gate.weight")), ht(f, &n("ffn_up.weight"))],
                    ),
                    down: b
                        .load_matrix(&[ht(f, &n("ffn_down.weight"))])
                        .unwrap()
                        .unwrap(),
                }
            })
            .collect();
        let out_norm = b.load_vector(ht(f, "output_norm.weight")).unwrap();
        let head_name = if f.tensor_info("output.weight").is_some() {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let head = b.load_matrix(&[ht(f, head_name)]).unwrap().unwrap();
        b.init_kv(KvSpec {
            n_layers: cfg.n_layers,
            num_blocks,
            block_size,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
        })
        .unwrap();
        let dt = b.act_dtype();
        let t = max_tokens;
        let h = cfg.hidden;
        let mut a = |n: usize| b.alloc(dt, n).unwrap();
        let bufs = Bufs {
            x: a(t * h),
            xn: a(t * h),
            qkv: a(t * cfg.qkv_width()),
            attn: a(t * cfg.n_heads * cfg.head_dim),
            tmp: a(t * h),
            gate_up: a(t * 2 * cfg.ff),
            h: a(t * cfg.ff),
            lx: a(t * h),
            lxn: a(t * h),
            logits: a(t * cfg.vocab),
            ids: b.alloc(DType::I32, t).unwrap(),
        };
        let g = AttnGeometry {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            rope: cfg.rope,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        Self {
            cfg,
            b,
            embed,
            layers,
            out_norm,
            head,
            bufs,
            g,
            block_size,
        }
    }

    /// Runs the step's layers and leaves the logit rows' logits in `bufs.logits`.
    fn forward(&mut self, s: &StepInputs) {
        let b = &mut self.b;
        let (cfg, g, w) = (&self.cfg, &self.g, &mut self.bufs);
        let t = s.tokens.len();
        let h = cfg.hidden;
        let (qd, kvd) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        let qkv_w = qd + 2 * kvd;
        let ff = cfg.ff;
        b.begin_step(s).unwrap();
        b.embed(&self.embed, ViewMut::rows(&mut w.x, t, h).unwrap())
            .unwrap();
        for (li, l) in self.layers.iter().enumerate() {
            b.rms_norm(
                View::rows(&w.x, t, h).unwrap(),
                &l.attn_norm,
                cfg.rms_eps,
                ViewMut::rows(&mut w.xn, t, h).unwrap(),
            )
            .unwrap();
            project(b, &w.xn, t, h, &l.qkv, &mut w.qkv, qkv_w);
            b.rope(
                ViewMut::new(&mut w.qkv, Layout::new(0, t, qd + kvd, qkv_w).unwrap()).unwrap(),
                g,
            )
            .unwrap();
            b.kv_write(
                View::new(&w.qkv, Layout::new(qd, t, kvd, qkv_w).unwrap()).unwrap(),
                View::new(&w.qkv, Layout::new(qd + kvd, t, kvd, qkv_w).unwrap()).unwrap(),
                g,
                li,
            )
            .unwrap();
            b.attention(
                View::new(&w.qkv, Layout::new(0, t, qd, qkv_w).unwrap()).unwrap(),
                g,
                li,
                ViewMut::rows(&mut w.attn, t, qd).unwrap(),
            )
            .unwrap();
            b.matmul(
                View::rows(&w.attn, t, qd).unwrap(),
                &l.wo,
                ViewMut::rows(&mut w.tmp, t, h).unwrap(),
            )
            .unwrap();
            b.add(
                ViewMut::rows(&mut w.x, t, h).unwrap(),
                View::rows(&w.tmp, t, h).unwrap(),
            )
            .unwrap();
            b.rms_norm(
                View::rows(&w.x, t, h).unwrap(),
                &l.ffn_norm,
                cfg.rms_eps,
                ViewMut::rows(&mut w.xn, t, h).unwrap(),
            )
            .unwrap();
            project(b, &w.xn, t, h, &l.gate_up, &mut w.gate_up, 2 * ff);
            b.swiglu(
                View::new(&w.gate_up, Layout::new(0, t, ff, 2 * ff).unwrap()).unwrap(),
                View::new(&w.gate_up, Layout::new(ff, t, ff, 2 * ff).unwrap()).unwrap(),
                ViewMut::rows(&mut w.h, t, ff).unwrap(),
            )
            .unwrap();
            b.matmul(
                View::rows(&w.h, t, ff).unwrap(),
                &l.down,
                ViewMut::rows(&mut w.tmp, t, h).unwrap(),
            )
            .unwrap();
            b.add(
                ViewMut::rows(&mut w.x, t, h).unwrap(),
                View::rows(&w.tmp, t, h).unwrap(),
            )
            .unwrap();
        }
        let n = s.logit_rows.len();
        b.gather_logit_rows(
            View::rows(&w.x, t, h).unwrap(),
            ViewMut::rows(&mut w.lx, n, h).unwrap(),
        )
        .unwrap();
        b.rms_norm(
            View::rows(&w.lx, n, h).unwrap(),
            &self.out_norm,
            cfg.rms_eps,
            ViewMut::rows(&mut w.lxn, n, h).unwrap(),
        )
        .unwrap();
        b.matmul(
            View::rows(&w.lxn, n, h).unwrap(),
            &self.head,
            ViewMut::rows(&mut w.logits, n, cfg.vocab).unwrap(),
        )
        .unwrap();
    }

    /// One step; the logits of its logit rows (row-major, `vocab` each).
    pub fn logits(&mut self, s: &StepInputs) -> Vec<f32> {
        self.forward(s);
        let n = s.logit_rows.len();
        let mut out = vec![0f32; n * self.cfg.vocab];
        self.b
            .read_back(&mut [Readback {
                src: View::rows(&self.bufs.logits, n, self.cfg.vocab).unwrap(),
                dst: HostSliceMut::F32(&mut out),
            }])
            .unwrap();
        out
    }

    /// One step; the greedy token of each logit row, picked on the device (only the ids are
    /// read back).
    pub fn greedy(&mut self, s: &StepInputs) -> Vec<i32> {
        self.forward(s);
        let n = s.logit_rows.len();
        let v = self.cfg.vocab;
        assert!(self
            .b
            .argmax_rows(
                View::rows(&self.bufs.logits, n, v).unwrap(),
                ViewMut::rows(&mut self.bufs.ids, n, 1).unwrap(),
            )
            .unwrap());
        let mut ids = vec![0i32; n];
        self.b
            .read_back(&mut [Readback {
                src: View::rows(&self.bufs.ids, n, 1).unwrap(),
                dst: HostSliceMut::I32(&mut ids),
            }])
            .unwrap();
        ids
    }
}

/// The step that feeds `new` tokens of one sequence after `start` cached ones, its blocks
/// `0, 1, 2, …` of the pool (so each token's slot is its position).
pub fn seq_step(new: &[u32], start: usize, max_blocks: usize) -> StepInputs {
    let n = new.len();
    StepInputs {
        tokens: new.to_vec(),
        positions: (start..start + n).map(|p| p as u32).collect(),
        slot_mapping: (start..start + n).map(|p| p as u32).collect(),
        seqs: vec![SeqSpan {
            q_row: 0,
            n_q: n as u32,
            start_pos: start as u32,
        }],
        block_tables: (0..max_blocks as u32).collect(),
        max_blocks,
        logit_rows: vec![n as u32 - 1],
    }
}
