//! Host-memory buffers of the CPU backend and the checked row access every op goes through: a
//! view becomes a slice of its buffer (taken with bounds-checked indexing) plus a row stride, so
//! no op ever writes outside the window it was handed.

use half::{bf16, f16};
use npu_backend::{BackendError, DType, DeviceBuffer, HostSlice, HostSliceMut, View, ViewMut};

use super::NAME;

/// A typed allocation in host memory.
#[derive(Debug, Clone)]
pub struct CpuBuffer {
    data: Data,
    /// Changes (to a value no buffer ever had) whenever the contents may change: every mutable
    /// access takes a fresh one. The backend keys what it derived from a buffer's contents (the
    /// quantized form of an op's output rows) by it, so a stale derivation can never be used.
    stamp: u64,
}

impl PartialEq for CpuBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.data == other.data
    }
}

/// A stamp no buffer has had before (process-wide).
fn fresh_stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[derive(Debug, Clone, PartialEq)]
enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
}

impl DeviceBuffer for CpuBuffer {
    fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
            Data::I32(_) => DType::I32,
        }
    }
    fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::I32(v) => v.len(),
        }
    }
}

/// A zeroed vector, or OutOfMemory instead of an abort when the allocation fails.
pub(crate) fn alloc_vec<T: Clone>(len: usize, v: T, what: &str) -> Result<Vec<T>, BackendError> {
    let oom = || BackendError::OutOfMemory {
        backend: NAME,
        what: what.to_string(),
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| oom())?;
    out.resize(len, v);
    Ok(out)
}

/// Like `alloc_vec`, for a large allocation that is read in scattered pieces (the KV pool): the
/// kernel is asked, before any page is touched, to back it with transparent huge pages where it
/// can, so strided reads across it miss the TLB far less. The advice is only a hint: where the
/// kernel declines (THP off, not Linux) this is `alloc_vec`.
pub(crate) fn alloc_vec_huge<T: Clone>(
    len: usize,
    v: T,
    what: &str,
) -> Result<Vec<T>, BackendError> {
    let oom = || BackendError::OutOfMemory {
        backend: NAME,
        what: what.to_string(),
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    let mut out: Vec<T> = Vec::new();
    out.try_reserve_exact(len).map_err(|_| oom())?;
    advise_huge_pages(
        out.as_mut_ptr() as usize,
        out.capacity() * std::mem::size_of::<T>(),
    );
    out.resize(len, v);
    Ok(out)
}

/// Asks for transparent huge pages on the whole pages inside `[start, start + bytes)`.
pub(crate) fn advise_huge_pages(start: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let first = start.next_multiple_of(PAGE);
        let end = (start + bytes) / PAGE * PAGE;
        if end > first {
            // SAFETY: madvise only changes how the kernel backs the pages of this range, which
            // lies inside an allocation this process owns (whole pages within it); it never
            // changes the memory's contents (MADV_HUGEPAGE is not a destructive advice).
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

impl CpuBuffer {
    /// A zeroed buffer of `len` elements of `dtype`.
    pub fn zeroed(dtype: DType, len: usize) -> Result<Self, BackendError> {
        const WHAT: &str = "a buffer";
        let data = match dtype {
            DType::F32 => Data::F32(alloc_vec(len, 0.0, WHAT)?),
            DType::F16 => Data::F16(alloc_vec(len, f16::ZERO, WHAT)?),
            DType::BF16 => Data::BF16(alloc_vec(len, bf16::ZERO, WHAT)?),
            DType::I32 => Data::I32(alloc_vec(len, 0, WHAT)?),
        };
        Ok(Self {
            data,
            stamp: fresh_stamp(),
        })
    }

    /// An f32 buffer holding `values`.
    pub fn from_f32(values: Vec<f32>) -> Self {
        Self {
            data: Data::F32(values),
            stamp: fresh_stamp(),
        }
    }

    /// The values of an f32 buffer.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The values of a bf16 buffer.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match &self.data {
            Data::BF16(v) => Some(v),
            _ => None,
        }
    }

    /// The values of an i32 buffer.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.data {
            Data::I32(v) => Some(v),
            _ => None,
        }
    }

    pub(crate) fn f32s(&self, op: &'static str) -> Result<&[f32], BackendError> {
        self.as_f32()
            .ok_or_else(|| wrong_dtype(op, DType::F32, self.dtype()))
    }

    /// The buffer's content stamp (see the field).
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp
    }

    /// The values, writable (the caller gives the buffer a fresh content stamp first).
    fn f32s_mut(&mut self, op: &'static str) -> Result<&mut [f32], BackendError> {
        let dtype = self.dtype();
        match &mut self.data {
            Data::F32(v) => Ok(v),
            _ => Err(wrong_dtype(op, DType::F32, dtype)),
        }
    }

    fn i32s_mut(&mut self, op: &'static str) -> Result<&mut [i32], BackendError> {
        let dtype = self.dtype();
        match &mut self.data {
            Data::I32(v) => Ok(v),
            _ => Err(wrong_dtype(op, DType::I32, dtype)),
        }
    }
}

