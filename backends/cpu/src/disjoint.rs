//! Disjoint mutable views of one output buffer for parallel tasks. A buffer seen as a row-major
//! matrix (rows `ld` elements apart) is cut into a grid of tiles: sorted, non-overlapping row
//! ranges crossed with sorted, non-overlapping column ranges inside one row. The grid checks that
//! every tile lies inside the buffer when it is built, and hands out each tile at most once, so
//! tasks on different threads can write their own tiles with no `unsafe` at the call site and no
//! way to reach outside the buffer or into another task's part.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

/// Why a grid cannot be built over a buffer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GridError {
    #[error("{what} ranges overlap or are out of order: {a:?} then {b:?}")]
    Overlap {
        what: &'static str,
        a: Range<usize>,
        b: Range<usize>,
    },
    #[error("column range {cols:?} does not fit in a row of {ld}")]
    ColumnsBeyondRow { cols: Range<usize>, ld: usize },
    #[error("rows up to {rows_end} with columns up to {cols_end} (rows {ld} apart) need more than the buffer's {len} elements")]
    BeyondBuffer {
        rows_end: usize,
        cols_end: usize,
        ld: usize,
        len: usize,
    },
}

/// Checks that `ranges` are in order and do not overlap (empty ranges are allowed anywhere).
fn check_sorted(what: &'static str, ranges: &[Range<usize>]) -> Result<(), GridError> {
    let mut prev: Option<&Range<usize>> = None;
    for r in ranges.iter().filter(|r| !r.is_empty()) {
        if let Some(p) = prev {
            if r.start < p.end {
                return Err(GridError::Overlap {
                    what,
                    a: p.clone(),
                    b: r.clone(),
                });
            }
        }
        prev = Some(r);
    }
    Ok(())
}

/// Checks that rows `rows` x columns `cols` of a matrix with rows `ld` apart fit in `len`
/// elements (and that a row's columns do not spill into the next row).
fn check_window(
    len: usize,
    ld: usize,
    rows: &Range<usize>,
    cols: &Range<usize>,
) -> Result<(), GridError> {
    if rows.is_empty() || cols.is_empty() {
        return Ok(());
    }
    if cols.end > ld {
        return Err(GridError::ColumnsBeyondRow {
            cols: cols.clone(),
            ld,
        });
    }
    let beyond = || GridError::BeyondBuffer {
        rows_end: rows.end,
        cols_end: cols.end,
        ld,
        len,
    };
    let last = (rows.end - 1)
        .checked_mul(ld)
        .and_then(|o| o.checked_add(cols.end))
        .ok_or_else(beyond)?;
    if last > len {
        return Err(beyond());
    }
    Ok(())
}

/// A buffer cut into tiles that parallel tasks take one each (see the module comment).
pub struct TileGrid<'a, T> {
    base: *mut T,
    ld: usize,
    row_parts: Vec<Range<usize>>,
    col_parts: Vec<Range<usize>>,
    /// One flag per tile (row part major): taken already.
    taken: Box<[AtomicBool]>,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: the grid gives out `&mut T` access to disjoint elements, each tile at most once
// (an atomic flag per tile), so sharing it between threads is like sending disjoint `&mut [T]`
// sub-slices to them: sound when `T: Send`.
unsafe impl<T: Send> Sync for TileGrid<'_, T> {}
// SAFETY: the grid owns a unique borrow of the buffer; moving it to another thread moves that
// borrow, which is sound when `T: Send`.
unsafe impl<T: Send> Send for TileGrid<'_, T> {}

impl<'a, T> TileGrid<'a, T> {
    /// A grid over `buf` seen as rows `ld` elements apart: tile `(i, j)` is rows `row_parts[i]`
    /// by columns `col_parts[j]`. Both lists must be in order without overlaps; every tile must
    /// lie inside `buf`.
    pub fn new(
        buf: &'a mut [T],
        ld: usize,
        row_parts: Vec<Range<usize>>,
        col_parts: Vec<Range<usize>>,
    ) -> Result<Self, GridError> {
        check_sorted("row", &row_parts)?;
        check_sorted("column", &col_parts)?;
        let rows = row_parts.iter().filter(|r| !r.is_empty());
        let cols = col_parts.iter().filter(|c| !c.is_empty());
        if let (Some(last_row), Some(first_col), Some(last_col)) = (
            rows.clone().next_back(),
            cols.clone().next(),
            cols.clone().next_back(),
        ) {
            let first_row = rows.clone().next().expect("a last implies a first");
            check_window(
                buf.len(),
                ld,
                &(first_row.start..last_row.end),
                &(first_col.start..last_col.end),
            )?;
        }
        let taken = (0..row_parts.len() * col_parts.len())
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(Self {
            base: buf.as_mut_ptr(),
            ld,
            row_parts,
            col_parts,
            taken,
            _buf: PhantomData,
        })
    }

