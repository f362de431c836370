//! Conformance cases of the ops the newer families need ([`Capability`]): per-head Q/K norm,
//! the GELU-gated FFN, row scaling, sliding-window attention, rope with frequency factors and
//! ropes of different bases in one step. Every output's name starts with its capability's
//! name: a backend that does not report the capability runs none of them, and the comparison
//! notes them as not built (such a backend refuses the families that need them at load).

use npu_backend::{Backend, BackendError, Capability, KvSpec, Layout, StepInputs, View, ViewMut};
use npu_model::intern_factors;

use super::{f32_tensor, filled, out, read, step_of, window, Ctx, Output, Rng};
use crate::conformance::Class;

/// The capability an output checks (from its name), if any.
pub(super) fn capability_of(name: &str) -> Option<Capability> {
    ALL.into_iter()
        .find(|c| name.starts_with(&format!("{}: ", c.name())))
}

const ALL: [Capability; 11] = [
    Capability::HeadNorm,
    Capability::GeluGate,
    Capability::ScaleRows,
    Capability::SlidingWindow,
    Capability::RopeFactors,
    Capability::PerLayerRope,
    Capability::Moe,
    Capability::ScoredRouting,
    Capability::LatentAttention,
    Capability::HeldExperts,
    Capability::Lora,
];

fn named(c: Capability, what: &str) -> String {
    format!("{}: {what}", c.name())
}

/// `rms_norm_heads` on the Q and K column ranges of a QKV-shaped window.
pub(super) fn head_norm<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let c = Capability::HeadNorm;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let act = b.act_dtype();
    let (rows, hd, nq, nkv) = (11usize, 32usize, 4usize, 2usize);
    let width = (nq + 2 * nkv) * hd;
    let mut rng = Rng(61);
    let wq = b.load_vector(f32_tensor(&rng.values(hd, 2.0), 1, hd))?;
    let wk = b.load_vector(f32_tensor(&rng.values(hd, 2.0), 1, hd))?;
    let win = window(rows, width, 5, width + 5);
    let mut x = filled(
        b,
        act,
        rows * (width + 5),
        win,
        &rng.values(rows * width, 3.0),
    )?;
    {
        let mut v = ViewMut::new(&mut x, win)?;
        b.rms_norm_heads(v.col_range(0, nq * hd)?, &wq, 1e-6, hd)?;
        b.rms_norm_heads(v.col_range(nq * hd, nkv * hd)?, &wk, 1e-6, hd)?;
    }
    Ok(vec![out(
        named(c, "q and k heads of a qkv window (v untouched)"),
        Class::Elementwise,
        read(b, &x, win)?,
    )])
}

/// `geglu` over gates on both sides of ggml's ±10 cut-offs, and `scale_rows` on a window.
pub(super) fn gelu_gate_and_scale<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let act = b.act_dtype();
    let mut outputs = Vec::new();
    let (rows, ff) = (7usize, 64usize);
    let mut rng = Rng(71);
    if b.supports(Capability::GeluGate) {
        let mut data = rng.values(rows * 2 * ff, 4.0);
        for (i, v) in data.iter_mut().take(rows * 2 * ff).step_by(13).enumerate() {
            *v = [12.5, -11.0, 10.0, -10.0, 0.0, 9.99][i % 6];
        }
        let gu = filled(
            b,
            act,
            rows * 2 * ff,
            Layout::contiguous(rows, 2 * ff),
            &data,
        )?;
        let gv = View::rows(&gu, rows, 2 * ff)?;
        let ow = window(rows, ff, 3, ff + 3);
        let mut o = b.alloc(act, rows * (ff + 3))?;
        b.geglu(
            gv.col_range(0, ff)?,
            gv.col_range(ff, ff)?,
            ViewMut::new(&mut o, ow)?,
        )?;
        outputs.push(out(
            named(Capability::GeluGate, "geglu of two column ranges"),
            Class::Elementwise,
            read(b, &o, ow)?,
        ));
    }
    if b.supports(Capability::ScaleRows) {
        let xw = window(rows, ff, 2, ff + 6);
        let mut x = filled(b, act, rows * (ff + 6), xw, &rng.values(rows * ff, 2.0))?;
        b.scale_rows(ViewMut::new(&mut x, xw)?, 25.298_222)?;
        outputs.push(out(
            named(Capability::ScaleRows, "a window times sqrt(640)"),
            Class::Elementwise,
            read(b, &x, xw)?,
        ));
    }
    Ok(outputs)
}

