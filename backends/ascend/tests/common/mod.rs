//! Shared test setup: the emulation built by scripts/ascend-emulator.sh, the runtime loaded from
//! it, one device (context + stream) per test thread, and host↔device helpers.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use half::f16;
use npu_backend_ascend::device::Device;
use npu_backend_ascend::memory::DeviceBuffer;
use npu_backend_ascend::tensor::{DType, Tensor, View};
use npu_backend_ascend::Acl;
use npu_ffi::SearchPaths;

pub fn emulator_root() -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ascend-emulator.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .output()
            .expect("run ascend-emulator.sh");
        assert!(
            out.status.success(),
            "ascend-emulator.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

pub fn acl() -> &'static Acl {
    Acl::init(&SearchPaths::root(&emulator_root())).expect("emulated CANN loads")
}

pub fn device() -> Device {
    Device::open(acl(), 0).expect("device 0 opens")
}

/// The emulation's own report of live objects (an emulation-only extension symbol).
pub fn leak_report() -> String {
    let path = emulator_root().join("lib64/libascendcl.so");
    // SAFETY: the same library the runtime already loaded (one state); the symbol has this prototype.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(*mut core::ffi::c_char, usize) -> usize> =
            lib.get(b"ascendEmulatorLeakReport\0").unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let n = f(buf.as_mut_ptr().cast(), buf.len());
        String::from_utf8_lossy(&buf[..n.min(buf.len() - 1)]).into_owned()
    }
}

pub fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f16::from_f32(*x).to_le_bytes())
        .collect()
}

pub fn upload(bytes: &[u8]) -> DeviceBuffer {
    let mut b = DeviceBuffer::alloc(acl(), bytes.len().max(1)).unwrap();
    b.upload(0, bytes).unwrap();
    b
}

pub fn upload_f16(v: &[f32]) -> DeviceBuffer {
    upload(&f16_bytes(v))
}

pub fn upload_i32(v: &[i32]) -> DeviceBuffer {
    upload(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
}

pub fn zeros(bytes: usize) -> DeviceBuffer {
    let mut b = DeviceBuffer::alloc(acl(), bytes).unwrap();
    b.fill(0, 0, bytes).unwrap();
    b
}

pub fn read_f16(b: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0u8; n * 2];
    b.download(0, &mut out).unwrap();
    out.chunks(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

pub fn read_f32(b: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0u8; n * 4];
    b.download(0, &mut out).unwrap();
    out.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn read_i64(b: &DeviceBuffer, n: usize) -> Vec<i64> {
    let mut out = vec![0u8; n * 8];
    b.download(0, &mut out).unwrap();
    out.chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn t(b: &DeviceBuffer, dtype: DType, dims: &[i64]) -> Tensor {
    Tensor::new(acl(), b, View::contiguous(dtype, dims)).unwrap()
}

/// Values rounded through f16, as the device holds them.
pub fn h(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| f16::from_f32(*x).to_f32()).collect()
}

pub fn rand_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(-1.0f32..1.0) * scale).collect()
}

pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Random rows in Q4_1 (GGUF's block layout) and their dequantized values.
pub fn q4_1_rows(seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    use half::f16;
    let vals = rand_vec(seed, n * k, 1.0);
    let (mut data, mut deq) = (Vec::new(), Vec::new());
    for blk in vals.chunks(32) {
        let (lo, hi) = blk
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let d = f16::from_f32((hi - lo) / 15.0);
        let m = f16::from_f32(lo);
        let q: Vec<u8> = blk
            .iter()
            .map(|v| (((v - m.to_f32()) / d.to_f32()).round().clamp(0.0, 15.0)) as u8)
            .collect();
        data.extend(d.to_le_bytes());
        data.extend(m.to_le_bytes());
        for i in 0..16 {
            data.push(q[i] | (q[i + 16] << 4));
        }
        deq.extend(q.iter().map(|&q| d.to_f32() * q as f32 + m.to_f32()));
    }
    (data, deq)
}

/// Random rows in Q4_0 (GGUF's block layout: f16 `d`, then element i in the low nibble of byte
/// i and element i + 16 in its high nibble; `w = d·(q − 8)`) and their dequantized values.
pub fn q4_0_block_rows(seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let vals = rand_vec(seed, n * k, 1.0);
    let (mut data, mut deq) = (Vec::new(), Vec::new());
    for blk in vals.chunks(32) {
        let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = f16::from_f32(amax / 8.0);
        let q: Vec<u8> = blk
            .iter()
            .map(|v| ((v / d.to_f32()).round() + 8.0).clamp(0.0, 15.0) as u8)
            .collect();
        data.extend(d.to_le_bytes());
        for i in 0..16 {
            data.push(q[i] | (q[i + 16] << 4));
        }
        deq.extend(q.iter().map(|&q| d.to_f32() * (q as f32 - 8.0)));
    }
    (data, deq)
}

/// Random rows in Q8_0 and their dequantized values.
pub fn q8_0_rows(seed: u64, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    use half::f16;
    let vals = rand_vec(seed, n * k, 1.0);
    let (mut data, mut deq) = (Vec::new(), Vec::new());
    for blk in vals.chunks(32) {
        let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        data.extend(d.to_le_bytes());
        for v in blk {
            let q = (v / d.to_f32()).round().clamp(-127.0, 127.0) as i8;
            data.push(q as u8);
            deq.push(d.to_f32() * q as f32);
        }
    }
    (data, deq)
}
pub mod seam;
