//! The scalar packed kernel against f64 arithmetic on the operands as the reference dequantizer
//! gives them (the file's weights, the quantized activations), and every SIMD kernel this machine
//! can run against the scalar one, bit for bit.

use super::*;
use crate::disjoint::Tile;
use crate::quant::testing::{random_ggml_rows, TestRng};
use npu_gguf::GgmlType;

const TYPES: [GgmlType; 13] = [
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

fn packed(ty: GgmlType, n: usize, k: usize, seed: u64) -> PackedMatrix {
    let bytes = random_ggml_rows(ty, n, k, seed);
    match WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k).unwrap() {
        WeightMatrix::Packed(p) => p,
        WeightMatrix::F32 { .. } => panic!("expected packed"),
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

fn run(isa: Isa, w: &PackedMatrix, a: &QuantizedActs, ldo: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; a.rows * ldo];
    let mut tile = Tile::whole(&mut out, ldo, 0..a.rows, 0..w.n).unwrap();
    packed_job(
        isa,
        &PackedJob {
            w,
            acts: a,
            groups: 0..w.groups(),
            rows: 0..a.rows,
        },
        &mut tile,
    );
    out
}

/// The kernel's result is the exact product of the file's weights with the quantized activations,
/// up to f32 rounding: for Q4_1/Q5_1 the minimum multiplies the activation block sum rounded
/// through f16 (`s`, as llama.cpp's Q8_1 has it), which the reference takes as the kernel does.
#[test]
fn scalar_matches_dequantized_arithmetic() {
    for ty in TYPES {
        for &(rows, n, k) in &[(1usize, 16usize, 256usize), (3, 21, 512), (6, 48, 256)] {
            let bytes = random_ggml_rows(ty, n, k, 5);
            let rb = ty.row_bytes(k).unwrap();
            let w = match WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k).unwrap() {
                WeightMatrix::Packed(p) => p,
                WeightMatrix::F32 { .. } => panic!("expected packed"),
            };
            let (_, a) = acts(rows, k, 9);
            let got = run(Isa::Scalar, &w, &a, n);
            let mut wrow = vec![0f32; k];
            let f = w.format;
            let f16_min = f.scales == crate::quant::packed::Scales::F16Min;
            for nn in 0..n {
                npu_gguf::quants::dequantize_row(ty, &bytes[nn * rb..(nn + 1) * rb], &mut wrow)
                    .unwrap();
                let gd = w.group_data(nn / 16);
                for m in 0..rows {
                    let mut want = 0f64;
                    let mut mag = 0f64;
                    for b in 0..k / 32 {
                        let blk = m * k / 32 + b;
                        let mn = if f16_min {
                            crate::quant::packed::lane_scales(f, gd, f.block_at(b), nn % 16).m
                        } else {
                            0.0
                        };
                        let span = b * 32..b * 32 + 32;
                        for (&q, &w) in a.qs[m * k..][span.clone()].iter().zip(&wrow[span]) {
                            let xv = q as f64 * a.d[blk] as f64;
                            want += xv * (w - mn) as f64;
                            mag += (xv * w as f64).abs();
                        }
                        want += mn as f64 * a.s[blk] as f64;
                    }
                    let g = got[m * n + nn] as f64;
                    let tol = 1e-5 * mag + 1e-5;
                    assert!(
                        (g - want).abs() <= tol,
                        "{} rows={rows} n={n} k={k} [{m},{nn}]: kernel {g} reference {want}",
                        ty.name()
                    );
                }
            }
        }
    }
}

