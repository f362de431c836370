//! DeepSeek's ops against the CPU backend: scored expert routing (sigmoid with a selection bias,
//! group-limited choice and a routed scale; softmax with normalised weights; ties; DeepSeek-V3's
//! 256 experts in 8 groups), and latent attention over a paged latent pool (several sequences
//! with history across blocks, decodes and prefill chunks in one step, two layers, a narrow and
//! a DeepSeek-sized row), in every activation dtype. The latent pool's blocks are the CPU's byte
//! for byte, and move with kv_copy_blocks / kv_blocks_to_host / kv_blocks_from_host.

use super::*;
use npu_backend::RouteSpec;
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_model::Gating;

type CpuBuf = <CpuBackend as Backend>::Buffer;

fn cpu() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 1,
        f32_reference: false,
    })
}

/// An f32 buffer of the CPU backend holding `v`.
fn cpu_put(c: &mut CpuBackend, v: &[f32]) -> CpuBuf {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    c.load_vector(HostTensor {
        ty: GgmlType::F32,
        data: &bytes,
        rows: 1,
        cols: v.len(),
    })
    .unwrap()
}

fn cpu_get(c: &mut CpuBackend, buf: &CpuBuf, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    c.read_back(&mut [Readback {
        src: View::rows(buf, 1, n).unwrap(),
        dst: HostSliceMut::F32(&mut out),
    }])
    .unwrap();
    out
}

fn cuda_ids(b: &mut CudaBackend, buf: &npu_backend_cuda::CudaBuffer, n: usize) -> Vec<i32> {
    let mut out = vec![0i32; n];
    b.read_back(&mut [Readback {
        src: View::rows(buf, 1, n).unwrap(),
        dst: HostSliceMut::I32(&mut out),
    }])
    .unwrap();
    out
}

// ---- scored routing ----------------------------------------------------------------------------

/// A routing case: experts, experts per token, how they are chosen, and whether with a bias.
struct RouteCase {
    ne: usize,
    spec: RouteSpec,
    bias: bool,
}

