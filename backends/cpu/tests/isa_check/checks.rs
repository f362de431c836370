//! The checks themselves: each runs a kernel with every SIMD instruction set and with scalar on
//! the same inputs and hands both results to the report.

use half::f16;

use npu_backend_cpu::disjoint::Tile;
use npu_backend_cpu::kernels::attention::{
    kv_write, paged_attention, AttnParams, AttnSeq, KvLayout,
};
use npu_backend_cpu::kernels::elementwise::swiglu;
use npu_backend_cpu::kernels::matmul::{matmul, packed_job, MatmulInput, PackedJob};
use npu_backend_cpu::kernels::quantize::quantize_acts;
use npu_backend_cpu::kernels::vecmath::{exp_approx, round_through_f16};
use npu_backend_cpu::kernels::Isa;
use npu_backend_cpu::quant::testing::{random_ggml_rows, TestRng};
use npu_backend_cpu::quant::{PackedMatrix, QuantizedActs, WeightMatrix};
use npu_backend_cpu::threadpool::ThreadPool;
use npu_gguf::GgmlType;

use crate::Report;

/// Every ggml type that packs (each packed format: 4-, 5-, 6- and 8-bit values, the K-quants'
/// 2- and 3-bit values, IQ4's table values, per-block f16 scales with and without minimums,
/// super-block f32 scales, the K-quants' and IQ4_XS's integer sub-block scales, every offset).
const PACKED_TYPES: [GgmlType; 13] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8K,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
];

pub fn run_all(pool: &ThreadPool, isas: &[Isa], r: &mut Report) {
    packed_matmul(isas, r);
    matmul_through_pool(pool, isas, r);
    attention(pool, isas, r);
    quantize(pool, isas, r);
    elementwise(isas, r);
}

fn packed(ty: GgmlType, n: usize, k: usize, seed: u64) -> PackedMatrix {
    let bytes = random_ggml_rows(ty, n, k, seed);
    match WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k) {
        Some(WeightMatrix::Packed(p)) => p,
        _ => panic!("{} does not pack", ty.name()),
    }
}

fn acts(rows: usize, k: usize, seed: u64) -> (Vec<f32>, QuantizedActs) {
    let mut rng = TestRng::new(seed);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let mut a = QuantizedActs::new();
    a.quantize(&x, rows, k);
    a.fill_tiles();
    // Made up front, as `matmul` does before its tasks (the kernels' jobs only read them).
    a.sums();
    (x, a)
}

/// One packed job into a NaN-filled `rows x ldo` output.
fn run_job(isa: Isa, job: &PackedJob, ldo: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; job.acts.rows * ldo];
    let mut tile = Tile::whole(&mut out, ldo, 0..job.acts.rows, 0..job.w.n).expect("output tile");
    packed_job(isa, job, &mut tile);
    out
}

/// Whole jobs and jobs on a part of the groups and rows (outputs they must not touch stay NaN,
/// which compares equal bit for bit only if both kernels left them alone).
fn packed_matmul(isas: &[Isa], r: &mut Report) {
    for ty in PACKED_TYPES {
        for &(rows, n, k) in &[
            (1usize, 16usize, 64usize),
            (2, 32, 256),
            (3, 21, 512),
            (5, 37, 512),
            (9, 64, 256),
            (16, 48, 512),
            (12, 40, 256),
            (15, 32, 256),
            (38, 21, 256),
        ] {
            let k = if ty.block_len() == 256 { k.max(256) } else { k };
            let w = packed(ty, n, k, 21 + rows as u64);
            let (_, a) = acts(rows, k, 4 + n as u64);
            let ldo = n + 3;
            let whole = PackedJob {
                w: &w,
                acts: &a,
                groups: 0..w.groups(),
                rows: 0..rows,
            };
            let part = PackedJob {
                groups: w.groups().min(1)..w.groups(),
                rows: rows / 3..rows,
                ..whole.clone()
            };
            for (label, job) in [("whole", &whole), ("part", &part)] {
                let want = run_job(Isa::Scalar, job, ldo);
                for &isa in isas {
                    let got = run_job(isa, job, ldo);
                    let what = format!(
                        "{} {} {label} job rows={rows} n={n} k={k}",
                        isa.name(),
                        ty.name()
                    );
                    r.f32s("packed matmul", &what, &got, &want);
                }
            }
        }
    }
}

