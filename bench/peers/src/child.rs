//! The two processes of every measurement: the source (this process, pinned
//! to CPU 0) re-executes its own binary as the hidden `echo` subcommand,
//! pinned to CPU 1, which sends every message straight back.
//!
//! Nothing may hang: the echo dies with its parent (PR_SET_PDEATHSIG), and a
//! watchdog thread in the source ends the whole program with an error as
//! soon as the echo exits unexpectedly, or when a point exceeds --timeout,
//! or when no run completed for [`STALL`].

use std::io::Read;
use std::os::fd::{BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::Args;

use crate::plan::Peer;

/// No completed run for this long: the transport lost a message or the echo hangs.
pub const STALL: Duration = Duration::from_secs(30);

/// Arguments of the echo process (set by the source, not by people).
#[derive(Debug, Clone, Args)]
pub struct EchoArgs {
    #[arg(long, value_enum)]
    pub peer: Peer,
    #[arg(long, default_value_t = 0)]
    pub size: usize,
    #[arg(long)]
    pub touch: bool,
    #[arg(long)]
    pub busy_poll: bool,
    #[arg(long, default_value_t = 1)]
    pub inflight: usize,
    /// Inherited file descriptors (their meaning depends on the peer).
    #[arg(long = "fd")]
    pub fds: Vec<RawFd>,
    #[arg(long)]
    pub port: Option<u16>,
    /// iceoryx2: the service name stem.
    #[arg(long)]
    pub service: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub cpu: usize,
    /// Testing only: exit (as if crashed) after this many messages.
    #[arg(long)]
    pub die_after: Option<u64>,
    /// fbufs transfers: read each message whole, check the first word of every
    /// page, answer with the 8-byte sequence number instead of the message.
    #[arg(long)]
    pub oneway: bool,
}

impl EchoArgs {
    pub fn new(peer: Peer, size: usize) -> EchoArgs {
        EchoArgs {
            peer,
            size,
            touch: false,
            busy_poll: false,
            inflight: 1,
            fds: Vec::new(),
            port: None,
            service: None,
            cpu: 1,
            die_after: None,
            oneway: false,
        }
    }

    fn to_args(&self) -> Vec<String> {
        let peer = clap::ValueEnum::to_possible_value(&self.peer).expect("no skipped variants");
        let mut v = vec![
            "echo".to_string(),
            "--peer".into(),
            peer.get_name().into(),
            "--size".into(),
            self.size.to_string(),
            "--inflight".into(),
            self.inflight.to_string(),
            "--cpu".into(),
            self.cpu.to_string(),
        ];
        if self.touch {
            v.push("--touch".into());
        }
        if self.busy_poll {
            v.push("--busy-poll".into());
        }
        if self.oneway {
            v.push("--oneway".into());
        }
        for fd in &self.fds {
            v.extend(["--fd".into(), fd.to_string()]);
        }
        if let Some(port) = self.port {
            v.extend(["--port".into(), port.to_string()]);
        }
        if let Some(s) = &self.service {
            v.extend(["--service".into(), s.clone()]);
        }
        if let Some(n) = self.die_after {
            v.extend(["--die-after".into(), n.to_string()]);
        }
        v
    }

    /// Called by the echo loops after each echoed message.
    pub fn maybe_die(&self, echoed: u64) {
        if self.die_after.is_some_and(|n| echoed >= n) {
            eprintln!("ferry-peers echo: dying after {echoed} messages as asked (--die-after)");
            std::process::exit(3);
        }
    }
}

/// Pin the calling thread to `cpu`; a failure is reported and otherwise ignored.
pub fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        eprintln!("ferry-peers: could not pin to cpu {cpu}: {e}");
    }
}

/// The running echo process, seen from the source.
pub struct EchoProc {
    child: Arc<Mutex<Child>>,
    armed: Arc<AtomicBool>,
    progress: Arc<AtomicU64>,
    watchdog: Option<JoinHandle<()>>,
    stdout: Option<ChildStdout>,
    finished: bool,
}

/// Start the echo process; `echo.fds` are inherited (their close-on-exec flag
/// is cleared in the child only). Pins the caller to CPU 0 afterwards.
pub fn spawn(echo: &EchoArgs, timeout: Duration) -> Result<EchoProc, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(echo.to_args()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let fds = echo.fds.clone();
    // SAFETY: only async-signal-safe system calls between fork and exec; `fds` was allocated before.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                rustix::io::fcntl_setfd(BorrowedFd::borrow_raw(fd), rustix::io::FdFlags::empty())?;
            }
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start the echo process: {e}"))?;
    let stdout = child.stdout.take();
    let child = Arc::new(Mutex::new(child));
    let armed = Arc::new(AtomicBool::new(true));
    let progress = Arc::new(AtomicU64::new(0));
    let watchdog = {
        let (child, armed, progress) = (child.clone(), armed.clone(), progress.clone());
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || watch(&child, &armed, &progress, timeout))
            .map_err(|e| format!("cannot start the watchdog: {e}"))?
    };
    pin(0);
    Ok(EchoProc { child, armed, progress, watchdog: Some(watchdog), stdout, finished: false })
}

