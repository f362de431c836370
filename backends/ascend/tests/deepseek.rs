//! DeepSeek's ops on `AscendBackend` over the emulated CANN, against plain Rust references of the
//! seam's contract (the CPU backend's semantics): scored routing through MoeGatingTopK
//! (DeepSeek-V3's sigmoid + bias + groups + scale; plain normalised softmax with a scale through
//! MoeGatingTopKSoftmaxV2 + InplaceMuls; the refusals named), and latent attention (the latent
//! pool's rows written by ScatterNdUpdate, FusedInferAttentionScoreV2 over them as keys and
//! values): several sequences with history across blocks, prefill chunks and decodes in one
//! step, two layers, the token-wise (block size 16) and prompt (block size 128) branches, block
//! copies and host round trips of latent blocks, and the refusals; at DeepSeek's own widths (512 +
//! 64) the split pool and FusedInferAttentionScoreV3's MLA form, head counts it does not take
//! padded with zero query heads (16, 20, 40), its limits refused by name, and
//! the emulated operator's own refusals.

mod common;

use common::seam::*;
use common::*;
use half::f16;
use npu_backend::*;
use npu_model::{Gating, Rope, RopeStyle};

fn r16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// One token's scored routing as the seam's contract says (the CPU backend's reference).
fn route_ref(logits: &[f32], bias: Option<&[f32]>, spec: &RouteSpec) -> (Vec<i32>, Vec<f32>) {
    let probs: Vec<f32> = match spec.gating {
        Gating::Softmax => {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let e: Vec<f64> = logits.iter().map(|&v| f64::from(v - max).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|v| (v / s) as f32).collect()
        }
        Gating::Sigmoid => logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
    };
    let mut sel: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    let top = |v: &[f32]| {
        let mut o: Vec<usize> = (0..v.len()).collect();
        o.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        o
    };
    if let Some((groups, used)) = spec.groups {
        let per = sel.len() / groups;
        let scores: Vec<f32> = (0..groups)
            .map(|g| {
                let part = &sel[g * per..(g + 1) * per];
                top(part).iter().take(2).map(|&i| part[i]).sum()
            })
            .collect();
        for &g in &top(&scores)[used..] {
            sel[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
        }
    }
    let order = top(&sel);
    let ids: Vec<i32> = order[..spec.k].iter().map(|&i| i as i32).collect();
    let mut w: Vec<f32> = order[..spec.k].iter().map(|&i| probs[i]).collect();
    if spec.normalize {
        let s = w.iter().sum::<f32>().max(6.103_515_6e-5);
        w.iter_mut().for_each(|v| *v /= s);
    }
    w.iter_mut().for_each(|v| *v *= spec.scale);
    (ids, w)
}

fn route(
    b: &mut npu_backend_ascend::AscendBackend,
    lb: &npu_backend_ascend::backend::AscendBuffer,
    bias: Option<&npu_backend_ascend::backend::AscendBuffer>,
    spec: &RouteSpec,
    t: usize,
    ne: usize,
) -> Result<(Vec<i32>, Vec<f32>), BackendError> {
    let k = spec.k;
    let mut ids = b.alloc(DType::I32, t * k)?;
    let mut w = b.alloc(DType::F32, t * k)?;
    b.moe_route_scored(
        View::rows(lb, t, ne)?,
        bias,
        spec,
        ViewMut::rows(&mut ids, t, k)?,
        ViewMut::rows(&mut w, t, k)?,
    )?;
    let mut got = vec![0i32; t * k];
    b.read_back(&mut [Readback {
        src: View::rows(&ids, t, k)?,
        dst: HostSliceMut::I32(&mut got),
    }])?;
    Ok((got, down(b, &w, Layout::contiguous(t, k))))
}

fn f32_vector(bytes: &[u8]) -> HostTensor<'_> {
    HostTensor {
        ty: npu_gguf::GgmlType::F32,
        data: bytes,
        rows: 1,
        cols: bytes.len() / 4,
    }
}

