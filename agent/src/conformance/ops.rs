//! Every op of the `Backend` trait on small, awkward cases: strided windows that start inside
//! wider buffers, the model file's own tensors (Q8_0 embedding and output head, Q4_1 projections,
//! f32 norms) as the file stores them, row counts on both sides of the kernels' tile sizes,
//! sequences with history, chunks and decode tokens in one step, KV blocks moved by id, and
//! logits with ties and non-finite values for the device greedy pick. Each case runs on the
//! reference and on the backend under test; its outputs are read back and compared.

use npu_backend::{
    AttnGeometry, Backend, BackendError, DType, HostSlice, HostSliceMut, HostTensor, KvSpec,
    Layout, Readback, SeqSpan, StepInputs, View, ViewMut,
};
use npu_backend_cpu::kernels::scan;
use npu_gguf::{GgmlType, GgufFile};
use npu_model::ModelConfig;

use super::{Class, Report, Tolerance};

mod deepseek;
mod family;
mod lora;

/// What an output is checked against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expect {
    /// The reference's output, within the tolerance of this class.
    Like(Class),
    /// Nothing: the values are the backend's own error measure (of its answers against each
    /// other), and each must be at most this.
    AtMost(f32),
}

/// One output of a case: a name, how it is checked, and its values (read back as f32).
pub struct Output {
    pub name: String,
    pub expect: Expect,
    pub values: Vec<f32>,
}

/// What the cases read from the model file.
struct Ctx<'f> {
    cfg: ModelConfig,
    file: &'f GgufFile,
}

impl<'f> Ctx<'f> {
    /// A tensor of the file as a `HostTensor` (`rows` outputs of `cols` inputs).
    fn tensor(&self, name: &str) -> Result<HostTensor<'f>, BackendError> {
        let (info, data) = self
            .file
            .tensor(name)
            .map_err(|e| BackendError::BadArgument {
                op: "conformance",
                message: e.to_string(),
            })?;
        let cols = info.dims.first().copied().unwrap_or(1) as usize;
        let rows = info.dims.iter().skip(1).product::<u64>() as usize;
        Ok(HostTensor {
            ty: info.ty,
            data,
            rows,
            cols,
        })
    }

    fn geometry(&self) -> AttnGeometry {
        AttnGeometry {
            n_heads: self.cfg.n_heads,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            rope: self.cfg.rope,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
            window: None,
        }
    }
}

/// Reproducible values in [-scale, scale).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }
}

fn out(name: impl Into<String>, class: Class, values: Vec<f32>) -> Output {
    Output {
        name: name.into(),
        expect: Expect::Like(class),
        values,
    }
}

fn own(name: impl Into<String>, limit: f32, values: Vec<f32>) -> Output {
    Output {
        name: name.into(),
        expect: Expect::AtMost(limit),
        values,
    }
}

/// A buffer of `len` elements holding `data` in the window `win` (zeros elsewhere).
fn filled<B: Backend>(
    b: &mut B,
    dtype: DType,
    len: usize,
    win: Layout,
    data: &[f32],
) -> Result<B::Buffer, BackendError> {
    let mut buf = b.alloc(dtype, len)?;
    b.upload(HostSlice::F32(data), ViewMut::new(&mut buf, win)?)?;
    Ok(buf)
}

/// The window `win` of `buf`, read back.
fn read<B: Backend>(b: &mut B, buf: &B::Buffer, win: Layout) -> Result<Vec<f32>, BackendError> {
    let mut host = vec![0f32; win.elements()];
    b.read_back(&mut [Readback {
        src: View::new(buf, win)?,
        dst: HostSliceMut::F32(&mut host),
    }])?;
    Ok(host)
}

/// A window of `rows` x `cols` starting at column `col0` of rows `stride` apart.
fn window(rows: usize, cols: usize, col0: usize, stride: usize) -> Layout {
    Layout::new(col0, rows, cols, stride).expect("a valid test window")
}

fn f32_tensor(data: &[f32], rows: usize, cols: usize) -> HostTensor<'_> {
    HostTensor {
        ty: GgmlType::F32,
        data: bytemuck::cast_slice(data),
        rows,
        cols,
    }
}

