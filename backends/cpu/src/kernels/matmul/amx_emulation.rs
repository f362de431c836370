//! A strict emulation of the AMX-INT8 instructions the AMX matmul issues (`ldtilecfg`,
//! `tileloadd`, `tilezero`, `tdpbsud`, `tilestored`), for testing the kernel's layout and
//! bookkeeping on machines without AMX. It is an emulation, not the hardware: it refuses (panics
//! on) what the instructions fault on — a configuration outside palette 1's limits, a tile used
//! before it is configured, a product whose tile shapes do not agree — and computes `tdpbsud`
//! from its definition (signed A bytes times unsigned B bytes, four per int32 lane, added to C).
//! The same kernel runs on the real tiles through `amx::Hardware` where the CPU has them.

use super::amx::{tile_config, TileConfig, TileEngine, HALF, TILE_ROWS};

/// Eight tiles of up to 16 rows x 64 bytes, and the shapes `ldtilecfg` gave them.
pub(crate) struct Emulation {
    shapes: Option<[(usize, usize); 8]>,
    tiles: [[u8; 1024]; 8],
}

impl Emulation {
    pub(crate) fn new() -> Self {
        Self {
            shapes: None,
            tiles: [[0; 1024]; 8],
        }
    }

    /// Loads a configuration, refusing what `ldtilecfg` faults on in palette 1: another palette,
    /// a nonzero start row or reserved byte, a tile of more than 16 rows or 64 bytes a row, a
    /// tile with rows but no bytes (or the reverse), or any setting for tiles 8-15.
    pub(crate) fn ldtilecfg(&mut self, cfg: &TileConfig) {
        assert_eq!(
            cfg.palette, 1,
            "palette {} (only palette 1 exists)",
            cfg.palette
        );
        assert_eq!(cfg.start_row, 0, "start_row must be 0");
        assert!(cfg.reserved.iter().all(|&b| b == 0), "reserved bytes set");
        let mut shapes = [(0, 0); 8];
        for (t, (&rows, &colsb)) in cfg.rows.iter().zip(&cfg.colsb).enumerate() {
            let (rows, colsb) = (rows as usize, colsb as usize);
            if t >= 8 {
                assert!(
                    rows == 0 && colsb == 0,
                    "tile {t} configured (palette 1 has 8)"
                );
                continue;
            }
            assert!(
                rows <= 16 && colsb <= 64,
                "tile {t}: {rows} x {colsb} bytes"
            );
            assert_eq!(
                rows == 0,
                colsb == 0,
                "tile {t}: {rows} rows of {colsb} bytes"
            );
            shapes[t] = (rows, colsb);
        }
        self.shapes = Some(shapes);
    }

    /// Rows and bytes per row of tile `t`, refusing a tile that is not configured.
    fn shape(&self, t: usize) -> (usize, usize) {
        let shapes = self.shapes.expect("a tile instruction before ldtilecfg");
        let (rows, colsb) = shapes[t];
        assert!(rows > 0, "tile {t} is not configured");
        (rows, colsb)
    }

    /// `tileloadd tmm{t}, [p + stride]`.
    ///
    /// # Safety
    /// `p` readable for the tile's rows, `stride` bytes apart, of its bytes per row.
    pub(crate) unsafe fn tileloadd(&mut self, t: usize, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        for r in 0..rows {
            // SAFETY: the caller guarantees the rows are readable.
            let src = unsafe { std::slice::from_raw_parts(p.add(r * stride), colsb) };
            self.tiles[t][r * 64..r * 64 + colsb].copy_from_slice(src);
        }
    }

    /// `tilezero tmm{t}`.
    pub(crate) fn tilezero(&mut self, t: usize) {
        self.shape(t);
        self.tiles[t] = [0; 1024];
    }

    /// `tdpbsud tmm{c}, tmm{a}, tmm{b}`: C[m][n] += sum over k of A[m][k] (signed) times B's
    /// byte k % 4 of row k / 4, lane n (unsigned), refusing disagreeing shapes.
    pub(crate) fn tdpbsud(&mut self, c: usize, a: usize, b: usize) {
        assert!(
            c != a && c != b && a != b,
            "tdpbsud needs three distinct tiles"
        );
        let (m, ka) = self.shape(a);
        let (kb, nb) = self.shape(b);
        let (mc, nc) = self.shape(c);
        assert!(
            ka % 4 == 0 && nc % 4 == 0,
            "tile widths must be whole dwords"
        );
        assert_eq!(m, mc, "A has {m} rows, C {mc}");
        assert_eq!(ka / 4, kb, "A has {} dwords a row, B {kb} rows", ka / 4);
        assert_eq!(nb, nc, "B has {nb} bytes a row, C {nc}");
        for row in 0..m {
            for n in 0..nc / 4 {
                let mut sum = 0i32;
                for k in 0..ka {
                    let x = self.tiles[a][row * 64 + k] as i8 as i32;
                    let y = self.tiles[b][(k / 4) * 64 + n * 4 + k % 4] as i32;
                    sum = sum.wrapping_add(x * y);
                }
                let at = row * 64 + n * 4;
                let old = i32::from_le_bytes(self.tiles[c][at..at + 4].try_into().unwrap());
                self.tiles[c][at..at + 4].copy_from_slice(&old.wrapping_add(sum).to_le_bytes());
            }
        }
    }

    /// `tilestored [p + stride], tmm{t}`.
    ///
    /// # Safety
    /// `p` writable for the tile's rows, `stride` bytes apart, of its bytes per row.
    pub(crate) unsafe fn tilestored(&mut self, t: usize, p: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(t);
        for r in 0..rows {
            // SAFETY: the caller guarantees the rows are writable.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), colsb) };
            dst.copy_from_slice(&self.tiles[t][r * 64..r * 64 + colsb]);
        }
    }
}

/// The instruction sequences of `amx::Hardware`, tile for tile.
impl TileEngine for Emulation {
    unsafe fn configure(&mut self, k: usize) {
        self.ldtilecfg(&tile_config(k));
    }

    unsafe fn product(&mut self, set: usize, a: *const i8, lda: usize, b: *const u8, halves: bool) {
        let (c0, c1, ta, tb) = (4 * set, 4 * set + 1, 4 * set + 2, 4 * set + 3);
        // SAFETY (both halves): the caller guarantees A's 16 rows of 32 bytes and B's 512 bytes.
        unsafe {
            self.tileloadd(ta, a as *const u8, lda);
            self.tileloadd(tb, b, 64);
        }
        self.tilezero(c0);
        self.tdpbsud(c0, ta, tb);
        if halves {
            unsafe {
                self.tileloadd(ta, a.add(HALF) as *const u8, lda);
                self.tileloadd(tb, b.add(256), 64);
            }
            self.tilezero(c1);
            self.tdpbsud(c1, ta, tb);
        }
    }

    unsafe fn store(&mut self, set: usize, c0: *mut i32, c1: *mut i32, halves: bool) {
        // SAFETY: the caller guarantees 256 writable int32 at each pointer.
        unsafe {
            self.tilestored(4 * set, c0 as *mut u8, 64);
            if halves {
                self.tilestored(4 * set + 1, c1 as *mut u8, 64);
            }
        }
    }
}

const _: () = assert!(TILE_ROWS == 16);