pub fn scored_routing_matches_the_reference(make: Make) {
    let cases = [
        // DeepSeek-V3's choice on a small scale: sigmoid, bias, 4 groups of 4 with 2 used,
        // normalised, scaled.
        RouteCase {
            ne: 16,
            spec: RouteSpec {
                k: 4,
                gating: Gating::Sigmoid,
                normalize: true,
                scale: 2.5,
                groups: Some((4, 2)),
            },
            bias: true,
        },
        // DeepSeek-V2-Lite's: softmax, normalised, no bias or groups.
        RouteCase {
            ne: 64,
            spec: RouteSpec {
                k: 6,
                gating: Gating::Softmax,
                normalize: true,
                scale: 1.0,
                groups: None,
            },
            bias: false,
        },
        // DeepSeek-V2's: softmax, groups, scaled, not normalised.
        RouteCase {
            ne: 40,
            spec: RouteSpec {
                k: 5,
                gating: Gating::Softmax,
                normalize: false,
                scale: 16.0,
                groups: Some((8, 3)),
            },
            bias: false,
        },
        // DeepSeek-V3's own shape: 256 experts, 8 groups, 4 used, 8 chosen.
        RouteCase {
            ne: 256,
            spec: RouteSpec {
                k: 8,
                gating: Gating::Sigmoid,
                normalize: true,
                scale: 2.5,
                groups: Some((8, 4)),
            },
            bias: true,
        },
    ];
    for dt in DTYPES {
        let Some(mut b) = make(dt, MatmulMode::Auto) else {
            return;
        };
        assert!(b.supports(Capability::ScoredRouting));
        let mut c = cpu();
        for (ci, case) in cases.iter().enumerate() {
            let (t, ne, k) = (9usize, case.ne, case.spec.k);
            let mut rng = Rng::new(70 + ci as u64);
            let mut logits = rng.vec(t * ne, -4.0, 4.0);
            let mut bias = rng.vec(ne, -0.3, 0.3);
            // Ties: two experts with the same logit and bias (the lower index first), and in
            // row 1 a whole row equal (without a bias every choice is a tie, groups too: the
            // lower index first).
            logits[3] = logits[7];
            bias[3] = bias[7];
            for v in &mut logits[ne..2 * ne] {
                *v = 0.5;
            }
            let logits = rounded(&logits, dt);
            // The logits as a strided window (rows ne + 3 apart, from column 1).
            let ld = ne + 3;
            let mut wide = vec![0f32; t * ld];
            for r in 0..t {
                wide[r * ld + 1..r * ld + 1 + ne].copy_from_slice(&logits[r * ne..(r + 1) * ne]);
            }
            let lg = put(&mut b, dt, &wide, t, ld);
            let bias_b = b
                .load_vector(HostTensor {
                    ty: GgmlType::F32,
                    data: bytemuck::cast_slice(&bias),
                    rows: 1,
                    cols: ne,
                })
                .unwrap();
            let mut ids = b.alloc(DType::I32, t * k).unwrap();
            let mut w = b.alloc(DType::F32, t * k).unwrap();
            take_launches(&b);
            b.moe_route_scored(
                View::new(&lg, Layout::new(1, t, ne, ld).unwrap()).unwrap(),
                case.bias.then_some(&bias_b),
                &case.spec,
                ViewMut::rows(&mut ids, t, k).unwrap(),
                ViewMut::rows(&mut w, t, k).unwrap(),
            )
            .unwrap();
            assert_launched(&b, vec![format!("moe_route_scored_{}", dt.name())]);
            let got_ids = cuda_ids(&mut b, &ids, t * k);
            let got_w = get(&mut b, &w);

            let lc = cpu_put(&mut c, &logits);
            let bc = cpu_put(&mut c, &bias);
            let mut idc = c.alloc(DType::I32, t * k).unwrap();
            let mut wc = c.alloc(DType::F32, t * k).unwrap();
            c.moe_route_scored(
                View::rows(&lc, t, ne).unwrap(),
                case.bias.then_some(&bc),
                &case.spec,
                ViewMut::rows(&mut idc, t, k).unwrap(),
                ViewMut::rows(&mut wc, t, k).unwrap(),
            )
            .unwrap();
            let mut want_ids = vec![0i32; t * k];
            c.read_back(&mut [Readback {
                src: View::rows(&idc, t, k).unwrap(),
                dst: HostSliceMut::I32(&mut want_ids),
            }])
            .unwrap();
            let want_w = cpu_get(&mut c, &wc, t * k);
            let what = format!("case {ci} ({:?}) {}", case.spec, dt.name());
            assert_eq!(got_ids, want_ids, "{what}: ids");
            let e = worst(&got_w, &want_w, 1e-6, 2e-5);
            assert!(
                e <= 1.0,
                "{what}: weights worst {e}: {got_w:?} vs {want_w:?}"
            );
        }
        // Refusals: a bias of the wrong length, groups that do not divide the experts, more
        // experts than the kept groups hold.
        let lg = put(&mut b, dt, &[0.0; 2 * 16], 2, 16);
        let short = b
            .load_vector(HostTensor {
                ty: GgmlType::F32,
                data: bytemuck::cast_slice(&[0f32; 15]),
                rows: 1,
                cols: 15,
            })
            .unwrap();
        let mut ids = b.alloc(DType::I32, 2 * 4).unwrap();
        let mut w = b.alloc(DType::F32, 2 * 4).unwrap();
        let spec = cases[0].spec;
        for (bias, spec, says) in [
            (Some(&short), spec, "bias"),
            (
                None,
                RouteSpec {
                    groups: Some((3, 1)),
                    ..spec
                },
                "groups",
            ),
            (
                None,
                RouteSpec {
                    groups: Some((8, 1)),
                    ..spec
                },
                "groups of 2",
            ),
        ] {
            let e = b
                .moe_route_scored(
                    View::rows(&lg, 2, 16).unwrap(),
                    bias,
                    &spec,
                    ViewMut::rows(&mut ids, 2, 4).unwrap(),
                    ViewMut::rows(&mut w, 2, 4).unwrap(),
                )
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    BackendError::BadArgument {
                        op: "moe_route_scored",
                        ..
                    }
                ) && e.to_string().contains(says),
                "{says}: {e}"
            );
        }
    }
}

// ---- latent attention --------------------------------------------------------------------------

/// A latent attention case: the pool, the heads, and per sequence (history, new tokens, block
/// table); blocks past the tables' are spare (block copies go there).
struct LatentCase {
    n_layers: usize,
    num_blocks: usize,
    block_size: usize,
    latent: usize,
    rope: usize,
    heads: usize,
    seqs: Vec<(usize, usize, Vec<u32>)>,
}