/// A step of sequences `(start_pos, n_new, block table)`, slots mapped through the tables.
fn step_of(seqs: &[(u32, u32, Vec<u32>)], block_size: u32, tokens: &[u32]) -> StepInputs {
    let max_blocks = seqs.iter().map(|s| s.2.len()).max().unwrap_or(0);
    let mut m = StepInputs {
        max_blocks,
        ..Default::default()
    };
    for (start, n, table) in seqs {
        let q_row = m.positions.len() as u32;
        for p in *start..start + n {
            m.positions.push(p);
            m.slot_mapping
                .push(table[(p / block_size) as usize] * block_size + p % block_size);
        }
        m.seqs.push(SeqSpan {
            q_row,
            n_q: *n,
            start_pos: *start,
        });
        m.block_tables.extend(table);
        m.block_tables
            .extend(std::iter::repeat_n(0, max_blocks - table.len()));
    }
    m.tokens = tokens
        .iter()
        .copied()
        .cycle()
        .take(m.positions.len())
        .collect();
    m
}

/// Runs every case on `b`; the outputs in a fixed order.
pub fn run_cases<B: Backend>(b: &mut B, file: &GgufFile) -> Vec<Result<Vec<Output>, BackendError>> {
    let ctx = match ModelConfig::from_gguf(file) {
        Ok(cfg) => Ctx { cfg, file },
        Err(e) => {
            return vec![Err(BackendError::BadArgument {
                op: "conformance",
                message: e.to_string(),
            })]
        }
    };
    vec![
        memory(b),
        embed_and_gather(b, &ctx),
        rms_norm(b, &ctx),
        matmuls(b, &ctx),
        elementwise(b, &ctx),
        rope(b, &ctx),
        attention(b, &ctx),
        greedy_pick(b),
        family::head_norm(b),
        family::gelu_gate_and_scale(b),
        family::window_attention(b, &ctx),
        family::ropes(b, &ctx),
        family::moe(b),
        deepseek::scored_routing(b),
        deepseek::latent_attention(b),
        lora::lora(b),
    ]
}

/// The reference's outputs of every case.
pub fn reference_outputs(file: &GgufFile) -> Vec<Result<Vec<Output>, BackendError>> {
    run_cases(&mut super::reference(), file)
}

/// Runs the cases on `dev` and compares them with `expected` (the reference's).
pub fn check_ops_against<B: Backend>(
    dev: &mut B,
    expected: &[Result<Vec<Output>, BackendError>],
    file: &GgufFile,
    report: &mut Report,
) {
    let tol = Tolerance::for_dtype(dev.act_dtype());
    let got = run_cases(dev, file);
    for (i, (g, want)) in got.iter().zip(expected).enumerate() {
        match (g, want) {
            (_, Err(e)) => report.error(format!("case {i} on the reference"), e),
            (Err(e), Ok(w)) => {
                let names: Vec<&str> = w.iter().map(|o| o.name.as_str()).collect();
                report.error(names.join(", "), e)
            }
            (Ok(g), Ok(w)) => {
                for wo in w {
                    if let Some(c) = family::capability_of(&wo.name).filter(|&c| !dev.supports(c)) {
                        report.verdict(
                            &wo.name,
                            true,
                            format!(
                                "not built on {}: families needing {} are refused at load",
                                dev.kind().name(),
                                c.name()
                            ),
                        );
                        continue;
                    }
                    let Some(go) = g.iter().find(|o| o.name == wo.name) else {
                        report.verdict(&wo.name, false, "no such output");
                        continue;
                    };
                    match wo.expect {
                        Expect::Like(class) => report.compare_within(
                            &wo.name,
                            &go.values,
                            &wo.values,
                            tol.bound(class),
                        ),
                        Expect::AtMost(limit) => own_verdict(report, go, limit),
                    }
                }
                // Outputs only the backend under test has (what it does not provide).
                for go in g.iter().filter(|o| w.iter().all(|wo| wo.name != o.name)) {
                    if let Expect::AtMost(limit) = go.expect {
                        own_verdict(report, go, limit);
                    }
                }
            }
        }
    }
}