#[test]
fn scored_routing_matches_the_reference() {
    let _g = serial();
    let mut b = default_backend();
    assert!(b.supports(Capability::ScoredRouting));
    for (ne, groups) in [(8usize, (4usize, 2usize)), (64, (8, 3))] {
        let (t, k) = (9usize, 4usize);
        let mut logits = h(&rand_vec(71 + ne as u64, t * ne, 3.0));
        logits[3] = logits[6]; // a tie in row 0
        let lb = up(&mut b, &logits, ne);
        let bias_v = rand_vec(5, ne, 0.3);
        let bias_bytes: Vec<u8> = bias_v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bias = b.load_vector(f32_vector(&bias_bytes)).unwrap();
        let specs = [
            (
                true,
                RouteSpec {
                    k,
                    gating: Gating::Sigmoid,
                    normalize: true,
                    scale: 2.5,
                    groups: Some(groups),
                },
            ),
            (
                false,
                RouteSpec {
                    k,
                    gating: Gating::Sigmoid,
                    normalize: true,
                    scale: 1.0,
                    groups: None,
                },
            ),
            (
                false,
                RouteSpec {
                    k,
                    gating: Gating::Softmax,
                    normalize: true,
                    scale: 1.5,
                    groups: None,
                },
            ),
            (
                false,
                RouteSpec {
                    k,
                    gating: Gating::Softmax,
                    normalize: false,
                    scale: 1.0,
                    groups: None,
                },
            ),
        ];
        for (with_bias, spec) in specs {
            let bias_opt = with_bias.then_some(&bias);
            let (ids, w) = route(&mut b, &lb, bias_opt, &spec, t, ne).unwrap();
            for r in 0..t {
                let row = &logits[r * ne..(r + 1) * ne];
                let (want_ids, want_w) = route_ref(row, with_bias.then_some(&bias_v[..]), &spec);
                let what = format!("{ne} experts, {spec:?}, row {r}");
                assert_eq!(&ids[r * k..(r + 1) * k], &want_ids[..], "{what}: ids");
                for j in 0..k {
                    let (g, w) = (w[r * k + j], want_w[j]);
                    assert!((g - w).abs() <= 2e-5 + 2e-5 * w.abs(), "{what}: {g} vs {w}");
                }
            }
        }
    }
    // What MoeGatingTopK cannot do is refused by name.
    let (t, ne) = (3usize, 8usize);
    let lb = up(&mut b, &h(&rand_vec(9, t * ne, 2.0)), ne);
    let mut spec = RouteSpec {
        k: 2,
        gating: Gating::Softmax,
        normalize: true,
        scale: 1.0,
        groups: Some((4, 2)),
    };
    let e = route(&mut b, &lb, None, &spec, t, ne)
        .unwrap_err()
        .to_string();
    assert!(e.contains("softmax") && e.contains("8.5"), "{e}");
    spec.gating = Gating::Sigmoid;
    spec.normalize = false;
    let e = route(&mut b, &lb, None, &spec, t, ne)
        .unwrap_err()
        .to_string();
    assert!(e.contains("without normalisation"), "{e}");
    spec.normalize = true;
    spec.k = 5; // more than 2 groups of 2 hold
    let e = route(&mut b, &lb, None, &spec, t, ne)
        .unwrap_err()
        .to_string();
    assert!(e.contains("limits"), "{e}");
}

const LAYERS: usize = 2;

/// The rows written so far, per (layer, block, offset): f16-rounded latent ‖ rope.
struct Latent {
    heads: usize,
    lat: usize,
    rope: usize,
    block_size: usize,
    cache: std::collections::HashMap<(usize, u32, u32), Vec<f32>>,
}

impl Latent {
    fn row(&self) -> usize {
        self.lat + self.rope
    }

