//! A small fork-join pool for compute kernels: `run(n_tasks, f)` calls `f(i)` for every task index
//! on the calling thread and the pool's workers, and returns when all are done. Workers spin briefly
//! between jobs (a step issues hundreds of jobs back to back) and then sleep, so an idle agent
//! costs no CPU.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for every job; workers wait for it to change.
    generation: AtomicUsize,
    /// The current job (a fat pointer, valid while `run` is blocked).
    job: Mutex<Option<JobPtr>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Workers still working on the current job.
    active: AtomicUsize,
    sleeping: Mutex<usize>,
    wake: Condvar,
    shutdown: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is Sync and outlives every use (run() waits for all workers).
unsafe impl Send for JobPtr {}

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
            generation: AtomicUsize::new(0),
            job: Mutex::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
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
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.workers.is_empty() {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: &(dyn Fn(usize) + Sync + '_) = &f;
        // SAFETY: erase the lifetime; we do not return before every worker has finished with it.
        let job: &'static Job = unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(job)
        };
        *s.job.lock().unwrap() = Some(JobPtr(job as *const Job));
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.active.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        {
            let sleeping = s.sleeping.lock().unwrap();
            if *sleeping > 0 {
                s.wake.notify_all();
            }
        }
        run_tasks(s, job);
        while s.active.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *s.job.lock().unwrap() = None;
    }
}

fn run_tasks(s: &Shared, job: &Job) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next_task.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        job(i);
    }
}

fn worker(s: Arc<Shared>) {
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin, then sleep.
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins % 64 == 0 && start.elapsed() > SPIN {
                let mut sleeping = s.sleeping.lock().unwrap();
                *sleeping += 1;
                while s.generation.load(Ordering::Acquire) == seen
                    && !s.shutdown.load(Ordering::Relaxed)
                {
                    sleeping = s.wake.wait(sleeping).unwrap();
                }
                *sleeping -= 1;
            } else {
                std::hint::spin_loop();
            }
        }
        if s.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let job = s.job.lock().unwrap().map(|p| p.0);
        if let Some(job) = job {
            // SAFETY: `run` keeps the job alive until `active` reaches zero.
            run_tasks(&s, unsafe { &*job });
        }
        s.active.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _sleeping = self.shared.sleeping.lock().unwrap();
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
