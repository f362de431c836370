//! `gpu_kit_tool gemv-bench`: the quantized matrix products alone, timed on the device through
//! the backend's public API (`Backend::matmul`, `synchronize`), as weight bytes read per second,
//! for the plain and the wide GEMV (`GemvVariant`, `NPU_SERVING_CUDA_GEMV`).
//!
//! Shapes of an 8B-class Llama (hidden 4096, KV 1024, ff 14336, a 49,152-token head), each in
//! Q4_0, Q8_0 and, kept packed (`KQuants::Packed`), Q4_K and Q6_K (which have one GEMV: their
//! rows show it under both columns). Every matrix is uploaded in enough copies (at least 3, and
//! at least 128 MB in all) that the products, taking the copies in turn, read their weights from
//! device memory rather than the 60 MB L2 of an H200. A round is a run of products (at least
//! 2 GB of weights, or 2,000 products) then a synchronisation; the time of a product is the
//! round's over its count, and the table gives the median of the rounds, plain and wide
//! alternating. Each product also pays its launch: shapes near the `launch floor` row (a
//! 64 x 256 Q4_0 product, whose weights take no time to read) are bound by the host's launch
//! rate, not by memory. The activations' 8-bit form is made once per activation buffer (the
//! backend keeps it for the products of the same rows that follow, as in a decode step).
//!
//! On the CPU emulation of the kernels (`NPU_SERVING_CUDA_EMULATION=1`) it runs on shapes cut
//! down 16 times (outputs) and 8 times (inputs), and says that its numbers are not measurements.

use std::io::Write;
use std::time::Instant;

use npu_backend::{Backend, DType, HostTensor, Layout, View, ViewMut};
use npu_backend_cuda::{CudaBackend, CudaConfig, CudaMatrix, GemvVariant, KQuants, MatmulMode};
use npu_gguf::GgmlType;

use crate::{arg, blocks, XorShift};

/// (name, outputs, inputs) of the 8B-class matrices.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q/o 4096x4096", 4096, 4096),
    ("k/v 1024x4096", 1024, 4096),
    ("gate/up 14336x4096", 14336, 4096),
    ("down 4096x14336", 4096, 14336),
    ("head 49152x4096", 49152, 4096),
];

const FORMATS: [GgmlType; 4] = [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K];

/// Weight bytes of an `n x k` matrix of `ty` as the file holds it (what a product reads, up to
/// the alignment of the device layout).
fn weight_bytes(ty: GgmlType, n: usize, k: usize) -> usize {
    n * ty.row_bytes(k).unwrap_or(0)
}

