//! Intel AMX packed matmul for 16 activation rows at a time. One `tdpbsud` multiplies a 16x32
//! tile of int8 activations by a 32x16 tile of unsigned weights: the packed layout's value
//! registers are already the B tile (rows of 4 consecutive values per output lane), so 4-bit
//! weights load after one unpack. The int32 block sums then get the same scale epilogue, in the
//! same order, as the AVX-512 kernel — results are identical. It takes the formats with 4-bit
//! values and per-block f16 scales (Q4_0, Q4_1); `packed_job` sends it nothing else.
//! Needs Linux's permission for AMX state (arch_prctl), requested once per process.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::OnceLock;

use super::{PackedJob, RawOut};
use crate::quant::acts::QBLOCK;
use crate::quant::packed::{code, Scales, Values, GROUP};

/// Activation rows per AMX tile.
pub const TILE_ROWS: usize = 16;

/// Whether AMX-INT8 can be used by this process (CPU support and OS permission), and not
/// disabled with `NPU_SERVING_AMX=0` (a value other than 0 or 1 is refused at start by
/// `kernels::check_settings`; here it counts as off).
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !crate::kernels::amx_setting().unwrap_or(false) {
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
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
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

impl TileConfig {
    /// Palette 1 with every tile unconfigured (zero rows and bytes).
    fn palette_1() -> Self {
        Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }
}

thread_local! {
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Loads this thread's tile configuration: two sets (tmm0-2 and tmm3-5, used for alternate blocks
/// so one block's product runs while the previous one's sums are scaled) of C (16 x 16 int32),
/// A (16 x 32 bytes) and B (8 x 64 bytes).
unsafe fn configure() {
    if CONFIGURED.with(|c| c.get()) {
        return;
    }
    let mut cfg = TileConfig::palette_1();
    for set in [0, 3] {
        cfg.colsb[set] = 64;
        cfg.rows[set] = 16;
        cfg.colsb[set + 1] = QBLOCK as u16;
        cfg.rows[set + 1] = TILE_ROWS as u8;
        cfg.colsb[set + 2] = 64;
        cfg.rows[set + 2] = (QBLOCK / 4) as u8;
    }
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack));
    CONFIGURED.with(|c| c.set(true));
}

/// Double-buffered staging of unpacked weights (B) and block sums (C).
#[repr(C, align(64))]
struct Scratch {
    b: [[u8; 512]; 2],
    c: [[i32; 256]; 2],
}

/// The product of block `b` into tile set 0 (even blocks) or 1 (odd blocks).
macro_rules! block_product {
    ($set:tt, $bptr:expr, $aptr:expr, $lda:expr) => {
        block_product!(@emit $set, $bptr, $aptr, $lda)
    };
    (@emit 0, $bptr:expr, $aptr:expr, $lda:expr) => {
        asm!(
            "tileloadd tmm2, [{b} + {bs}]",
            "tileloadd tmm1, [{a} + {as_}]",
            "tilezero tmm0",
            "tdpbsud tmm0, tmm1, tmm2",
            b = in(reg) $bptr, bs = in(reg) 64usize, a = in(reg) $aptr, as_ = in(reg) $lda,
            options(nostack),
        )
    };
    (@emit 1, $bptr:expr, $aptr:expr, $lda:expr) => {
        asm!(
            "tileloadd tmm5, [{b} + {bs}]",
            "tileloadd tmm4, [{a} + {as_}]",
            "tilezero tmm3",
            "tdpbsud tmm3, tmm4, tmm5",
            b = in(reg) $bptr, bs = in(reg) 64usize, a = in(reg) $aptr, as_ = in(reg) $lda,
            options(nostack),
        )
    };
}

/// Stores the block sums of tile set 0 or 1.
macro_rules! store_sums {
    (0, $cptr:expr) => {
        asm!("tilestored [{c} + {cs}], tmm0", c = in(reg) $cptr, cs = in(reg) 64usize, options(nostack))
    };
    (1, $cptr:expr) => {
        asm!("tilestored [{c} + {cs}], tmm3", c = in(reg) $cptr, cs = in(reg) 64usize, options(nostack))
    };
}