/// A step of `seqs` ((start, new tokens, table)); sequences without new tokens are left out.
fn latent_step(seqs: &[(usize, usize, Vec<u32>)], bs: usize) -> StepInputs {
    let max_blocks = seqs.iter().map(|q| q.2.len()).max().unwrap();
    let mut s = StepInputs {
        max_blocks,
        ..Default::default()
    };
    for (start, n, table) in seqs.iter().filter(|q| q.1 > 0) {
        s.seqs.push(SeqSpan {
            q_row: s.tokens.len() as u32,
            n_q: *n as u32,
            start_pos: *start as u32,
        });
        for p in *start..start + n {
            s.tokens.push(1);
            s.positions.push(p as u32);
            s.slot_mapping
                .push(table[p / bs] * bs as u32 + (p % bs) as u32);
        }
        s.logit_rows.push(s.tokens.len() as u32 - 1);
        let mut t = table.clone();
        t.resize(max_blocks, 0);
        s.block_tables.extend(t);
    }
    s
}

fn geometry(case: &LatentCase) -> AttnGeometry {
    let row = case.latent + case.rope;
    AttnGeometry {
        n_heads: case.heads,
        n_kv_heads: 1,
        head_dim: row,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: case.rope,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0 / (row as f32).sqrt(),
        window: None,
    }
}

/// Writes random rows for `step`'s tokens into every layer of both pools.
fn write_rows(
    b: &mut CudaBackend,
    c: &mut CpuBackend,
    case: &LatentCase,
    step: &StepInputs,
    dt: DType,
    rng: &mut Rng,
) {
    let (n, lat, rope) = (step.tokens.len(), case.latent, case.rope);
    b.begin_step(step).unwrap();
    c.begin_step(step).unwrap();
    for layer in 0..case.n_layers {
        let l = rounded(&rng.vec(n * lat, -1.0, 1.0), dt);
        let r = rounded(&rng.vec(n * rope, -1.0, 1.0), dt);
        // On the device the rotated keys sit in a wider row (as in the model's Q buffer).
        let ld = rope + 5;
        let mut wide = vec![0f32; n * ld];
        for t in 0..n {
            wide[t * ld + 2..t * ld + 2 + rope].copy_from_slice(&r[t * rope..(t + 1) * rope]);
        }
        let lb = put(b, dt, &l, n, lat);
        let rb = put(b, dt, &wide, n, ld);
        take_launches(b);
        b.kv_write_latent(
            View::rows(&lb, n, lat).unwrap(),
            View::new(&rb, Layout::new(2, n, rope, ld).unwrap()).unwrap(),
            layer,
        )
        .unwrap();
        assert_launched(b, vec![format!("kv_write_latent_{}", dt.name())]);
        let (lc, rc) = (cpu_put(c, &l), cpu_put(c, &r));
        c.kv_write_latent(
            View::rows(&lc, n, lat).unwrap(),
            View::rows(&rc, n, rope).unwrap(),
            layer,
        )
        .unwrap();
    }
}

/// The queries of `step` in every layer: (q_latent, q_rope) per layer.
type Queries = Vec<(Vec<f32>, Vec<f32>)>;

/// Attention of `step`'s tokens in every layer on both backends: (device, reference) outputs.
fn attend(
    b: &mut CudaBackend,
    c: &mut CpuBackend,
    case: &LatentCase,
    step: &StepInputs,
    qs: &Queries,
    dt: DType,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let (n, lat, rope, h) = (step.tokens.len(), case.latent, case.rope, case.heads);
    let g = geometry(case);
    b.begin_step(step).unwrap();
    c.begin_step(step).unwrap();
    let mut outs = Vec::new();
    for (layer, (ql, qr)) in qs.iter().enumerate() {
        let qlb = put(b, dt, ql, n, h * lat);
        // q_rope as a column range of a wider buffer; out into a strided window.
        let ld = h * rope + 4;
        let mut wide = vec![0f32; n * ld];
        for t in 0..n {
            wide[t * ld + 3..t * ld + 3 + h * rope]
                .copy_from_slice(&qr[t * h * rope..(t + 1) * h * rope]);
        }
        let qrb = put(b, dt, &wide, n, ld);
        let lo = h * lat + 6;
        let mut ob = b.alloc(dt, n * lo).unwrap();
        take_launches(b);
        b.attention_latent(
            View::rows(&qlb, n, h * lat).unwrap(),
            View::new(&qrb, Layout::new(3, n, h * rope, ld).unwrap()).unwrap(),
            &g,
            lat,
            layer,
            ViewMut::new(&mut ob, Layout::new(1, n, h * lat, lo).unwrap()).unwrap(),
        )
        .unwrap();
        assert_launched(b, vec![format!("attention_latent_{}", dt.name())]);
        let got = window_of(&get(b, &ob), n, lo, 1, h * lat);

        let (qlc, qrc) = (cpu_put(c, ql), cpu_put(c, qr));
        let mut oc = c.alloc(DType::F32, n * h * lat).unwrap();
        c.attention_latent(
            View::rows(&qlc, n, h * lat).unwrap(),
            View::rows(&qrc, n, h * rope).unwrap(),
            &g,
            lat,
            layer,
            ViewMut::rows(&mut oc, n, h * lat).unwrap(),
        )
        .unwrap();
        outs.push((got, cpu_get(c, &oc, n * h * lat)));
    }
    outs
}