fn own_verdict(report: &mut Report, o: &Output, limit: f32) {
    let worst = o
        .values
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.is_nan() || v > m { v } else { m });
    let passed = !worst.is_nan() && worst <= limit;
    report.verdict(
        &o.name,
        passed,
        if passed {
            String::new()
        } else {
            format!("{worst} (at most {limit})")
        },
    );
}

/// Every op against the reference.
pub fn check_ops<B: Backend>(
    dev: &mut B,
    reference: &mut impl Backend,
    file: &GgufFile,
    report: &mut Report,
) {
    let expected = run_cases(reference, file);
    check_ops_against(dev, &expected, file, report);
}

/// Upload and read back through windows, in the activation dtype and i32; memory info.
fn memory<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let act = b.act_dtype();
    let mut rng = Rng(11);
    let data = rng.values(40, 3.0);
    let win = window(4, 10, 3, 16);
    let buf = filled(b, act, 80, win, &data)?;
    let all = read(b, &buf, Layout::contiguous(5, 16))?;
    let part = read(b, &buf, win.row_range(1, 2)?.col_range(2, 5)?)?;
    let mut ids = b.alloc(DType::I32, 12)?;
    let want: Vec<i32> = vec![3, -7, 0, i32::MAX, 49151, 12];
    b.upload(
        HostSlice::I32(&want),
        ViewMut::new(&mut ids, window(2, 3, 1, 6))?,
    )?;
    let mut back = vec![0i32; 12];
    b.read_back(&mut [Readback {
        src: View::rows(&ids, 2, 6)?,
        dst: HostSliceMut::I32(&mut back),
    }])?;
    let mem = b.mem_info()?;
    let mem_ok = mem.total > 0 && mem.free <= mem.total;
    Ok(vec![
        out("upload/read_back whole buffer", Class::Exact, all),
        out("upload/read_back window", Class::Exact, part),
        out(
            "upload/read_back i32 window",
            Class::Exact,
            back.iter().map(|&v| v as f32).collect(),
        ),
        own(
            "mem_info: free at most total",
            0.0,
            vec![f32::from(u8::from(!mem_ok))],
        ),
    ])
}

/// Embedding lookup (Q8_0 table) into a window, then a gather of logit rows.
fn embed_and_gather<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let h = ctx.cfg.hidden;
    let vocab = ctx.cfg.vocab as u32;
    let table = b.load_embedding(ctx.tensor("token_embd.weight")?)?;
    let tokens = [0, 5, vocab - 1, 17, 3, 3, 1000];
    let mut step = step_of(&[(0, 7, vec![0])], 16, &tokens);
    step.logit_rows = vec![4, 0, 6, 4];
    b.begin_step(&step)?;
    let win = window(7, h, 16, h + 32);
    let mut x = b.alloc(b.act_dtype(), 7 * (h + 32))?;
    b.embed(&table, ViewMut::new(&mut x, win)?)?;
    let embedded = read(b, &x, win)?;
    let mut g = b.alloc(b.act_dtype(), 4 * h)?;
    b.gather_logit_rows(View::new(&x, win)?, ViewMut::rows(&mut g, 4, h)?)?;
    let gathered = read(b, &g, Layout::contiguous(4, h))?;
    Ok(vec![
        out("embed q8_0 into a window", Class::Exact, embedded),
        out("gather_logit_rows", Class::Exact, gathered),
    ])
}

