//! Intel AMX packed matmul for 16 activation rows at a time. One `tdpbsud` multiplies a 16x32
//! tile of int8 activations by a 32x16 tile of unsigned weights: the packed layout's value
//! registers are already the B tile (rows of 4 consecutive values per output lane), so byte
//! weights load straight from the matrix and 4-bit ones after one unpack. The int32 block sums then
//! get the same scale epilogue, in the same order, as the AVX-512 kernel — results are identical.
//! Needs Linux's permission for AMX state (arch_prctl), requested once per process.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::OnceLock;

use super::PackedJob;
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{PackKind, GROUP};

/// Activation rows per AMX tile.
pub const TILE_ROWS: usize = 16;

/// Whether AMX-INT8 can be used by this process (CPU support and OS permission), and not
/// disabled with `NPU_SERVING_AMX=0`.
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("NPU_SERVING_AMX").is_ok_and(|v| v == "0") {
            return false;
        }
        if !std::arch::is_x86_feature_detected!("avx512f")
            || !std::arch::is_x86_feature_detected!("avx512bw")
            || !std::arch::is_x86_feature_detected!("f16c")
            || !std::arch::is_x86_feature_detected!("fma")
        {
            return false;
        }
        let leaf7 = __cpuid_count(7, 0);
        let tile = (leaf7.edx >> 24) & 1 == 1;
        let int8 = (leaf7.edx >> 25) & 1 == 1;
        if !(tile && int8) {
            return false;
        }
        request_permission()
    })
}

#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall asking the kernel to allow AMX tile state for this process.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

thread_local! {
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Loads this thread's tile configuration: tmm0 = C (16 x 16 int32), tmm1 = A (16 x 32 bytes),
/// tmm2 = B (8 x 64 bytes).
unsafe fn configure() {
    if CONFIGURED.with(|c| c.get()) {
        return;
    }
    let mut cfg = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    cfg.colsb[0] = 64;
    cfg.rows[0] = 16;
    cfg.colsb[1] = QBLOCK as u16;
    cfg.rows[1] = TILE_ROWS as u8;
    cfg.colsb[2] = 64;
    cfg.rows[2] = (QBLOCK / 4) as u8;
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack));
    CONFIGURED.with(|c| c.set(true));
}

#[repr(C, align(64))]
struct Scratch {
    b: [u8; 512],
    c: [i32; 256],
}

/// Runs the full 16-row tiles `0..rows / 16 * 16` of the job's activations.
///
/// # Safety
/// `available()` must be true; the activation buffers hold whole rows for every row touched.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub unsafe fn packed_full_tiles(job: &PackedJob) {
    configure();
    let f = job.w.format;
    match (f.kind == PackKind::Nibble, f.f16_scales, f.has_min) {
        (true, true, true) => run::<true, true, true>(job),
        (true, true, false) => run::<true, true, false>(job),
        (true, false, true) => run::<true, false, true>(job),
        (true, false, false) => run::<true, false, false>(job),
        (false, true, true) => run::<false, true, true>(job),
        (false, true, false) => run::<false, true, false>(job),
        (false, false, true) => run::<false, false, true>(job),
        (false, false, false) => run::<false, false, false>(job),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn run<const NIB: bool, const F16S: bool, const MIN: bool>(job: &PackedJob) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let unit = w.format.unit_bytes();
    let vb = w.format.values_bytes();
    let sb = w.format.scale_bytes();
    let offset = w.format.offset;
    let full = job.rows.start + job.rows.len() / TILE_ROWS * TILE_ROWS;
    let low = _mm512_set1_epi8(0x0F);
    let mut scratch = Scratch {
        b: [0; 512],
        c: [0; 256],
    };
    let qs = a.qs.as_ptr();
    let xd = a.d.as_ptr();
    let xs = a.s.as_ptr();
    let xsum = a.isum.as_ptr();
    for g in job.groups.clone() {
        let valid = (w.n - g * GROUP).min(GROUP);
        let mask: __mmask16 = if valid == GROUP {
            0xFFFF
        } else {
            ((1u32 << valid) - 1) as u16
        };
        let gd = w.group_data(g).as_ptr();
        for m0 in (job.rows.start..full).step_by(TILE_ROWS) {
            let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
            for b in 0..nb {
                let u = gd.add(b * unit);
                let bptr = if NIB {
                    for j in 0..4 {
                        let v = _mm512_loadu_si512(u.add(j * 64) as *const _);
                        _mm512_store_si512(
                            scratch.b.as_mut_ptr().add(j * 64) as *mut _,
                            _mm512_and_si512(v, low),
                        );
                        _mm512_store_si512(
                            scratch.b.as_mut_ptr().add((j + 4) * 64) as *mut _,
                            _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
                        );
                    }
                    scratch.b.as_ptr()
                } else {
                    u
                };
                asm!(
                    "tileloadd tmm2, [{b} + {bs}]",
                    "tileloadd tmm1, [{a} + {as_}]",
                    "tilezero tmm0",
                    "tdpbsud tmm0, tmm1, tmm2",
                    "tilestored [{c} + {cs}], tmm0",
                    b = in(reg) bptr,
                    bs = in(reg) 64usize,
                    a = in(reg) qs.add(m0 * k + b * QBLOCK),
                    as_ = in(reg) k,
                    c = in(reg) scratch.c.as_mut_ptr(),
                    cs = in(reg) 64usize,
                    options(nostack),
                );
                let dw = if F16S {
                    _mm512_cvtph_ps(_mm256_loadu_si256(u.add(vb) as *const __m256i))
                } else {
                    _mm512_loadu_ps(u.add(vb) as *const f32)
                };
                let mw = if MIN {
                    if F16S {
                        _mm512_cvtph_ps(_mm256_loadu_si256(u.add(vb + sb) as *const __m256i))
                    } else {
                        _mm512_loadu_ps(u.add(vb + sb) as *const f32)
                    }
                } else {
                    _mm512_setzero_ps()
                };
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let blk = (m0 + r) * nb + b;
                    let mut ia = _mm512_load_si512(scratch.c.as_ptr().add(r * 16) as *const _);
                    if offset != 0 {
                        ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(offset * *xsum.add(blk)));
                    }
                    let sc = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(blk)));
                    *acc_r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sc, *acc_r);
                    if MIN {
                        *acc_r = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xs.add(blk)), *acc_r);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let dst = job.out.0.add((m0 + r) * job.ldo + g * GROUP);
                _mm512_mask_storeu_ps(dst, mask, *acc_r);
            }
        }
    }
}