/// KV writes and attention through a 7-position window: a prefill chunk longer than the window,
/// then a chunk and decode tokens far past it, on the second layer of a two-layer pool.
pub(super) fn window_attention<B: Backend>(
    b: &mut B,
    ctx: &Ctx,
) -> Result<Vec<Output>, BackendError> {
    let c = Capability::SlidingWindow;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let mut g = ctx.geometry();
    g.window = Some(7);
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
    let mut rng = Rng(81);
    let mut outputs = Vec::new();
    let tables = [vec![5u32, 2, 14], vec![9], vec![1, 12, 7]];
    let steps = [
        vec![(0, 30, tables[0].clone()), (0, 3, tables[1].clone())],
        vec![
            (30, 1, tables[0].clone()),
            (3, 5, tables[1].clone()),
            (0, 40, tables[2].clone()),
        ],
    ];
    for (si, seqs) in steps.iter().enumerate() {
        let step = step_of(seqs, bs, &[1]);
        let n = step.tokens.len();
        b.begin_step(&step)?;
        for layer in [0usize, 1] {
            let qkv = filled(
                b,
                act,
                n * width,
                Layout::contiguous(n, width),
                &rng.values(n * width, 1.5),
            )?;
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
                    named(c, &format!("kv_write + attention, step {}", si + 1)),
                    Class::Reduction,
                    read(b, &o, Layout::contiguous(n, qw))?,
                ));
            }
        }
    }
    Ok(outputs)
}

/// Rope with Llama 3-style frequency factors, and two ropes of different bases applied to the
/// same step one after the other (Gemma 3's local and global layers).
pub(super) fn ropes<B: Backend>(b: &mut B, ctx: &Ctx) -> Result<Vec<Output>, BackendError> {
    let g = ctx.geometry();
    let (qw, kvw) = (g.q_width(), g.kv_width());
    let width = qw + 2 * kvw;
    let positions = [0u32, 1, 9, 700, 4000, 9000];
    let n = positions.len();
    let step = StepInputs {
        tokens: vec![1; n],
        positions: positions.to_vec(),
        slot_mapping: vec![0; n],
        ..Default::default()
    };
    let mut outputs = Vec::new();
    let mut rng = Rng(91);
    let mut run = |b: &mut B, ropes: &[npu_model::Rope]| -> Result<Vec<f32>, BackendError> {
        b.begin_step(&step)?;
        let mut qkv = filled(
            b,
            b.act_dtype(),
            n * width,
            Layout::contiguous(n, width),
            &rng.values(n * width, 2.0),
        )?;
        for r in ropes {
            let mut gr = g;
            gr.rope = *r;
            let mut all = ViewMut::rows(&mut qkv, n, width)?;
            b.rope(all.col_range(0, qw + kvw)?, &gr)?;
        }
        read(b, &qkv, Layout::contiguous(n, width))
    };
    if b.supports(Capability::RopeFactors) {
        let pairs = g.rope.dims / 2;
        let factors: Vec<f32> = (0..pairs)
            .map(|i| 1.0 + 7.0 * i as f32 / pairs.max(1) as f32)
            .collect();
        let mut r = g.rope;
        r.factors = Some(intern_factors(&factors));
        outputs.push(out(
            named(Capability::RopeFactors, "rope with per-pair factors"),
            Class::Elementwise,
            run(b, &[r])?,
        ));
    }
    if b.supports(Capability::PerLayerRope) {
        let mut local = g.rope;
        local.base = 10_000.0;
        let mut global = g.rope;
        global.base = 1_000_000.0;
        outputs.push(out(
            named(Capability::PerLayerRope, "two bases, one after the other"),
            Class::Elementwise,
            run(b, &[local, global, local])?,
        ));
    }
    Ok(outputs)
}