fn rms_norm<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let h = ctx.cfg.hidden;
    let act = b.act_dtype();
    let w = b.load_vector(ctx.tensor("blk.0.attn_norm.weight")?)?;
    let mut outputs = Vec::new();
    for rows in [1usize, 9] {
        let data = Rng(rows as u64 + 3).values(rows * h, 4.0);
        let xw = window(rows, h, 8, h + 8);
        let x = filled(b, act, rows * (h + 8), xw, &data)?;
        let ow = window(rows, h, 5, h + 16);
        let mut o = b.alloc(act, rows * (h + 16))?;
        b.rms_norm(
            View::new(&x, xw)?,
            &w,
            ctx.cfg.rms_eps,
            ViewMut::new(&mut o, ow)?,
        )?;
        outputs.push(out(
            format!("rms_norm {rows} rows"),
            Class::Elementwise,
            read(b, &o, ow)?,
        ));
        // The residual add and the next norm (`add_rms_norm`: one pass where a backend folds
        // them), straight into a quantized product (where a backend's norm kernel may write the
        // product's 8-bit activations itself).
        let y = filled(
            b,
            act,
            rows * h,
            Layout::contiguous(rows, h),
            &Rng(rows as u64 + 30).values(rows * h, 4.0),
        )?;
        let mut x = x;
        b.add_rms_norm(
            ViewMut::new(&mut x, xw)?,
            View::rows(&y, rows, h)?,
            &w,
            ctx.cfg.rms_eps,
            ViewMut::new(&mut o, ow)?,
        )?;
        let q = ctx.tensor("blk.0.attn_q.weight")?;
        let m = b
            .load_matrix(&[q])?
            .ok_or_else(|| BackendError::Unsupported {
                backend: "conformance",
                what: format!("a {} matrix", q.ty.name()),
            })?;
        let mut p = b.alloc(act, rows * q.rows)?;
        b.matmul(View::new(&o, ow)?, &m, ViewMut::rows(&mut p, rows, q.rows)?)?;
        let name = format!("add_rms_norm {rows} rows");
        outputs.push(out(
            format!("{name}: the sum"),
            Class::Elementwise,
            read(b, &x, xw)?,
        ));
        outputs.push(out(
            format!("{name}: the norm"),
            Class::Elementwise,
            read(b, &o, ow)?,
        ));
        outputs.push(out(
            format!("{name} into a {} matmul", q.ty.name()),
            Class::Reduction,
            read(b, &p, Layout::contiguous(rows, q.rows))?,
        ));
    }
    Ok(outputs)
}

/// Runs `x` (rows of `k`) through the matrix built from `parts` into a window of a wider output
/// (each part on its own when the backend cannot fuse them).
fn matmul_case<B: Backend>(
    b: &mut B,
    parts: &[HostTensor],
    rows: usize,
    x_stride: usize,
    seed: u64,
) -> Result<Vec<f32>, BackendError> {
    let act = b.act_dtype();
    let k = parts[0].cols;
    let n: usize = parts.iter().map(|p| p.rows).sum();
    let data = Rng(seed).values(rows * k, 2.0);
    let xw = window(rows, k, x_stride - k, x_stride);
    let x = filled(b, act, rows * x_stride, xw, &data)?;
    let ow = window(rows, n, 7, n + 7);
    let mut o = b.alloc(act, rows * (n + 7))?;
    match b.load_matrix(parts)? {
        Some(m) => b.matmul(View::new(&x, xw)?, &m, ViewMut::new(&mut o, ow)?)?,
        None => {
            let mut col = 0;
            for p in parts {
                let m = b.load_matrix(std::slice::from_ref(p))?.ok_or_else(|| {
                    BackendError::Unsupported {
                        backend: "conformance",
                        what: format!("a {} matrix", p.ty.name()),
                    }
                })?;
                let mut view = ViewMut::new(&mut o, ow)?;
                b.matmul(View::new(&x, xw)?, &m, view.col_range(col, p.rows)?)?;
                col += p.rows;
            }
        }
    }
    read(b, &o, ow)
}

