//! Pinned host memory for the backend's asynchronous copies (step inputs up, KV blocks up and
//! down): a small pool, as the aclrtMallocHost page advises against allocating and freeing
//! page-locked memory often. The buffer a queued copy still reads is never handed out again
//! before the stream is synchronized; after that it returns to the pool.

use crate::memory::PinnedBuffer;
use crate::runtime::Acl;

use super::{err, BackendError};

/// Idle buffers kept for reuse after a synchronization (beyond them the smallest are freed).
const IDLE_KEEP: usize = 2;

/// The smallest staging allocation.
const MIN_BYTES: usize = 4096;

#[derive(Default)]
pub(super) struct Staging {
    /// The buffer [`Staging::get`] last handed out.
    current: Option<PinnedBuffer>,
    /// `current` feeds a copy queued since the last synchronization (set by the caller).
    pub(super) busy: bool,
    /// Earlier buffers that copies queued since the last synchronization still read.
    in_flight: Vec<PinnedBuffer>,
    /// Buffers no queued copy reads.
    idle: Vec<PinnedBuffer>,
    allocations: u64,
}

impl Staging {
    /// A buffer of at least `bytes` that no queued copy reads (it becomes [`Staging::current`]):
    /// the smallest free one that fits (the current one included when no copy reads it), else a
    /// new allocation.
    pub(super) fn get(
        &mut self,
        acl: &'static Acl,
        bytes: usize,
    ) -> Result<&mut PinnedBuffer, BackendError> {
        if let Some(old) = self.current.take() {
            if self.busy {
                self.in_flight.push(old);
            } else {
                self.idle.push(old);
            }
        }
        self.busy = false;
        let best = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, p)| p.bytes() >= bytes)
            .min_by_key(|(_, p)| p.bytes())
            .map(|(i, _)| i);
        let buf = match best {
            Some(i) => self.idle.swap_remove(i),
            None => {
                self.allocations += 1;
                PinnedBuffer::alloc(acl, bytes.max(MIN_BYTES).next_power_of_two()).map_err(err)?
            }
        };
        Ok(self.current.insert(buf))
    }

    /// The buffer last handed out (its downloaded bytes are valid after a synchronization).
    pub(super) fn current(&self) -> Option<&PinnedBuffer> {
        self.current.as_ref()
    }

    /// After a stream synchronization: every buffer is free again; the pool keeps the largest
    /// [`IDLE_KEEP`] idle ones.
    pub(super) fn synchronized(&mut self) {
        self.busy = false;
        self.idle.append(&mut self.in_flight);
        if self.idle.len() > IDLE_KEEP {
            self.idle.sort_by_key(|p| std::cmp::Reverse(p.bytes()));
            self.idle.truncate(IDLE_KEEP);
        }
    }

    /// Pinned allocations made so far.
    pub(super) fn allocations(&self) -> u64 {
        self.allocations
    }
}
