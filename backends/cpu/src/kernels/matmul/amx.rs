//! Intel AMX packed matmul for 16 activation rows at a time, every packed format. One `tdpbsud`
//! multiplies a 16x32 tile of int8 activations by a 32x16 tile of unsigned weights: the AVX-512
//! kernels' unpacked value registers are already B tiles (rows of 4 consecutive values per output
//! lane), so each group's weights are unpacked once into a panel in cache and every 16-row tile
//! of the job loads its B tiles from there. Formats whose block step needs the sums of a block's
//! two halves apart (Q6_K, Q3_K, Q2_K) take two products of 16 values instead. The int32 sums then
//! go through the AVX-512 kernel's own epilogue (`avx512::block_step`) with the same integers, so
//! the results are the VNNI kernels' (and the scalar kernel's) bit for bit.
//!
//! The tile instructions sit behind [`TileEngine`]: [`Hardware`] issues them; the tests also run
//! the same kernel on a strict emulation of them (`amx_emulation`, refusing any shape the
//! instructions fault on), so the kernel's layout and bookkeeping are checked on machines without
//! AMX. Needs Linux's permission for AMX state (arch_prctl), requested once per process.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::sync::OnceLock;

use super::avx512::{block_scales, block_step, header, sum_ptrs, unpack, SumPtrs};
use super::{PackedJob, RawOut};
use crate::quant::acts::{ActSums, QBLOCK};
use crate::quant::packed::{code, GROUP};

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

/// The 64-byte operand of `ldtilecfg`: palette, then each tile's bytes per row and rows.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    pub(crate) palette: u8,
    pub(crate) start_row: u8,
    pub(crate) reserved: [u8; 14],
    pub(crate) colsb: [u16; 16],
    pub(crate) rows: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<TileConfig>() == 64);