#[test]
fn simd_kernels_match_scalar_bit_for_bit() {
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|i| *i != Isa::Scalar)
        .collect();
    if isas.is_empty() {
        eprintln!("no SIMD instruction set on this machine: only the scalar kernel was tested");
    }
    #[cfg(target_arch = "x86_64")]
    eprintln!("AMX available: {}", amx::available());
    for ty in TYPES {
        for &(rows, n, k) in &[
            (1usize, 16usize, 64usize),
            (2, 32, 256),
            (5, 37, 512),
            (9, 64, 256),
            // 16 rows and more also take the AMX path where the machine has it.
            (16, 48, 512),
            (37, 21, 256),
            // More rows than a tile, and every remainder.
            (12, 32, 256),
            (15, 16, 256),
            (24, 16, 256),
            (38, 21, 256),
            // Long rows: the AVX2 kernel takes rows in panels of fewer rows than this.
            (37, 21, 8192),
            // Many row tiles, a partial last group, and rows past the last whole tile.
            (64, 40, 512),
            (77, 35, 256),
        ] {
            let k = if ty.block_len() == 256 {
                k.max(256) / 256 * 256
            } else {
                k
            };
            let w = packed(ty, n, k, 21);
            let (_, a) = acts(rows, k, 4);
            let want = run(Isa::Scalar, &w, &a, n + 3);
            for &isa in &isas {
                let got = run(isa, &w, &a, n + 3);
                for m in 0..rows {
                    for nn in 0..n {
                        let (g, s) = (got[m * (n + 3) + nn], want[m * (n + 3) + nn]);
                        assert_eq!(
                            g.to_bits(),
                            s.to_bits(),
                            "{} {} rows={rows} n={n} k={k} [{m},{nn}]: {g} vs scalar {s}",
                            isa.name(),
                            ty.name()
                        );
                    }
                    // Padding columns beyond n are never written.
                    for nn in n..n + 3 {
                        assert!(got[m * (n + 3) + nn].is_nan());
                    }
                }
            }
        }
    }
}

#[test]
fn parallel_matmul_matches_single_job() {
    let pool = ThreadPool::new(3);
    let k = 576;
    // 300 rows: tasks take them in chunks of `ROW_CHUNK` (128, 128, 44).
    let cases = [(1usize, 192usize), (7, 960), (33, 96), (300, 96)];
    for (ty, &(rows, n)) in [GgmlType::Q4_1, GgmlType::Q4_0]
        .into_iter()
        .flat_map(|ty| cases.iter().map(move |c| (ty, c)))
    {
        let w = WeightMatrix::Packed(packed(ty, n, k, 2));
        let (x, a) = acts(rows, k, 3);
        let mut par = vec![0f32; rows * n];
        matmul(
            &pool,
            Isa::active(),
            &w,
            MatmulInput {
                f32: &x,
                quantized: &a,
                rows,
            },
            &mut par,
            n,
        )
        .unwrap();
        let WeightMatrix::Packed(p) = &w else {
            unreachable!()
        };
        let one = run(Isa::active(), p, &a, n);
        assert_eq!(par, one, "{} rows={rows} n={n}", ty.name());
    }
}

#[test]
fn f32_weights_match_naive() {
    let pool = ThreadPool::new(2);
    let (n, k, rows) = (40usize, 70usize, 3usize);
    let bytes = random_ggml_rows(GgmlType::F32, n, k, 8);
    let w = WeightMatrix::from_ggml_parts(&[(GgmlType::F32, &bytes, n)], k).unwrap();
    let WeightMatrix::F32 { data, .. } = &w else {
        panic!()
    };
    let mut rng = TestRng::new(1);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-1.0, 1.0)).collect();
    for isa in Isa::available() {
        let mut out = vec![0f32; rows * n];
        let empty = QuantizedActs::new();
        matmul(
            &pool,
            isa,
            &w,
            MatmulInput {
                f32: &x,
                quantized: &empty,
                rows,
            },
            &mut out,
            n,
        )
        .unwrap();
        for m in 0..rows {
            for nn in 0..n {
                let want: f32 = (0..k).map(|kk| x[m * k + kk] * data[nn * k + kk]).sum();
                assert!((out[m * n + nn] - want).abs() < 1e-4, "{}", isa.name());
            }
        }
    }
}