    fn geometry(&self) -> AttnGeometry {
        AttnGeometry {
            n_heads: self.heads,
            n_kv_heads: 1,
            head_dim: self.row(),
            rope: Rope::plain(RopeStyle::Halves, self.rope, 10000.0, 1.0),
            scale: 0.3,
            window: None,
        }
    }

    /// One step: writes each layer's new rows and attends; returns each layer's output and its
    /// reference.
    fn step(
        &mut self,
        b: &mut npu_backend_ascend::AscendBackend,
        step: &StepInputs,
        seed: u64,
        write: bool,
    ) -> Vec<(Vec<f32>, Vec<f32>)> {
        b.begin_step(step).unwrap();
        let t = step.tokens.len();
        let (h, lat, rope) = (self.heads, self.lat, self.rope);
        let g = self.geometry();
        let mut res = Vec::new();
        for layer in 0..LAYERS {
            let s = seed * 10 + layer as u64;
            // Rope values as columns 3.. of wider rows, the latent dense.
            let kvw = rope + 5;
            let new_lat = h16(&rand_vec(s, t * lat, 1.0));
            let new_rope = h16(&rand_vec(s + 1, t * kvw, 1.0));
            let lb = up(b, &new_lat, lat);
            let rb = up(b, &new_rope, kvw);
            if write {
                let rv = View::rows(&rb, t, kvw).unwrap().col_range(3, rope).unwrap();
                b.kv_write_latent(View::rows(&lb, t, lat).unwrap(), rv, layer)
                    .unwrap();
                for (i, &slot) in step.slot_mapping.iter().enumerate() {
                    let mut r = new_lat[i * lat..(i + 1) * lat].to_vec();
                    r.extend_from_slice(&new_rope[i * kvw + 3..i * kvw + 3 + rope]);
                    let bs = self.block_size as u32;
                    self.cache.insert((layer, slot / bs, slot % bs), r);
                }
            }
            let qw = h * rope + 7;
            let ql = h16(&rand_vec(s + 2, t * h * lat, 1.0));
            let qr = h16(&rand_vec(s + 3, t * qw, 1.0));
            let qlb = up(b, &ql, h * lat);
            let qrb = up(b, &qr, qw);
            let mut ob = b.alloc(DType::F16, t * h * lat).unwrap();
            b.attention_latent(
                View::rows(&qlb, t, h * lat).unwrap(),
                View::rows(&qrb, t, qw)
                    .unwrap()
                    .col_range(7, h * rope)
                    .unwrap(),
                &g,
                lat,
                layer,
                ViewMut::rows(&mut ob, t, h * lat).unwrap(),
            )
            .unwrap();
            let got = down(b, &ob, Layout::contiguous(t, h * lat));
            // The reference.
            let mut want = vec![0f32; t * h * lat];
            for (si, sq) in step.seqs.iter().enumerate() {
                let table = &step.block_tables[si * step.max_blocks..(si + 1) * step.max_blocks];
                for j in 0..sq.n_q as usize {
                    let r = sq.q_row as usize + j;
                    let len = sq.start_pos as usize + j + 1;
                    let ctx: Vec<&Vec<f32>> = (0..len)
                        .map(|p| {
                            let blk = table[p / self.block_size];
                            &self.cache[&(layer, blk, (p % self.block_size) as u32)]
                        })
                        .collect();
                    for hd in 0..h {
                        let q1 = &ql[r * h * lat + hd * lat..][..lat];
                        let q2 = &qr[r * qw + 7 + hd * rope..][..rope];
                        let sc: Vec<f64> = ctx
                            .iter()
                            .map(|c| {
                                let d: f64 = q1
                                    .iter()
                                    .chain(q2)
                                    .zip(c.iter())
                                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                    .sum();
                                d * f64::from(g.scale)
                            })
                            .collect();
                        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for d in 0..lat {
                            let v: f64 = e
                                .iter()
                                .zip(&ctx)
                                .map(|(p, c)| p / z * f64::from(c[d]))
                                .sum();
                            want[r * h * lat + hd * lat + d] = v as f32;
                        }
                    }
                }
            }
            res.push((got, want));
        }
        res
    }
}