    /// `buf` as consecutive rows of `row_len` elements, cut into the row ranges `parts` (each a
    /// whole-row tile `(i, 0)`).
    pub fn rows(
        buf: &'a mut [T],
        row_len: usize,
        parts: Vec<Range<usize>>,
    ) -> Result<Self, GridError> {
        Self::row_parts(buf, row_len, parts, 0..row_len)
    }

    /// The row ranges `parts` of `buf` (rows `ld` apart), each at columns `cols`: tile `(i, 0)`.
    pub fn row_parts(
        buf: &'a mut [T],
        ld: usize,
        parts: Vec<Range<usize>>,
        cols: Range<usize>,
    ) -> Result<Self, GridError> {
        Self::new(buf, ld, parts, std::iter::once(cols).collect())
    }

    /// The column ranges `parts` of rows `rows` of `buf` (rows `ld` apart): tile `(0, j)`.
    pub fn column_parts(
        buf: &'a mut [T],
        ld: usize,
        rows: Range<usize>,
        parts: Vec<Range<usize>>,
    ) -> Result<Self, GridError> {
        Self::new(buf, ld, std::iter::once(rows).collect(), parts)
    }

    pub fn n_row_parts(&self) -> usize {
        self.row_parts.len()
    }

    pub fn n_col_parts(&self) -> usize {
        self.col_parts.len()
    }

    /// Takes tile `(i, j)`. Panics if it does not exist or was taken before (a task bug: each
    /// tile belongs to one task).
    pub fn take(&self, i: usize, j: usize) -> Tile<'_, T> {
        assert!(
            i < self.row_parts.len() && j < self.col_parts.len(),
            "tile ({i}, {j}) is outside a grid of {} x {}",
            self.row_parts.len(),
            self.col_parts.len()
        );
        let was = self.taken[i * self.col_parts.len() + j].swap(true, Ordering::AcqRel);
        assert!(!was, "tile ({i}, {j}) was taken twice");
        Tile {
            base: self.base,
            ld: self.ld,
            rows: self.row_parts[i].clone(),
            cols: self.col_parts[j].clone(),
            _buf: PhantomData,
        }
    }
}

/// One tile: rows `rows()` by columns `cols()` of the matrix, writable by its holder alone.
pub struct Tile<'a, T> {
    base: *mut T,
    ld: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: a tile is a unique borrow of its elements (like `&mut [T]`): sendable when `T: Send`.
unsafe impl<T: Send> Send for Tile<'_, T> {}
// SAFETY: `&Tile` gives read access to nothing but the tile's shape.
unsafe impl<T: Sync> Sync for Tile<'_, T> {}

impl<'a, T> Tile<'a, T> {
    /// All of `buf` (rows `rows` by columns `cols`, rows `ld` apart) as one tile, checked to lie
    /// inside it.
    pub fn whole(
        buf: &'a mut [T],
        ld: usize,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Self, GridError> {
        check_window(buf.len(), ld, &rows, &cols)?;
        Ok(Self {
            base: buf.as_mut_ptr(),
            ld,
            rows,
            cols,
            _buf: PhantomData,
        })
    }

    /// Absolute row indices of the tile.
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }

    /// Absolute column indices of the tile.
    pub fn cols(&self) -> Range<usize> {
        self.cols.clone()
    }

    /// Distance between rows, in elements.
    pub fn ld(&self) -> usize {
        self.ld
    }

