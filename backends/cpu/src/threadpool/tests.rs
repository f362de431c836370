//! The pool runs every task exactly once, survives sleeping between jobs, and turns a panicking
//! task into an error without hanging, without touching the job afterwards, and without losing a
//! worker.

use super::*;
use std::sync::atomic::AtomicU64;

#[test]
fn every_task_runs_once() {
    let pool = ThreadPool::new(3);
    for n in [1usize, 2, 7, 100, 1000] {
        let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
        pool.run(n, |i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
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
        })
        .unwrap();
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
        })
        .unwrap();
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

/// Which thread runs a task is up to the scheduler: panicking at every index in turn makes both
/// the caller and the workers panic at some point.
#[test]
fn a_panicking_task_is_an_error_and_the_pool_works_afterwards() {
    for threads in [1usize, 2, 4] {
        let pool = ThreadPool::new(threads);
        for bad in 0..24usize {
            let ran = AtomicU64::new(0);
            let r = pool.run(24, |i| {
                if i == bad {
                    panic!("task {i} failed on purpose");
                }
                ran.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(
                r,
                Err(PoolError::TaskPanicked(format!(
                    "task {bad} failed on purpose"
                ))),
                "threads={threads}"
            );
            // Tasks after the panicking one may have been cancelled, never run twice.
            assert!(ran.load(Ordering::Relaxed) <= 23);
            // The same pool runs the next job completely.
            let hits: Vec<AtomicU64> = (0..100).map(|_| AtomicU64::new(0)).collect();
            pool.run(100, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        // Every worker is still alive and takes part: each of `threads` tasks waits until all
        // of them have started, which only completes if every thread runs one.
        let started = AtomicU64::new(0);
        pool.run(threads, |_| {
            started.fetch_add(1, Ordering::SeqCst);
            let t0 = Instant::now();
            while started.load(Ordering::SeqCst) < threads as u64 {
                assert!(t0.elapsed() < Duration::from_secs(20), "a worker is gone");
                std::thread::yield_now();
            }
        })
        .unwrap();
    }
}

/// When `run` returns, no task of its job is still running, and none starts later: the closure
/// (and what it borrows) is never used after the call.
#[test]
fn nothing_runs_after_run_returns_from_a_panic() {
    let pool = ThreadPool::new(4);
    for round in 0..50u64 {
        let running = AtomicU64::new(0);
        let started = AtomicU64::new(0);
        let r = pool.run(64, |i| {
            running.fetch_add(1, Ordering::SeqCst);
            started.fetch_add(1, Ordering::SeqCst);
            if i == (round as usize * 7) % 64 {
                running.fetch_sub(1, Ordering::SeqCst);
                panic!("boom");
            }
            std::thread::sleep(Duration::from_micros(50));
            running.fetch_sub(1, Ordering::SeqCst);
        });
        assert!(matches!(r, Err(PoolError::TaskPanicked(ref m)) if m == "boom"));
        assert_eq!(running.load(Ordering::SeqCst), 0, "a task outlived run");
        let seen = started.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(
            started.load(Ordering::SeqCst),
            seen,
            "a task started after run"
        );
    }
}

#[test]
fn several_panicking_tasks_report_one_and_do_not_hang() {
    let pool = ThreadPool::new(3);
    for _ in 0..200 {
        let r = pool.run(50, |i| {
            if i % 3 == 0 {
                panic!("bad {}", i % 3);
            }
        });
        assert_eq!(r, Err(PoolError::TaskPanicked("bad 0".into())));
    }
    pool.run(10, |_| {}).unwrap();
}

#[test]
fn a_panic_with_a_non_string_payload_is_reported_too() {
    let pool = ThreadPool::new(2);
    let r = pool.run(8, |i| {
        if i == 5 {
            std::panic::panic_any(42u32);
        }
    });
    assert!(matches!(r, Err(PoolError::TaskPanicked(_))));
}

/// A panic whose payload panics again when dropped is still one error, and no thread is lost.
#[test]
fn a_payload_that_panics_on_drop_does_not_break_the_pool() {
    struct Nasty;
    impl Drop for Nasty {
        fn drop(&mut self) {
            panic!("dropping the payload");
        }
    }
    let pool = ThreadPool::new(3);
    for _ in 0..20 {
        let r = pool.run(12, |i| {
            if i == 7 {
                std::panic::panic_any(Nasty);
            }
        });
        assert!(matches!(r, Err(PoolError::TaskPanicked(_))));
    }
    let hits = AtomicU64::new(0);
    pool.run(30, |_| {
        hits.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(hits.load(Ordering::Relaxed), 30);
}

/// A task that issues its own parallel call must not wait for the pool it is part of.
#[test]
fn nested_runs_do_not_hang() {
    let pool = ThreadPool::new(3);
    let total = AtomicU64::new(0);
    pool.run(6, |_| {
        pool.run(4, |j| {
            total.fetch_add(j as u64, Ordering::Relaxed);
        })
        .unwrap();
    })
    .unwrap();
    assert_eq!(total.load(Ordering::Relaxed), 6 * 6);
    // A nested panic surfaces through both calls.
    let r = pool.run(4, |i| {
        pool.run(2, |j| assert!(!(i == 2 && j == 1), "inner"))
            .unwrap();
    });
    assert!(matches!(r, Err(PoolError::TaskPanicked(_))));
    pool.run(4, |_| {}).unwrap();
}

mod stress {
    use super::*;

    #[test]
    fn jobs_with_sleeps_between_never_hang() {
        let pool = ThreadPool::new(2);
        let total = AtomicU64::new(0);
        for i in 0..3000u64 {
            pool.run(8, |t| {
                total.fetch_add(t as u64, Ordering::Relaxed);
            })
            .unwrap();
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
            })
            .unwrap();
        }
        for (t, h) in hits.iter().enumerate() {
            let want = if t < 8 { 20_000 } else { 10_000 };
            assert_eq!(h.load(Ordering::Relaxed), want, "task {t}");
        }
    }

    /// Panicking jobs interleaved with good ones of other sizes: good jobs stay exact.
    #[test]
    fn panics_between_good_jobs_leave_them_exact() {
        let pool = ThreadPool::new(3);
        let hits: Vec<AtomicU64> = (0..40).map(|_| AtomicU64::new(0)).collect();
        for i in 0..3000usize {
            if i % 3 == 0 {
                let r = pool.run(40, |t| assert!(t != i % 40, "planned"));
                assert!(r.is_err());
            } else {
                pool.run(40, |t| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                })
                .unwrap();
            }
        }
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 2000));
    }
}