fn h16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| r16(x)).collect()
}

fn check(res: &[(Vec<f32>, Vec<f32>)], what: &str) {
    for (l, (got, want)) in res.iter().enumerate() {
        assert_close(got, want, 8e-3, &format!("{what}, layer {l}"));
    }
}

fn latent_spec(block_size: usize, num_blocks: usize, row: usize) -> KvSpec {
    KvSpec {
        n_layers: LAYERS,
        num_blocks,
        block_size,
        n_kv_heads: 1,
        head_dim: row,
    }
}

#[test]
fn latent_attention_matches_the_reference_across_blocks_steps_copies_and_host_trips() {
    let _g = serial();
    let mut b = default_backend();
    assert!(b.supports(Capability::LatentAttention));
    let bs = 16usize;
    let mut m = Latent {
        heads: 4,
        lat: 32,
        rope: 16,
        block_size: bs,
        cache: Default::default(),
    };
    let spec = latent_spec(bs, 12, m.row());
    b.init_latent_kv(spec).unwrap();
    let bytes = LAYERS * bs * m.row() * 2;
    assert_eq!(b.kv_block_bytes(), bytes);
    assert_eq!(b.latent_kv_block_bytes_for(&spec), bytes);
    let toks: Vec<u32> = (1..100).collect();
    // Step 1: sequence A's prompt of 21 (two blocks), B's of 5.
    let s1 = step_of(&[(0, 21, vec![3, 1]), (0, 5, vec![0])], bs as u32, &toks);
    check(&m.step(&mut b, &s1, 1, true), "step 1");
    // Step 2: A decodes one, B takes a chunk of 14 (into its second block), C starts with 2.
    let s2 = step_of(
        &[(21, 1, vec![3, 1]), (5, 14, vec![0, 7]), (0, 2, vec![9])],
        bs as u32,
        &toks,
    );
    check(&m.step(&mut b, &s2, 2, true), "step 2");
    // A's blocks copied to 5 and 6: the same attention through the new table.
    b.kv_copy_blocks(&[(3, 5), (1, 6)]).unwrap();
    for l in 0..LAYERS {
        for (s, d) in [(3u32, 5u32), (1, 6)] {
            for o in 0..bs as u32 {
                if let Some(r) = m.cache.get(&(l, s, o)).cloned() {
                    m.cache.insert((l, d, o), r);
                }
            }
        }
    }
    let s3 = step_of(&[(21, 1, vec![5, 6])], bs as u32, &toks);
    let copied = m.step(&mut b, &s3, 3, false);
    check(&copied, "A through copied blocks");
    // B's blocks out to the host and back into 10 and 11: the same again.
    let mut host = vec![0u8; 2 * bytes];
    b.kv_blocks_to_host(&[0, 7], &mut host).unwrap();
    b.kv_blocks_from_host(&host, &[10, 11]).unwrap();
    for l in 0..LAYERS {
        for (s, d) in [(0u32, 10u32), (7, 11)] {
            for o in 0..bs as u32 {
                if let Some(r) = m.cache.get(&(l, s, o)).cloned() {
                    m.cache.insert((l, d, o), r);
                }
            }
        }
    }
    // The host bytes: block 0, layer 0's first row is B's first latent row.
    let first: Vec<f32> = host[..m.row() * 2]
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(first, m.cache[&(0, 0, 0)]);
    let s4 = step_of(&[(18, 1, vec![10, 11])], bs as u32, &toks);
    check(&m.step(&mut b, &s4, 4, false), "B through host round trips");
}