fn err(what: &str) -> impl Fn(npu_backend::BackendError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Bench {
    b: CudaBackend,
    rounds: usize,
    emulated: bool,
}

impl Bench {
    /// Seconds per product of `rows` activation rows by each of `mats` in turn, one round.
    #[allow(clippy::too_many_arguments)]
    fn round(
        &mut self,
        mats: &[CudaMatrix],
        (n, k): (usize, usize),
        bytes: usize,
        rows: usize,
        x: &npu_backend_cuda::CudaBuffer,
        out: &mut npu_backend_cuda::CudaBuffer,
    ) -> Result<f64, String> {
        let calls = if self.emulated {
            mats.len()
        } else {
            (2_000_000_000usize.div_ceil(bytes.max(1))).clamp(mats.len(), 2000)
        };
        self.b.synchronize().map_err(err("synchronize"))?;
        let t = Instant::now();
        for i in 0..calls {
            self.b
                .matmul(
                    View::new(x, Layout::new(0, rows, k, k).map_err(err("layout"))?)
                        .map_err(err("view"))?,
                    &mats[i % mats.len()],
                    ViewMut::new(out, Layout::new(0, rows, n, n).map_err(err("layout"))?)
                        .map_err(err("view"))?,
                )
                .map_err(err("matmul"))?;
        }
        self.b.synchronize().map_err(err("synchronize"))?;
        Ok(t.elapsed().as_secs_f64() / calls as f64)
    }

    /// Median seconds per product for the plain and the wide GEMV.
    fn time(
        &mut self,
        mats: &[CudaMatrix],
        (n, k): (usize, usize),
        bytes: usize,
        rows: usize,
    ) -> Result<[f64; 2], String> {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ (rows as u64));
        let xv: Vec<f32> = (0..rows * k)
            .map(|_| (rng.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect();
        let mut x = self.b.alloc(DType::F32, rows * k).map_err(err("alloc"))?;
        self.b
            .upload(
                npu_backend::HostSlice::F32(&xv),
                ViewMut::rows(&mut x, rows, k).map_err(err("view"))?,
            )
            .map_err(err("upload"))?;
        let mut out = self.b.alloc(DType::F32, rows * n).map_err(err("alloc"))?;
        let variants = [GemvVariant::Plain, GemvVariant::Wide];
        let mut times = [Vec::new(), Vec::new()];
        for &v in &variants {
            self.b.set_gemv_variant(v);
            self.round(mats, (n, k), bytes, rows, &x, &mut out)?; // warm-up
        }
        for _ in 0..self.rounds {
            for (i, &v) in variants.iter().enumerate() {
                self.b.set_gemv_variant(v);
                times[i].push(self.round(mats, (n, k), bytes, rows, &x, &mut out)?);
            }
        }
        self.b.set_gemv_variant(GemvVariant::Plain);
        let [p, w] = times;
        Ok([median(p), median(w)])
    }
}

/// `gpu_kit_tool gemv-bench [--device N] [--rounds N] [--formats q4_0,q8_0,q4_k,q6_k]`
pub fn run(args: &[String]) -> Result<(), String> {
    let device: usize = arg(args, "--device")
        .map(|d| d.parse().map_err(|_| format!("bad --device {d}")))
        .transpose()?
        .unwrap_or(0);
    let rounds: usize = arg(args, "--rounds")
        .map(|d| d.parse().map_err(|_| format!("bad --rounds {d}")))
        .transpose()?
        .unwrap_or(5)
        .max(1);
    let formats: Vec<GgmlType> = match arg(args, "--formats") {
        None => FORMATS.to_vec(),
        Some(list) => list
            .split(',')
            .map(|f| {
                FORMATS
                    .iter()
                    .copied()
                    .find(|t| t.name().eq_ignore_ascii_case(f))
                    .ok_or_else(|| format!("--formats: {f} is not one of q4_0, q8_0, q4_k, q6_k"))
            })
            .collect::<Result<_, _>>()?,
    };
    let cfg = CudaConfig {
        act_dtype: DType::F32,
        matmul: MatmulMode::Quantized,
        kquants: KQuants::Packed,
        ..CudaConfig::default()
    };
    let b = CudaBackend::new(device, cfg).map_err(err("opening the CUDA backend"))?;
    let emulated = b.emulation().is_some();
    let mut bench = Bench {
        b,
        rounds: if emulated { 1 } else { rounds },
        emulated,
    };
    let (cut_n, cut_k) = if emulated { (16, 8) } else { (1, 1) };
    println!("## GEMV alone");
    println!();
    if emulated {
        println!(
            "On the CPU EMULATION of the kernels, on shapes cut down {cut_n}x (outputs) and {cut_k}x \
             (inputs): the code path only, NOT A MEASUREMENT."
        );
    } else {
        println!("{}", bench.b.describe());
    }
    println!();
    println!(
        "Weight GB/s (weight bytes of one matrix / median time of a product; launch included), \
         f32 activations; {} rounds of at least 2 GB of weights (or 2,000 products) each, \
         copies of each matrix taken in turn (at least 128 MB of them, so the L2 does not hold \
         them). Q4_K and Q6_K have one GEMV (the same kernel under both columns).",
        bench.rounds
    );
    println!();
    println!("| matrix | format | rows | MB | plain GB/s | wide GB/s | wide/plain | plain µs |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    // The launch floor: a product whose weights take no time to read.
    let mut jobs: Vec<(&str, GgmlType, usize, usize)> =
        vec![("launch floor 64x256", GgmlType::Q4_0, 64, 256)];
    for &ty in &formats {
        for &(name, n, k) in &SHAPES {
            jobs.push((name, ty, n / cut_n, k / cut_k));
        }
    }
    for (name, ty, n, k) in jobs {
        let bytes = weight_bytes(ty, n, k);
        let data = blocks(&mut rng, ty, n as u64, k as u64, 0.02);
        let copies = if name.starts_with("launch") || emulated {
            1
        } else {
            (128usize << 20).div_ceil(bytes).max(3)
        };
        let mut mats = Vec::with_capacity(copies);
        for _ in 0..copies {
            let m = bench
                .b
                .load_matrix(&[HostTensor {
                    ty,
                    data: &data,
                    rows: n,
                    cols: k,
                }])
                .map_err(err("load_matrix"))?
                .ok_or_else(|| {
                    format!("{}: the backend did not take a {n}x{k} matrix", ty.name())
                })?;
            mats.push(m);
        }
        drop(data);
        for rows in [1, 8] {
            let [p, w] = bench.time(&mats, (n, k), bytes, rows)?;
            let gb = |t: f64| bytes as f64 / t / 1e9;
            println!(
                "| {name} | {} | {rows} | {:.1} | {:.0} | {:.0} | {:.2} | {:.1} |",
                ty.name(),
                bytes as f64 / 1e6,
                gb(p),
                gb(w),
                p / w,
                p * 1e6
            );
            let _ = std::io::stdout().flush();
        }
    }
    println!();
    Ok(())
}
