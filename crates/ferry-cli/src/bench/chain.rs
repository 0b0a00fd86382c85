//! `ferry bench chain`: Container Shipping's Fig. 7 (Pasquale, Anderson
//! and Muller) as the paper ran it: a source process reads a large file, N-2
//! intermediate processes hand the data on (touching every byte or not),
//! a sink process writes it to a file or to `/dev/null`. Three chains, in
//! one run, on the same file:
//!
//! * `ferry` (`shm`): the stages of `ferry bench pipeline` joined by Ferry
//!   channels; the source reads the file with ferry-io straight into pool
//!   buffers (the kernel's one copy in), buffers are moved down the chain
//!   and passed back, the sink writes each buffer to its file (the kernel's
//!   one copy out; none to `/dev/null`).
//! * `pipe-copy`: the same stages joined by pipes (enlarged to
//!   pipe-max-size), moving `--size` chunks with read/write: two more
//!   copies in the kernel per hop.
//! * `cat`: `cat SRC | cat | … | cat > SINK` run by `/bin/sh`, N cats.
//!
//! The source file holds --total bytes; each `--size` chunk starts with
//! its number, which the sink of the ferry and pipe chains checks; the
//! cat chain's sink file is checked afterwards (size and every chunk's
//! number). The sample is --total / time of the run; the per-buffer cost
//! of an untouched stage is (time with 5 stages − time with 3) / 2 / buffers
//! (wall clock), and, measured directly, the CPU time the middle stage
//! processes used during the run (`/proc/PID/task/*/schedstat`, all their
//! threads) / middle stages / buffers.

use std::io::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::json;

use super::pipeline::{Chain, Files, Variant};
use super::point::{Head, Point};
use super::progress::Progress;
use super::{check_pool_sizes, Ctx};
use crate::stats::{round, Summary};
use crate::CliError;

/// Where the chain writes: a file or /dev/null.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sink {
    /// `/dev/null`.
    Null,
    /// A file next to the source file.
    File,
}

impl Sink {
    fn name(self) -> &'static str {
        match self {
            Sink::Null => "null",
            Sink::File => "file",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ferry,
    Pipe,
    Cat,
}

impl Kind {
    fn backend(self) -> &'static str {
        match self {
            Kind::Ferry => "shm",
            Kind::Pipe => "pipe-copy",
            Kind::Cat => "cat",
        }
    }
}

/// CPU time (ns) process `pid` has used so far, all its threads: the
/// first field of `/proc/PID/task/TID/schedstat`.
fn cpu_ns(pid: u32) -> Result<u64, CliError> {
    let dir = format!("/proc/{pid}/task");
    let mut ns = 0u64;
    for t in std::fs::read_dir(&dir).map_err(os(dir.clone()))? {
        let path = t.map_err(os(dir.clone()))?.path().join("schedstat");
        // A thread that ended meanwhile has no file any more: its time is gone with it.
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        ns += text.split_whitespace().next().and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(ns)
}

/// CPU time (ns) of the middle stages (all but the first and the last).
fn middle_cpu_ns(pids: &[u32]) -> Result<u64, CliError> {
    let middle = pids.get(1..pids.len().saturating_sub(1)).unwrap_or(&[]);
    middle.iter().map(|&p| cpu_ns(p)).sum()
}

fn os(what: String) -> impl Fn(std::io::Error) -> CliError {
    move |e| CliError::Failed(format!("chain: {what}: {e}"))
}

/// The source file: `total` bytes, each `size` chunk starting with its number.
fn make_source(path: &Path, size: usize, total: u64) -> Result<(), CliError> {
    let mut f = std::io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(path).map_err(os(path.display().to_string()))?,
    );
    let mut chunk = vec![0u8; size];
    for (i, b) in chunk.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    for seq in 0..total / size as u64 {
        chunk[..8].copy_from_slice(&seq.to_le_bytes());
        f.write_all(&chunk).map_err(os(path.display().to_string()))?;
    }
    f.flush().map_err(os(path.display().to_string()))
}

/// The cat chain's sink file: the right size and every chunk's number in place.
fn check_sink(path: &Path, size: usize, total: u64) -> Result<(), CliError> {
    let f = std::fs::File::open(path).map_err(os(path.display().to_string()))?;
    let len = f.metadata().map_err(os(path.display().to_string()))?.len();
    if len != total {
        return Err(CliError::Failed(format!("chain: the cat chain wrote {len} of {total} bytes")));
    }
    let mut tag = [0u8; 8];
    for seq in 0..total / size as u64 {
        f.read_exact_at(&mut tag, seq * size as u64).map_err(os(path.display().to_string()))?;
        if tag != seq.to_le_bytes() {
            return Err(CliError::Failed(format!("chain: the cat chain's chunk {seq} arrived wrong")));
        }
    }
    Ok(())
}