impl TileConfig {
    /// Palette 1 with every tile unconfigured (zero rows and bytes).
    pub(crate) fn palette_1() -> Self {
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
    /// The tile shapes this thread's configuration holds: 0 none, else the bytes per product row
    /// (`FULL` or `HALF`).
    static CONFIGURED: Cell<usize> = const { Cell::new(0) };
}

/// Bytes of one activation row in a whole-block product (32 values).
pub(crate) const FULL: usize = QBLOCK;
/// Bytes of one activation row in a half-block product (16 values).
pub(crate) const HALF: usize = QBLOCK / 2;

/// The tile configuration for products of `k` bytes per row (`FULL` or `HALF`): two sets (tiles
/// 0-3 and 4-7, used for alternate blocks so one block's products run while the previous one's
/// sums are scaled), each of C0 and C1 (16 x 16 int32), A (16 rows x `k` bytes) and B (`k / 4`
/// rows x 64 bytes).
pub(crate) fn tile_config(k: usize) -> TileConfig {
    let mut cfg = TileConfig::palette_1();
    for set in [0, 4] {
        for c in [set, set + 1] {
            cfg.colsb[c] = 64;
            cfg.rows[c] = 16;
        }
        cfg.colsb[set + 2] = k as u16;
        cfg.rows[set + 2] = TILE_ROWS as u8;
        cfg.colsb[set + 3] = 64;
        cfg.rows[set + 3] = (k / 4) as u8;
    }
    cfg
}

/// What the kernel asks of the tiles. `product` leaves set `set`'s sums in its C tiles; `store`
/// writes them out as 16 rows of 16 int32, 64 bytes apart.
pub(crate) trait TileEngine {
    /// Makes the tiles take products of `k` bytes per row (`FULL` or `HALF`).
    ///
    /// # Safety
    /// For [`Hardware`], `available()` must be true.
    unsafe fn configure(&mut self, k: usize);
    /// C0 = A x B for the block whose A tile starts at `a` (16 rows, `lda` bytes apart) and whose
    /// B tile is the 512 bytes at `b`; with `halves`, C0 from its values 0..16 and C1 from 16..32.
    ///
    /// # Safety
    /// Configured for the matching `k`; `a` readable for 16 rows of 32 bytes, `b` for 512.
    unsafe fn product(&mut self, set: usize, a: *const i8, lda: usize, b: *const u8, halves: bool);
    /// Writes set `set`'s C0 to `c0` (and C1 to `c1` with `halves`), 256 int32 each.
    ///
    /// # Safety
    /// As `product`; `c0` (and `c1`) writable for 256 int32.
    unsafe fn store(&mut self, set: usize, c0: *mut i32, c1: *mut i32, halves: bool);
}

/// The tile instructions themselves.
pub(crate) struct Hardware;

impl TileEngine for Hardware {
    unsafe fn configure(&mut self, k: usize) {
        if CONFIGURED.with(|c| c.get()) == k {
            return;
        }
        let cfg = tile_config(k);
        // SAFETY: AMX permission was granted (caller); the configuration is palette 1 with
        // shapes inside its limits (16 rows, 64 bytes), read from an aligned struct.
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack));
        CONFIGURED.with(|c| c.set(k));
    }

    unsafe fn product(&mut self, set: usize, a: *const i8, lda: usize, b: *const u8, halves: bool) {
        // SAFETY (every block): configured (caller) so that A is 16 x k bytes read `lda` apart
        // from `a`, B is k / 4 rows of 64 bytes read 64 apart from `b` (and from `b + 256`, the
        // second half's rows, with `halves`), inside what the caller guarantees readable.
        macro_rules! emit {
            ($c0:literal, $c1:literal, $ta:literal, $tb:literal) => {
                if halves {
                    asm!(
                        concat!("tileloadd tmm", $ta, ", [{a} + {as_}]"),
                        concat!("tileloadd tmm", $tb, ", [{b} + {bs}]"),
                        concat!("tilezero tmm", $c0),
                        concat!("tdpbsud tmm", $c0, ", tmm", $ta, ", tmm", $tb),
                        concat!("tileloadd tmm", $ta, ", [{a2} + {as_}]"),
                        concat!("tileloadd tmm", $tb, ", [{b2} + {bs}]"),
                        concat!("tilezero tmm", $c1),
                        concat!("tdpbsud tmm", $c1, ", tmm", $ta, ", tmm", $tb),
                        a = in(reg) a, a2 = in(reg) a.add(HALF), as_ = in(reg) lda,
                        b = in(reg) b, b2 = in(reg) b.add(256), bs = in(reg) 64usize,
                        options(nostack),
                    )
                } else {
                    asm!(
                        concat!("tileloadd tmm", $ta, ", [{a} + {as_}]"),
                        concat!("tileloadd tmm", $tb, ", [{b} + {bs}]"),
                        concat!("tilezero tmm", $c0),
                        concat!("tdpbsud tmm", $c0, ", tmm", $ta, ", tmm", $tb),
                        a = in(reg) a, as_ = in(reg) lda, b = in(reg) b, bs = in(reg) 64usize,
                        options(nostack),
                    )
                }
            };
        }
        if set == 0 {
            emit!("0", "1", "2", "3")
        } else {
            emit!("4", "5", "6", "7")
        }
    }

    unsafe fn store(&mut self, set: usize, c0: *mut i32, c1: *mut i32, halves: bool) {
        // SAFETY: C tiles are 16 rows of 64 bytes, stored 64 apart into buffers the caller
        // guarantees writable for 256 int32 each.
        macro_rules! emit {
            ($c0:literal, $c1:literal) => {{
                asm!(
                    concat!("tilestored [{c} + {s}], tmm", $c0),
                    c = in(reg) c0, s = in(reg) 64usize, options(nostack),
                );
                if halves {
                    asm!(
                        concat!("tilestored [{c} + {s}], tmm", $c1),
                        c = in(reg) c1, s = in(reg) 64usize, options(nostack),
                    );
                }
            }};
        }
        if set == 0 {
            emit!("0", "1")
        } else {
            emit!("4", "5")
        }
    }
}

/// Whether a format's block step takes the sums of the block's two halves apart.
pub(crate) const fn halves(s: u8) -> bool {
    matches!(s, code::K6 | code::K3 | code::K2)
}

/// Runs the full 16-row tiles `job.rows.start..` (whole tiles only) of the job on the tiles.
///
/// # Safety
/// `available()` must be true; the job must have passed `check_job`, its rows must start at a
/// multiple of 16, the activations must carry their tile layout (`amx_tiles_ready`), `sums` must
/// be the activation sums where the format needs them, and `out` must be writable, by this call
/// alone, at rows `job.rows` x the output columns of `job.groups` (what `packed_job` guarantees).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn packed_full_tiles(job: &PackedJob, sums: Option<&ActSums>, out: RawOut) {
    packed_full_tiles_on(&mut Hardware, job, sums, out)
}

/// `packed_full_tiles` on any tile engine.
///
/// # Safety
/// As `packed_full_tiles` (for [`Hardware`]; the emulation needs only AVX-512 VNNI, F16C and FMA).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn packed_full_tiles_on<E: TileEngine>(
    e: &mut E,
    job: &PackedJob,
    sums: Option<&ActSums>,
    out: RawOut,
) {
    let f = job.w.format;
    let sums = sum_ptrs(sums);
    macro_rules! go {
        ($($v:ident $s:ident),*) => {
            match (code::values(f.values), code::scales(f.scales)) {
                $((code::$v, code::$s) => run::<{ code::$v }, { code::$s }, E>(e, job, sums, out),)*
                _ => unreachable!("a packed format without a kernel: {f:?}"),
            }
        };
    }
    go!(
        Q4 F16, Q4 F16MIN, Q5 F16, Q5 F16MIN, Q8 F16, Q8 F32SUPER, Q4 K4, Q5 K4, Q6 K6, Q3 K3,
        Q2 K2, IQ4 F16, IQ4 XS
    );
}