fn matmuls<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let h = ctx.cfg.hidden;
    let qkv = [
        ctx.tensor("blk.0.attn_q.weight")?,
        ctx.tensor("blk.0.attn_k.weight")?,
        ctx.tensor("blk.0.attn_v.weight")?,
    ];
    let down = ctx.tensor("blk.0.ffn_down.weight")?;
    let head = match ctx.tensor("output.weight") {
        Ok(t) => t,
        Err(_) => ctx.tensor("token_embd.weight")?,
    };
    let f32_w = Rng(99).values(40 * 64, 0.5);
    let f32_m = f32_tensor(&f32_w, 40, 64);
    let mut outputs = Vec::new();
    for rows in [1usize, 5, 33] {
        outputs.push(out(
            format!("matmul {} q/k/v {rows} rows", qkv[0].ty.name()),
            Class::Reduction,
            matmul_case(b, &qkv, rows, h, rows as u64)?,
        ));
    }
    outputs.push(out(
        format!("matmul {} strided input 3 rows", down.ty.name()),
        Class::Reduction,
        matmul_case(b, &[down], 3, down.cols + 32, 7)?,
    ));
    outputs.push(out(
        format!("matmul {} output head 2 rows", head.ty.name()),
        Class::Reduction,
        matmul_case(b, &[head], 2, h, 8)?,
    ));
    outputs.push(out(
        "matmul f32 weights 7 rows",
        Class::Reduction,
        matmul_case(b, &[f32_m], 7, 64, 9)?,
    ));
    Ok(outputs)
}

/// add_bias, swiglu and add on windows.
fn elementwise<B: Backend>(b: &mut B, _ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let act = b.act_dtype();
    let (rows, ff) = (9usize, 96usize);
    let mut rng = Rng(21);
    // add_bias over a window.
    let bias_v = rng.values(ff, 1.0);
    let bias = b.load_vector(f32_tensor(&bias_v, 1, ff))?;
    let xw = window(rows, ff, 4, ff + 4);
    let mut x = filled(b, act, rows * (ff + 4), xw, &rng.values(rows * ff, 2.0))?;
    b.add_bias(ViewMut::new(&mut x, xw)?, &bias)?;
    let biased = read(b, &x, xw)?;
    // swiglu of the two halves of one buffer, into a window.
    let gu = filled(
        b,
        act,
        rows * 2 * ff,
        Layout::contiguous(rows, 2 * ff),
        &rng.values(rows * 2 * ff, 4.0),
    )?;
    let gu_view = View::rows(&gu, rows, 2 * ff)?;
    let ow = window(rows, ff, 3, ff + 3);
    let mut o = b.alloc(act, rows * (ff + 3))?;
    b.swiglu(
        gu_view.col_range(0, ff)?,
        gu_view.col_range(ff, ff)?,
        ViewMut::new(&mut o, ow)?,
    )?;
    let swiglu = read(b, &o, ow)?;
    // add: the swiglu window += the first half of gate/up.
    b.add(ViewMut::new(&mut o, ow)?, gu_view.col_range(0, ff)?)?;
    let added = read(b, &o, ow)?;
    Ok(vec![
        out("add_bias on a window", Class::Elementwise, biased),
        out("swiglu of two column ranges", Class::Elementwise, swiglu),
        out("add on a window", Class::Elementwise, added),
    ])
}

fn rope<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let g = ctx.geometry();
    let (qw, kvw) = (g.q_width(), g.kv_width());
    let width = qw + 2 * kvw;
    let positions = [0u32, 1, 2, 7, 100, 4000];
    let mut step = StepInputs {
        tokens: vec![1; positions.len()],
        positions: positions.to_vec(),
        ..Default::default()
    };
    step.slot_mapping = vec![0; positions.len()];
    b.begin_step(&step)?;
    let n = positions.len();
    let data = Rng(31).values(n * width, 2.0);
    let mut qkv = filled(
        b,
        b.act_dtype(),
        n * width,
        Layout::contiguous(n, width),
        &data,
    )?;
    {
        let mut all = ViewMut::rows(&mut qkv, n, width)?;
        b.rope(all.col_range(0, qw + kvw)?, &g)?;
    }
    Ok(vec![out(
        "rope on q and k heads (v untouched)",
        Class::Elementwise,
        read(b, &qkv, Layout::contiguous(n, width))?,
    )])
}

