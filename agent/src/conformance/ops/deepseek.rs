//! Conformance cases of DeepSeek's ops: scored expert routing (sigmoid and softmax scores, a
//! selection bias, group-limited choice, a routed scale) and latent attention (the latent
//! pool's writes, causal attention over latents through block tables across two steps, and
//! block copies and host round trips of latent blocks). Named after their capabilities, so a
//! backend without them runs none and the comparison notes them as not built.

use npu_backend::{
    AttnGeometry, Backend, BackendError, Capability, DType, HostSliceMut, KvSpec, Layout, Readback,
    RouteSpec, View, ViewMut,
};
use npu_model::{Gating, Rope, RopeStyle};

use super::{f32_tensor, filled, out, own, read, step_of, Output, Rng};
use crate::conformance::Class;

fn named(c: Capability, what: &str) -> String {
    format!("{}: {what}", c.name())
}

/// `moe_route_scored` with DeepSeek-V3's choices and with a plain normalised softmax.
pub(super) fn scored_routing<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let c = Capability::ScoredRouting;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let act = b.act_dtype();
    let (t, ne, k) = (7usize, 8usize, 3usize);
    let mut rng = Rng(131);
    let logits = rng.values(t * ne, 3.0);
    let lg = filled(b, act, t * ne, Layout::contiguous(t, ne), &logits)?;
    let bias = b.load_vector(f32_tensor(&rng.values(ne, 0.3), 1, ne))?;
    let specs = [
        (
            "sigmoid, bias, 2 of 4 groups, scale 2.5",
            Some(&bias),
            RouteSpec {
                k,
                gating: Gating::Sigmoid,
                normalize: true,
                scale: 2.5,
                groups: Some((4, 2)),
            },
        ),
        (
            "softmax, normalised, no groups",
            None,
            RouteSpec {
                k,
                gating: Gating::Softmax,
                normalize: true,
                scale: 1.0,
                groups: None,
            },
        ),
    ];
    let mut outputs = Vec::new();
    for (what, bias, spec) in specs {
        let mut ids = b.alloc(DType::I32, t * k)?;
        let mut w = b.alloc(DType::F32, t * k)?;
        b.moe_route_scored(
            View::rows(&lg, t, ne)?,
            bias,
            &spec,
            ViewMut::rows(&mut ids, t, k)?,
            ViewMut::rows(&mut w, t, k)?,
        )?;
        let mut id_host = vec![0i32; t * k];
        b.read_back(&mut [Readback {
            src: View::rows(&ids, t, k)?,
            dst: HostSliceMut::I32(&mut id_host),
        }])?;
        outputs.push(out(
            named(c, &format!("{what}: expert ids")),
            Class::Exact,
            id_host.iter().map(|&v| v as f32).collect(),
        ));
        outputs.push(out(
            named(c, &format!("{what}: weights")),
            Class::Elementwise,
            read(b, &w, Layout::contiguous(t, k))?,
        ));
    }
    Ok(outputs)
}

/// Latent writes and attention over two steps (prompts, then decode and a chunk) of three
/// sequences whose tables cross blocks, on layer 1 of two; then one query through copies of its
/// blocks (device copies and a host round trip).
pub(super) fn latent_attention<B: Backend>(b: &mut B) -> Result<Vec<Output>, BackendError> {
    let c = Capability::LatentAttention;
    if !b.supports(c) {
        return Ok(Vec::new());
    }
    let act = b.act_dtype();
    let (heads, latent, rope) = (4usize, 32usize, 16usize);
    let row = latent + rope;
    let g = AttnGeometry {
        n_heads: heads,
        n_kv_heads: 1,
        head_dim: row,
        rope: Rope::plain(RopeStyle::Interleaved, rope, 10_000.0, 1.0),
        scale: 0.13,
        window: None,
    };
    let bs = 16u32;
    b.init_latent_kv(KvSpec {
        n_layers: 2,
        num_blocks: 16,
        block_size: bs as usize,
        n_kv_heads: 1,
        head_dim: row,
    })?;
    let mut rng = Rng(151);
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
    let (ql, qr) = (heads * latent, heads * rope);
    for (si, seqs) in steps.iter().enumerate() {
        let step = step_of(seqs, bs, &[1]);
        let n = step.tokens.len();
        b.begin_step(&step)?;
        for layer in [0usize, 1] {
            let rows = filled(
                b,
                act,
                n * row,
                Layout::contiguous(n, row),
                &rng.values(n * row, 1.5),
            )?;
            let v = View::rows(&rows, n, row)?;
            b.kv_write_latent(v.col_range(0, latent)?, v.col_range(latent, rope)?, layer)?;
            if layer == 1 {
                let q = filled(
                    b,
                    act,
                    n * (ql + qr),
                    Layout::contiguous(n, ql + qr),
                    &rng.values(n * (ql + qr), 1.5),
                )?;
                let qv = View::rows(&q, n, ql + qr)?;
                let mut o = b.alloc(act, n * ql)?;
                b.attention_latent(
                    qv.col_range(0, ql)?,
                    qv.col_range(ql, qr)?,
                    &g,
                    latent,
                    1,
                    ViewMut::rows(&mut o, n, ql)?,
                )?;
                outputs.push(out(
                    named(
                        c,
                        &format!("kv_write_latent + attention_latent, step {}", si + 1),
                    ),
                    Class::Reduction,
                    read(b, &o, Layout::contiguous(n, ql))?,
                ));
            }
        }
    }
    let query = rng.values(ql + qr, 1.5);
    let q = filled(b, act, ql + qr, Layout::contiguous(1, ql + qr), &query)?;
    let through = |b: &mut B, table: Vec<u32>| -> Result<Vec<f32>, BackendError> {
        b.begin_step(&step_of(&[(20, 1, table)], bs, &[1]))?;
        let mut o = b.alloc(act, ql)?;
        let qv = View::rows(&q, 1, ql + qr)?;
        b.attention_latent(
            qv.col_range(0, ql)?,
            qv.col_range(ql, qr)?,
            &g,
            latent,
            1,
            ViewMut::rows(&mut o, 1, ql)?,
        )?;
        read(b, &o, Layout::contiguous(1, ql))
    };
    let original = through(b, vec![5, 2])?;
    b.kv_copy_blocks(&[(5, 3), (2, 4)])?;
    let copied = through(b, vec![3, 4])?;
    let bytes = b.kv_block_bytes();
    let mut host = vec![0u8; 2 * bytes];
    b.kv_blocks_to_host(&[3, 4], &mut host)?;
    b.kv_blocks_from_host(&host, &[10, 11])?;
    let restored = through(b, vec![10, 11])?;
    let diff = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(x, y)| (x - y).abs()).sum::<f32>();
    outputs.push(out(
        named(c, "attention_latent through the original blocks"),
        Class::Reduction,
        original.clone(),
    ));
    outputs.push(own(
        named(c, "kv_copy_blocks: latent copies read as the originals"),
        0.0,
        vec![diff(&original, &copied)],
    ));
    outputs.push(own(
        named(
            c,
            "kv_blocks_to/from_host: latent blocks read as the originals",
        ),
        0.0,
        vec![diff(&original, &restored)],
    ));
    outputs.push(own(
        named(c, "a latent block's bytes: one f16 row per token and layer"),
        0.0,
        vec![(bytes as f32 - (2 * bs as usize * row * 2) as f32).abs()],
    ));
    Ok(outputs)
}
