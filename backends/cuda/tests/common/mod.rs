//! Shared by the CUDA backend's tests: the backend on the emulation (or a skip with its reason),
//! host↔device helpers, deterministic random data, and random GGUF blocks.

#![allow(dead_code)]

pub mod conformance;
pub mod llama;

use half::{bf16, f16};
use npu_backend::{Backend, DType, HostSlice, HostSliceMut, Readback, View, ViewMut};
use npu_backend_cuda::{CudaBackend, CudaBuffer, CudaConfig, MatmulMode};

/// The backend on the CPU emulation of the kernels. `None` (with the reason printed) only when
/// no C++ compiler can be run; a kernel that does not compile is a failure.
pub fn emulated(dt: DType, matmul: MatmulMode) -> Option<CudaBackend> {
    let cfg = CudaConfig {
        act_dtype: dt,
        matmul,
        gemv_max_rows: 8,
        kernel_cache: None,
        lib_dirs: Vec::new(),
        int8_mma: true,
        fuse: true,
        fold_gemv: true,
        fold_rope: false,
        fold_ffn: false,
        fold_attn_out: false,
        kquants: npu_backend_cuda::KQuants::F16,
    };
    match CudaBackend::emulated(cfg) {
        Ok(b) => Some(b),
        Err(e) if e.to_string().contains("could not run the C++ compiler") => {
            eprintln!("SKIPPED (no C++ compiler for the CUDA emulation): {e}");
            None
        }
        Err(e) => panic!("the CUDA emulation failed to build: {e}"),
    }
}

/// Kernels launched since the last call (and forgets them); `None` on a real device.
pub fn take_launches(b: &CudaBackend) -> Option<Vec<String>> {
    let emu = b.emulation()?;
    let l = emu.launched();
    emu.clear_launched();
    Some(l)
}

/// On the emulation: the kernels launched since the last check are exactly `want`.
pub fn assert_launched(b: &CudaBackend, want: Vec<String>) {
    if let Some(got) = take_launches(b) {
        assert_eq!(got, want);
    }
}

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// `v` as the device stores it in `dt`, back in f32.
pub fn rounded(v: &[f32], dt: DType) -> Vec<f32> {
    v.iter()
        .map(|&x| match dt {
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::BF16 => bf16::from_f32(x).to_f32(),
            _ => x,
        })
        .collect()
}

/// A new `rows x cols` buffer of `dt` holding `v`.
pub fn put(b: &mut CudaBackend, dt: DType, v: &[f32], rows: usize, cols: usize) -> CudaBuffer {
    assert_eq!(v.len(), rows * cols);
    let mut buf = b.alloc(dt, v.len()).unwrap();
    b.upload(
        HostSlice::F32(v),
        ViewMut::rows(&mut buf, rows, cols).unwrap(),
    )
    .unwrap();
    buf
}

/// All of `buf`'s elements as f32.
pub fn get(b: &mut CudaBackend, buf: &CudaBuffer) -> Vec<f32> {
    let mut out = vec![0f32; buf_len(buf)];
    let n = out.len();
    b.read_back(&mut [Readback {
        src: View::rows(buf, 1, n).unwrap(),
        dst: HostSliceMut::F32(&mut out),
    }])
    .unwrap();
    out
}

pub fn buf_len(buf: &CudaBuffer) -> usize {
    use npu_backend::DeviceBuffer;
    buf.len()
}

/// Largest |a - b| / (atol + rtol |b|) over the slices (<= 1 passes).
pub fn worst(a: &[f32], b: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            if x.is_nan() || y.is_nan() {
                f32::INFINITY
            } else {
                (x - y).abs() / (atol + rtol * y.abs())
            }
        })
        .fold(0.0, f32::max)
}

/// Random ggml blocks of `ty` for `rows x cols` (scales kept in a sane range).
pub fn random_tensor(rng: &mut Rng, ty: npu_gguf::GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    use npu_gguf::GgmlType as G;
    let mut out = Vec::new();
    let f16b = |v: f32| f16::from_f32(v).to_le_bytes();
    for _ in 0..rows {
        match ty {
            G::F32 => {
                for _ in 0..cols {
                    out.extend(rng.uniform(-1.0, 1.0).to_le_bytes());
                }
            }
            G::F16 => {
                for _ in 0..cols {
                    out.extend(f16b(rng.uniform(-1.0, 1.0)));
                }
            }
            G::BF16 => {
                for _ in 0..cols {
                    out.extend(bf16::from_f32(rng.uniform(-1.0, 1.0)).to_le_bytes());
                }
            }
            G::Q8_0 => {
                for _ in 0..cols / 32 {
                    out.extend(f16b(rng.uniform(0.001, 0.02)));
                    out.extend((0..32).map(|_| rng.next_u64() as u8));
                }
            }
            G::Q4_0 => {
                for _ in 0..cols / 32 {
                    out.extend(f16b(rng.uniform(0.01, 0.2)));
                    out.extend((0..16).map(|_| rng.next_u64() as u8));
                }
            }
            G::Q4_1 => {
                for _ in 0..cols / 32 {
                    out.extend(f16b(rng.uniform(0.01, 0.1)));
                    out.extend(f16b(rng.uniform(-0.8, 0.0)));
                    out.extend((0..16).map(|_| rng.next_u64() as u8));
                }
            }
            other => panic!("no random generator for {}", other.name()),
        }
    }
    out
}

/// Dequantized rows of a tensor (the reference dequantization).
pub fn dequantized(ty: npu_gguf::GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        npu_gguf::quants::dequantize_row(
            ty,
            &data[r * rb..(r + 1) * rb],
            &mut out[r * cols..(r + 1) * cols],
        )
        .unwrap();
    }
    out
}
