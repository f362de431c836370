//! SVG plots of a run (latency CDFs, throughput over time, TTFT against arrival time) and of a
//! rate sweep (throughput–latency curve), drawn with plotters' SVG backend (no system fonts).

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::BenchError;
use crate::metrics::{itl_gaps, RequestRecord, Summary};

/// (x, y) points of one plotted series.
pub type Points = Vec<(f64, f64)>;

/// Empirical CDF points: each sorted value with the fraction of values at or below it.
pub fn cdf_points(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// Output tokens per second and completed requests per second in buckets of `bucket_s`
/// seconds after the run start, as (bucket start, rate) points. A request's output tokens are
/// spread evenly over its non-empty chunks, each counted when it arrived.
pub fn throughput_series(records: &[RequestRecord], bucket_s: f64) -> (Points, Points) {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let end = ok
        .iter()
        .map(|r| r.send_offset_s + r.e2e_s)
        .fold(0.0f64, f64::max);
    if ok.is_empty() || bucket_s <= 0.0 {
        return (Vec::new(), Vec::new());
    }
    let buckets = ((end / bucket_s).floor() as usize) + 1;
    let mut tokens = vec![0.0f64; buckets];
    let mut done = vec![0.0f64; buckets];
    let slot = |t: f64| ((t / bucket_s).floor() as usize).min(buckets - 1);
    for r in ok {
        if !r.chunk_times_s.is_empty() {
            let per_chunk = r.output_tokens as f64 / r.chunk_times_s.len() as f64;
            for c in &r.chunk_times_s {
                tokens[slot(r.send_offset_s + c)] += per_chunk;
            }
        }
        done[slot(r.send_offset_s + r.e2e_s)] += 1.0;
    }
    let series = |v: Vec<f64>| {
        v.into_iter()
            .enumerate()
            .map(|(i, x)| (i as f64 * bucket_s, x / bucket_s))
            .collect()
    };
    (series(tokens), series(done))
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Upper end of an axis for values up to `max` (never an empty range).
fn axis_max(max: f64) -> f64 {
    if max.is_finite() && max > 0.0 {
        max * 1.05
    } else {
        1.0
    }
}

fn max_of<'a>(xs: impl IntoIterator<Item = &'a (f64, f64)>, y: bool) -> f64 {
    xs.into_iter()
        .map(|p| if y { p.1 } else { p.0 })
        .fold(0.0, f64::max)
}

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    Line,
    Points,
    LineAndPoints,
}