/// F16 and BF16 weights meet activations rounded to their own type first (llama.cpp's CPU
/// matmul converts its input to the weights' `vec_dot_type`): the product equals the exact dot
/// product of the rounded activations, and differs from the unrounded one.
#[test]
fn half_weights_take_activations_rounded_to_their_type() {
    let pool = ThreadPool::new(2);
    let (n, k, rows) = (32usize, 64usize, 2usize);
    let mut rng = TestRng::new(5);
    // Values with more mantissa bits than f16/bf16 keep, so the rounding shows.
    let x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-3.0, 3.0)).collect();
    for (ty, round) in [
        (
            GgmlType::F16,
            (|v: f32| half::f16::from_f32(v).to_f32()) as fn(f32) -> f32,
        ),
        (GgmlType::BF16, |v: f32| half::bf16::from_f32(v).to_f32()),
    ] {
        let bytes = random_ggml_rows(ty, n, k, 9);
        let w = WeightMatrix::from_ggml_parts(&[(ty, &bytes, n)], k).unwrap();
        let WeightMatrix::F32 { data, .. } = &w else {
            panic!("expected float weights")
        };
        for isa in Isa::available() {
            let mut out = vec![0f32; rows * n];
            let empty = QuantizedActs::new();
            let input = MatmulInput {
                f32: &x,
                quantized: &empty,
                rows,
            };
            matmul(&pool, isa, &w, input, &mut out, n).unwrap();
            let mut far_from_exact = false;
            for m in 0..rows {
                for nn in 0..n {
                    let dot = |f: &dyn Fn(f32) -> f32| -> f64 {
                        (0..k)
                            .map(|kk| f(x[m * k + kk]) as f64 * data[nn * k + kk] as f64)
                            .sum()
                    };
                    let (want, exact) = (dot(&|v| round(v)), dot(&|v| v));
                    let got = out[m * n + nn] as f64;
                    assert!((got - want).abs() < 1e-4, "{} {}", ty.name(), isa.name());
                    far_from_exact |= (got - exact).abs() > 1e-3;
                }
            }
            assert!(
                far_from_exact,
                "{}: activations were not rounded",
                ty.name()
            );
        }
    }
}

/// `matmul` makes the activation sums the K-quant formats need before its tasks start (a task
/// that made them would leave the others blocked on them; a job without them panics).
#[test]
fn matmul_makes_the_k_quant_sums_before_its_tasks() {
    let pool = ThreadPool::new(2);
    let (rows, n, k) = (1usize, 256usize, 2048usize);
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q4_0] {
        let w = WeightMatrix::Packed(packed(ty, n, k, 11));
        let mut rng = TestRng::new(12);
        let x: Vec<f32> = (0..rows * k).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let q8k = ty != GgmlType::Q4_0;
        let quantize = |a: &mut QuantizedActs| {
            if q8k {
                a.quantize_q8k(&x, rows, k)
            } else {
                a.quantize(&x, rows, k)
            }
        };
        let mut a = QuantizedActs::new();
        quantize(&mut a);
        assert!(a.sums_made().is_none());
        let mut out = vec![0f32; rows * n];
        let input = MatmulInput {
            f32: &x,
            quantized: &a,
            rows,
        };
        matmul(&pool, Isa::active(), &w, input, &mut out, n).unwrap();
        let WeightMatrix::Packed(p) = &w else {
            unreachable!()
        };
        assert_eq!(a.sums_made().is_some(), p.format.needs_act_sums(), "{ty:?}");
        // The same product as the scalar kernel's on activations that had their sums already.
        let mut b = QuantizedActs::new();
        quantize(&mut b);
        b.sums();
        assert_eq!(out, run(Isa::Scalar, p, &b, n), "{ty:?}");
    }
}

/// A matmul refuses activations quantized for another weight type (Q8_0 blocks for K-quant
/// weights, which take Q8_K as in llama.cpp), naming both.
#[test]
fn matmul_refuses_activations_quantized_for_other_weights() {
    let pool = ThreadPool::new(2);
    let (rows, n, k) = (1usize, 16usize, 256usize);
    let w = WeightMatrix::Packed(packed(GgmlType::Q4K, n, k, 3));
    let x = vec![0.5f32; rows * k];
    let mut a = QuantizedActs::new();
    a.quantize(&x, rows, k);
    let mut out = vec![0f32; rows * n];
    let input = MatmulInput {
        f32: &x,
        quantized: &a,
        rows,
    };
    let e = matmul(&pool, Isa::active(), &w, input, &mut out, n).unwrap_err();
    assert!(e.to_string().contains("Q8K"), "{e}");
}