#[test]
fn latent_attention_prompt_branch_matches_the_reference() {
    let _g = serial();
    let mut b = default_backend();
    let bs = 128usize;
    let mut m = Latent {
        heads: 8,
        lat: 64,
        rope: 32,
        block_size: bs,
        cache: Default::default(),
    };
    b.init_latent_kv(latent_spec(bs, 4, m.row())).unwrap();
    let toks: Vec<u32> = (1..300).collect();
    let s1 = step_of(&[(0, 130, vec![2, 0]), (0, 9, vec![1])], bs as u32, &toks);
    check(&m.step(&mut b, &s1, 5, true), "prompts");
    let s2 = step_of(&[(130, 1, vec![2, 0]), (9, 6, vec![1])], bs as u32, &toks);
    check(&m.step(&mut b, &s2, 6, true), "decode and chunk");
}

#[test]
fn latent_and_kv_pools_refuse_each_others_ops() {
    let _g = serial();
    let mut b = default_backend();
    let bs = 16usize;
    let m = Latent {
        heads: 2,
        lat: 32,
        rope: 16,
        block_size: bs,
        cache: Default::default(),
    };
    let g = m.geometry();
    let toks = [1u32, 2, 3];
    // A K/V pool: the latent ops are refused.
    b.init_kv(kv_spec(bs, 4)).unwrap();
    b.begin_step(&step_of(&[(0, 3, vec![0])], bs as u32, &toks))
        .unwrap();
    let buf = up(&mut b, &vec![0.5; 3 * 64], 64);
    let e = b
        .kv_write_latent(
            View::rows(&buf, 3, 64).unwrap().col_range(0, 32).unwrap(),
            View::rows(&buf, 3, 64).unwrap().col_range(32, 16).unwrap(),
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("init_latent_kv"), "{e}");
    // A latent pool: attention and kv_write are refused; rows FusedInferAttentionScoreV2's
    // ordinary form cannot take (DeepSeek's 512 + 64) are refused by name.
    b.init_latent_kv(latent_spec(bs, 4, m.row())).unwrap();
    b.begin_step(&step_of(&[(0, 3, vec![0])], bs as u32, &toks))
        .unwrap();
    let q = up(&mut b, &vec![0.5; 3 * 96], 96);
    let mut o = b.alloc(DType::F16, 3 * 96).unwrap();
    let dense = AttnGeometry {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 48,
        ..g
    };
    let e = b
        .attention(
            View::rows(&q, 3, 96).unwrap(),
            &dense,
            0,
            ViewMut::rows(&mut o, 3, 96).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention_latent"), "{e}");
    b.init_latent_kv(latent_spec(bs, 2, 576)).unwrap();
    b.begin_step(&step_of(&[(0, 1, vec![0])], bs as u32, &toks))
        .unwrap();
    // (2 heads would be padded to 32 for the MLA form; 160 exceed both forms.)
    let n = 160usize;
    let ql = up(&mut b, &vec![0.1; n * 512], n * 512);
    let qr = up(&mut b, &vec![0.1; n * 64], n * 64);
    let mut o = b.alloc(DType::F16, n * 512).unwrap();
    let big = AttnGeometry {
        n_heads: n,
        n_kv_heads: 1,
        head_dim: 576,
        ..g
    };
    let e = b
        .attention_latent(
            View::rows(&ql, 1, n * 512).unwrap(),
            View::rows(&qr, 1, n * 64).unwrap(),
            &big,
            512,
            0,
            ViewMut::rows(&mut o, 1, n * 512).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("latent attention") && e.contains("MLA form"),
        "{e}"
    );
}

/// How many times the emulation has launched `op` in this process (an emulation-only symbol).
fn launches(op: &str) -> u64 {
    let path = emulator_root().join("lib64/libascendcl.so");
    let name = std::ffi::CString::new(op).unwrap();
    // SAFETY: the library the runtime already loaded (one state); the symbol has this prototype.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(*const core::ffi::c_char) -> u64> =
            lib.get(b"ascendEmulatorLaunchCount\0").unwrap();
        f(name.as_ptr())
    }
}