/// The parallel entry point (one thread here) for packed and f32 weights.
fn matmul_through_pool(pool: &ThreadPool, isas: &[Isa], r: &mut Report) {
    let k = 768;
    let rows = 7;
    let (x, a) = acts(rows, k, 3);
    // The K-quants take Q8_K activations, as in llama.cpp.
    let mut a8k = QuantizedActs::new();
    a8k.quantize_q8k(&x, rows, k);
    a8k.fill_tiles();
    a8k.sums();
    // Q4_1 and the K-quants of a Q4_K_M file (the latter read the activations' extra sums, made
    // on first use inside the call).
    let mut weights: Vec<(&str, WeightMatrix)> = [GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K]
        .into_iter()
        .map(|ty| (ty.name(), WeightMatrix::Packed(packed(ty, 96, k, 2))))
        .collect();
    for (ty, n) in [(GgmlType::F32, 40usize), (GgmlType::F16, 33)] {
        let bytes = random_ggml_rows(ty, n, k, 8);
        let w = WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k).expect("float weights");
        weights.push((ty.name(), w));
    }
    for (name, w) in &weights {
        let n = w.n();
        let quantized = match w {
            WeightMatrix::Packed(p)
                if p.format.act_blocks() == npu_backend_cpu::quant::acts::ActBlocks::Q8K =>
            {
                &a8k
            }
            _ => &a,
        };
        let run = |isa: Isa| {
            let mut out = vec![f32::NAN; rows * n];
            let input = MatmulInput {
                f32: &x,
                quantized,
                rows,
            };
            matmul(pool, isa, w, input, &mut out, n).map(|_| out)
        };
        let want = run(Isa::Scalar).expect("scalar matmul");
        for &isa in isas {
            let what = format!("{} {name} matmul rows={rows} n={n} k={k}", isa.name());
            match run(isa) {
                Ok(got) => r.f32s("matmul (pool, packed and f32 weights)", &what, &got, &want),
                Err(e) => r.fail(
                    "matmul (pool, packed and f32 weights)",
                    format!("{what}: {e}"),
                ),
            }
        }
    }
}

/// Paged attention over scrambled block tables: prefill chunks, decode rows, a sequence whose
/// history ends inside a block, and long histories split over the KV; then a decoding batch (a
/// task per sequence for all its KV heads); grouped-query heads.
fn attention(pool: &ThreadPool, isas: &[Isa], r: &mut Report) {
    // (history already cached, new tokens this step)
    let mixed = [
        (0usize, 5usize),
        (37, 1),
        (16, 20),
        (100, 1),
        (3, 9),
        (1100, 1),
        (1060, 4),
    ];
    let decoding: Vec<(usize, usize)> = [0usize, 5, 15, 16, 17, 40, 63, 100, 150]
        .iter()
        .map(|&h| (h, 1))
        .collect();
    for shapes in [&mixed[..], &decoding[..]] {
        attention_shapes(pool, isas, shapes, r);
    }
}