/// Activations whose buffers do not match their shape (fields are public) are refused inside the
/// kernel's task: the parallel call returns an error instead of reading past them, and the pool
/// runs the next matmul normally.
#[test]
fn inconsistent_activations_are_an_error_and_the_pool_survives() {
    let pool = ThreadPool::new(3);
    let (rows, n, k) = (4usize, 256usize, 576usize);
    let w = WeightMatrix::Packed(packed(GgmlType::Q4_1, n, k, 2));
    let (x, good) = acts(rows, k, 3);
    let mut bad = QuantizedActs::new();
    bad.quantize(&x, rows, k);
    bad.qs.truncate(k);
    for isa in Isa::available() {
        let mut out = vec![0f32; rows * n];
        let input = MatmulInput {
            f32: &x,
            quantized: &bad,
            rows,
        };
        let r = matmul(&pool, isa, &w, input, &mut out, n);
        assert!(
            matches!(r, Err(KernelError::Pool(crate::threadpool::PoolError::TaskPanicked(ref m))) if m.contains("shorter")),
            "{}: {r:?}",
            isa.name()
        );
        let input = MatmulInput {
            f32: &x,
            quantized: &good,
            rows,
        };
        matmul(&pool, isa, &w, input, &mut out, n).unwrap();
        let WeightMatrix::Packed(p) = &w else {
            unreachable!()
        };
        assert_eq!(out, run(isa, p, &good, n), "{}", isa.name());
    }
}

/// An output buffer too small for the result is refused before anything runs.
#[test]
fn a_short_output_is_refused() {
    let pool = ThreadPool::new(2);
    let (rows, n, k) = (3usize, 48usize, 64usize);
    let w = WeightMatrix::Packed(packed(GgmlType::Q8_0, n, k, 2));
    let (x, a) = acts(rows, k, 3);
    let mut out = vec![0f32; rows * n - 1];
    let input = MatmulInput {
        f32: &x,
        quantized: &a,
        rows,
    };
    let r = matmul(&pool, Isa::active(), &w, input, &mut out, n);
    assert!(matches!(r, Err(KernelError::BadShape { .. })), "{r:?}");
}

/// Not a test: prints the packed matmul's speed per format and shape on this machine, the
/// best of many short runs (other tenants of a shared machine only slow a run down):
/// `KSHAPES=512x2048x2048 KTYPES=Q4_0,Q4_K KTHREADS=2 cargo test --release -p npu-backend-cpu
/// --lib kernel_speed -- --ignored --nocapture` (shapes are rows x n x k).
#[test]
#[ignore]
fn kernel_speed() {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or(default.to_string());
    let shapes: Vec<Vec<usize>> = var("KSHAPES", "4x512x2048,512x2048x2048")
        .split(',')
        .map(|t| t.split('x').map(|x| x.parse().unwrap()).collect())
        .collect();
    let only = var("KTYPES", "");
    let pool = ThreadPool::new(var("KTHREADS", "1").parse().unwrap());
    let isa = Isa::active();
    for ty in TYPES {
        if !only.is_empty() && !only.split(',').any(|t| t == ty.name()) {
            continue;
        }
        for shape in &shapes {
            let (rows, n, k) = (shape[0], shape[1], shape[2]);
            let w = WeightMatrix::Packed(packed(ty, n, k, 21));
            let (x, a) = acts(rows, k, 4);
            let mut out = vec![0f32; rows * n];
            let mut once = || {
                let input = MatmulInput {
                    f32: &x,
                    quantized: &a,
                    rows,
                };
                matmul(&pool, isa, &w, input, &mut out, n).unwrap();
            };
            once();
            let t = std::time::Instant::now();
            let mut best = f64::MAX;
            while t.elapsed().as_secs_f64() < 0.5 {
                let one = std::time::Instant::now();
                once();
                best = best.min(one.elapsed().as_secs_f64());
            }
            let gops = 2.0 * (rows * n * k) as f64 / best / 1e9;
            eprintln!(
                "{} {} {rows}x{n}x{k}: {gops:.1} GOP/s",
                isa.name(),
                ty.name()
            );
        }
    }
}

