//! Conformance cases of the int8 KV pool (`kv_cache_dtype: int8`, src/kv.rs and
//! kernels/attention_i8.cu), against the CPU backend with its own int8 pool, through the
//! `Backend` trait on both: the block size the pool is sized by, the block bytes the KV writes
//! leave (byte for byte the CPU's), the fused rope + KV write (the bytes of rope then the KV
//! write), and paged attention over the int8 cache.
//!
//! Attention's tolerance: |cuda - cpu| <= 3e-3 + (3e-3 + the output dtype's rounding) * |cpu|,
//! the f16 cache's bar (attention.rs). Both read the same int8 values and scales; the CPU
//! reference rounds queries and probabilities through f16 and its exponential is an
//! approximation, which is what the bar covers.

use super::{out_rtol, Make, DTYPES};
use crate::common::*;
use npu_backend::{
    AttnGeometry, Backend, DType, HostSlice, HostSliceMut, KvDtype, KvSpec, Readback, SeqSpan,
    StepInputs, View, ViewMut,
};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_backend_cuda::{CudaBackend, MatmulMode};
use npu_model::{Rope, RopeStyle};

type CpuBuf = <CpuBackend as Backend>::Buffer;

fn cpu_int8() -> CpuBackend {
    let mut c = CpuBackend::new(CpuConfig {
        threads: 1,
        f32_reference: false,
    });
    c.set_kv_dtype(KvDtype::Int8).unwrap();
    c
}

