//! A small fork-join pool for compute kernels: `run(n_tasks, f)` calls `f(i)` for every task index
//! on the calling thread and the pool's workers, and returns when all are done. Tasks are claimed
//! from one atomic word that holds the job's generation, task count and next index (so a claim is
//! always checked against the job it belongs to), and the caller never waits
//! for a worker that has not started (a busy machine may deschedule it): it does the work itself.
//! Workers spin briefly between jobs (a step issues hundreds back to back) and then sleep, so an
//! idle agent costs no CPU.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

type Job = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is Sync and outlives every use (see `run`).
unsafe impl Send for JobPtr {}
unsafe impl Sync for JobPtr {}

struct Shared {
    /// Bits 32..64: job generation; 16..32: its task count; 0..16: next task index.
    state: AtomicU64,
    /// Tasks of the current job finished.
    done: AtomicUsize,
    /// The current job, valid while its generation is current and tasks remain.
    job: Mutex<Option<JobPtr>>,
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
    /// A pool that runs jobs on `threads` threads in total (the caller counts as one).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            sleeping: Mutex::new(0),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("compute-{i}"))
                    .spawn(move || worker(s))
                    .expect("spawning a compute thread")
            })
            .collect();
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

    /// Calls `f(i)` for i in 0..n_tasks across the pool; returns when all calls returned.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks <= 1 || self.workers.is_empty() {
            (0..n_tasks).for_each(f);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut start = 0;
        while start < n_tasks {
            let n = (n_tasks - start).min(MAX_TASKS);
            self.run_job(n, &|i| f(start + i));
            start += n;
        }
    }

    fn run_job(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: the lifetime is erased only for the workers; a worker calls the job only after
        // claiming a task of this generation, and we return only after every task is done.
        let job: &'static Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(job as *const Job));
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
        while s.done.load(Ordering::Acquire) != n_tasks {
            std::hint::spin_loop();
        }
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

/// Claims and runs tasks of generation `gen` until none are left.
fn work(s: &Shared, gen: u64, job: &Job) {
    while let Some(i) = claim(s, gen) {
        job(i);
        s.done.fetch_add(1, Ordering::Release);
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
            let job = s
                .job
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .expect("a job is set while its tasks remain");
            // SAFETY: we hold an unfinished task of this job, so `run` has not returned.
            let job = unsafe { &*job.0 };
            job(first);
            s.done.fetch_add(1, Ordering::Release);
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
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once() {
        let pool = ThreadPool::new(3);
        for n in [1usize, 2, 7, 100, 1000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn many_small_jobs_back_to_back() {
        let pool = ThreadPool::new(4);
        let total = AtomicU64::new(0);
        for _ in 0..20_000 {
            pool.run(3, |i| {
                total.fetch_add(i as u64 + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 20_000 * 6);
    }

    #[test]
    fn survives_sleep_between_jobs() {
        let pool = ThreadPool::new(2);
        let total = AtomicU64::new(0);
        for round in 0..5 {
            pool.run(10, |i| {
                total.fetch_add(i as u64, Ordering::Relaxed);
            });
            if round == 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 5 * 45);
    }

    #[test]
    fn split_range_covers_everything() {
        for n in 0..50 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(n, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}

#[cfg(test)]
mod stress {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn jobs_with_sleeps_between_never_hang() {
        let pool = ThreadPool::new(2);
        let total = AtomicU64::new(0);
        for i in 0..3000u64 {
            pool.run(8, |t| {
                total.fetch_add(t as u64, Ordering::Relaxed);
            });
            if i % 7 == 0 {
                std::thread::sleep(Duration::from_micros(250 + (i % 5) * 40));
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 3000 * 28);
    }

    /// A worker that saw an old job must never claim a task of the next one by index alone
    /// (jobs of different sizes back to back once ran a task twice and hung the caller).
    #[test]
    fn alternating_job_sizes_run_each_task_once() {
        let pool = ThreadPool::new(3);
        let hits: Vec<AtomicU64> = (0..96).map(|_| AtomicU64::new(0)).collect();
        for i in 0..20_000usize {
            let n = if i % 2 == 0 { 8 } else { 96 };
            pool.run(n, |t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
        }
        for (t, h) in hits.iter().enumerate() {
            let want = if t < 8 { 20_000 } else { 10_000 };
            assert_eq!(h.load(Ordering::Relaxed), want, "task {t}");
        }
    }
}
