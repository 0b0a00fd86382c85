//! `--plot FILE.svg`: the points of this run drawn with plotters (SVG
//! backend only; text is SVG text, no font files).
//!
//! * rtt — round-trip time per backend against buffer size: median markers,
//!   p5–p95 bars, a cross at p99 (log scales).
//! * throughput — payload Gbit/s against buffer size per backend, p5–p95
//!   bars, optionally a loopback iperf3 line (`--iperf3-gbit`).
//! * fbufs-table — the table as bars (µs per page, p5–p95) beside the
//!   throughput-vs-size figure of every variant.
//! * pipeline — GB/s end to end against the number of processes.
//! * fanin — bars: round trips with one client active (µs) beside the
//!   aggregate throughput with every client busy (M msg/s).
//!
//! Log axes are drawn as linear axes over log2/log10 of the values, with
//! labels that show the values themselves.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::{Ctx, Experiment, Point};
use crate::CliError;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// An x and the quantiles (median, p5, p95, p99) there.
type Xq = (f64, [f64; 4]);

/// One line of a chart: (x, median, low, high, p99) per point.
struct Series {
    label: String,
    pts: Vec<(f64, f64, f64, f64, Option<f64>)>,
}

struct Spec<'a> {
    title: String,
    x_desc: &'a str,
    y_desc: &'a str,
    log_x: bool,
    log_y: bool,
    /// A horizontal reference line: value, label.
    hline: Option<(f64, String)>,
    /// Where the legend goes (where the data are not).
    legend: SeriesLabelPosition,
}

fn err(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(format!("plot: {e}"))
}

fn bytes(v: f64) -> String {
    let b = v.round() as u64;
    match b {
        0 => "0".into(),
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

fn num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{:.3}", v).trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        let s = format!("{:.2e}", v);
        s.parse::<f64>().map_or(s, |x| format!("{x}"))
    }
}

/// Group points into series by label, one entry per x (rounds of
/// `--compare`: the round with the middle median).
fn series(points: &[&Point], label: impl Fn(&Point) -> String, xy: impl Fn(&Point) -> Option<Xq>) -> Vec<Series> {
    let mut groups: Vec<(String, Vec<Xq>)> = Vec::new();
    for p in points {
        let Some(v) = xy(p) else { continue };
        let l = label(p);
        match groups.iter_mut().find(|(g, _)| *g == l) {
            Some((_, vs)) => vs.push(v),
            None => groups.push((l, vec![v])),
        }
    }
    groups
        .into_iter()
        .map(|(label, mut vs)| {
            vs.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1[0].total_cmp(&b.1[0])));
            let mut pts = Vec::new();
            let mut i = 0;
            while i < vs.len() {
                let j = vs[i..].iter().position(|v| v.0 != vs[i].0).map_or(vs.len(), |k| i + k);
                let [m, p5, p95, p99] = vs[i + (j - i - 1) / 2].1;
                pts.push((vs[i].0, m, p5, p95, Some(p99).filter(|v| v.is_finite())));
                i = j;
            }
            Series { label, pts }
        })
        .collect()
}

fn tx(v: f64, log: bool, base: f64) -> f64 {
    if log {
        v.max(f64::MIN_POSITIVE).log(base)
    } else {
        v
    }
}