fn cpu_put(c: &mut CpuBackend, v: &[f32], rows: usize, cols: usize) -> CpuBuf {
    let mut buf = c.alloc(DType::F32, v.len()).unwrap();
    c.upload(
        HostSlice::F32(v),
        ViewMut::rows(&mut buf, rows, cols).unwrap(),
    )
    .unwrap();
    buf
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

/// The whole pool's bytes (every block, in order).
fn pool_bytes<B: Backend>(b: &mut B, spec: &KvSpec) -> Vec<u8> {
    let blocks: Vec<u32> = (0..spec.num_blocks as u32).collect();
    let mut out = vec![0u8; blocks.len() * b.kv_block_bytes()];
    b.kv_blocks_to_host(&blocks, &mut out).unwrap();
    out
}

fn geometry(
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    rope: Rope,
    window: Option<u32>,
) -> AttnGeometry {
    AttnGeometry {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        rope,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    }
}

fn plain_rope(dims: usize, style: RopeStyle) -> Rope {
    Rope {
        style,
        dims,
        base: 10000.0,
        freq_scale: 1.0,
        factors: None,
    }
}

/// K and V rows (t x 2 * kvw) with an outlier channel per head (8x, as Llama's keys have), as
/// `dt` stores them.
fn kv_rows(rng: &mut Rng, t: usize, kvw: usize, hd: usize, dt: DType) -> Vec<f32> {
    let mut kv = rng.vec(t * 2 * kvw, -1.5, 1.5);
    for (i, x) in kv.iter_mut().enumerate() {
        if i % hd == 3 {
            *x *= 8.0;
        }
    }
    rounded(&kv, dt)
}

/// Sequences of a step: (start position, new tokens, block table).
type Seqs = Vec<(usize, usize, Vec<u32>)>;

/// The history step (positions 0..start of every sequence) or the new tokens' step.
fn make_step(seqs: &Seqs, bs: usize, history: bool) -> StepInputs {
    let max_blocks = seqs.iter().map(|q| q.2.len()).max().unwrap();
    let mut st = StepInputs {
        max_blocks,
        ..Default::default()
    };
    for (start, n_new, table) in seqs {
        let (from, n) = if history {
            (0, *start)
        } else {
            (*start, *n_new)
        };
        if n == 0 {
            continue;
        }
        st.seqs.push(SeqSpan {
            q_row: st.tokens.len() as u32,
            n_q: n as u32,
            start_pos: from as u32,
        });
        for p in from..from + n {
            st.tokens.push(0);
            st.positions.push(p as u32);
            st.slot_mapping
                .push(table[p / bs] * bs as u32 + (p % bs) as u32);
        }
        let mut row = table.clone();
        row.resize(max_blocks, 0);
        st.block_tables.extend(row);
    }
    st
}

/// The int8 pool is sized as the CPU's (`kv_block_bytes_for` before `init_kv`, the block after
/// it): ~1.9x the tokens of f16 in the same memory; its blocks copy and round-trip through host
/// memory; a latent pool refuses int8 by name.
pub fn int8_kv_pool_is_sized_and_copied_as_the_cpus(make: Make) {
    let Some(mut b) = make(DType::F16, MatmulMode::Auto) else {
        return;
    };
    let spec = KvSpec {
        n_layers: 30,
        num_blocks: 6,
        block_size: 16,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let f16_bytes = b.kv_block_bytes_for(&spec);
    assert_eq!(f16_bytes, 368_640, "the default model's f16 block");
    b.set_kv_dtype(KvDtype::Int8).unwrap();
    assert_eq!(b.kv_dtype(), KvDtype::Int8);
    let c = cpu_int8();
    assert_eq!(b.kv_block_bytes_for(&spec), c.kv_block_bytes_for(&spec));
    assert_eq!(
        b.kv_block_bytes_for(&spec),
        190_080,
        "docs/kv-cache.md's int8 block"
    );
    let ratio = f16_bytes as f64 / b.kv_block_bytes_for(&spec) as f64;
    assert!(ratio > 1.9, "{ratio}");
    b.init_kv(spec).unwrap();
    let bb = b.kv_block_bytes();
    assert_eq!(bb, 190_080);
    let src: Vec<u8> = (0..2 * bb).map(|i| (i % 251) as u8).collect();
    b.kv_blocks_from_host(&src, &[4, 1]).unwrap();
    b.kv_copy_blocks(&[(4, 0), (1, 5)]).unwrap();
    let mut out = vec![0u8; 2 * bb];
    b.kv_blocks_to_host(&[0, 5], &mut out).unwrap();
    assert_eq!(out, src);
    assert!(b.kv_copy_blocks(&[(6, 0)]).is_err());
    assert!(b.kv_blocks_to_host(&[0], &mut out).is_err(), "wrong length");
    let e = b
        .init_latent_kv(KvSpec {
            n_kv_heads: 1,
            ..spec
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("kv_cache_dtype int8") && e.contains("latent"),
        "{e}"
    );
}

/// `kv_write` into an int8 pool leaves the CPU backend's bytes, byte for byte (the same rows,
/// as each activation dtype stores them), over two layers, odd and even head sizes, and block
/// sizes below and above the attention tile; `rope_kv_write` (one launch) leaves the bytes and
/// rotated rows of `rope` then `kv_write` (`set_fuse(false)`), in both rope styles, with partial
/// rotary dimensions.
pub fn int8_kv_writes_leave_the_cpus_bytes(make: Make) {
    let shapes = [(2usize, 64usize, 16usize), (3, 80, 5), (1, 128, 48)];
    for (si, &(n_kv, hd, bs)) in shapes.iter().enumerate() {
        for (di, dt) in DTYPES.into_iter().enumerate() {
            let Some(mut b) = make(dt, MatmulMode::Auto) else {
                return;
            };
            let mut rng = Rng::new(100 + 10 * si as u64 + di as u64);
            let spec = KvSpec {
                n_layers: 2,
                num_blocks: 5,
                block_size: bs,
                n_kv_heads: n_kv,
                head_dim: hd,
            };
            b.set_kv_dtype(KvDtype::Int8).unwrap();
            b.init_kv(spec).unwrap();
            let mut c = cpu_int8();
            c.init_kv(spec).unwrap();
            let g = geometry(
                2 * n_kv,
                n_kv,
                hd,
                plain_rope(hd, RopeStyle::Interleaved),
                None,
            );
            let kvw = n_kv * hd;
            // Tokens scattered over the pool, some rows zero (a zero scale).
            let t = 2 * bs + 3;
            let seqs: Seqs = vec![(0, t, vec![4, 1, 3, 0])];
            let st = make_step(&seqs, bs, false);
            for layer in 0..2 {
                let mut kv = kv_rows(&mut rng, t, kvw, hd, dt);
                kv[(t - 1) * 2 * kvw..(t - 1) * 2 * kvw + hd].fill(0.0);
                b.begin_step(&st).unwrap();
                c.begin_step(&st).unwrap();
                let kb = put(&mut b, dt, &kv, t, 2 * kvw);
                let kc = cpu_put(&mut c, &kv, t, 2 * kvw);
                take_launches(&b);
                let v = View::rows(&kb, t, 2 * kvw).unwrap();
                b.kv_write(
                    v.col_range(0, kvw).unwrap(),
                    v.col_range(kvw, kvw).unwrap(),
                    &g,
                    layer,
                )
                .unwrap();
                assert_launched(&b, vec![format!("kv_write_i8_{}", dt.name())]);
                let v = View::rows(&kc, t, 2 * kvw).unwrap();
                c.kv_write(
                    v.col_range(0, kvw).unwrap(),
                    v.col_range(kvw, kvw).unwrap(),
                    &g,
                    layer,
                )
                .unwrap();
            }
            let (got, want) = (pool_bytes(&mut b, &spec), pool_bytes(&mut c, &spec));
            assert_eq!(got.len(), want.len());
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                panic!(
                    "{} n_kv {n_kv} hd {hd} bs {bs}: byte {i} of the pool is {} (the CPU's {})",
                    dt.name(),
                    got[i],
                    want[i]
                );
            }
            assert!(got.iter().any(|&x| x != 0), "something was written");
        }
    }
    // The fused rope + KV write against rope then the KV write.
    for (style, dims, hd) in [
        (RopeStyle::Interleaved, 64, 64),
        (RopeStyle::Halves, 32, 80),
        (RopeStyle::Halves, 128, 128),
    ] {
        for dt in DTYPES {
            let run = |fuse: bool| -> Option<(Vec<u8>, Vec<f32>, Vec<String>)> {
                let mut b = make(dt, MatmulMode::Auto)?;
                b.set_fuse(fuse);
                let (n_kv, n_heads, bs) = (2, 4, 16);
                let spec = KvSpec {
                    n_layers: 2,
                    num_blocks: 4,
                    block_size: bs,
                    n_kv_heads: n_kv,
                    head_dim: hd,
                };
                b.set_kv_dtype(KvDtype::Int8).unwrap();
                b.init_kv(spec).unwrap();
                let g = geometry(n_heads, n_kv, hd, plain_rope(dims, style), None);
                let w = (n_heads + 2 * n_kv) * hd;
                let t = 21;
                let st = make_step(&vec![(40, t, vec![3, 0, 2, 1])], bs, false);
                b.begin_step(&st).unwrap();
                let mut rng = Rng::new(7 + hd as u64);
                let x = rounded(&rng.vec(t * w, -2.0, 2.0), dt);
                let mut qkv = put(&mut b, dt, &x, t, w);
                take_launches(&b);
                b.rope_kv_write(ViewMut::rows(&mut qkv, t, w).unwrap(), &g, 1)
                    .unwrap();
                let launched = take_launches(&b).unwrap_or_default();
                Some((pool_bytes(&mut b, &spec), get(&mut b, &qkv), launched))
            };
            let (Some(fused), Some(plain)) = (run(true), run(false)) else {
                return;
            };
            let s = dt.name();
            assert!(
                fused.0 == plain.0,
                "{s} {style:?} {dims}/{hd}: the pool differs when fused"
            );
            assert!(
                fused.1 == plain.1,
                "{s} {style:?} {dims}/{hd}: the rows differ when fused"
            );
            if !fused.2.is_empty() {
                assert_eq!(fused.2, vec![format!("rope_kv_write_i8_{s}")]);
                assert_eq!(
                    plain.2,
                    vec![format!("rope_{s}"), format!("kv_write_i8_{s}")]
                );
            }
        }
    }
}

/// A step of several sequences over an int8 pool, attention checked against the CPU backend's
/// int8 attention over the same cache (whose bytes are checked equal first).
struct Int8Case {
    spec: KvSpec,
    n_heads: usize,
    seqs: Seqs,
    layer: usize,
    /// Whether the context is split (and combined).
    split: bool,
    window: Option<u32>,
}

fn run_int8_case(make: Make, case: &Int8Case, dt: DType, seed: u64) {
    let Some(mut b) = make(dt, MatmulMode::Auto) else {
        return;
    };
    let mut rng = Rng::new(seed);
    let s = case.spec;
    let (hd, n_kv, bs) = (s.head_dim, s.n_kv_heads, s.block_size);
    let g = geometry(
        case.n_heads,
        n_kv,
        hd,
        plain_rope(hd, RopeStyle::Interleaved),
        case.window,
    );
    b.set_kv_dtype(KvDtype::Int8).unwrap();
    b.init_kv(s).unwrap();
    let mut c = cpu_int8();
    c.init_kv(s).unwrap();
    let kvw = n_kv * hd;
    let name = dt.name();
    for history in [true, false] {
        let st = make_step(&case.seqs, bs, history);
        let t = st.tokens.len();
        if t == 0 {
            continue;
        }
        b.begin_step(&st).unwrap();
        c.begin_step(&st).unwrap();
        let kv = kv_rows(&mut rng, t, kvw, hd, dt);
        let kb = put(&mut b, dt, &kv, t, 2 * kvw);
        let kc = cpu_put(&mut c, &kv, t, 2 * kvw);
        let v = View::rows(&kb, t, 2 * kvw).unwrap();
        b.kv_write(
            v.col_range(0, kvw).unwrap(),
            v.col_range(kvw, kvw).unwrap(),
            &g,
            case.layer,
        )
        .unwrap();
        let v = View::rows(&kc, t, 2 * kvw).unwrap();
        c.kv_write(
            v.col_range(0, kvw).unwrap(),
            v.col_range(kvw, kvw).unwrap(),
            &g,
            case.layer,
        )
        .unwrap();
        if history {
            assert!(
                pool_bytes(&mut b, &s) == pool_bytes(&mut c, &s),
                "{name}: the history's bytes differ from the CPU's"
            );
            if let Some(w) = case.window {
                poison_before_the_window(&mut b, &mut c, case, w as usize);
            }
            continue;
        }
        let qw = g.q_width();
        let q = rounded(&rng.vec(t * qw, -1.5, 1.5), dt);
        let qb = put(&mut b, dt, &q, t, qw);
        let qc = cpu_put(&mut c, &q, t, qw);
        let mut out = b.alloc(dt, t * qw).unwrap();
        let mut out_c = c.alloc(DType::F32, t * qw).unwrap();
        take_launches(&b);
        b.attention(
            View::rows(&qb, t, qw).unwrap(),
            &g,
            case.layer,
            ViewMut::rows(&mut out, t, qw).unwrap(),
        )
        .unwrap();
        c.attention(
            View::rows(&qc, t, qw).unwrap(),
            &g,
            case.layer,
            ViewMut::rows(&mut out_c, t, qw).unwrap(),
        )
        .unwrap();
        let launched = take_launches(&b).unwrap_or_default();
        if !launched.is_empty() {
            assert_eq!(launched[0], format!("attention_i8_{name}"));
            let combined = launched.contains(&format!("attention_combine_{name}"));
            assert_eq!(combined, case.split, "{launched:?}");
        }
        let got = get(&mut b, &out);
        let want = cpu_get(&mut c, &out_c, t * qw);
        let e = worst(&got, &want, 3e-3, 3e-3 + out_rtol(dt));
        assert!(
            e <= 1.0,
            "{name} ({launched:?}): worst {e}; first values {:?} vs {:?}",
            &got[..4],
            &want[..4]
        );
    }
}

/// Fills every block wholly before the first position a sequence's new tokens see with 0xff
/// bytes (values -1, scales NaN) on both backends: windowed attention must not read them.
fn poison_before_the_window(b: &mut CudaBackend, c: &mut CpuBackend, case: &Int8Case, w: usize) {
    let bs = case.spec.block_size;
    let bb = b.kv_block_bytes();
    for (start, _, table) in &case.seqs {
        let dead: Vec<u32> = table[..(start + 1).saturating_sub(w) / bs].to_vec();
        if !dead.is_empty() {
            let junk = vec![0xff; dead.len() * bb];
            b.kv_blocks_from_host(&junk, &dead).unwrap();
            c.kv_blocks_from_host(&junk, &dead).unwrap();
        }
    }
}

/// Paged attention over an int8 pool: prefill chunks mixed with decodes under grouped-query
/// attention, a long decode split and combined, sliding windows (one past poisoned blocks), and
/// odd head and block sizes; every activation dtype.
pub fn int8_paged_attention_matches_the_cpu_backend(make: Make) {
    let gqa = |window| Int8Case {
        spec: KvSpec {
            n_layers: 2,
            num_blocks: 32,
            block_size: 16,
            n_kv_heads: 2,
            head_dim: 64,
        },
        n_heads: 6,
        seqs: vec![
            (20, 37, vec![5, 9, 2, 14]),
            (100, 1, vec![0, 1, 3, 4, 6, 7, 8]),
            (3, 1, vec![31]),
            (0, 5, vec![20]),
        ],
        layer: 1,
        split: false,
        window,
    };
    let long = |window| Int8Case {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 24,
            block_size: 32,
            n_kv_heads: 1,
            head_dim: 128,
        },
        n_heads: 4,
        seqs: vec![(699, 1, (0..22).rev().collect())],
        layer: 0,
        split: true,
        window,
    };
    for (i, dt) in DTYPES.into_iter().enumerate() {
        run_int8_case(make, &gqa(None), dt, 200 + i as u64);
        run_int8_case(make, &long(None), dt, 210 + i as u64);
    }
    run_int8_case(make, &gqa(Some(7)), DType::F16, 220);
    run_int8_case(make, &long(Some(200)), DType::F32, 221);
    let odd = Int8Case {
        spec: KvSpec {
            n_layers: 1,
            num_blocks: 12,
            block_size: 5,
            n_kv_heads: 3,
            head_dim: 80,
        },
        n_heads: 3,
        seqs: vec![(41, 9, (0..10).collect()), (7, 1, vec![11, 10])],
        layer: 0,
        split: false,
        window: None,
    };
    run_int8_case(make, &odd, DType::BF16, 222);
}