/// Runs the full 16-row tiles `0..rows / 16 * 16` of the job's activations.
///
/// # Safety
/// `available()` must be true; the activation buffers hold whole rows for every row touched.
/// The job must have passed `check_job`, and `out` must be writable, by this call alone, at rows
/// `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
pub(crate) unsafe fn packed_full_tiles(job: &PackedJob, out: RawOut) {
    configure();
    let f = job.w.format;
    assert!(
        f.values == Values::Q4,
        "the AMX kernel takes 4-bit values only"
    );
    match f.scales {
        Scales::F16 => run::<false>(job, out),
        Scales::F16Min => run::<true>(job, out),
        _ => panic!("the AMX kernel takes per-block f16 scales only"),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn run<const MIN: bool>(job: &PackedJob, out: RawOut) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    // Each block: its 16 f16 scales (and 16 f16 minimums), then its 256 bytes of nibbles.
    let sb = code::scale_bytes(if MIN { code::F16MIN } else { code::F16 });
    let unit = sb + code::values_bytes(code::Q4);
    let offset = w.format.offset;
    let full = job.rows.start + job.rows.len() / TILE_ROWS * TILE_ROWS;
    let low = _mm512_set1_epi8(0x0F);
    let mut scratch = Scratch {
        b: [[0; 512]; 2],
        c: [[0; 256]; 2],
    };
    // A tiles laid out contiguously ([tile][block][16 rows][32 bytes]) by the quantizer: one tile
    // load then touches 8 whole cache lines instead of 16 scattered rows.
    assert!(
        a.tiles.len() >= a.rows / TILE_ROWS * nb * TILE_ROWS * QBLOCK,
        "activations were quantized without their AMX tile layout"
    );
    let a_tiles = a.tiles.as_ptr();
    let xd = a.d.as_ptr();
    let xs = a.s.as_ptr();
    let xsum = a.isum.as_ptr();
    // The B tile of block `b`, staged in an aligned buffer, nibbles unpacked (blocks are not
    // cache-line aligned, and a tile load of split lines is slow).
    let b_tile = |gd: *const u8, b: usize, buf: *mut u8| -> *const u8 {
        let u = gd.add(b * unit + sb);
        for j in 0..4 {
            let v = _mm512_loadu_si512(u.add(j * 64) as *const _);
            _mm512_store_si512(buf.add(j * 64) as *mut _, _mm512_and_si512(v, low));
            _mm512_store_si512(
                buf.add((j + 4) * 64) as *mut _,
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
            );
        }
        buf
    };
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
            assert!(
                m0 % TILE_ROWS == 0,
                "AMX tiles start at multiples of 16 rows"
            );
            let tile = m0 / TILE_ROWS;
            let a_at = |b: usize| a_tiles.add((tile * nb + b) * TILE_ROWS * QBLOCK);
            // Pipeline: block b+1's product runs on the other tile set while block b is scaled.
            let bp = b_tile(gd, 0, scratch.b[0].as_mut_ptr());
            block_product!(0, bp, a_at(0), QBLOCK);
            store_sums!(0, scratch.c[0].as_mut_ptr());
            for b in 0..nb {
                let cur = b % 2;
                if b + 1 < nb {
                    let bp = b_tile(gd, b + 1, scratch.b[1 - cur].as_mut_ptr());
                    if cur == 0 {
                        block_product!(1, bp, a_at(b + 1), QBLOCK);
                    } else {
                        block_product!(0, bp, a_at(b + 1), QBLOCK);
                    }
                }
                let u = gd.add(b * unit);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(u as *const __m256i));
                let mw = if MIN {
                    _mm512_cvtph_ps(_mm256_loadu_si256(u.add(32) as *const __m256i))
                } else {
                    _mm512_setzero_ps()
                };
                let sums = scratch.c[cur].as_ptr();
                macro_rules! scale_row {
                    ($($r:literal)*) => {$(
                        let blk = (m0 + $r) * nb + b;
                        let mut ia = _mm512_load_si512(sums.add($r * 16) as *const _);
                        if offset != 0 {
                            ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(offset * *xsum.add(blk)));
                        }
                        let sc = _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(blk)));
                        acc[$r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sc, acc[$r]);
                        if MIN {
                            acc[$r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xs.add(blk)), acc[$r]);
                        }
                    )*};
                }
                scale_row!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
                if b + 1 < nb {
                    if cur == 0 {
                        store_sums!(1, scratch.c[1].as_mut_ptr());
                    } else {
                        store_sums!(0, scratch.c[0].as_mut_ptr());
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let dst = out.base.add((m0 + r) * out.ld + g * GROUP);
                _mm512_mask_storeu_ps(dst, mask, *acc_r);
            }
        }
    }
}

/// The tile products `peak_products` runs per step: independent accumulators, more than the
/// instruction's latency over its issue interval.
pub const PEAK_CHAINS: u64 = 4;

/// Multiply-adds of one `tdpbusd` (16 x 16 int32 sums of 64 products each).
pub const MACS_PER_PRODUCT: u64 = 16 * 16 * 64;

/// `steps` rounds of `PEAK_CHAINS` independent `tdpbusd` on tiles loaded once (nothing streamed):
/// the tiles' int8 peak for one thread. Returns a value depending on every product. Leaves this
/// thread's tiles released and unconfigured, so the matmul configures its own layout next time.
///
/// # Safety
/// `available()` must be true.
#[target_feature(enable = "avx512f")]
pub unsafe fn peak_products(steps: u64) -> i32 {
    #[repr(C, align(64))]
    struct Buffers {
        a: [u8; 1024],
        b: [u8; 1024],
        c: [i32; 256],
    }
    let mut cfg = TileConfig::palette_1();
    // tmm0-3: C (16 x 16 int32); tmm4: A (16 x 64 bytes); tmm5: B (16 x 64 bytes).
    for t in 0..6 {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    let mut buf = Buffers {
        a: [1; 1024],
        b: [1; 1024],
        c: [0; 256],
    };
    // SAFETY (every asm block): AMX permission was granted (`available`); the configuration
    // names tiles 0-5 of 16 rows x 64 bytes, and every load and store covers 16 rows of 64 bytes
    // at a 64-byte stride inside `buf`.
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack));
    asm!(
        "tileloadd tmm4, [{a} + {s}]",
        "tileloadd tmm5, [{b} + {s}]",
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        a = in(reg) buf.a.as_ptr(), b = in(reg) buf.b.as_ptr(), s = in(reg) 64usize,
        options(nostack),
    );
    for _ in 0..steps {
        asm!(
            "tdpbusd tmm0, tmm4, tmm5",
            "tdpbusd tmm1, tmm4, tmm5",
            "tdpbusd tmm2, tmm4, tmm5",
            "tdpbusd tmm3, tmm4, tmm5",
            options(nostack, nomem),
        );
    }
    asm!(
        "tilestored [{c} + {s}], tmm3",
        c = in(reg) buf.c.as_mut_ptr(), s = in(reg) 64usize,
        options(nostack),
    );
    asm!("tilerelease", options(nostack, nomem));
    CONFIGURED.with(|c| c.set(false));
    buf.c.iter().fold(0i32, |a, &v| a.wrapping_add(v))
}