fn chart(area: &Area<'_>, spec: &Spec<'_>, all: &[Series]) -> Result<(), CliError> {
    let (lx, ly) = (spec.log_x, spec.log_y);
    let fx = |v: f64| tx(v, lx, 2.0);
    let fy = |v: f64| tx(v, ly, 10.0);
    let xs: Vec<f64> = all.iter().flat_map(|s| s.pts.iter().map(|p| p.0)).filter(|x| !lx || *x > 0.0).collect();
    let mut ys: Vec<f64> = all
        .iter()
        .flat_map(|s| s.pts.iter().flat_map(|p| [p.1, p.2, p.3].into_iter().chain(p.4)))
        .filter(|y| y.is_finite() && (!ly || *y > 0.0))
        .collect();
    if let Some((h, _)) = &spec.hline {
        ys.push(*h);
    }
    if xs.is_empty() || ys.is_empty() {
        return Err(err("nothing to draw"));
    }
    let (x0, x1) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(fx(x)), b.max(fx(x))));
    let (y0, y1) = ys.iter().fold((f64::MAX, f64::MIN), |(a, b), &y| (a.min(fy(y)), b.max(fy(y))));
    let padx = if x1 > x0 { (x1 - x0) * 0.08 } else { 1.0 };
    let pady = if y1 > y0 {
        (y1 - y0) * 0.08
    } else if ly {
        0.5
    } else {
        y1.abs().max(1.0) * 0.5
    };
    let y_lo = if ly { y0 - pady } else { (y0 - pady).min(0.0).max(if y0 >= 0.0 { 0.0 } else { f64::MIN }) };
    let mut c = ChartBuilder::on(area)
        .caption(&spec.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d((x0 - padx)..(x1 + padx), y_lo..(y1 + pady))
        .map_err(err)?;
    let xfmt = |v: &f64| if lx { bytes(2f64.powf(*v)) } else { num(*v) };
    let yfmt = |v: &f64| if ly { num(10f64.powf(*v)) } else { num(*v) };
    c.configure_mesh()
        .x_desc(spec.x_desc)
        .y_desc(spec.y_desc)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&yfmt)
        .x_labels(if lx { ((x1 - x0).round() as usize + 1).clamp(2, 12) } else { 8 })
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    let n = all.len() as f64;
    for (k, s) in all.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        // Spread series a little along x so their bars do not hide each other.
        let shift = if n > 1.0 { (k as f64 - (n - 1.0) / 2.0) * (x1 - x0 + 2.0 * padx) * 0.008 } else { 0.0 };
        let pts: Vec<(f64, f64)> = s.pts.iter().map(|p| (fx(p.0) + shift, fy(p.1))).collect();
        if pts.len() == 1 && s.pts[0].0 == 0.0 && lx {
            continue;
        }
        c.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(err)?;
        for p in &s.pts {
            let x = fx(p.0) + shift;
            c.draw_series(std::iter::once(PathElement::new(vec![(x, fy(p.2)), (x, fy(p.3))], color.stroke_width(1))))
                .map_err(err)?;
            if let Some(p99) = p.4 {
                c.draw_series(std::iter::once(Cross::new((x, fy(p99)), 4, color.stroke_width(1)))).map_err(err)?;
            }
        }
    }
    // Series without x (e.g. the payload-free eventfd floor): horizontal lines.
    for (k, s) in all.iter().enumerate() {
        if lx && s.pts.len() == 1 && s.pts[0].0 == 0.0 {
            let color = COLORS[k % COLORS.len()];
            let y = fy(s.pts[0].1);
            c.draw_series(LineSeries::new(vec![(x0 - padx, y), (x1 + padx, y)], color.stroke_width(2)))
                .map_err(err)?
                .label(format!("{} (no payload)", s.label))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
    }
    if let Some((h, label)) = &spec.hline {
        let y = fy(*h);
        let style = BLACK.stroke_width(1);
        c.draw_series(DashedLineSeries::new(vec![(x0 - padx, y), (x1 + padx, y)], 6, 4, style))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .position(spec.legend.clone())
        .draw()
        .map_err(err)?;
    Ok(())
}

fn bars(area: &Area<'_>, title: &str, rows: &[(String, [f64; 4])]) -> Result<(), CliError> {
    let pos: Vec<f64> = rows.iter().flat_map(|(_, q)| q.iter().copied()).filter(|v| *v > 0.0).collect();
    if pos.is_empty() {
        return Err(err("no positive per-page cost to draw"));
    }
    let lo = pos.iter().fold(f64::MAX, |a, &b| a.min(b)).log10().floor();
    let hi = pos.iter().fold(f64::MIN, |a, &b| a.max(b)).log10().ceil().max(lo + 1.0);
    let k = rows.len();
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..(k as f64 - 0.5), lo..hi)
        .map_err(err)?;
    let names: Vec<String> = rows.iter().map(|(l, _)| l.clone()).collect();
    let xfmt = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 0.01 && i >= 0.0 && (i as usize) < names.len() {
            names[i as usize].clone()
        } else {
            String::new()
        }
    };
    c.configure_mesh()
        .x_labels(k * 2 + 1)
        .x_label_formatter(&xfmt)
        .y_desc("µs per page (median, p5–p95)")
        .y_label_formatter(&|v| num(10f64.powf(*v)))
        .disable_x_mesh()
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    for (i, (_, [m, p5, p95, _])) in rows.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let x = i as f64;
        if *m > 0.0 {
            c.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.35, lo), (x + 0.35, m.log10())],
                color.mix(0.7).filled(),
            )))
            .map_err(err)?;
        }
        let (a, b) = (p5.max(10f64.powf(lo)), p95.max(10f64.powf(lo)));
        c.draw_series(std::iter::once(PathElement::new(vec![(x, a.log10()), (x, b.log10())], BLACK.stroke_width(1))))
            .map_err(err)?;
    }
    Ok(())
}