/// KV writes and paged attention over two steps (prefill, then history with a chunk and decode
/// tokens), on the second layer of a two-layer pool; then the same read through blocks moved
/// by id on the device and through the host.
fn attention<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let g = ctx.geometry();
    let (qw, kvw) = (g.q_width(), g.kv_width());
    let width = qw + 2 * kvw;
    let bs = 16u32;
    b.init_kv(KvSpec {
        n_layers: 2,
        num_blocks: 16,
        block_size: bs as usize,
        n_kv_heads: g.n_kv_heads,
        head_dim: g.head_dim,
    })?;
    let act = b.act_dtype();
    let mut rng = Rng(41);
    let mut outputs = Vec::new();
    let tables = [vec![5u32, 2], vec![9], vec![1, 12, 7]];
    let steps = [
        vec![
            (0, 20, tables[0].clone()),
            (0, 3, tables[1].clone()),
            (0, 40, tables[2].clone()),
        ],
        vec![
            (20, 1, tables[0].clone()),
            (3, 5, tables[1].clone()),
            (40, 1, tables[2].clone()),
        ],
    ];
    for (si, seqs) in steps.iter().enumerate() {
        let step = step_of(seqs, bs, &[1]);
        let n = step.tokens.len();
        b.begin_step(&step)?;
        // Layer 0 gets other values: attention on layer 1 must not see them.
        for layer in [0usize, 1] {
            let data = rng.values(n * width, 1.5);
            let qkv = filled(b, act, n * width, Layout::contiguous(n, width), &data)?;
            let v = View::rows(&qkv, n, width)?;
            b.kv_write(
                v.col_range(qw, kvw)?,
                v.col_range(qw + kvw, kvw)?,
                &g,
                layer,
            )?;
            if layer == 1 {
                let mut o = b.alloc(act, n * qw)?;
                b.attention(v.col_range(0, qw)?, &g, 1, ViewMut::rows(&mut o, n, qw)?)?;
                outputs.push(out(
                    format!("kv_write + attention, step {}", si + 1),
                    Class::Reduction,
                    read(b, &o, Layout::contiguous(n, qw))?,
                ));
            }
        }
    }
    // One decode query of the first sequence, read through different copies of its blocks.
    let query = rng.values(width, 1.5);
    let q = filled(b, act, width, Layout::contiguous(1, width), &query)?;
    let through = |b: &mut B, table: Vec<u32>| -> Result<Vec<f32>, BackendError> {
        b.begin_step(&step_of(&[(20, 1, table)], bs, &[1]))?;
        let mut o = b.alloc(act, qw)?;
        let qv = View::rows(&q, 1, width)?;
        b.attention(qv.col_range(0, qw)?, &g, 1, ViewMut::rows(&mut o, 1, qw)?)?;
        read(b, &o, Layout::contiguous(1, qw))
    };
    let original = through(b, vec![5, 2])?;
    b.kv_copy_blocks(&[(5, 3), (2, 4)])?;
    let copied = through(b, vec![3, 4])?;
    let bytes = b.kv_block_bytes();
    let mut host = vec![0u8; 2 * bytes];
    b.kv_blocks_to_host(&[3, 4], &mut host)?;
    b.kv_blocks_from_host(&host, &[10, 11])?;
    let restored = through(b, vec![10, 11])?;
    // Device-internal: copies read exactly like the originals.
    let diff = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(x, y)| (x - y).abs()).sum::<f32>();
    outputs.push(out(
        "attention through the original blocks",
        Class::Reduction,
        original.clone(),
    ));
    outputs.push(own(
        "kv_copy_blocks: copies read as the originals",
        0.0,
        vec![diff(&original, &copied)],
    ));
    outputs.push(own(
        "kv_blocks_to/from_host: read as the originals",
        0.0,
        vec![diff(&original, &restored)],
    ));
    Ok(outputs)
}