#[test]
fn the_prefetch_setting_takes_whole_blocks_and_refuses_the_rest_by_name() {
    assert_eq!(parse_prefetch_setting(None), Ok(DEFAULT_PREFETCH_BLOCKS));
    assert_eq!(parse_prefetch_setting(Some("1")), Ok(1));
    assert_eq!(parse_prefetch_setting(Some("32")), Ok(32));
    assert_eq!(parse_prefetch_setting(Some("1024")), Ok(1024));
    for bad in ["", "0", "1025", "-4", "twenty", " 20", "2.5"] {
        let e = parse_prefetch_setting(Some(bad)).unwrap_err();
        assert!(e.to_string().starts_with("NPU_SERVING_PREFETCH="), "{e}");
        assert!(e.to_string().contains("from 1 to 1024"), "{e}");
    }
}

#[test]
fn a_prefetch_distance_changes_no_product() {
    // The distance only decides which bytes are asked for early: every distance gives the same
    // bits (on the AVX-512 kernels that use it; elsewhere trivially).
    let pool = ThreadPool::new(2);
    let (n, k, rows) = (48, 512, 3);
    let w = WeightMatrix::Packed(packed(GgmlType::Q4_0, n, k, 5));
    let (x, a) = acts(rows, k, 9);
    let before = prefetch_blocks();
    let mut outs = Vec::new();
    for blocks in [1, 20, MAX_PREFETCH_BLOCKS] {
        set_prefetch_blocks(blocks);
        assert_eq!(prefetch_blocks(), blocks);
        let mut out = vec![0f32; rows * n];
        let input = MatmulInput {
            f32: &x,
            quantized: &a,
            rows,
        };
        matmul(&pool, Isa::active(), &w, input, &mut out, n).unwrap();
        outs.push(out);
    }
    set_prefetch_blocks(0);
    assert_eq!(prefetch_blocks(), 1, "0 is clamped to one block");
    set_prefetch_blocks(before);
    assert!(outs.iter().all(|o| o == &outs[0]));
}

/// The AMX kernel on the strict tile emulation (and on the real tiles where the CPU has them)
/// gives the scalar kernel's bits for every packed format, whole-block and half-block products
/// alike, over several row tiles, partial last groups and long rows.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_amx_kernel_gives_the_scalar_bits_for_every_format_on_the_emulated_tiles() {
    use super::amx_emulation::Emulation;
    if Isa::active() != Isa::Avx512Vnni {
        eprintln!(
            "SKIPPED: the AMX kernel's epilogue needs AVX-512 VNNI (this CPU runs {})",
            Isa::active().name()
        );
        return;
    }
    let hardware = amx::available();
    if !hardware {
        eprintln!("AMX tiles not usable here: the emulation alone is checked");
    }
    for ty in TYPES {
        for &(rows, n, k) in &[(16usize, 48usize, 512usize), (37, 21, 256), (64, 40, 2048)] {
            let k = if ty.block_len() == 256 {
                k.max(256) / 256 * 256
            } else {
                k
            };
            let w = packed(ty, n, k, 23);
            let (_, a) = acts(rows, k, 6);
            let want = run(Isa::Scalar, &w, &a, n);
            let full = rows / amx::TILE_ROWS * amx::TILE_ROWS;
            let job = PackedJob {
                w: &w,
                acts: &a,
                groups: 0..w.groups(),
                rows: 0..full,
            };
            let sums = job_sums(&job);
            type Engine<'a> = (&'a str, Box<dyn FnMut(RawOut) + 'a>);
            let mut engines: Vec<Engine> = vec![(
                "emulated",
                Box::new(|raw| {
                    // SAFETY: AVX-512 VNNI, F16C and FMA are present (checked above); the job's
                    // rows are whole tiles of activations carrying their tile layout, and `raw`
                    // covers rows x n.
                    unsafe { amx::packed_full_tiles_on(&mut Emulation::new(), &job, sums, raw) }
                }),
            )];
            if hardware {
                engines.push((
                    "hardware",
                    Box::new(|raw| {
                        // SAFETY: as above, and the tiles are usable (`amx::available`).
                        unsafe { amx::packed_full_tiles(&job, sums, raw) }
                    }),
                ));
            }
            for (name, f) in engines.iter_mut() {
                let mut out = vec![f32::NAN; rows * n];
                f(RawOut {
                    base: out.as_mut_ptr(),
                    ld: n,
                });
                for m in 0..full {
                    for nn in 0..n {
                        let (g, s) = (out[m * n + nn], want[m * n + nn]);
                        assert_eq!(
                            g.to_bits(),
                            s.to_bits(),
                            "{name} AMX {} rows={rows} n={n} k={k} [{m},{nn}]: {g} vs scalar {s}",
                            ty.name()
                        );
                    }
                }
                assert!(
                    out[full * n..].iter().all(|v| v.is_nan()),
                    "{name} AMX {} wrote past its whole tiles",
                    ty.name()
                );
            }
        }
    }
}