fn attention_shapes(pool: &ThreadPool, isas: &[Isa], shapes: &[(usize, usize)], r: &mut Report) {
    for &(n_kv, hd, bs, n_heads) in &[
        (3usize, 64usize, 16usize, 9usize),
        (2, 32, 8, 2),
        (1, 48, 5, 4),
        // One register per output row (up to 16 rows of a GQA group together), and eight.
        (1, 16, 16, 2),
        (2, 128, 16, 4),
    ] {
        // One layer's K and V interleaved block by block, as the backend lays them out.
        let block_elems = n_kv * hd * bs;
        let lay = KvLayout {
            n_kv_heads: n_kv,
            head_dim: hd,
            block_size: bs,
            block_stride: 2 * block_elems,
        };
        let num_blocks = 512;
        let mut rng = TestRng::new(5 + hd as u64);
        let mut cache = vec![f16::ZERO; num_blocks * 2 * block_elems];
        let (k_base, v_base) = (0, block_elems);
        // (history already cached, new tokens this step)
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        free.sort_by_key(|b| (b * 7919) % num_blocks as u32);
        let ld = (n_heads + 2 * n_kv) * hd;
        let total_new: usize = shapes.iter().map(|s| s.1).sum();
        let mut qkv = vec![0f32; total_new * ld];
        let mut tables = Vec::new();
        let mut row = 0;
        for &(hist, new) in shapes {
            let len = hist + new;
            let table: Vec<u32> = (0..len.div_ceil(bs))
                .map(|_| free.pop().expect("enough blocks"))
                .collect();
            for pos in 0..len {
                let kv_row: Vec<f32> = (0..ld).map(|_| rng.uniform(-1.0, 1.0)).collect();
                let slot = table[pos / bs] * bs as u32 + (pos % bs) as u32;
                let (k_col, v_col) = (n_heads * hd, (n_heads + n_kv) * hd);
                kv_write(
                    &lay,
                    &kv_row[k_col..],
                    ld,
                    &kv_row[v_col..],
                    ld,
                    &[slot],
                    &mut cache,
                    k_base,
                    v_base,
                );
                if pos >= hist {
                    let q = row + pos - hist;
                    qkv[q * ld..(q + 1) * ld].copy_from_slice(&kv_row);
                    for x in &mut qkv[q * ld..q * ld + n_heads * hd] {
                        *x = rng.uniform(-3.0, 3.0);
                    }
                }
            }
            tables.push(table);
            row += new;
        }
        let mut seqs = Vec::new();
        let mut row = 0;
        for (i, &(hist, new)) in shapes.iter().enumerate() {
            seqs.push(AttnSeq {
                q_row: row,
                n_q: new,
                start_pos: hist,
                block_table: &tables[i],
            });
            row += new;
        }
        let p = AttnParams {
            lay,
            n_heads,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
        };
        let ldo = n_heads * hd;
        let run = |isa: Isa| {
            let mut out = vec![f32::NAN; total_new * ldo];
            paged_attention(
                pool,
                isa,
                &p,
                &qkv,
                ld,
                &seqs,
                &cache[k_base..],
                &cache[v_base..],
                &mut out,
                ldo,
            )
            .map(|_| out)
        };
        let want = run(Isa::Scalar).expect("scalar attention");
        for &isa in isas {
            let what = format!(
                "{} attention kv_heads={n_kv} heads={n_heads} head_dim={hd} block={bs} \
                 sequences={}",
                isa.name(),
                shapes.len()
            );
            match run(isa) {
                Ok(got) => r.f32s("paged attention", &what, &got, &want),
                Err(e) => r.fail("paged attention", format!("{what}: {e}")),
            }
        }
    }
}