/// The device greedy pick on rows with ties, NaN and infinities, against the pick of the values
/// the device holds (read back), made on the host as the sampler makes it.
fn greedy_pick<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let act = b.act_dtype();
    let cols = 1000;
    let mut rng = Rng(51);
    let mut data = rng.values(4 * cols, 8.0);
    // Row 1: a tie for the maximum (the lower id wins).
    data[cols + 10] = 20.0;
    data[cols + 900] = 20.0;
    // Row 2: NaN and infinities.
    data[2 * cols + 3] = f32::NAN;
    data[2 * cols + 500] = f32::INFINITY;
    data[2 * cols + 7] = f32::NEG_INFINITY;
    // Row 3: nothing finite.
    for (i, v) in data[3 * cols..].iter_mut().enumerate() {
        *v = if i % 2 == 0 {
            f32::NAN
        } else {
            f32::NEG_INFINITY
        };
    }
    let logits = filled(b, act, 4 * cols, Layout::contiguous(4, cols), &data)?;
    let held = read(b, &logits, Layout::contiguous(4, cols))?;
    let view = View::rows(&logits, 4, cols)?;
    let mut lp = b.alloc(DType::F32, 4)?;
    let mut ids = b.alloc(DType::I32, 4)?;
    let has_lp = b.argmax_logprob_rows(view, ViewMut::rows(&mut lp, 4, 1)?)?;
    let has_ids = b.argmax_rows(view, ViewMut::rows(&mut ids, 4, 1)?)?;
    let host_ids: Vec<f32> = held
        .chunks(cols)
        .map(|r| scan::argmax_sanitized(r) as f32)
        .collect();
    let host_lp: Vec<f32> = held.chunks(cols).map(scan::max_logprob_sanitized).collect();
    let mut outputs = Vec::new();
    if !(has_ids && has_lp) {
        outputs.push(own(
            "device greedy pick: not provided (logits are read back)",
            0.0,
            vec![0.0],
        ));
    }
    // Where the device has no pick, its answer is the host's (the engine reads logits back).
    let got_ids = if has_ids {
        let mut v = vec![0i32; 4];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, 4, 1)?,
            dst: HostSliceMut::I32(&mut v),
        }])?;
        v.iter().map(|&i| i as f32).collect()
    } else {
        host_ids.clone()
    };
    let got_lp = if has_lp {
        read(b, &lp, Layout::contiguous(4, 1))?
    } else {
        host_lp.clone()
    };
    // Compared with the host's pick of the same values, not with the reference's values:
    // (ids that differ, largest log-probability error).
    let pick_errors = |ids: &[f32], lp: &[f32]| {
        let wrong = ids.iter().zip(&host_ids).filter(|(a, c)| a != c).count() as f32;
        let err = lp
            .iter()
            .zip(&host_lp)
            .map(|(a, c)| (a - c).abs())
            .fold(0f32, f32::max);
        (wrong, err)
    };
    let (wrong_ids, lp_err) = pick_errors(&got_ids, &got_lp);
    outputs.push(own("argmax_rows (vs its own logits)", 0.0, vec![wrong_ids]));
    outputs.push(own(
        "argmax_logprob_rows (vs its own logits)",
        1e-3,
        vec![lp_err],
    ));
    // Both through the one call the engine makes (a backend may share the scans).
    let mut lp2 = b.alloc(DType::F32, 4)?;
    let mut ids2 = b.alloc(DType::I32, 4)?;
    let (got_ids, got_lp) = if b.argmax_and_logprob_rows(
        view,
        ViewMut::rows(&mut ids2, 4, 1)?,
        ViewMut::rows(&mut lp2, 4, 1)?,
    )? {
        let mut v = vec![0i32; 4];
        b.read_back(&mut [Readback {
            src: View::rows(&ids2, 4, 1)?,
            dst: HostSliceMut::I32(&mut v),
        }])?;
        let ids: Vec<f32> = v.iter().map(|&i| i as f32).collect();
        (ids, read(b, &lp2, Layout::contiguous(4, 1))?)
    } else {
        (host_ids.clone(), host_lp.clone())
    };
    let (wrong, lp_err) = pick_errors(&got_ids, &got_lp);
    outputs.push(own(
        "argmax_and_logprob_rows: picks (vs its own logits)",
        0.0,
        vec![wrong],
    ));
    outputs.push(own(
        "argmax_and_logprob_rows: log-probabilities (vs its own logits)",
        1e-3,
        vec![lp_err],
    ));
    Ok(outputs)
}