/// One run of `cat SRC | cat | … | cat > SINK` (n cats): seconds.
fn cat_once(n: usize, source: &Path, sink: &Path) -> Result<f64, CliError> {
    let mut script = String::from("cat \"$1\"");
    for _ in 1..n {
        script.push_str(" | cat");
    }
    script.push_str(" > \"$2\"");
    let t0 = Instant::now();
    let st = Command::new("/bin/sh")
        .args(["-c", &script, "sh"])
        .arg(source)
        .arg(sink)
        .stdin(Stdio::null())
        .status()
        .map_err(os("cannot run /bin/sh".into()))?;
    let secs = t0.elapsed().as_secs_f64();
    if !st.success() {
        return Err(CliError::Failed(format!("chain: `{script}` failed ({st})")));
    }
    Ok(secs)
}

/// `ferry bench chain`.
pub fn run(ctx: &mut Ctx<'_>) -> Result<(), CliError> {
    let a = ctx.args;
    let size = *a.sizes.first().unwrap_or(&(1 << 20));
    check_pool_sizes(&[size])?;
    let total = a.total.unwrap_or(512 << 20);
    if total < size as u64 || total % size as u64 != 0 {
        return Err(CliError::Usage(format!(
            "--total {total}: not a multiple of --size {size}; give a multiple such as {}",
            (total / size as u64).max(1) * size as u64
        )));
    }
    let stages = if a.stages.is_empty() { vec![3, 5] } else { a.stages.clone() };
    if stages.iter().any(|&n| n < 2) {
        return Err(CliError::Usage("--stages: a chain has at least 2 processes".into()));
    }
    let sinks = if a.sinks.is_empty() { vec![Sink::Null, Sink::File] } else { a.sinks.clone() };
    let touches: Vec<bool> = if a.touch { vec![true] } else { vec![false, true] };
    let runs = a.runs.unwrap_or(3);
    let window = a.inflight.unwrap_or(16);
    let dir = std::env::temp_dir().join(format!("ferry-chain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(os(dir.display().to_string()))?;
    let _cleanup = Cleanup(dir.clone());
    let source = dir.join("source");
    make_source(&source, size, total)?;
    let units = sinks.len() * touches.len() * stages.len() * 3 * runs;
    ctx.progress = Progress::new(units as u64, a.json);
    for &sink in &sinks {
        let sink_path: PathBuf = match sink {
            Sink::Null => "/dev/null".into(),
            Sink::File => dir.join("sink"),
        };
        for &touch in &touches {
            // Median seconds per (stages, kind), for the ratios and the per-stage cost.
            let mut secs: Vec<(usize, Kind, f64)> = Vec::new();
            // Median CPU µs per buffer of one middle stage, per (stages, kind).
            let mut cpu_per_buffer: Vec<(usize, Kind, f64)> = Vec::new();
            for &n in &stages {
                for kind in [Kind::Ferry, Kind::Pipe, Kind::Cat] {
                    if kind == Kind::Cat && touch {
                        continue; // cat never reads what it passes on
                    }
                    ctx.progress.say(format!("chain {n} stages {} sink={}", kind.backend(), sink.name()));
                    let files = Files { source: &source, sink: &sink_path, touch_middle: touch };
                    let mut times = Vec::with_capacity(runs);
                    let mut cpu_us = Vec::with_capacity(runs);
                    let mut chain = match kind {
                        Kind::Ferry => {
                            Some(Chain::start(Variant::Ferry, n, size, total, window, false, false, Some(&files))?)
                        }
                        Kind::Pipe => {
                            Some(Chain::start(Variant::Pipe, n, size, total, window, false, false, Some(&files))?)
                        }
                        Kind::Cat => None,
                    };
                    for run in 0..=runs {
                        let t = match &mut chain {
                            Some(c) => {
                                let pids = c.pids();
                                let before = middle_cpu_ns(&pids)?;
                                let t = c.run_once()?;
                                let used = middle_cpu_ns(&pids)?.saturating_sub(before);
                                if n > 2 && run > 0 {
                                    cpu_us.push(used as f64 / 1e3 / (n - 2) as f64 / (total / size as u64) as f64);
                                }
                                t
                            }
                            None => {
                                let t = cat_once(n, &source, &sink_path)?;
                                if sink == Sink::File {
                                    check_sink(&sink_path, size, total)?;
                                }
                                t
                            }
                        };
                        if run > 0 {
                            times.push(t);
                            ctx.progress.inc(1);
                        }
                    }
                    if let Some(c) = chain {
                        c.stop()?;
                    }
                    let rates: Vec<f64> = times.iter().map(|t| total as f64 / t / 1e9).collect();
                    let s = Summary::of(&rates).ok_or_else(|| CliError::Failed("no samples".into()))?;
                    secs.push((n, kind, total as f64 / s.median / 1e9));
                    let cpu = Summary::of(&cpu_us).map(|c| round(c.median));
                    if let Some(c) = cpu {
                        cpu_per_buffer.push((n, kind, c));
                    }
                    let head = Head {
                        experiment: "chain",
                        backend: kind.backend(),
                        size,
                        trust: if kind == Kind::Ferry { "full" } else { "n/a" },
                        mode: "blocking",
                        touch,
                        runs,
                        unit: "GB/s",
                    };
                    let copies = match kind {
                        Kind::Ferry => 1 + u64::from(sink == Sink::File),
                        _ => 2 * (n as u64 - 1) + 1 + u64::from(sink == Sink::File),
                    };
                    let extra = json!({ "stages": n, "total": total, "sink": sink.name(), "verified": true,
                        "variant": format!("sink={} middle={}", sink.name(), if touch { "touched" } else { "untouched" }),
                        "copies_kernel": copies, "gbit_s_median": round(s.median * 8.0),
                        "middle_cpu_us_per_buffer": cpu });
                    ctx.emit(Point::new(head, s, Some(0), extra));
                }
            }
            summarize(ctx, &secs, &cpu_per_buffer, size, total, sink, touch);
        }
    }
    Ok(())
}

/// The ratios of one (sink, touch) group, and the per-buffer cost of an
/// untouched stage from the first and last stage counts.
fn summarize(
    ctx: &mut Ctx<'_>,
    secs: &[(usize, Kind, f64)],
    cpu: &[(usize, Kind, f64)],
    size: usize,
    total: u64,
    sink: Sink,
    touch: bool,
) {
    let get = |n: usize, k: Kind| secs.iter().find(|(m, j, _)| *m == n && *j == k).map(|x| x.2);
    let buffers = (total / size as u64) as f64;
    let middle = if touch { "touched" } else { "untouched" };
    let mut lines = Vec::new();
    let ns: Vec<usize> = {
        let mut v: Vec<usize> = secs.iter().map(|x| x.0).collect();
        v.dedup();
        v
    };
    for &n in &ns {
        for base in [Kind::Pipe, Kind::Cat] {
            if let (Some(f), Some(b)) = (get(n, Kind::Ferry), get(n, base)) {
                let r = b / f;
                lines.push(json!({ "kind": "ratio", "experiment": "chain", "unit": "GB/s", "size": size, "stages": n,
                    "sink": sink.name(), "middle": middle, "ferry": "shm", "baseline": base.backend(),
                    "ratios": [round(r)], "median_ratio": round(r), "ferry_faster_by": round(r) }));
            }
        }
    }
    if let (Some(&lo), Some(&hi)) = (ns.first(), ns.last()) {
        if hi > lo {
            for k in [Kind::Ferry, Kind::Pipe, Kind::Cat] {
                if let (Some(a), Some(b)) = (get(lo, k), get(hi, k)) {
                    let us = (b - a) / (hi - lo) as f64 / buffers * 1e6;
                    // Measured directly: one middle stage's CPU time per buffer, with the most stages.
                    let cpu_us = cpu.iter().find(|(m, j, _)| *m == hi && *j == k).map(|x| x.2);
                    lines.push(
                        json!({ "kind": "stage-cost", "experiment": "chain", "backend": k.backend(), "size": size,
                        "sink": sink.name(), "middle": middle, "from_stages": lo, "to_stages": hi,
                        "us_per_buffer_per_stage": round(us), "cpu_us_per_buffer_per_stage": cpu_us }),
                    );
                }
            }
        }
    }
    for l in lines {
        if ctx.args.json {
            ctx.progress.println(&l.to_string());
        } else if l["kind"] == "ratio" {
            ctx.progress.println(&format!(
                "  chain {} stages, sink={}, middle {middle}: ferry / {} = {}",
                l["stages"],
                sink.name(),
                l["baseline"].as_str().unwrap_or("?"),
                l["ferry_faster_by"]
            ));
        } else {
            let cpu = match l["cpu_us_per_buffer_per_stage"].as_f64() {
                Some(c) => format!(", a middle stage's own CPU time {c} µs"),
                None => String::new(),
            };
            ctx.progress.println(&format!(
                "  chain {}, sink={}, middle {middle}: one more stage costs {} µs per {size}-byte buffer (wall clock){cpu}",
                l["backend"].as_str().unwrap_or("?"),
                sink.name(),
                l["us_per_buffer_per_stage"]
            ));
        }
    }
}

/// Removes the scratch directory (source and sink files) at the end.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