pub(crate) fn wrong_dtype(op: &'static str, want: DType, got: DType) -> BackendError {
    BackendError::BadArgument {
        op,
        message: format!("needs an {} buffer, got {}", want.name(), got.name()),
    }
}

pub(crate) fn bad(op: &'static str, message: String) -> BackendError {
    BackendError::BadArgument { op, message }
}

/// The rows of a read-only view: row `r` is `data[r * stride..r * stride + cols]`.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
    /// The buffer's content stamp.
    pub stamp: u64,
}

/// Which rows of which contents: a window of a buffer as it was at one content stamp. Two equal
/// keys name the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowsKey {
    stamp: u64,
    start: usize,
    rows: usize,
    cols: usize,
    stride: usize,
}

impl RowsKey {
    fn of(stamp: u64, start: *const f32, rows: usize, cols: usize, stride: usize) -> Self {
        Self {
            stamp,
            start: start as usize,
            rows,
            cols,
            stride,
        }
    }
}

impl<'a> Rows<'a> {
    #[inline]
    pub fn row(&self, r: usize) -> &'a [f32] {
        &self.data[r * self.stride..r * self.stride + self.cols]
    }
    /// The window and the contents it holds now.
    pub fn key(&self) -> RowsKey {
        RowsKey::of(
            self.stamp,
            self.data.as_ptr(),
            self.rows,
            self.cols,
            self.stride,
        )
    }
    /// All rows as one slice when they follow each other without gaps.
    pub fn contiguous(&self) -> Option<&'a [f32]> {
        (self.rows <= 1 || self.cols == self.stride).then_some(self.data)
    }
}

/// The rows of a writable view, laid out as in `Rows`.
pub(crate) struct RowsMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
    /// The buffer's content stamp taken for this write.
    pub stamp: u64,
}

impl RowsMut<'_> {
    /// The window and the contents it will hold once this write is done (what a later `Rows`
    /// of the same window has for `key` while nothing else writes the buffer).
    pub fn key(&self) -> RowsKey {
        RowsKey::of(
            self.stamp,
            self.data.as_ptr(),
            self.rows,
            self.cols,
            self.stride,
        )
    }
    #[inline]
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.stride..r * self.stride + self.cols]
    }
}

/// The f32 rows `v` names (`data` spans exactly the window: offset to end).
pub(crate) fn rows<'a>(
    v: &View<'a, CpuBuffer>,
    op: &'static str,
) -> Result<Rows<'a>, BackendError> {
    let l = v.layout();
    let stamp = v.buf().stamp();
    let all = v.buf().f32s(op)?;
    let data = all
        .get(l.offset()..l.end())
        .ok_or_else(|| bad(op, format!("{l:?} lies outside its buffer")))?;
    Ok(Rows {
        data,
        rows: l.rows(),
        cols: l.cols(),
        stride: l.stride(),
        stamp,
    })
}

/// The f32 rows `v` names, writable.
pub(crate) fn rows_mut<'a>(
    v: &'a mut ViewMut<'_, CpuBuffer>,
    op: &'static str,
) -> Result<RowsMut<'a>, BackendError> {
    let l = v.layout();
    let buf = v.buf_mut();
    // The stamp this write takes (nothing else can change it while the rows borrow the buffer).
    let stamp = fresh_stamp();
    buf.stamp = stamp;
    let all = buf.f32s_mut(op)?;
    let data = all
        .get_mut(l.offset()..l.end())
        .ok_or_else(|| bad(op, format!("{l:?} lies outside its buffer")))?;
    Ok(RowsMut {
        data,
        rows: l.rows(),
        cols: l.cols(),
        stride: l.stride(),
        stamp,
    })
}

/// The i32 rows `v` names (as one slice spanning the window and a stride).
pub(crate) fn i32_rows<'a>(
    v: &View<'a, CpuBuffer>,
    op: &'static str,
) -> Result<(&'a [i32], usize), BackendError> {
    let l = v.layout();
    let all = v
        .buf()
        .as_i32()
        .ok_or_else(|| wrong_dtype(op, DType::I32, v.buf().dtype()))?;
    let data = all
        .get(l.offset()..l.end())
        .ok_or_else(|| bad(op, format!("{l:?} lies outside its buffer")))?;
    Ok((data, l.stride()))
}

/// The i32 rows `v` names, writable (as one slice and a stride).
pub(crate) fn i32_rows_mut<'a>(
    v: &'a mut ViewMut<'_, CpuBuffer>,
    op: &'static str,
) -> Result<(&'a mut [i32], usize), BackendError> {
    let l = v.layout();
    let buf = v.buf_mut();
    buf.stamp = fresh_stamp();
    let all = buf.i32s_mut(op)?;
    let data = all
        .get_mut(l.offset()..l.end())
        .ok_or_else(|| bad(op, format!("{l:?} lies outside its buffer")))?;
    Ok((data, l.stride()))
}