fn watch(child: &Mutex<Child>, armed: &AtomicBool, progress: &AtomicU64, timeout: Duration) {
    let t0 = Instant::now();
    let (mut seen, mut since) = (progress.load(Ordering::Relaxed), Instant::now());
    while armed.load(Ordering::Acquire) {
        let mut c = child.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(Some(status)) = c.try_wait() {
            eprintln!("ferry-peers: the echo process died ({status}); no result");
            std::process::exit(1);
        }
        let p = progress.load(Ordering::Relaxed);
        if p != seen {
            (seen, since) = (p, Instant::now());
        }
        let why = if t0.elapsed() > timeout {
            Some(format!("the point took longer than --timeout {} s", timeout.as_secs()))
        } else if since.elapsed() > STALL {
            Some(format!("no run completed for {} s (lost message or stuck peer)", STALL.as_secs()))
        } else {
            None
        };
        if let Some(why) = why {
            let _ = c.kill();
            let _ = c.wait();
            eprintln!("ferry-peers: {why}; echo process killed, no result");
            std::process::exit(1);
        }
        drop(c);
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl EchoProc {
    /// A run completed (resets the stall timer).
    pub fn tick(&self) {
        self.progress.fetch_add(1, Ordering::Relaxed);
    }

    /// Stop watching for the echo's exit: call before telling it to stop.
    pub fn disarm(&mut self) {
        self.armed.store(false, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }

    /// Wait (≤ 10 s) for the echo to exit after it was told to stop; the
    /// number of messages it echoed.
    pub fn finish(mut self) -> Result<u64, String> {
        self.disarm();
        let t0 = Instant::now();
        let status = loop {
            let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
            match c.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if t0.elapsed() < Duration::from_secs(10) => {}
                Ok(None) => return Err("the echo process did not exit after the stop message".into()),
                Err(e) => return Err(format!("waiting for the echo process: {e}")),
            }
            drop(c);
            std::thread::sleep(Duration::from_millis(1));
        };
        self.finished = true;
        let mut out = String::new();
        if let Some(mut s) = self.stdout.take() {
            s.read_to_string(&mut out).map_err(|e| format!("reading the echo's report: {e}"))?;
        }
        if !status.success() {
            return Err(format!("the echo process failed ({status})"));
        }
        parse_report(&out)
    }
}

/// The echo's last stdout line is `echoed N`.
pub fn parse_report(out: &str) -> Result<u64, String> {
    out.lines()
        .last()
        .and_then(|l| l.strip_prefix("echoed "))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| format!("the echo process reported {out:?}, expected `echoed N`"))
}

impl Drop for EchoProc {
    fn drop(&mut self) {
        self.disarm();
        if !self.finished {
            let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The echo process: pin, run the peer's echo loop, report.
pub fn echo_main(a: &EchoArgs) -> Result<u64, String> {
    pin(a.cpu);
    match a.peer {
        #[cfg(feature = "iceoryx2")]
        Peer::Iceoryx2 => crate::iox::echo(a),
        #[cfg(not(feature = "iceoryx2"))]
        Peer::Iceoryx2 => Err("built without iceoryx2".into()),
        Peer::Eventfd => crate::wake::echo(a),
        Peer::Uds | Peer::Tcp | Peer::Pipe => crate::stream::echo(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_parsing() {
        assert_eq!(parse_report("echoed 25250\n"), Ok(25250));
        assert!(parse_report("").is_err());
        assert!(parse_report("echoed x\n").is_err());
    }

    #[test]
    fn echo_args_round_trip() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(subcommand)]
            c: C,
        }
        #[derive(clap::Subcommand)]
        enum C {
            Echo(EchoArgs),
        }
        let mut e = EchoArgs::new(Peer::Tcp, 4096);
        (e.touch, e.port, e.fds, e.die_after) = (true, Some(4242), vec![5, 7], Some(3));
        let args = e.to_args();
        let T { c: C::Echo(back) } = T::try_parse_from(std::iter::once("t".to_string()).chain(args)).unwrap();
        assert_eq!(
            (back.peer, back.size, back.touch, back.port, back.fds, back.die_after, back.cpu),
            (Peer::Tcp, 4096, true, Some(4242), vec![5, 7], Some(3), 1)
        );
    }
}