    /// The tile's part of row `r` (an absolute row index inside `rows()`).
    #[inline]
    pub fn row_mut(&mut self, r: usize) -> &mut [T] {
        if self.cols.is_empty() {
            return &mut [];
        }
        assert!(
            self.rows.contains(&r),
            "row {r} is outside the tile's rows {:?}",
            self.rows
        );
        // SAFETY: the grid (or `whole`) checked that every row of the tile, at the tile's
        // columns, lies inside the buffer; the tile is the only holder of these elements, and
        // the returned borrow ties them to `&mut self`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.add(r * self.ld + self.cols.start),
                self.cols.len(),
            )
        }
    }

    /// The whole tile as one slice, when its rows are contiguous (its columns span whole rows,
    /// or it has a single row).
    pub fn contiguous_mut(&mut self) -> &mut [T] {
        if self.rows.is_empty() || self.cols.is_empty() {
            return &mut [];
        }
        assert!(
            self.rows.len() == 1 || self.cols == (0..self.ld),
            "tile rows {:?} x columns {:?} (rows {} apart) are not contiguous",
            self.rows,
            self.cols,
            self.ld
        );
        let len = (self.rows.len() - 1) * self.ld + self.cols.len();
        // SAFETY: with whole rows (or one row) the tile's elements are exactly this span, which
        // the grid checked lies inside the buffer; the tile holds them alone.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base.add(self.rows.start * self.ld + self.cols.start),
                len,
            )
        }
    }

    /// The matrix's first element, for kernels that write the tile with vector stores. Writing
    /// element `(r, c)` at `base + r * ld + c` is allowed exactly for `r` in `rows()` and `c` in
    /// `cols()`, while the tile is borrowed mutably.
    #[inline]
    pub(crate) fn raw_base(&mut self) -> *mut T {
        self.base
    }
}

#[cfg(test)]
// One-range lists are the point of several cases here.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn tiles_write_their_own_elements() {
        let mut buf = vec![0u32; 3 * 10];
        {
            let grid = TileGrid::new(&mut buf, 10, vec![0..1, 1..3], vec![0..4, 4..9]).unwrap();
            for i in 0..2 {
                for j in 0..2 {
                    let mut t = grid.take(i, j);
                    for r in t.rows() {
                        let tag = (i * 2 + j + 1) as u32;
                        t.row_mut(r).fill(tag);
                    }
                }
            }
        }
        for r in 0..3 {
            let i = usize::from(r > 0);
            let row = &buf[r * 10..r * 10 + 10];
            assert_eq!(&row[..4], &[(i * 2 + 1) as u32; 4]);
            assert_eq!(&row[4..9], &[(i * 2 + 2) as u32; 5]);
            assert_eq!(row[9], 0);
        }
    }

    #[test]
    fn bad_grids_are_refused() {
        let mut buf = vec![0f32; 20];
        assert!(matches!(
            TileGrid::new(&mut buf, 10, vec![0..2, 1..2], vec![0..10]),
            Err(GridError::Overlap { .. })
        ));
        assert!(matches!(
            TileGrid::new(&mut buf, 10, vec![0..2], vec![4..8, 0..4]),
            Err(GridError::Overlap { .. })
        ));
        assert!(matches!(
            TileGrid::new(&mut buf, 10, vec![0..2], vec![0..11]),
            Err(GridError::ColumnsBeyondRow { .. })
        ));
        assert!(matches!(
            TileGrid::new(&mut buf, 10, vec![0..3], vec![0..1]),
            Err(GridError::BeyondBuffer { .. })
        ));
        assert!(matches!(
            TileGrid::new(&mut buf, usize::MAX / 2, vec![0..3], vec![0..1]),
            Err(GridError::BeyondBuffer { .. })
        ));
        // The last row may be short: columns 0..5 of row 2 end at element 25.
        let mut short = vec![0f32; 25];
        assert!(TileGrid::new(&mut short, 10, vec![0..3], vec![0..5]).is_ok());
        assert!(Tile::whole(&mut short, 10, 0..3, 0..6).is_err());
    }

    #[test]
    #[should_panic(expected = "taken twice")]
    fn a_tile_is_given_once() {
        let mut buf = vec![0f32; 4];
        let grid = TileGrid::rows(&mut buf, 2, vec![0..1, 1..2]).unwrap();
        let _a = grid.take(1, 0);
        let _b = grid.take(1, 0);
    }

    #[test]
    #[should_panic(expected = "outside the tile")]
    fn rows_outside_the_tile_are_refused() {
        let mut buf = vec![0f32; 4];
        let grid = TileGrid::rows(&mut buf, 2, vec![0..1, 1..2]).unwrap();
        let mut t = grid.take(0, 0);
        t.row_mut(1);
    }

    #[test]
    fn contiguous_tiles() {
        let mut buf: Vec<u8> = (0..12).collect();
        let grid = TileGrid::rows(&mut buf, 3, vec![0..1, 1..4]).unwrap();
        assert_eq!(
            grid.take(1, 0).contiguous_mut(),
            &[3, 4, 5, 6, 7, 8, 9, 10, 11]
        );
        assert_eq!(grid.take(0, 0).contiguous_mut(), &[0, 1, 2]);
    }
}