/// Short bar labels (SVG text does not wrap).
fn short(p: &Point) -> String {
    match p.str("variant") {
        "cached-volatile" => "cached vol.".into(),
        "cached-secured" => "cached sec.".into(),
        "uncached-volatile" => "uncached vol.".into(),
        "uncached-secured" => "uncached sec.".into(),
        _ => p.backend().replace("-copy", " copy"),
    }
}

fn label(p: &Point) -> String {
    let mut l = p.backend().to_string();
    if let Some(v) = p.0.get("variant").and_then(|v| v.as_str()) {
        l = format!("{l} {v}");
    }
    if p.0.get("touch").and_then(|v| v.as_bool()) == Some(true) {
        l.push_str(" touch");
    }
    l
}

/// Draw the points of this run into `path`.
pub fn draw(ctx: &Ctx<'_>, path: &Path) -> Result<(), CliError> {
    let a = ctx.args;
    let pts: Vec<&Point> = ctx.points.iter().collect();
    let root =
        SVGBackend::new(path, if a.experiment.is_fbufs() { (1200, 520) } else { (860, 540) }).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mode = a.mode();
    match a.experiment {
        Experiment::Rtt => {
            let s = series(&pts, label, |p| Some((p.size() as f64, p.quantiles())));
            let spec = Spec {
                title: format!("Round trip (move + pass back), {mode}"),
                x_desc: "buffer size (bytes)",
                y_desc: "µs (median, p5–p95, × p99)",
                log_x: true,
                log_y: true,
                hline: None,
                legend: SeriesLabelPosition::UpperLeft,
            };
            chart(&root, &spec, &s)?;
        }
        Experiment::Throughput => {
            let s = series(&pts, label, |p| {
                let size = p.size() as f64;
                let g = p.quantiles().map(|q| q * size * 8.0 / 1e3);
                (p.unit() == "Mops/s").then_some((size, [g[0], g[1], g[2], f64::NAN]))
            });
            let spec = Spec {
                title: format!("Throughput, payload one way, {mode}"),
                x_desc: "buffer size (bytes)",
                y_desc: "Gbit/s (median, p5–p95)",
                log_x: true,
                log_y: true,
                hline: a.iperf3_gbit.map(|g| (g, format!("iperf3 loopback {g} Gbit/s"))),
                legend: SeriesLabelPosition::UpperLeft,
            };
            chart(&root, &spec, &s)?;
        }
        Experiment::FbufsTable | Experiment::Fbufs => {
            let (left, right) = root.split_horizontally(480);
            let rows: Vec<(String, [f64; 4])> = pts
                .iter()
                .filter(|p| p.unit() == "us/page" && p.num("round").unwrap_or(1.0) <= 1.0)
                .map(|p| (short(p), p.quantiles()))
                .collect();
            let ferry = pts.iter().map(|p| p.backend()).find(|b| !b.ends_with("-copy")).unwrap_or("copy");
            bars(&left, &format!("Cost per page, {ferry} {mode} (fbufs Table 1)"), &rows)?;
            let s = series(&pts, label, |p| {
                let g = p.num("gbit_s_median")?;
                let size = p.size() as f64;
                let q = p.quantiles();
                let gb = |us: f64| if us > 0.0 { size * 8.0 / us / 1e3 } else { f64::NAN };
                (p.unit() == "us").then_some((size, [g, gb(q[2]), gb(q[1]), f64::NAN]))
            });
            let spec = Spec {
                title: "Throughput of one domain crossing vs size".into(),
                x_desc: "message size (bytes)",
                y_desc: "Gbit/s (median, p5–p95)",
                log_x: true,
                log_y: true,
                hline: None,
                legend: SeriesLabelPosition::UpperLeft,
            };
            chart(&right, &spec, &s)?;
        }
        Experiment::Pipeline => {
            let s = series(&pts, label, |p| Some((p.num("stages")?, p.quantiles())));
            let spec = Spec {
                title: "Pipeline: GB/s end to end through N processes".into(),
                x_desc: "processes in the chain",
                y_desc: "GB/s (median, p5–p95)",
                log_x: false,
                log_y: false,
                hline: None,
                legend: SeriesLabelPosition::UpperRight,
            };
            chart(&root, &spec, &s)?;
        }
        Experiment::Fanin => {
            let rows = |unit: &str| -> Vec<(String, [f64; 4])> {
                pts.iter()
                    .filter(|p| p.unit() == unit && p.num("round").unwrap_or(1.0) <= 1.0)
                    .map(|p| (p.str("variant").to_string(), p.quantiles()))
                    .collect()
            };
            let (rtt, rate) = (rows("us"), rows("Mops/s"));
            let rtt_title = format!("Round trip, one client active, {} (µs)", pts.first().map_or("", |p| p.backend()));
            // --backend shm measures round trips only.
            if rate.is_empty() {
                bars(&root, &rtt_title, &rtt)?;
            } else {
                let (left, right) = root.split_horizontally(430);
                bars(&left, &rtt_title, &rtt)?;
                bars(&right, "Every client busy (M msg/s)", &rate)?;
            }
        }
        Experiment::SocketTouch | Experiment::Layers => {
            let rows: Vec<(String, [f64; 4])> = pts
                .iter()
                .map(|p| (format!("{} {} {}", p.backend(), p.size(), p.str("variant")), p.quantiles()))
                .collect();
            let title = if a.experiment == Experiment::Layers {
                "Layered stack across three processes: GB/s, aggregates against copying (fbufs §2)"
            } else {
                "Receiver over an AF_UNIX socket: GB/s by pages touched (Container Shipping Fig. 4)"
            };
            bars(&root, title, &rows)?;
        }
        Experiment::Demux => {
            let rows = |unit: &str| -> Vec<(String, [f64; 4])> {
                pts.iter().filter(|p| p.unit() == unit).map(|p| (p.backend().to_string(), p.quantiles())).collect()
            };
            let (left, right) = root.split_horizontally(430);
            bars(&left, "Aggregate throughput (Gbit/s)", &rows("Gbit/s"))?;
            bars(&right, "Priority channel round trip under load (µs)", &rows("us"))?;
        }
        Experiment::Chain => {
            let rows: Vec<(String, [f64; 4])> = pts
                .iter()
                .map(|p| {
                    let n = p.0.get("stages").and_then(|v| v.as_u64()).unwrap_or(0);
                    (format!("{} {n} {}", p.backend(), p.str("variant")), p.quantiles())
                })
                .collect();
            bars(&root, "Chain of processes from a file: GB/s (Container Shipping Fig. 7)", &rows)?;
        }
        Experiment::UdpForward => {
            let rows: Vec<(String, [f64; 4])> = pts
                .iter()
                .map(|p| {
                    let k = p.0.get("competitors").and_then(|v| v.as_u64()).unwrap_or(0);
                    (format!("{} {k} competing", p.backend()), p.quantiles().map(|q| q / 1e3))
                })
                .collect();
            bars(&root, "UDP forwarder on loopback: thousand datagrams/s (Container Shipping Fig. 6)", &rows)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}