fn latent_case(make: Make, case: &LatentCase, dt: DType, seed: u64) {
    let Some(mut b) = make(dt, MatmulMode::Auto) else {
        return;
    };
    assert!(b.supports(Capability::LatentAttention));
    let mut c = cpu();
    let mut rng = Rng::new(seed);
    let (bs, lat, rope, h) = (case.block_size, case.latent, case.rope, case.heads);
    let spec = KvSpec {
        n_layers: case.n_layers,
        num_blocks: case.num_blocks,
        block_size: bs,
        n_kv_heads: 1,
        head_dim: lat + rope,
    };
    b.init_latent_kv(spec).unwrap();
    c.init_latent_kv(spec).unwrap();
    let bb = b.kv_block_bytes();
    assert_eq!(bb, case.n_layers * bs * (lat + rope) * 2);
    assert_eq!(bb, b.latent_kv_block_bytes_for(&spec));
    assert_eq!(bb, c.kv_block_bytes());

    // The history (positions 0..start), then the new tokens.
    let history: Vec<_> = case
        .seqs
        .iter()
        .map(|(start, _, t)| (0, *start, t.clone()))
        .collect();
    write_rows(
        &mut b,
        &mut c,
        case,
        &latent_step(&history, bs),
        dt,
        &mut rng,
    );
    let step = latent_step(&case.seqs, bs);
    write_rows(&mut b, &mut c, case, &step, dt, &mut rng);
    let n = step.tokens.len();
    let qs: Queries = (0..case.n_layers)
        .map(|_| {
            (
                rounded(&rng.vec(n * h * lat, -1.0, 1.0), dt),
                rounded(&rng.vec(n * h * rope, -1.0, 1.0), dt),
            )
        })
        .collect();
    let outs = attend(&mut b, &mut c, case, &step, &qs, dt);
    for (layer, (got, want)) in outs.iter().enumerate() {
        let e = worst(got, want, 3e-3, 3e-3 + out_rtol(dt));
        assert!(
            e <= 1.0,
            "{} heads of {lat} + {rope}, layer {layer}, {}: worst {e}",
            h,
            dt.name()
        );
    }

    // The pool's blocks are the CPU's, byte for byte.
    let all: Vec<u32> = (0..case.num_blocks as u32).collect();
    let (mut dev, mut host) = (vec![0u8; all.len() * bb], vec![0u8; all.len() * bb]);
    b.kv_blocks_to_host(&all, &mut dev).unwrap();
    c.kv_blocks_to_host(&all, &mut host).unwrap();
    assert!(dev == host, "{}: the latent pools differ", dt.name());

    // Blocks move: the first sequence's copied on the device, the second's through the host,
    // each into spare blocks; attention over the moved blocks gives the same outputs.
    let mut spare = (case.seqs.iter().flat_map(|q| q.2.iter()).max().unwrap() + 1)..;
    let mut moved = case.seqs.clone();
    let t0: Vec<u32> = moved[0].2.iter().map(|_| spare.next().unwrap()).collect();
    let pairs: Vec<(u32, u32)> = moved[0].2.iter().copied().zip(t0.iter().copied()).collect();
    b.kv_copy_blocks(&pairs).unwrap();
    moved[0].2 = t0;
    let t1: Vec<u32> = moved[1].2.iter().map(|_| spare.next().unwrap()).collect();
    let mut bytes = vec![0u8; t1.len() * bb];
    b.kv_blocks_to_host(&moved[1].2, &mut bytes).unwrap();
    b.kv_blocks_from_host(&bytes, &t1).unwrap();
    moved[1].2 = t1;
    assert!(spare.start <= case.num_blocks as u32, "spare blocks");
    let moved_step = latent_step(&moved, bs);
    // The CPU pool keeps the old blocks: its outputs are the same.
    let again = attend(&mut b, &mut c, case, &moved_step, &qs, dt);
    for ((g1, _), (g2, _)) in outs.iter().zip(&again) {
        assert!(
            g1 == g2,
            "{}: attention over moved blocks differs",
            dt.name()
        );
    }
}

