//! Host↔device copies whose memory safety rests on documented behaviour only (review finding 3
//! and 6).
//!
//! - **Host→device** goes through a ring of pinned staging buffers: the source is copied into a
//!   pinned buffer, an asynchronous copy is queued from there and an event recorded after it, and
//!   a buffer is written again only after its event completed. `cuMemcpyHtoDAsync` from pinned
//!   memory is documented to be asynchronous and to read the buffer when the stream gets to it,
//!   so the caller's source may be reused (or dropped) as soon as `htod` returns, and a step's
//!   inputs do not wait for the previous step's kernels (two buffers: the host fills one while
//!   the other's copy may still be queued). From pageable memory the driver documents none of
//!   this for the asynchronous call.
//! - **Device→host** reads land in a pinned buffer of at most `READ_CAP` bytes, read in batches
//!   of at most that size, so a large read (many KV blocks) neither pins a buffer the size of the
//!   whole transfer nor keeps it pinned for the life of the process. A batch is queued as
//!   `cuMemcpyDtoHAsync` copies into the pinned buffer, which is fully asynchronous from device to
//!   pinned memory: the host reads the buffer only after `cuStreamSynchronize` returned.
//!
//! Both are generic over the device ([`StageDevice`], [`ReadDevice`]): the real device
//! (`driver`) and the CUDA emulation (`emu`) run this same code, and the emulation performs the
//! queued copies only when the stream is synchronized (or an event waited for), so a missing
//! wait here reads stale bytes there; the unit tests run the ring against a device that reads
//! the staging buffer as late as the documentation allows.

use npu_backend::BackendError;

use crate::gpu::DevPtr;

/// Staging buffers in the ring.
pub const STAGE_BUFFERS: usize = 2;
/// Bytes of each staging buffer: uploads larger than this go in pieces, alternating buffers.
pub const STAGE_BYTES: usize = 4 << 20;
/// Most bytes of pinned memory a read uses at once.
pub const READ_CAP: usize = 16 << 20;

/// What the ring asks of a device.
pub trait StageDevice {
    /// Pinned buffer `i` (`STAGE_BYTES` or the ring's own size).
    fn buffer(&self, i: usize) -> *mut u8;
    /// Blocks until the copy last queued from buffer `i` has read it.
    fn wait(&self, i: usize) -> Result<(), BackendError>;
    /// Queues a copy of `len` bytes from buffer `i` to `dst`, marked so that `wait(i)` waits
    /// for it.
    fn copy(&self, i: usize, dst: DevPtr, len: usize) -> Result<(), BackendError>;
}

/// The ring's state: which buffer is next and which have a queued copy.
#[derive(Debug)]
pub struct Staging {
    bytes: usize,
    next: usize,
    queued: [bool; STAGE_BUFFERS],
}

impl Staging {
    pub fn new(bytes: usize) -> Self {
        assert!(bytes > 0);
        Self {
            bytes,
            next: 0,
            queued: [false; STAGE_BUFFERS],
        }
    }

    /// Queues `src` → `dst` through the ring; `src` may be reused when this returns.
    pub fn htod(
        &mut self,
        dev: &dyn StageDevice,
        dst: DevPtr,
        src: &[u8],
    ) -> Result<(), BackendError> {
        for (n, part) in src.chunks(self.bytes).enumerate() {
            let i = self.next;
            self.next = (i + 1) % STAGE_BUFFERS;
            if self.queued[i] {
                dev.wait(i)?;
                self.queued[i] = false;
            }
            // SAFETY: buffer `i` holds `self.bytes` >= part.len() bytes and no queued copy reads
            // it any more (waited above).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dev.buffer(i), part.len()) };
            dev.copy(i, dst + (n * self.bytes) as u64, part.len())?;
            self.queued[i] = true;
        }
        Ok(())
    }

    /// Forgets queued copies (after the stream was synchronized).
    pub fn drained(&mut self) {
        self.queued = [false; STAGE_BUFFERS];
    }
}

/// What a read asks of a device.
pub trait ReadDevice {
    /// Makes the pinned read buffer hold at least `bytes` (it is idle: every earlier batch was
    /// synchronized); its contents are unspecified.
    fn reserve(&mut self, bytes: usize) -> Result<(), BackendError>;
    /// The pinned read buffer (at least the bytes last reserved).
    fn buffer(&self) -> *const u8;
    /// Queues an asynchronous copy of `bytes` from `src` into the pinned buffer at `at`.
    fn copy_to_host(&mut self, at: usize, src: DevPtr, bytes: usize) -> Result<(), BackendError>;
    /// Blocks until everything queued on the stream, the copies above included, has completed.
    fn synchronize(&mut self) -> Result<(), BackendError>;
}