/// DeepSeek's own widths (a latent of 512 and a rotated key of 64): the split pool and
/// FusedInferAttentionScoreV3's MLA form, every step token-wise, with 32 heads over blocks of 16
/// and 64 heads over blocks of 128 (prompts, a decode and a chunk in one step), block copies and
/// host round trips (a block's host bytes per layer: its latents, then its rotated keys).
#[test]
fn latent_attention_at_deepseeks_widths_goes_through_the_mla_form() {
    let _g = serial();
    for (bs, heads) in [(16usize, 32usize), (128, 64)] {
        let mut b = default_backend();
        let mut m = Latent {
            heads,
            lat: 512,
            rope: 64,
            block_size: bs,
            cache: Default::default(),
        };
        let spec = latent_spec(bs, 12, m.row());
        b.init_latent_kv(spec).unwrap();
        let bytes = LAYERS * bs * m.row() * 2;
        assert_eq!(b.kv_block_bytes(), bytes);
        let toks: Vec<u32> = (1..100).collect();
        let (v2, v3) = (
            launches("aclnnFusedInferAttentionScoreV2"),
            launches("aclnnFusedInferAttentionScoreV3"),
        );
        let what = format!("{heads} heads, blocks of {bs}");
        let s1 = step_of(&[(0, 21, vec![3, 1]), (0, 5, vec![0])], bs as u32, &toks);
        check(&m.step(&mut b, &s1, 1, true), &format!("{what}, prompts"));
        let s2 = step_of(
            &[(21, 1, vec![3, 1]), (5, 14, vec![0, 7]), (0, 2, vec![9])],
            bs as u32,
            &toks,
        );
        check(&m.step(&mut b, &s2, 2, true), &format!("{what}, mixed"));
        assert_eq!(launches("aclnnFusedInferAttentionScoreV2"), v2, "{what}");
        assert!(
            launches("aclnnFusedInferAttentionScoreV3") >= v3 + 4,
            "{what}"
        );
        b.kv_copy_blocks(&[(3, 5), (1, 6)]).unwrap();
        let mut host = vec![0u8; 2 * bytes];
        b.kv_blocks_to_host(&[0, 7], &mut host).unwrap();
        b.kv_blocks_from_host(&host, &[10, 11]).unwrap();
        for l in 0..LAYERS {
            for (s, d) in [(3u32, 5u32), (1, 6), (0, 10), (7, 11)] {
                for o in 0..bs as u32 {
                    if let Some(r) = m.cache.get(&(l, s, o)).cloned() {
                        m.cache.insert((l, d, o), r);
                    }
                }
            }
        }
        let f16s = |at: usize, n: usize| -> Vec<f32> {
            host[at * 2..(at + n) * 2]
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()
        };
        let row0 = &m.cache[&(0, 0, 0)];
        assert_eq!(
            f16s(0, 512),
            row0[..512],
            "{what}: the block's first latent"
        );
        assert_eq!(
            f16s(bs * 512, 64),
            row0[512..],
            "{what}: its first rotated key"
        );
        let s3 = step_of(
            &[(21, 1, vec![5, 6]), (18, 1, vec![10, 11])],
            bs as u32,
            &toks,
        );
        check(
            &m.step(&mut b, &s3, 3, false),
            &format!("{what}, copied blocks and host round trips"),
        );
    }
}