/// The emulation refuses what the tile instructions fault on.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_tile_emulation_refuses_what_the_instructions_fault_on() {
    use super::amx::{tile_config, TileConfig, FULL, HALF};
    use super::amx_emulation::Emulation;
    let refused =
        |f: &mut dyn FnMut()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    // A product before any configuration.
    assert!(refused(&mut || Emulation::new().tilezero(0)));
    // Shapes outside palette 1's limits, another palette, tiles 8-15.
    let bad: [fn(&mut TileConfig); 5] = [
        |c| c.rows[0] = 17,
        |c| c.colsb[2] = 68,
        |c| c.palette = 0,
        |c| c.rows[9] = 1,
        |c| c.colsb[1] = 0,
    ];
    for (i, edit) in bad.iter().enumerate() {
        let mut cfg = tile_config(FULL);
        edit(&mut cfg);
        assert!(
            refused(&mut || Emulation::new().ldtilecfg(&cfg)),
            "edit {i}"
        );
    }
    // A product whose shapes disagree: A of the whole-block shape against B of the half-block one.
    let mut cfg = tile_config(FULL);
    cfg.rows[3] = (HALF / 4) as u8;
    let mut e = Emulation::new();
    e.ldtilecfg(&cfg);
    assert!(refused(&mut || e.tdpbsud(0, 2, 3)));
    // The kernel's own configurations are accepted, and one product computes A x B.
    for k in [FULL, HALF] {
        let mut e = Emulation::new();
        e.ldtilecfg(&tile_config(k));
        let a: Vec<i8> = (0..16 * 32).map(|i| (i % 7) as i8 - 3).collect();
        let b: Vec<u8> = (0..512).map(|i| (i % 5) as u8).collect();
        let mut c = vec![0i32; 256];
        // SAFETY: 16 rows of 32 bytes of A, 512 bytes of B, 256 int32 of C.
        unsafe {
            e.tileloadd(2, a.as_ptr() as *const u8, 32);
            e.tileloadd(3, b.as_ptr(), 64);
            e.tilezero(0);
            e.tdpbsud(0, 2, 3);
            e.tilestored(0, c.as_mut_ptr() as *mut u8, 64);
        }
        for m in 0..16 {
            for n in 0..16 {
                let want: i32 = (0..k)
                    .map(|kk| a[m * 32 + kk] as i32 * b[(kk / 4) * 64 + n * 4 + kk % 4] as i32)
                    .sum();
                assert_eq!(c[m * 16 + n], want, "k={k} [{m},{n}]");
            }
        }
    }
}

/// Jobs are cut into a whole number of tasks per thread wherever there are groups enough (the
/// 3B model's Q/K/V projection at batch 1 made 3 tasks on 2 threads).
#[test]
fn tasks_come_in_whole_rounds_of_the_threads() {
    let pool = ThreadPool::new(2);
    // (16-column groups, block products per group): 3B Q/K/V, W_o, gate/up, down at batch 1, a
    // prefill-sized job, a small one.
    for (units, blocks) in [
        (320, 96),
        (192, 96),
        (1024, 96),
        (192, 256),
        (320, 512 * 96),
        (7, 64),
    ] {
        let t = task_count(&pool, units, blocks);
        assert!(t >= 1 && t <= units, "{units} x {blocks}: {t} tasks");
        if units >= 2 && units * blocks >= 256 {
            assert_eq!(t % 2, 0, "{units} x {blocks}: {t} tasks on 2 threads");
        }
    }
    assert_eq!(task_count(&pool, 320, 96), 4);
    assert_eq!(task_count(&ThreadPool::new(1), 320, 96), 1);
}
