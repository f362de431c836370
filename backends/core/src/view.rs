//! Typed device buffers and the strided 2-D views every op takes. A view is checked against its
//! buffer once, when it is made, so a backend can turn it into a tensor descriptor (an aclTensor,
//! a CUDA pointer + stride) without re-deriving or re-checking anything: every element a valid
//! view names lies inside its buffer.

use crate::{BackendError, DType};

/// A device allocation of `len` elements of `dtype`. Backends implement it for their buffer type.
pub trait DeviceBuffer: Send {
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A row-major 2-D window: `rows` rows of `cols` elements, rows `stride` elements apart, starting
/// at element `offset`. Only `Layout::new` makes one, so `cols <= stride` always holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    offset: usize,
    rows: usize,
    cols: usize,
    stride: usize,
}

impl Layout {
    pub fn new(
        offset: usize,
        rows: usize,
        cols: usize,
        stride: usize,
    ) -> Result<Self, BackendError> {
        if cols > stride && rows > 1 {
            return Err(BackendError::BadView(format!(
                "{cols} columns do not fit a row stride of {stride}"
            )));
        }
        Ok(Self {
            offset,
            rows,
            cols,
            stride: stride.max(cols),
        })
    }

    /// `rows` contiguous rows of `cols` from the start of a buffer.
    pub fn contiguous(rows: usize, cols: usize) -> Self {
        Self {
            offset: 0,
            rows,
            cols,
            stride: cols,
        }
    }

    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn stride(&self) -> usize {
        self.stride
    }
    /// Elements the window covers: rows * cols.
    pub fn elements(&self) -> usize {
        self.rows * self.cols
    }
    /// True when the rows follow each other without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.rows <= 1 || self.cols == self.stride
    }
    /// One past the last element named (0 for an empty window).
    pub fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            self.offset
        } else {
            self.offset + (self.rows - 1) * self.stride + self.cols
        }
    }

    /// Columns `start..start + n` of every row.
    pub fn col_range(&self, start: usize, n: usize) -> Result<Self, BackendError> {
        if start + n > self.cols {
            return Err(BackendError::BadView(format!(
                "columns {start}..{} of a {}-column view",
                start + n,
                self.cols
            )));
        }
        Ok(Self {
            offset: self.offset + start,
            cols: n,
            ..*self
        })
    }

    /// Rows `start..start + n`.
    pub fn row_range(&self, start: usize, n: usize) -> Result<Self, BackendError> {
        if start + n > self.rows {
            return Err(BackendError::BadView(format!(
                "rows {start}..{} of a {}-row view",
                start + n,
                self.rows
            )));
        }
        Ok(Self {
            offset: self.offset + start * self.stride,
            rows: n,
            ..*self
        })
    }

    fn check(&self, len: usize) -> Result<(), BackendError> {
        if self.end() > len {
            return Err(BackendError::BadView(format!(
                "{self:?} reaches element {} of a {len}-element buffer",
                self.end()
            )));
        }
        Ok(())
    }
}

/// A checked read-only window of a device buffer.
pub struct View<'a, B: DeviceBuffer + ?Sized> {
    buf: &'a B,
    layout: Layout,
}

impl<B: DeviceBuffer + ?Sized> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: DeviceBuffer + ?Sized> Copy for View<'_, B> {}

impl<'a, B: DeviceBuffer + ?Sized> View<'a, B> {
    pub fn new(buf: &'a B, layout: Layout) -> Result<Self, BackendError> {
        layout.check(buf.len())?;
        Ok(Self { buf, layout })
    }
    /// `rows` contiguous rows of `cols` from the buffer's start.
    pub fn rows(buf: &'a B, rows: usize, cols: usize) -> Result<Self, BackendError> {
        Self::new(buf, Layout::contiguous(rows, cols))
    }
    pub fn buf(&self) -> &'a B {
        self.buf
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    pub fn col_range(&self, start: usize, n: usize) -> Result<Self, BackendError> {
        Ok(Self {
            buf: self.buf,
            layout: self.layout.col_range(start, n)?,
        })
    }
    pub fn row_range(&self, start: usize, n: usize) -> Result<Self, BackendError> {
        Ok(Self {
            buf: self.buf,
            layout: self.layout.row_range(start, n)?,
        })
    }
}

/// A checked writable window of a device buffer.
pub struct ViewMut<'a, B: DeviceBuffer + ?Sized> {
    buf: &'a mut B,
    layout: Layout,
}

impl<'a, B: DeviceBuffer + ?Sized> ViewMut<'a, B> {
    pub fn new(buf: &'a mut B, layout: Layout) -> Result<Self, BackendError> {
        layout.check(buf.len())?;
        Ok(Self { buf, layout })
    }
    pub fn rows(buf: &'a mut B, rows: usize, cols: usize) -> Result<Self, BackendError> {
        Self::new(buf, Layout::contiguous(rows, cols))
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    /// The buffer, for the backend that writes it (the layout stays checked against it).
    pub fn buf_mut(&mut self) -> &mut B {
        self.buf
    }
    pub fn buf(&self) -> &B {
        self.buf
    }
    /// The same window, read-only.
    pub fn as_view(&self) -> View<'_, B> {
        View {
            buf: self.buf,
            layout: self.layout,
        }
    }
    /// A narrower window of the same buffer (borrows this one).
    pub fn col_range(&mut self, start: usize, n: usize) -> Result<ViewMut<'_, B>, BackendError> {
        Ok(ViewMut {
            layout: self.layout.col_range(start, n)?,
            buf: self.buf,
        })
    }
    pub fn row_range(&mut self, start: usize, n: usize) -> Result<ViewMut<'_, B>, BackendError> {
        Ok(ViewMut {
            layout: self.layout.row_range(start, n)?,
            buf: self.buf,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Host(usize);
    impl DeviceBuffer for Host {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn len(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn views_stay_inside_their_buffer() {
        let b = Host(12);
        assert!(View::rows(&b, 3, 4).is_ok());
        assert!(View::rows(&b, 4, 4).is_err());
        let v = View::new(&b, Layout::new(1, 2, 3, 4).unwrap()).unwrap();
        assert_eq!(v.layout().end(), 8);
        assert!(v.col_range(1, 2).is_ok());
        assert!(v.col_range(2, 2).is_err());
        assert_eq!(v.row_range(1, 1).unwrap().layout().offset(), 5);
        assert!(Layout::new(0, 2, 5, 4).is_err());
        // A window that starts inside but runs past the end is refused.
        assert!(View::new(&b, Layout::new(10, 1, 3, 3).unwrap()).is_err());
        let mut m = Host(8);
        let mut w = ViewMut::rows(&mut m, 2, 4).unwrap();
        assert_eq!(w.col_range(2, 2).unwrap().layout().offset(), 2);
        assert!(w.row_range(1, 2).is_err());
    }
}