/// Activation quantization, as Q8_0 blocks and as Q8_K super-blocks: random rows plus a zero
/// block, exact halves (ties), and values far apart in size.
fn quantize(pool: &ThreadPool, isas: &[Isa], r: &mut Report) {
    use npu_backend_cpu::quant::acts::ActBlocks;
    let mut rng = TestRng::new(3);
    let shapes = [(1usize, 32usize), (13, 576), (9, 1536), (3, 512)];
    for (blocks, &(rows, k)) in [ActBlocks::Q8_0, ActBlocks::Q8K]
        .into_iter()
        .flat_map(|b| shapes.iter().map(move |s| (b, s)))
        .filter(|(b, (_, k))| *b == ActBlocks::Q8_0 || k % 256 == 0)
    {
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
        x[..32].fill(0.0);
        if k >= 96 {
            for (i, v) in x[32..64].iter_mut().enumerate() {
                *v = (i as f32 - 16.0) * 0.5;
            }
            for (i, v) in x[64..96].iter_mut().enumerate() {
                *v = if i == 7 { 3.0e4 } else { (i as f32) * 1e-3 };
            }
        }
        let mut want = QuantizedActs::new();
        match blocks {
            ActBlocks::Q8_0 => want.quantize(&x, rows, k),
            ActBlocks::Q8K => want.quantize_q8k(&x, rows, k),
        }
        for &isa in isas {
            let mut got = QuantizedActs::new();
            let what = format!("{} quantize {blocks:?} rows={rows} k={k}", isa.name());
            if let Err(e) = quantize_acts(pool, isa, &x, rows, k, blocks, &mut got) {
                r.fail("activation quantization", format!("{what}: {e}"));
                continue;
            }
            r.exact(
                "activation quantization",
                &format!("{what} values"),
                &got.qs,
                &want.qs,
            );
            r.f32s(
                "activation quantization",
                &format!("{what} scales"),
                &got.d,
                &want.d,
            );
            r.f32s(
                "activation quantization",
                &format!("{what} sums"),
                &got.s,
                &want.s,
            );
            r.exact(
                "activation quantization",
                &format!("{what} integer sums"),
                &got.isum,
                &want.isum,
            );
        }
    }
}

/// SwiGLU (its vector exp) and f16 rounding over ordinary values and the edges: huge and tiny
/// magnitudes, infinities, f16 overflow, subnormals and ties.
fn elementwise(isas: &[Isa], r: &mut Report) {
    let mut rng = TestRng::new(11);
    let ff = 777;
    let mut gate_up: Vec<f32> = (0..3 * 2 * ff).map(|_| rng.uniform(-12.0, 12.0)).collect();
    let edges = [
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        88.0,
        -88.0,
        100.0,
        -100.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
    ];
    gate_up[..edges.len()].copy_from_slice(&edges);
    let mut want = vec![0f32; 3 * ff];
    let swiglu_rows = |isa: Isa, out: &mut [f32]| {
        for (row, o) in gate_up.chunks_exact(2 * ff).zip(out.chunks_exact_mut(ff)) {
            swiglu(isa, &row[..ff], &row[ff..], o);
        }
    };
    swiglu_rows(Isa::Scalar, &mut want);
    for &isa in isas {
        let mut got = vec![0f32; 3 * ff];
        swiglu_rows(isa, &mut got);
        r.f32s(
            "swiglu (vector exp)",
            &format!("{} swiglu ff={ff}", isa.name()),
            &got,
            &want,
        );
    }

    let mut vals: Vec<f32> = (0..4099)
        .map(|i| ((i as f32) * 0.731).sin() * 10f32.powi((i % 13) - 8))
        .collect();
    let f16_edges = [
        65504.0,
        65520.0,
        1e6,
        -1e6,
        6.0e-8,
        3.0e-8,
        2.98e-8,
        6.1e-5,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
    ];
    vals[..f16_edges.len()].copy_from_slice(&f16_edges);
    let mut want = vals.clone();
    round_through_f16(Isa::Scalar, &mut want);
    for &isa in isas {
        let mut got = vals.clone();
        round_through_f16(isa, &mut got);
        r.f32s(
            "f16 rounding",
            &format!("{} round_through_f16", isa.name()),
            &got,
            &want,
        );
    }
}

/// The vector exp itself, as this target compiles it: within its stated error of e^x (not a
/// comparison with scalar, so not part of the fault self-test).
pub fn exp_accuracy(r: &mut Report) {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let want = (x as f64).exp();
        worst = worst.max(((exp_approx(x) as f64 - want) / want).abs());
        x += 0.0173;
    }
    if worst >= 3e-7 {
        r.fail(
            "exp accuracy",
            format!("exp_approx relative error {worst:e} exceeds 3e-7"),
        );
    } else {
        r.exact("exp accuracy", "exp_approx within 3e-7", &[true], &[true]);
    }
}