/// Router softmax and top-k over logits with a tie, then the experts' FFN over tokens routed to
/// overlapping experts (f32 expert weights, gate and up fused); where the backend has
/// `moe_ffn_held`, the same FFN over each half of the experts (the halves' sum is the whole).
pub(super) fn moe<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let c = Capability::Moe;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let act = b.act_dtype();
    let (t, h, ff, ne, k) = (5usize, 64usize, 32usize, 4usize, 2usize);
    let mut rng = Rng(101);
    let mut logits = rng.values(t * ne, 3.0);
    logits[1] = logits[2]; // a tie: the lower index goes first
    let lg = filled(b, act, t * ne, Layout::contiguous(t, ne), &logits)?;
    let mut ids = b.alloc(npu_backend::DType::I32, t * k)?;
    let mut w = b.alloc(npu_backend::DType::F32, t * k)?;
    b.moe_route(
        View::rows(&lg, t, ne)?,
        k,
        true,
        ViewMut::rows(&mut ids, t, k)?,
        ViewMut::rows(&mut w, t, k)?,
    )?;
    let mut id_host = vec![0i32; t * k];
    b.read_back(&mut [npu_backend::Readback {
        src: View::rows(&ids, t, k)?,
        dst: npu_backend::HostSliceMut::I32(&mut id_host),
    }])?;
    let weights = read(b, &w, Layout::contiguous(t, k))?;
    let mut gate_up = Vec::new();
    let mut down = Vec::new();
    for _ in 0..ne {
        let gu = rng.values(2 * ff * h, 0.2);
        let d = rng.values(h * ff, 0.2);
        let m = |b: &mut B, v: &[f32], rows, cols| {
            b.load_matrix(&[f32_tensor(v, rows, cols)])?
                .ok_or_else(|| BackendError::BadArgument {
                    op: "conformance",
                    message: "an f32 expert matrix was not loaded".into(),
                })
        };
        gate_up.push(m(b, &gu, 2 * ff, h)?);
        down.push(m(b, &d, h, ff)?);
    }
    let x = filled(
        b,
        act,
        t * h,
        Layout::contiguous(t, h),
        &rng.values(t * h, 1.0),
    )?;
    let mut o = b.alloc(act, t * h)?;
    b.moe_ffn(
        View::rows(&x, t, h)?,
        View::rows(&ids, t, k)?,
        View::rows(&w, t, k)?,
        &gate_up,
        &down,
        ff,
        ViewMut::rows(&mut o, t, h)?,
    )?;
    let mut outputs = vec![
        out(
            named(c, "routed expert ids"),
            Class::Exact,
            id_host.iter().map(|&v| v as f32).collect(),
        ),
        out(named(c, "routing weights"), Class::Elementwise, weights),
        out(
            named(c, "expert FFN"),
            Class::Reduction,
            read(b, &o, Layout::contiguous(t, h))?,
        ),
    ];
    if b.supports(Capability::HeldExperts) {
        // Tokens whose two experts fall in one half give the other half a zero row.
        for held in [0..ne / 2, ne / 2..ne] {
            b.moe_ffn_held(
                View::rows(&x, t, h)?,
                View::rows(&ids, t, k)?,
                View::rows(&w, t, k)?,
                &gate_up[held.clone()],
                &down[held.clone()],
                held.clone(),
                ne,
                ff,
                ViewMut::rows(&mut o, t, h)?,
            )?;
            outputs.push(out(
                named(
                    Capability::HeldExperts,
                    &format!("experts {held:?} of {ne}"),
                ),
                Class::Reduction,
                read(b, &o, Layout::contiguous(t, h))?,
            ));
        }
    }
    Ok(outputs)
}