fn line_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(&str, Points, RGBColor)],
    mark: Mark,
) -> Result<(), String> {
    let xmax = axis_max(max_of(series.iter().flat_map(|s| s.1.iter()), false));
    let ymax = axis_max(max_of(series.iter().flat_map(|s| s.1.iter()), true));
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(|e| e.to_string())?;
    let any_data = series.iter().any(|s| !s.1.is_empty());
    for (name, pts, color) in series {
        let color = *color;
        if mark != Mark::Line {
            let drawn = chart
                .draw_series(
                    pts.iter()
                        .map(|p| Circle::new(*p, 3, ShapeStyle::from(&color).filled())),
                )
                .map_err(|e| e.to_string())?;
            if mark == Mark::Points {
                drawn
                    .label(*name)
                    .legend(move |(x, y)| Circle::new((x + 10, y), 3, color.filled()));
            }
        }
        if mark != Mark::Points {
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), &color))
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
    }
    if any_data && series.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    if !any_data {
        area.draw(&Text::new(
            "no data",
            (
                area.dim_in_pixel().0 as i32 / 2 - 20,
                area.dim_in_pixel().1 as i32 / 2,
            ),
            ("sans-serif", 16),
        ))
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Writes `latency_cdf_{label}.svg`, `throughput_{label}.svg` and `ttft_vs_arrival_{label}.svg`.
pub fn write_run_plots(
    out_dir: &Path,
    label: &str,
    records: &[RequestRecord],
    duration_s: f64,
) -> Result<Vec<PathBuf>, BenchError> {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let ms = |xs: Vec<f64>| xs.into_iter().map(|x| x * 1e3).collect::<Vec<_>>();
    let mut written = Vec::new();

    let cdf_path = out_dir.join(format!("latency_cdf_{label}.svg"));
    {
        let root = SVGBackend::new(&cdf_path, (1100, 800)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(&cdf_path, e))?;
        let panels = root.split_evenly((2, 2));
        let data = [
            ("TTFT", ms(ok.iter().filter_map(|r| r.ttft_s).collect())),
            ("TPOT", ms(ok.iter().filter_map(|r| r.tpot_s()).collect())),
            (
                "ITL",
                ms(ok.iter().flat_map(|r| itl_gaps(&r.chunk_times_s)).collect()),
            ),
            ("E2E latency", ms(ok.iter().map(|r| r.e2e_s).collect())),
        ];
        for (area, (name, values)) in panels.iter().zip(data) {
            line_panel(
                area,
                &format!("{name} CDF"),
                "ms",
                "fraction of requests",
                &[(name, cdf_points(&values), BLUE)],
                Mark::Line,
            )
            .map_err(|e| plot_err(&cdf_path, e))?;
        }
        root.present().map_err(|e| plot_err(&cdf_path, e))?;
    }
    written.push(cdf_path);

    let tp_path = out_dir.join(format!("throughput_{label}.svg"));
    {
        let bucket = (duration_s / 40.0).max(0.25);
        let (tok, req) = throughput_series(records, bucket);
        let root = SVGBackend::new(&tp_path, (1000, 700)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(&tp_path, e))?;
        let panels = root.split_evenly((2, 1));
        line_panel(
            &panels[0],
            "Output token throughput over time",
            "seconds since start",
            "tokens/s",
            &[("output tok/s", tok, BLUE)],
            Mark::Line,
        )
        .map_err(|e| plot_err(&tp_path, e))?;
        line_panel(
            &panels[1],
            "Completed requests over time",
            "seconds since start",
            "requests/s",
            &[("completed req/s", req, GREEN)],
            Mark::Line,
        )
        .map_err(|e| plot_err(&tp_path, e))?;
        root.present().map_err(|e| plot_err(&tp_path, e))?;
    }
    written.push(tp_path);

    let scatter_path = out_dir.join(format!("ttft_vs_arrival_{label}.svg"));
    {
        let pts: Vec<(f64, f64)> = ok
            .iter()
            .filter_map(|r| r.ttft_s.map(|t| (r.send_offset_s, t * 1e3)))
            .collect();
        let root = SVGBackend::new(&scatter_path, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(&scatter_path, e))?;
        line_panel(
            &root,
            "TTFT against arrival time",
            "send time (s since start)",
            "TTFT (ms)",
            &[("TTFT", pts, RED)],
            Mark::Points,
        )
        .map_err(|e| plot_err(&scatter_path, e))?;
        root.present().map_err(|e| plot_err(&scatter_path, e))?;
    }
    written.push(scatter_path);
    Ok(written)
}

/// Writes a throughput–latency curve of a sweep: x = output token throughput, y = median and
/// p99 end-to-end latency and median TTFT, one point per run.
pub fn write_sweep_plot(path: &Path, runs: &[Summary]) -> Result<PathBuf, BenchError> {
    let pick = |f: &dyn Fn(&Summary) -> Option<f64>| -> Vec<(f64, f64)> {
        let mut pts: Vec<(f64, f64)> = runs
            .iter()
            .filter_map(|s| f(s).map(|y| (s.output_throughput, y)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    };
    let e2e_med = pick(&|s| s.e2e_ms.as_ref().map(|x| x.median));
    let e2e_p99 = pick(&|s| s.e2e_ms.as_ref().map(|x| x.p99));
    let ttft_med = pick(&|s| s.ttft_ms.as_ref().map(|x| x.median));
    let root = SVGBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    line_panel(
        &root,
        "Throughput vs latency",
        "output throughput (tok/s)",
        "latency (ms)",
        &[
            ("E2E median", e2e_med, BLUE),
            ("E2E p99", e2e_p99, RED),
            ("TTFT median", ttft_med, GREEN),
        ],
        Mark::LineAndPoints,
    )
    .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(send: f64, e2e: f64, out: usize, chunks: &[f64]) -> RequestRecord {
        RequestRecord {
            index: 0,
            prompt: String::new(),
            prompt_tokens: 1,
            max_new_tokens: out,
            send_offset_s: send,
            success: true,
            error: None,
            resp_text: "x".into(),
            output_tokens: out,
            ttft_s: chunks.first().copied(),
            e2e_s: e2e,
            chunk_times_s: chunks.to_vec(),
            server_completion_tokens: None,
        }
    }

    #[test]
    fn cdf_by_hand() {
        assert_eq!(
            cdf_points(&[3.0, 1.0, 2.0, 2.0]),
            vec![(1.0, 0.25), (2.0, 0.5), (2.0, 0.75), (3.0, 1.0)]
        );
        assert!(cdf_points(&[]).is_empty());
    }

    #[test]
    fn throughput_buckets_by_hand() {
        // Request A: sent at 0, 4 tokens in 2 chunks at 0.2 s and 1.2 s, done at 1.2 s.
        // Request B: sent at 1.0, 2 tokens in 1 chunk at 1.5 s (abs), done at 1.5 s.
        let rs = vec![rec(0.0, 1.2, 4, &[0.2, 1.2]), rec(1.0, 0.5, 2, &[0.5])];
        let (tok, req) = throughput_series(&rs, 1.0);
        assert_eq!(tok, vec![(0.0, 2.0), (1.0, 4.0)]);
        assert_eq!(req, vec![(0.0, 0.0), (1.0, 2.0)]);
    }

    #[test]
    fn plots_are_written_even_without_data() {
        let dir = std::env::temp_dir().join(format!("bench-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rs = vec![
            rec(0.0, 1.2, 4, &[0.2, 0.5, 0.9, 1.2]),
            rec(0.5, 0.8, 1, &[0.3]),
        ];
        let files = write_run_plots(&dir, "1.0", &rs, 1.3).unwrap();
        assert_eq!(files.len(), 3);
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            assert!(text.starts_with("<svg"), "{}", f.display());
        }
        let empty = write_run_plots(&dir, "0.5", &[], 0.0).unwrap();
        assert!(std::fs::read_to_string(&empty[0])
            .unwrap()
            .contains("no data"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
