//! A small fork-join pool for compute kernels: `run(n_tasks, f)` calls `f(i)` for every task index
//! on the calling thread and the pool's workers, and returns when all are done. Tasks are claimed
//! from one atomic word that holds the job's generation, task count and next index (so a claim is
//! always checked against the job it belongs to), and the caller never waits
//! for a worker that has not started (a busy machine may deschedule it): it does the work itself.
//! Workers spin briefly between jobs (a step issues hundreds back to back) and then sleep, so an
//! idle agent costs no CPU.
//!
//! A task that panics is caught where it ran: the job's unclaimed tasks are cancelled, the tasks
//! already running finish, and `run` returns [`PoolError::TaskPanicked`] only then, so no thread
//! ever touches the job's closure after `run` has returned. Workers survive and the pool stays
//! usable. A `run` issued from inside a task (of any pool) runs inline on that thread (it would
//! otherwise wait for itself).

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

/// Waiting spins of the caller between yields of its time slice (a worker it waits for may be
/// descheduled on a busy machine).
const WAIT_SPINS_BEFORE_YIELD: u32 = 1 << 12;

/// Why a parallel call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A task panicked; the job's other tasks either finished or never started, and whatever the
    /// job was writing must be treated as garbage.
    #[error("a compute task panicked: {0}")]
    TaskPanicked(String),
}

type Job = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is Sync (so it may be called from any thread) and outlives every use:
// workers dereference it only while they hold an unfinished task of its job, and `run_job` does
// not return before every task of the job is finished or cancelled (see `run_job` and `worker`).
unsafe impl Send for JobPtr {}
// SAFETY: as for Send; the pointer itself is only copied.
unsafe impl Sync for JobPtr {}