/// Head counts the MLA form does not take (DeepSeek-V2-Lite's 16; 20 and 40, which divide into
/// none of 32, 64 and 128): padded on the device with zero query heads to 32 or 64, only the real
/// heads' outputs kept, against the same reference, prompts then a decode and a chunk, blocks of
/// 16 and 128. A step's cost over the unpadded path (32 heads, the same step): 2 more InplaceCopy
/// calls a layer (the query into the padded scratch, the real heads out of the output), the same
/// FusedInferAttentionScoreV3 calls.
#[test]
fn latent_attention_pads_other_head_counts_for_the_mla_form() {
    let _g = serial();
    let toks: Vec<u32> = (1..100).collect();
    // InplaceCopy and V3 launches of one step of `heads` over a fresh backend and pool.
    let run = |bs: usize, heads: usize| {
        let mut b = default_backend();
        let mut m = Latent {
            heads,
            lat: 512,
            rope: 64,
            block_size: bs,
            cache: Default::default(),
        };
        b.init_latent_kv(latent_spec(bs, 12, m.row())).unwrap();
        let what = format!("{heads} heads, blocks of {bs}");
        let s1 = step_of(&[(0, 21, vec![3, 1]), (0, 5, vec![0])], bs as u32, &toks);
        check(&m.step(&mut b, &s1, 1, true), &format!("{what}, prompts"));
        let s2 = step_of(
            &[(21, 1, vec![3, 1]), (5, 14, vec![0, 7]), (0, 2, vec![9])],
            bs as u32,
            &toks,
        );
        let (c, v3) = (
            launches("aclnnInplaceCopy"),
            launches("aclnnFusedInferAttentionScoreV3"),
        );
        check(&m.step(&mut b, &s2, 2, true), &format!("{what}, mixed"));
        (
            launches("aclnnInplaceCopy") - c,
            launches("aclnnFusedInferAttentionScoreV3") - v3,
        )
    };
    for bs in [16usize, 128] {
        let (copies, v3) = run(bs, 32);
        for heads in [16usize, 20, 40] {
            assert_eq!(
                run(bs, heads),
                (copies + 2 * LAYERS as u64, v3),
                "{heads} heads, blocks of {bs}: InplaceCopy and V3 launches of a step against \
                 32 unpadded heads' ({copies}, {v3})"
            );
        }
    }
}