/// Checks that a view has the expected shape.
pub(crate) fn shape(
    op: &'static str,
    what: &str,
    rows: usize,
    cols: usize,
    want_rows: usize,
    want_cols: usize,
) -> Result<(), BackendError> {
    if rows != want_rows || cols != want_cols {
        return Err(bad(
            op,
            format!("{what} is {rows}x{cols}, expected {want_rows}x{want_cols}"),
        ));
    }
    Ok(())
}

/// `upload`: writes `src` into `dst`'s window row by row, converting f32 to the buffer's float
/// type.
pub(crate) fn upload(
    src: HostSlice<'_>,
    mut dst: ViewMut<'_, CpuBuffer>,
) -> Result<(), BackendError> {
    const OP: &str = "upload";
    let l = dst.layout();
    if src.len() != l.elements() {
        return Err(bad(
            OP,
            format!("{} values for a window of {}", src.len(), l.elements()),
        ));
    }
    if l.cols() == 0 {
        return Ok(());
    }
    let dtype = dst.dtype();
    let window = l.offset()..l.end();
    let outside = || bad(OP, format!("{l:?} lies outside its buffer"));
    let rows = |n: usize| (0..l.rows()).map(move |r| (r * l.stride(), r * n));
    let buf = dst.buf_mut();
    buf.stamp = fresh_stamp();
    match (src, &mut buf.data) {
        (HostSlice::F32(s), Data::F32(d)) => {
            let d = d.get_mut(window).ok_or_else(outside)?;
            for (at, from) in rows(l.cols()) {
                d[at..at + l.cols()].copy_from_slice(&s[from..from + l.cols()]);
            }
        }
        (HostSlice::F32(s), Data::F16(d)) => {
            let d = d.get_mut(window).ok_or_else(outside)?;
            for (at, from) in rows(l.cols()) {
                for (o, &v) in d[at..at + l.cols()].iter_mut().zip(&s[from..]) {
                    *o = f16::from_f32(v);
                }
            }
        }
        (HostSlice::F32(s), Data::BF16(d)) => {
            let d = d.get_mut(window).ok_or_else(outside)?;
            for (at, from) in rows(l.cols()) {
                for (o, &v) in d[at..at + l.cols()].iter_mut().zip(&s[from..]) {
                    *o = bf16::from_f32(v);
                }
            }
        }
        (HostSlice::I32(s), Data::I32(d)) => {
            let d = d.get_mut(window).ok_or_else(outside)?;
            for (at, from) in rows(l.cols()) {
                d[at..at + l.cols()].copy_from_slice(&s[from..from + l.cols()]);
            }
        }
        (HostSlice::F32(_), _) => return Err(wrong_dtype(OP, DType::F32, dtype)),
        (HostSlice::I32(_), _) => return Err(wrong_dtype(OP, DType::I32, dtype)),
    }
    Ok(())
}

/// One read of `read_back`: `src`'s window, row by row, into `dst` (float dtypes into f32).
pub(crate) fn read(
    src: &View<'_, CpuBuffer>,
    dst: &mut HostSliceMut<'_>,
) -> Result<(), BackendError> {
    const OP: &str = "read_back";
    let l = src.layout();
    if dst.len() != l.elements() {
        return Err(bad(
            OP,
            format!("{} host values for a window of {}", dst.len(), l.elements()),
        ));
    }
    if l.cols() == 0 {
        return Ok(());
    }
    let window = l.offset()..l.end();
    let outside = || bad(OP, format!("{l:?} lies outside its buffer"));
    let (cols, stride) = (l.cols(), l.stride());
    fn each_row<T: Copy, U>(s: &[T], d: &mut [U], cols: usize, stride: usize, f: impl Fn(T) -> U) {
        for (r, out) in d.chunks_exact_mut(cols).enumerate() {
            for (o, &v) in out.iter_mut().zip(&s[r * stride..r * stride + cols]) {
                *o = f(v);
            }
        }
    }
    match (&src.buf().data, dst) {
        (Data::F32(s), HostSliceMut::F32(d)) => {
            each_row(s.get(window).ok_or_else(outside)?, d, cols, stride, |v| v)
        }
        (Data::F16(s), HostSliceMut::F32(d)) => each_row(
            s.get(window).ok_or_else(outside)?,
            d,
            cols,
            stride,
            f16::to_f32,
        ),
        (Data::BF16(s), HostSliceMut::F32(d)) => each_row(
            s.get(window).ok_or_else(outside)?,
            d,
            cols,
            stride,
            bf16::to_f32,
        ),
        (Data::I32(s), HostSliceMut::I32(d)) => {
            each_row(s.get(window).ok_or_else(outside)?, d, cols, stride, |v| v)
        }
        (Data::I32(_), HostSliceMut::F32(_)) => {
            return Err(bad(OP, "an i32 buffer read into f32 memory".into()))
        }
        (_, HostSliceMut::I32(_)) => {
            return Err(wrong_dtype(OP, DType::I32, src.dtype()));
        }
    }
    Ok(())
}