pub fn latent_attention_matches_the_reference(make: Make) {
    let cases = [
        // A narrow row: decode, prefill chunks after history, a fresh prefill, a context over
        // two tiles of 32 positions; blocks scattered, two layers.
        LatentCase {
            n_layers: 2,
            num_blocks: 16,
            block_size: 8,
            latent: 64,
            rope: 16,
            heads: 3,
            seqs: vec![
                (13, 1, vec![5, 2]),
                (3, 5, vec![9]),
                (0, 4, vec![0]),
                (40, 3, vec![1, 3, 4, 6, 7, 8]),
            ],
        },
        // DeepSeek's row (a latent of 512 and a rotated key of 64), 10 heads (two blocks of
        // heads a token, the second partly idle).
        LatentCase {
            n_layers: 1,
            num_blocks: 10,
            block_size: 16,
            latent: 512,
            rope: 64,
            heads: 10,
            seqs: vec![(20, 1, vec![3, 0]), (0, 3, vec![5]), (33, 2, vec![1, 2, 4])],
        },
    ];
    for dt in DTYPES {
        for (i, case) in cases.iter().enumerate() {
            latent_case(make, case, dt, 90 + i as u64);
        }
    }
}

/// The K/V ops refuse a latent pool and the latent ops a K/V pool (or none).
pub fn latent_pool_refusals(make: Make) {
    let Some(mut b) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let spec = KvSpec {
        n_layers: 1,
        num_blocks: 2,
        block_size: 4,
        n_kv_heads: 1,
        head_dim: 24,
    };
    let step = latent_step(&[(0, 2, vec![0])], 4);
    let x = put(&mut b, DType::F16, &[0.5; 2 * 24], 2, 24);
    let g = AttnGeometry {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 24,
        rope: Rope {
            style: RopeStyle::Interleaved,
            dims: 8,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 0.2,
        window: None,
    };
    // No pool yet.
    b.begin_step(&step).unwrap();
    let e = b
        .kv_write_latent(
            View::rows(&x, 2, 24).unwrap().col_range(0, 16).unwrap(),
            View::rows(&x, 2, 24).unwrap().col_range(16, 8).unwrap(),
            0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("KV pool"), "{e}");
    // A latent pool needs one row a token.
    let e = b
        .init_latent_kv(KvSpec {
            n_kv_heads: 2,
            ..spec
        })
        .unwrap_err();
    assert!(e.to_string().contains("one row per token"), "{e}");
    b.init_latent_kv(spec).unwrap();
    b.begin_step(&step).unwrap();
    let v = View::rows(&x, 2, 24).unwrap();
    let e = b.kv_write(v, v, &g, 0).unwrap_err();
    assert!(e.to_string().contains("latent"), "{e}");
    let mut out = b.alloc(DType::F16, 2 * 24).unwrap();
    let e = b
        .attention(v, &g, 0, ViewMut::rows(&mut out, 2, 24).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("latent"), "{e}");
    // A layer the pool lacks; a latent of a size the kernel cannot hold.
    let e = b
        .kv_write_latent(v.col_range(0, 16).unwrap(), v.col_range(16, 8).unwrap(), 1)
        .unwrap_err();
    assert!(e.to_string().contains("layer 1"), "{e}");
    let e = b
        .attention_latent(
            v.col_range(0, 15).unwrap(),
            v.col_range(15, 9).unwrap(),
            &g,
            15,
            0,
            ViewMut::rows(&mut out, 2, 24)
                .unwrap()
                .col_range(0, 15)
                .unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("latents of 15"), "{e}");
    // A K/V pool: the latent ops refuse it.
    b.init_kv(spec).unwrap();
    b.begin_step(&step).unwrap();
    let e = b
        .kv_write_latent(v.col_range(0, 16).unwrap(), v.col_range(16, 8).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("not a latent one"), "{e}");
    let e = b
        .attention_latent(
            v.col_range(0, 16).unwrap(),
            v.col_range(16, 8).unwrap(),
            &g,
            16,
            0,
            ViewMut::rows(&mut out, 2, 24)
                .unwrap()
                .col_range(0, 16)
                .unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("not a latent one"), "{e}");
}