/// The MLA form's limits, refused by name: more than 128 heads (before any call),
/// blocks other than 16 or 128 for rows of 512 + 64 (at the pool), and rows above 512 that are
/// not 512 + 64 (FusedInferAttentionScoreV2's ordinary form stops at 512).
#[test]
fn the_mla_forms_limits_are_refused_by_name() {
    let _g = serial();
    let mut b = default_backend();
    let e = b
        .init_latent_kv(latent_spec(64, 4, 576))
        .unwrap_err()
        .to_string();
    assert!(e.contains("block_size = 64") && e.contains("MLA"), "{e}");
    let toks = [1u32, 2];
    for (row, heads, lat, want) in [
        (576usize, 160usize, 512usize, "32, 64 or 128"),
        (640, 32, 576, "ordinary form"),
    ] {
        b.init_latent_kv(latent_spec(16, 4, row)).unwrap();
        b.begin_step(&step_of(&[(0, 2, vec![0])], 16, &toks))
            .unwrap();
        let rope = row - lat;
        let ql = up(&mut b, &vec![0.1; 2 * heads * lat], heads * lat);
        let qr = up(&mut b, &vec![0.1; 2 * heads * rope], heads * rope);
        let mut o = b.alloc(DType::F16, 2 * heads * lat).unwrap();
        let g = AttnGeometry {
            n_heads: heads,
            n_kv_heads: 1,
            head_dim: row,
            rope: Rope::plain(RopeStyle::Halves, rope, 10000.0, 1.0),
            scale: 0.1,
            window: None,
        };
        let e = b
            .attention_latent(
                View::rows(&ql, 2, heads * lat).unwrap(),
                View::rows(&qr, 2, heads * rope).unwrap(),
                &g,
                lat,
                0,
                ViewMut::rows(&mut o, 2, heads * lat).unwrap(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("latent attention") && e.contains(want), "{e}");
    }
}

/// One first phase of FusedInferAttentionScoreV3's MLA form straight on the emulation: BSND
/// query (1, `s`, `heads`, `d`) and its rope part, one block of `block_size` rows of 512 and 64,
/// 3 cached tokens; the status and the emulation's message.
fn mla_first_phase(heads: i64, d: i64, s: i64, block_size: i64) -> (i32, String) {
    use npu_backend_ascend::tensor::{DType as T, IntArray, TensorList};
    use npu_ffi::types::aclTensor;
    let dev = device();
    let acl = acl();
    let ops = acl.api.ops;
    let (prep, launch) = (
        ops.aclnnFusedInferAttentionScoreV3GetWorkspaceSize
            .expect("the emulation has V3"),
        ops.aclnnFusedInferAttentionScoreV3
            .expect("the emulation has V3"),
    );
    let n = (s * heads) as usize;
    let (qb, qrb, ob) = (
        zeros(n * d as usize * 2),
        zeros(n * 64 * 2),
        zeros(n * d as usize * 2),
    );
    let (kc, kr, tb) = (
        zeros(block_size as usize * 512 * 2),
        zeros(block_size as usize * 64 * 2),
        upload_i32(&[0]),
    );
    let q = t(&qb, T::F16, &[1, s, heads, d]);
    let qr = t(&qrb, T::F16, &[1, s, heads, 64]);
    let o = t(&ob, T::F16, &[1, s, heads, d]);
    let krt = t(&kr, T::F16, &[1, block_size, 64]);
    let kl = TensorList::new(acl, vec![t(&kc, T::F16, &[1, block_size, 512])]).unwrap();
    let vl = TensorList::new(acl, vec![t(&kc, T::F16, &[1, block_size, 512])]).unwrap();
    let bt = t(&tb, T::I32, &[1, 1]);
    let kv = IntArray::new(acl, &[3]).unwrap();
    let mut layout = *b"BSND\0";
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    let null = std::ptr::null::<aclTensor>();
    // SAFETY: live handles, null optionals, a NUL-terminated layout and out-pointers.
    let rc = unsafe {
        prep(
            q.raw(),
            kl.raw(),
            vl.raw(),
            null,
            null,
            std::ptr::null(),
            kv.raw(),
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            bt.raw(),
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            null,
            std::ptr::null(),
            qr.raw(),
            krt.raw(),
            null,
            heads,
            0.1,
            i32::MAX as i64,
            i32::MAX as i64,
            layout.as_mut_ptr().cast(),
            1,
            0,
            0,
            block_size,
            0,
            false,
            0,
            0,
            o.raw(),
            null,
            &mut ws,
            &mut exec,
        )
    };
    let msg = acl.last_message();
    if rc == 0 {
        // The call taken: its second phase runs (the executor is spent by it).
        let wsb = zeros(ws.max(1) as usize);
        // SAFETY: the executor just made, a device workspace of the size asked for.
        let rc = unsafe { launch(wsb.ptr(), ws, exec, dev.stream()) };
        assert_eq!(rc, 0, "{}", acl.last_message());
        dev.synchronize().unwrap();
        assert_eq!(read_f16(&ob, 4), [0.0; 4]);
    }
    (rc, msg)
}

/// The emulation's FusedInferAttentionScoreV3 takes what its page documents for the MLA form and
/// refuses the rest: 16 heads, a block of 64, a query d of 256, two queries without the causal
/// mask.
#[test]
fn the_emulated_mla_form_refuses_what_its_page_forbids() {
    let _g = serial();
    let ok = mla_first_phase(32, 512, 1, 16);
    assert_eq!(ok.0, 0, "{}", ok.1);
    for (heads, d, s, bs, want) in [
        (16, 512, 1, 16, "32, 64 or 128"),
        (32, 512, 1, 64, "16 or 128"),
        (32, 256, 1, 16, "must be 512"),
        (32, 512, 2, 16, "sparseMode 3"),
    ] {
        let (rc, msg) = mla_first_phase(heads, d, s, bs);
        assert_eq!(rc, npu_ffi::types::ACLNN_ERR_PARAM_INVALID, "{msg}");
        assert!(
            msg.contains(want),
            "{heads} heads, d {d}, s {s}, blocks of {bs}: {msg}"
        );
    }
}