/// Reads each `(address, bytes)` region after every queued op, one after the other, into
/// `out`: batches of at most `cap` bytes, each queued into the pinned buffer and synchronized
/// before the host reads it. No region: a synchronization only.
pub fn read(
    dev: &mut dyn ReadDevice,
    regions: &[(DevPtr, usize)],
    cap: usize,
    out: &mut Vec<u8>,
) -> Result<(), BackendError> {
    out.clear();
    let batches = read_batches(regions, cap);
    if batches.is_empty() {
        // Nothing to copy, but the read still waits for the queued work.
        return dev.synchronize();
    }
    for batch in batches {
        let total: usize = batch.iter().map(|p| p.1).sum();
        dev.reserve(total)?;
        let mut at = 0usize;
        for &(src, bytes) in &batch {
            dev.copy_to_host(at, src, bytes)?;
            at += bytes;
        }
        dev.synchronize()?;
        // SAFETY: the buffer holds at least `total` bytes (reserved above) and the copies that
        // filled them completed (synchronized above); nothing writes it until the next batch.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(dev.buffer(), total) });
    }
    Ok(())
}

/// A device→host read cut into batches of at most `cap` bytes: each batch is a list of
/// `(device address, bytes)` pieces, in order; together they cover `regions` exactly.
pub fn read_batches(regions: &[(DevPtr, usize)], cap: usize) -> Vec<Vec<(DevPtr, usize)>> {
    assert!(cap > 0);
    let mut batches = Vec::new();
    let mut cur: Vec<(DevPtr, usize)> = Vec::new();
    let mut room = cap;
    for &(mut src, mut left) in regions {
        while left > 0 {
            let n = left.min(room);
            cur.push((src, n));
            src += n as u64;
            left -= n;
            room -= n;
            if room == 0 {
                batches.push(std::mem::take(&mut cur));
                room = cap;
            }
        }
    }
    if !cur.is_empty() {
        batches.push(cur);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A device that reads a staging buffer only when it must: at `wait` for that buffer or at
    /// `flush` (the latest the documentation allows), and that fails when a buffer is queued
    /// again before its previous copy read it.
    struct LateReader {
        bufs: RefCell<Vec<Vec<u8>>>,
        pending: RefCell<Vec<Option<(DevPtr, usize)>>>,
        memory: RefCell<Vec<u8>>,
    }

    impl LateReader {
        fn new(bytes: usize, mem: usize) -> Self {
            Self {
                bufs: RefCell::new(vec![vec![0u8; bytes]; STAGE_BUFFERS]),
                pending: RefCell::new(vec![None; STAGE_BUFFERS]),
                memory: RefCell::new(vec![0u8; mem]),
            }
        }
        fn perform(&self, i: usize) {
            if let Some((dst, len)) = self.pending.borrow_mut()[i].take() {
                let b = self.bufs.borrow();
                self.memory.borrow_mut()[dst as usize..dst as usize + len]
                    .copy_from_slice(&b[i][..len]);
            }
        }
        fn flush(&self) {
            for i in 0..STAGE_BUFFERS {
                self.perform(i);
            }
        }
    }

    impl StageDevice for LateReader {
        fn buffer(&self, i: usize) -> *mut u8 {
            assert!(
                self.pending.borrow()[i].is_none(),
                "staging buffer {i} written while its copy is still queued"
            );
            self.bufs.borrow_mut()[i].as_mut_ptr()
        }
        fn wait(&self, i: usize) -> Result<(), BackendError> {
            self.perform(i);
            Ok(())
        }
        fn copy(&self, i: usize, dst: DevPtr, len: usize) -> Result<(), BackendError> {
            assert!(
                self.pending.borrow()[i].is_none(),
                "buffer {i} queued twice"
            );
            self.pending.borrow_mut()[i] = Some((dst, len));
            Ok(())
        }
    }

    #[test]
    fn the_source_may_be_reused_at_once_even_when_the_device_reads_late() {
        let dev = LateReader::new(1000, 10_000);
        let mut ring = Staging::new(1000);
        let mut src: Vec<u8> = (0..4321u32).map(|i| (i * 7) as u8).collect();
        let want = src.clone();
        ring.htod(&dev, 100, &src).unwrap();
        // The caller rewrites (or drops) its buffer right away, as begin_step and upload do.
        src.iter_mut().for_each(|b| *b = 0xee);
        let small = [1u8, 2, 3];
        ring.htod(&dev, 5000, &small).unwrap();
        drop(src);
        dev.flush();
        let mem = dev.memory.borrow();
        assert_eq!(&mem[100..100 + 4321], &want[..]);
        assert_eq!(&mem[5000..5003], &small);
    }

    #[test]
    fn reads_are_cut_into_capped_batches_in_order() {
        let regions = [(0u64, 10usize), (100, 25), (200, 0), (300, 5)];
        let b = read_batches(&regions, 16);
        assert_eq!(
            b,
            vec![
                vec![(0, 10), (100, 6)],
                vec![(106, 16)],
                vec![(122, 3), (300, 5)],
            ]
        );
        assert!(b.iter().all(|x| x.iter().map(|p| p.1).sum::<usize>() <= 16));
        assert!(read_batches(&[], 16).is_empty());
    }
}
