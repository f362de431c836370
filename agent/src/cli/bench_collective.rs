//! `npu-serving bench-collective`: the time of one all-reduce between the processes of a
//! tensor-parallel group on this machine, through the group's shared-memory region (as the
//! agents run it), for rows of `--hidden` values at each of `--rows`. The command starts the
//! other ranks itself (this binary again, joining the region it made) and prints, per row
//! count, the median and 90th percentile over `--iters` all-reduces: of the region alone, and
//! staged through CPU backend buffers (read back, summed, uploaded: what a model step pays).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use npu_backend::{Backend, Collective, DType, HostCollective, HostStaged, ViewMut};
use npu_backend_cpu::{CpuBackend, CpuConfig};
use npu_protocol::shm::{segment_name, GroupRegion, GROUP_REGION_ID_BASE};
use serde::Serialize;

use crate::tp::ShmCollective;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchCollectiveArgs {
    /// Ranks (processes) of the group.
    #[arg(long, default_value_t = 2)]
    pub ranks: u32,
    /// Values per row: the model's hidden width (SmolLM2-135M: 576; Gemma 3 270M: 640).
    #[arg(long, default_value_t = 576)]
    pub hidden: usize,
    /// Rows per all-reduce: the step's tokens (decode: the batch size).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 32])]
    pub rows: Vec<usize>,
    /// All-reduces timed per row count (after 200 untimed ones).
    #[arg(long, default_value_t = 5000)]
    pub iters: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Join this region as `--rank` (how the command starts its other ranks).
    #[arg(long, hide = true)]
    pub join: Option<String>,
    #[arg(long, hide = true, default_value_t = 0)]
    pub rank: u32,
}

/// One row count's timings, microseconds per all-reduce.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveTiming {
    pub rows: usize,
    pub bytes: usize,
    pub shm_median_us: f64,
    pub shm_p90_us: f64,
    pub staged_median_us: f64,
    pub staged_p90_us: f64,
}

const WARMUP: usize = 200;

pub fn run(args: BenchCollectiveArgs) -> anyhow::Result<()> {
    if args.ranks < 2 || args.hidden == 0 || args.rows.contains(&0) {
        bail!("bench-collective needs --ranks >= 2, --hidden > 0 and row counts > 0");
    }
    let max_rows = args.rows.iter().copied().max().unwrap_or(1);
    let (region_name, owned, children) = match &args.join {
        Some(name) => (name.clone(), None, Vec::new()),
        None => {
            let name = segment_name(GROUP_REGION_ID_BASE).context("naming the region")?;
            let region = GroupRegion::create(&name, args.ranks, (args.hidden * max_rows) as u64)
                .context("creating the group's region")?;
            let children = spawn_ranks(&args, &name)?;
            (name, Some(region), children)
        }
    };
    let outcome = measure(&args, &region_name, max_rows);
    for mut c in children {
        let _ = c.wait();
    }
    drop(owned);
    let timings = outcome?;
    if args.join.is_some() {
        return Ok(());
    }
    if args.json {
        println!("{}", serde_json::to_string(&timings)?);
        return Ok(());
    }
    println!(
        "all-reduce of f32 rows of {} values between {} processes (shared memory), {} times each",
        args.hidden, args.ranks, args.iters
    );
    println!(
        "rows  bytes    region alone: median  p90 (us)   staged via CPU buffers: median  p90 (us)"
    );
    for t in &timings {
        println!(
            "{:>4}  {:>7}  {:>20.1}  {:>8.1}  {:>32.1}  {:>8.1}",
            t.rows, t.bytes, t.shm_median_us, t.shm_p90_us, t.staged_median_us, t.staged_p90_us
        );
    }
    Ok(())
}

fn spawn_ranks(args: &BenchCollectiveArgs, region: &str) -> anyhow::Result<Vec<Child>> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let rows: Vec<String> = args.rows.iter().map(|r| r.to_string()).collect();
    (1..args.ranks)
        .map(|rank| {
            Command::new(&exe)
                .args(["bench-collective", "--join", region])
                .args(["--rank", &rank.to_string()])
                .args(["--ranks", &args.ranks.to_string()])
                .args(["--hidden", &args.hidden.to_string()])
                .args(["--rows", &rows.join(",")])
                .args(["--iters", &args.iters.to_string()])
                .stdin(Stdio::null())
                .spawn()
                .context("starting another rank")
        })
        .collect()
}

fn percentiles(mut us: Vec<f64>) -> (f64, f64) {
    us.sort_by(f64::total_cmp);
    (us[us.len() / 2], us[us.len() * 9 / 10])
}

fn measure(
    args: &BenchCollectiveArgs,
    region: &str,
    max_rows: usize,
) -> anyhow::Result<Vec<CollectiveTiming>> {
    let region = GroupRegion::open(region).context("opening the group's region")?;
    let member = region
        .join(
            args.rank,
            Duration::from_secs(30),
            Instant::now() + Duration::from_secs(30),
        )
        .context("joining the group")?;
    let mut staged = HostStaged::new(ShmCollective::from_member(member).quiet());
    let mut cpu = CpuBackend::new(CpuConfig {
        threads: 1,
        f32_reference: false,
    });
    let mut buf = cpu.alloc(DType::F32, args.hidden * max_rows)?;
    let mut out = Vec::new();
    let fill = (args.rank + 1) as f32;
    for &rows in &args.rows {
        let n = rows * args.hidden;
        let mut x = vec![fill; n];
        let mut shm = Vec::with_capacity(args.iters);
        for i in 0..WARMUP + args.iters {
            x.fill(fill);
            let t = Instant::now();
            staged.host_mut().all_reduce_sum(&mut x)?;
            if i >= WARMUP {
                shm.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let want: f32 = (1..=args.ranks).map(|r| r as f32).sum();
        if x.iter().any(|&v| v != want) {
            bail!("the all-reduce summed to {} instead of {want}", x[0]);
        }
        let mut st = Vec::with_capacity(args.iters);
        for i in 0..WARMUP + args.iters {
            let t = Instant::now();
            Collective::<CpuBackend>::all_reduce_sum(
                &mut staged,
                &mut cpu,
                ViewMut::rows(&mut buf, rows, args.hidden)?,
            )?;
            if i >= WARMUP {
                st.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let (sm, s9) = percentiles(shm);
        let (gm, g9) = percentiles(st);
        out.push(CollectiveTiming {
            rows,
            bytes: n * 4,
            shm_median_us: sm,
            shm_p90_us: s9,
            staged_median_us: gm,
            staged_p90_us: g9,
        });
    }
    Ok(out)
}