/// 64-byte aligned int32 sums of one tile set: C0 and C1.
#[repr(C, align(64))]
struct Sums([[i32; 256]; 2]);

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn run<const V: u8, const S: u8, E: TileEngine>(
    e: &mut E,
    job: &PackedJob,
    sums: SumPtrs,
    out: RawOut,
) {
    let w = job.w;
    let a = job.acts;
    let k = a.k;
    let nb = k / QBLOCK;
    let lay = code::Layout::of(V, S);
    let (bps, super_bytes) = (lay.bps, lay.super_bytes);
    let offset = w.format.offset;
    let half = halves(S);
    let full = job.rows.start + job.rows.len() / TILE_ROWS * TILE_ROWS;
    assert!(
        job.rows.start.is_multiple_of(TILE_ROWS),
        "AMX tiles start at multiples of 16 rows"
    );
    // A tiles laid out contiguously ([tile][block][16 rows][32 bytes]) by the quantizer: one tile
    // load then touches 8 whole cache lines instead of 16 scattered rows.
    assert!(
        a.tiles.len() >= a.rows / TILE_ROWS * nb * TILE_ROWS * QBLOCK,
        "activations were quantized without their AMX tile layout"
    );
    if job.rows.start >= full {
        return;
    }
    e.configure(if half { HALF } else { FULL });
    let a_tiles = a.tiles.as_ptr();
    let xa = (a.d.as_ptr(), a.s.as_ptr(), a.isum.as_ptr());
    // One group's B tiles, unpacked once (512 bytes a block) and read by every row tile; 64
    // bytes of slack to start it on a cache line.
    let mut panel = vec![0u8; nb * 512 + 64];
    let pb = {
        let p = panel.as_mut_ptr();
        p.add(p.align_offset(64))
    };
    let mut c = [Sums([[0; 256]; 2]), Sums([[0; 256]; 2])];
    let zero = _mm512_setzero_si512();
    for g in job.groups.clone() {
        let valid = (w.n - g * GROUP).min(GROUP);
        let mask: __mmask16 = if valid == GROUP {
            0xFFFF
        } else {
            ((1u32 << valid) - 1) as u16
        };
        let gd = w.group_data(g).as_ptr();
        for sup in 0..nb / bps {
            let base = gd.add(sup * super_bytes);
            for j in 0..bps {
                let wv = unpack::<V>(base.add(lay.values_at(j)));
                let dst = pb.add((sup * bps + j) * 512);
                for (p, v) in wv.iter().enumerate() {
                    _mm512_store_si512(dst.add(p * 64) as *mut _, *v);
                }
            }
        }
        for m0 in (job.rows.start..full).step_by(TILE_ROWS) {
            let tile = m0 / TILE_ROWS;
            let a_at = |b: usize| a_tiles.add((tile * nb + b) * TILE_ROWS * QBLOCK);
            let b_at = |b: usize| pb.add(b * 512) as *const u8;
            let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
            // Block b + 1's products run on the other tile set while block b is scaled.
            e.product(0, a_at(0), QBLOCK, b_at(0), half);
            let [c0, c1] = &mut c[0].0;
            e.store(0, c0.as_mut_ptr(), c1.as_mut_ptr(), half);
            for sup in 0..nb / bps {
                let base = gd.add(sup * super_bytes);
                let (hd, hm) = header::<S>(base);
                for j in 0..bps {
                    let b = sup * bps + j;
                    let cur = b % 2;
                    if b + 1 < nb {
                        e.product(1 - cur, a_at(b + 1), QBLOCK, b_at(b + 1), half);
                    }
                    let s = block_scales::<S>(base.add(lay.scales_at(j)), hd, hm, offset);
                    let [s0, s1] = &c[cur].0;
                    macro_rules! scale_row {
                        ($($r:literal)*) => {$(
                            let i0 = _mm512_load_si512(s0.as_ptr().add($r * 16) as *const _);
                            let i1 = if half {
                                _mm512_load_si512(s1.as_ptr().add($r * 16) as *const _)
                            } else {
                                zero
                            };
                            let blk = (m0 + $r) * nb + b;
                            acc[$r] = block_step::<S>(&s, offset, i0, i1, xa, sums, blk, acc[$r]);
                        )*};
                    }
                    scale_row!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
                    if b + 1 < nb {
                        let [c0, c1] = &mut c[1 - cur].0;
                        e.store(1 - cur, c0.as_mut_ptr(), c1.as_mut_ptr(), half);
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
    CONFIGURED.with(|c| c.set(0));
    buf.c.iter().fold(0i32, |a, &v| a.wrapping_add(v))
}