thread_local! {
    /// Set while this thread runs a pool task: a nested `run` then runs inline.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

struct Shared {
    /// Bits 32..64: job generation; 16..32: its task count; 0..16: next task index.
    state: AtomicU64,
    /// Tasks of the current job finished (run, or cancelled after a panic).
    done: AtomicUsize,
    /// The current job, valid while its generation is current and tasks remain.
    job: Mutex<Option<JobPtr>>,
    /// The message of the first task of the current job that panicked.
    panic: Mutex<Option<String>>,
    sleeping: Mutex<usize>,
    wake: Condvar,
    shutdown: AtomicBool,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises concurrent `run` calls from different threads.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool that runs jobs on `threads` threads in total (the caller counts as one). If the
    /// system refuses to start a thread, the pool runs with the ones it has (and says so).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            panic: Mutex::new(None),
            sleeping: Mutex::new(0),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("compute-{i}"))
                .spawn(move || worker(s))
            {
                Ok(handle) => workers.push(handle),
                Err(e) => {
                    tracing::warn!(
                        "could not start compute thread {i} of {threads} ({e}); running with {i}"
                    );
                    break;
                }
            }
        }
        Self {
            shared,
            workers,
            run_lock: Mutex::new(()),
        }
    }

    /// All cores this process may use.
    pub fn available_threads() -> usize {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` for i in 0..n_tasks across the pool; returns when every call returned (or,
    /// after a task panicked, when every call that had started returned: the rest never run).
    /// A pool of one thread, a single task, or a call from inside a task runs inline on the
    /// calling thread and spawns nothing.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) -> Result<(), PoolError> {
        if n_tasks <= 1 || self.workers.is_empty() || IN_TASK.with(Cell::get) {
            return run_inline(n_tasks, &f);
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut start = 0;
        while start < n_tasks {
            let n = (n_tasks - start).min(MAX_TASKS);
            self.run_job(n, &|i| f(start + i))?;
            start += n;
        }
        Ok(())
    }

    fn run_job(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), PoolError> {
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the workers; a worker calls the job only after
        // claiming a task of this generation, and we return only after every task is done or
        // cancelled, so no call through this reference outlives `f`.
        let job: &'static Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(job as *const Job));
        *s.panic.lock().unwrap_or_else(|e| e.into_inner()) = None;
        s.done.store(0, Ordering::Relaxed);
        let gen = (s.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        s.state
            .store(gen << 32 | (n_tasks as u64) << 16, Ordering::Release);
        {
            let sleeping = s.sleeping.lock().unwrap_or_else(|e| e.into_inner());
            if *sleeping > 0 {
                s.wake.notify_all();
            }
        }
        work(s, gen, job);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) != n_tasks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(WAIT_SPINS_BEFORE_YIELD) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Every task is finished or cancelled: no worker can reach the job any more (a claim of
        // this generation fails from now on), so forgetting the pointer is only tidiness.
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        match s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(message) => Err(PoolError::TaskPanicked(message)),
            None => Ok(()),
        }
    }
}

/// Runs the tasks one after another on this thread, stopping at the first that panics.
fn run_inline(n_tasks: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), PoolError> {
    for i in 0..n_tasks {
        call_task(f, i).map_err(PoolError::TaskPanicked)?;
    }
    Ok(())
}

/// Calls one task with this thread marked as running a task; a panic comes back as its message.
fn call_task(f: &(dyn Fn(usize) + Sync), i: usize) -> Result<(), String> {
    let outer = IN_TASK.with(|t| t.replace(true));
    // AssertUnwindSafe: a panicking task's partial writes are never trusted; its job reports
    // the panic as an error and the caller discards what the job produced.
    let r = catch_unwind(AssertUnwindSafe(|| f(i)));
    IN_TASK.with(|t| t.set(outer));
    r.map_err(|payload| {
        let message = panic_message(payload.as_ref());
        // A payload whose drop panics too must not unwind out of the pool's bookkeeping.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
        message
    })
}

/// The text of a panic payload (`panic!` with a message gives a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

/// Most tasks one job word can describe.
const MAX_TASKS: usize = 0xFFFF;

/// Claims the next task of generation `gen`: its index, or None when the job is done or gone.
#[inline]
fn claim(s: &Shared, gen: u64) -> Option<usize> {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        let idx = cur & 0xFFFF;
        let n = (cur >> 16) & 0xFFFF;
        if cur >> 32 != gen || idx >= n {
            return None;
        }
        match s
            .state
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(idx as usize),
            Err(now) => cur = now,
        }
    }
}

/// Cancels the unclaimed tasks of generation `gen` (no one can claim them any more) and counts
/// them as done.
fn cancel_rest(s: &Shared, gen: u64) {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        let idx = cur & 0xFFFF;
        let n = (cur >> 16) & 0xFFFF;
        if cur >> 32 != gen || idx >= n {
            return;
        }
        match s.state.compare_exchange_weak(
            cur,
            (cur & !0xFFFF) | n,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                s.done.fetch_add((n - idx) as usize, Ordering::Release);
                return;
            }
            Err(now) => cur = now,
        }
    }
}

/// Runs claimed task `i` of generation `gen`: a panic is recorded and cancels the rest of the
/// job. The task counts as done only afterwards, so the caller sees the panic when it sees the
/// job finished.
#[inline]
fn run_claimed(s: &Shared, gen: u64, job: &Job, i: usize) {
    if let Err(message) = call_task(job, i) {
        {
            let mut first = s.panic.lock().unwrap_or_else(|e| e.into_inner());
            if first.is_none() {
                *first = Some(message);
            }
        }
        cancel_rest(s, gen);
    }
    s.done.fetch_add(1, Ordering::Release);
}

/// Claims and runs tasks of generation `gen` until none are left.
fn work(s: &Shared, gen: u64, job: &Job) {
    while let Some(i) = claim(s, gen) {
        run_claimed(s, gen, job, i);
    }
}

fn worker(s: Arc<Shared>) {
    let mut seen_gen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let gen = loop {
            let gen = s.state.load(Ordering::Acquire) >> 32;
            if gen != seen_gen {
                break gen;
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let mut sleeping = s.sleeping.lock().unwrap_or_else(|e| e.into_inner());
                *sleeping += 1;
                while s.state.load(Ordering::Acquire) >> 32 == seen_gen
                    && !s.shutdown.load(Ordering::Relaxed)
                {
                    sleeping = s.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
                }
                *sleeping -= 1;
            } else {
                std::hint::spin_loop();
            }
        };
        seen_gen = gen;
        // A claim of this generation means the job is still alive: only then read its pointer.
        if let Some(first) = claim(&s, gen) {
            let ptr = *s.job.lock().unwrap_or_else(|e| e.into_inner());
            let Some(ptr) = ptr else {
                // Unreachable: the job is set before its generation is published and cleared
                // only after all its tasks are done, one of which this worker holds.
                s.done.fetch_add(1, Ordering::Release);
                continue;
            };
            // SAFETY: we hold an unfinished task of this job (claimed above), so `run_job` has
            // not returned and the closure behind the pointer is alive; it stays alive while we
            // run further tasks claimed from the same generation.
            let job = unsafe { &*ptr.0 };
            run_claimed(&s, gen, job, first);
            work(&s, gen, job);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _sleeping = self
                .shared
                .sleeping
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Splits `n` items into `parts` nearly equal ranges; returns the range of part `i`.
pub fn split_range(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let base = n / parts;
    let rem = n % parts;
    let start = i * base + i.min(rem);
    let len = base + usize::from(i < rem);
    start..(start + len).min(n)
}

#[cfg(test)]
mod tests;
