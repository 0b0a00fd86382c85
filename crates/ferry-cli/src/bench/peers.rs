//! The baselines and peers of `bench/peers` (Unix-socket, TCP and pipe
//! copies, iceoryx2, the eventfd floor), run as the separate `ferry-peers`
//! program: same experiments, same JSON lines, read back into [`Point`]s.
//!
//! The binary is found through `FERRY_PEERS=PATH`, else as
//! `bench/peers/target/release/ferry-peers` above this executable or the
//! current directory. Not built, or built without iceoryx2 when iceoryx2 is
//! asked for: a usage error (exit 2) that says how to build it.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::{Backend, Ctx, Experiment, Point};
use crate::CliError;

const REL: &str = "bench/peers/target/release/ferry-peers";
const HOW: &str = "build it with `scripts/bench-peers --build` (add --without-iceoryx2 to skip the 45 s iceoryx2 build), or set FERRY_PEERS=PATH";

/// Where `ferry-peers` is, or how to get it.
pub fn binary() -> Result<PathBuf, CliError> {
    if let Some(p) = std::env::var_os("FERRY_PEERS") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(CliError::Usage(format!("FERRY_PEERS={}: no such file; {HOW}", p.display())))
        };
    }
    let exe = std::env::current_exe().ok();
    let cwd = std::env::current_dir().ok();
    let starts = exe.iter().chain(cwd.iter());
    for start in starts {
        for dir in start.ancestors() {
            let p = dir.join(REL);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(CliError::Usage(format!("the baselines and peers need the ferry-peers program, which is not built: {HOW}")))
}

/// Whether `backend` can run here: the binary exists, and for iceoryx2 it
/// was built with it.
pub fn check(backend: Backend) -> Result<(), CliError> {
    let bin = binary()?;
    if backend == Backend::Iceoryx2 {
        let out = Command::new(&bin).arg("features").stderr(Stdio::null()).output();
        // An older ferry-peers without `features` always had iceoryx2.
        if let Ok(out) = out {
            let text = String::from_utf8_lossy(&out.stdout);
            if out.status.success() && !text.split_whitespace().any(|f| f == "iceoryx2") {
                return Err(CliError::Usage(format!(
                    "--backend iceoryx2: {} was built without iceoryx2; run `scripts/bench-peers --build` (needs libclang)",
                    bin.display()
                )));
            }
        }
    }
    Ok(())
}

/// Run `ferry-peers BACKEND EXPERIMENT ARGS… --json` and read its points.
pub fn invoke(backend: Backend, experiment: &str, args: &[String]) -> Result<Vec<Point>, CliError> {
    check(backend)?;
    let bin = binary()?;
    let mut cmd = Command::new(&bin);
    cmd.arg(backend.name()).arg(experiment).args(args).arg("--json");
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| CliError::Failed(format!("cannot run {}: {e}", bin.display())))?;
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    let last = last.strip_prefix("ferry-peers: ").unwrap_or(last);
    let last = last.strip_prefix("error: ").unwrap_or(last);
    match out.status.code() {
        Some(0) => {
            // Notes (e.g. pipe buffer sizes) are passed on.
            for l in err.lines().filter(|l| !l.trim().is_empty()) {
                eprintln!("{l}");
            }
        }
        Some(2) => return Err(CliError::Usage(format!("--backend {}: {last}", backend.name()))),
        _ => return Err(CliError::Failed(format!("{} {experiment} failed ({}): {last}", backend.name(), out.status))),
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let points: Vec<Point> = text.lines().filter_map(Point::parse).collect();
    if points.is_empty() {
        return Err(CliError::Failed(format!("{} {experiment}: no result from ferry-peers", backend.name())));
    }
    Ok(points)
}

/// rtt or throughput on a baseline or peer, at `sizes` (empty: the peer's
/// default, e.g. the eventfd floor has no size).
pub fn measure(ctx: &Ctx<'_>, backend: Backend, sizes: &[usize]) -> Result<Vec<Point>, CliError> {
    let a = ctx.args;
    let primary = a.backend() == backend;
    let mut args: Vec<String> = Vec::new();
    // The eventfd floor moves no payload: it takes no size.
    for s in sizes.iter().filter(|_| backend != Backend::Eventfd) {
        args.extend(["--size".into(), s.to_string()]);
    }
    if let Some(r) = a.runs {
        args.extend(["--runs".into(), r.to_string()]);
    }
    if a.experiment == Experiment::Throughput {
        if let Some(m) = a.moves {
            args.extend(["--moves".into(), m.to_string()]);
        }
        if let Some(w) = a.inflight {
            args.extend(["--inflight".into(), w.to_string()]);
        }
    }
    if primary {
        // As asked: the peer refuses what it cannot do (e.g. a copy with --busy-poll).
        if a.busy_poll {
            args.push("--busy-poll".into());
        }
        if a.blocking {
            args.push("--blocking".into());
        }
    } else {
        // Side by side with Ferry in its mode: peers that have both modes follow it;
        // the copying transports are measured as they are (blocking I/O).
        match backend {
            Backend::Eventfd if a.busy() => args.push("--busy-poll".into()),
            Backend::Iceoryx2 if !a.busy() => args.push("--blocking".into()),
            _ => {}
        }
    }
    if a.touch && backend != Backend::Eventfd {
        args.push("--touch".into());
    }
    if a.idle_us > 0 {
        args.extend(["--idle-us".into(), a.idle_us.to_string()]);
    }
    let pts = invoke(backend, a.experiment.name(), &args)?;
    let runs = a.runs.unwrap_or(if a.experiment == Experiment::Rtt { 100 } else { 20 });
    ctx.progress.inc((runs * sizes.len().max(1)) as u64);
    Ok(pts)
}
