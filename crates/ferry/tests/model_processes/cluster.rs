//! The domain processes of one suite: this test binary run again in
//! domain-server mode (selected by [`SERVER_ENV`]), one process per domain,
//! each connected to the coordinator by a Unix stream socket (the
//! coordinator listens on an abstract name; a process says which domain it
//! is in its first frame).
//!
//! Every read has a deadline; a process that dies or stays silent fails the
//! step with a message naming it, and is killed (by its pid) and started
//! again at the next [`Cluster::reset`], so a later case (or proptest's
//! shrinking) starts from fresh processes. Dropping the cluster closes the
//! sockets, which ends the processes; stragglers are killed.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::wire::{read_frame, write_frame, Cmd, Reply};

/// Environment variable that makes the test binary a domain process: the
/// coordinator's abstract socket name.
pub const SERVER_ENV: &str = "FERRY_MODEL_SERVER";
/// Which domain the process is.
pub const DOMAIN_ENV: &str = "FERRY_MODEL_DOMAIN";

/// How long a process may take to start and say hello.
const START: Duration = Duration::from_secs(30);
/// How long a command may take (the longest, a delivery, waits 10 s).
const ANSWER: Duration = Duration::from_secs(30);

struct Proc {
    child: Child,
    sock: UnixStream,
}

/// One process per domain.
pub struct Cluster {
    addr: String,
    listener: UnixListener,
    procs: Vec<Option<Proc>>,
    /// Processes started so far (first start included).
    pub spawned: usize,
}

fn unique(tag: &str) -> String {
    crate::support::unique_name(&format!("mp-{tag}"))
}

/// A fresh abstract endpoint name for a channel.
pub fn endpoint_name(tag: &str) -> String {
    unique(tag)
}

impl Cluster {
    /// Start `n` domain processes.
    pub fn start(tag: &str, n: usize) -> Result<Cluster, String> {
        let addr = unique(&format!("{tag}-ctl"));
        let sa = SocketAddr::from_abstract_name(addr.as_bytes()).map_err(|e| e.to_string())?;
        let listener = UnixListener::bind_addr(&sa).map_err(|e| format!("listen on {addr}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut c = Cluster { addr, listener, procs: (0..n).map(|_| None).collect(), spawned: 0 };
        c.spawn_missing()?;
        Ok(c)
    }

    /// Start a process for every domain that has none, and wait for each
    /// to connect.
    fn spawn_missing(&mut self) -> Result<(), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut starting: Vec<(usize, Child)> = Vec::new();
        for d in 0..self.procs.len() {
            if self.procs[d].is_none() {
                let child = Command::new(&exe)
                    .args(["--exact", "domain_server", "--ignored", "--nocapture", "--test-threads=1"])
                    .env(SERVER_ENV, &self.addr)
                    .env(DOMAIN_ENV, d.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()
                    .map_err(|e| format!("spawn domain process d{d}: {e}"))?;
                self.spawned += 1;
                starting.push((d, child));
            }
        }
        let t = Instant::now();
        while !starting.is_empty() {
            match self.listener.accept() {
                Ok((mut sock, _)) => {
                    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
                    sock.set_read_timeout(Some(START)).map_err(|e| e.to_string())?;
                    let hello = read_frame(&mut sock).map_err(|e| format!("domain process hello: {e}"))?;
                    let Ok(Reply::Hello { domain }) = Reply::decode(&hello) else {
                        return Err(format!("domain process said {hello:?} instead of hello"));
                    };
                    let pos = starting
                        .iter()
                        .position(|(d, _)| *d == domain as usize)
                        .ok_or_else(|| format!("unexpected hello from d{domain}"))?;
                    let (d, child) = starting.swap_remove(pos);
                    sock.set_read_timeout(Some(ANSWER)).map_err(|e| e.to_string())?;
                    sock.set_write_timeout(Some(ANSWER)).map_err(|e| e.to_string())?;
                    self.procs[d] = Some(Proc { child, sock });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    for (d, child) in &mut starting {
                        if let Ok(Some(status)) = child.try_wait() {
                            return Err(format!("domain process d{d} exited at start: {status}"));
                        }
                    }
                    if t.elapsed() > START {
                        for (_, child) in &mut starting {
                            let _ = child.kill();
                            let _ = child.wait();
                        }
                        return Err(format!("domain processes did not connect within {START:?}"));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("accept: {e}")),
            }
        }
        Ok(())
    }

    /// Number of domains.
    pub fn len(&self) -> usize {
        self.procs.len()
    }

    /// A process failed: describe it, make sure it is gone, forget it.
    fn lost(&mut self, d: usize, what: &str, err: std::io::Error) -> String {
        let Some(mut p) = self.procs[d].take() else { return format!("domain process d{d} is gone ({what})") };
        let t = Instant::now();
        let status = loop {
            match p.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                _ if t.elapsed() > Duration::from_millis(500) => break None,
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        match status {
            Some(s) => format!("domain process d{d} (pid {}) died during {what}: {s}", p.child.id()),
            None => {
                let _ = p.child.kill();
                let _ = p.child.wait();
                format!("domain process d{d} (pid {}) did not answer {what} ({err}); killed it", p.child.id())
            }
        }
    }

    /// Send a command to `d` without waiting for the answer.
    pub fn send(&mut self, d: usize, cmd: &Cmd) -> Result<(), String> {
        let Some(p) = self.procs[d].as_mut() else { return Err(format!("domain process d{d} is gone")) };
        match write_frame(&mut p.sock, &cmd.encode()) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lost(d, &format!("{cmd:?}"), e)),
        }
    }

    /// The answer of `d` to the command sent last (`what` names it).
    pub fn recv(&mut self, d: usize, what: &dyn std::fmt::Debug) -> Result<Reply, String> {
        let Some(p) = self.procs[d].as_mut() else { return Err(format!("domain process d{d} is gone")) };
        match read_frame(&mut p.sock) {
            Ok(body) => match Reply::decode(&body) {
                Ok(Reply::Failed(msg)) => Err(format!("domain process d{d} could not run {what:?}: {msg}")),
                Ok(r) => Ok(r),
                Err(e) => Err(format!("domain process d{d}: undecodable answer to {what:?}: {e}")),
            },
            Err(e) => Err(self.lost(d, &format!("{what:?}"), e)),
        }
    }

    /// Send a command to `d` and wait for its answer.
    pub fn call(&mut self, d: usize, cmd: &Cmd) -> Result<Reply, String> {
        self.send(d, cmd)?;
        self.recv(d, cmd)
    }

    /// Start again: replace dead processes, then reset every domain.
    /// Returns each process's open file descriptors after the reset.
    pub fn reset(&mut self) -> Result<Vec<u32>, String> {
        self.spawn_missing()?;
        for d in 0..self.len() {
            self.send(d, &Cmd::Reset)?;
        }
        let mut fds = Vec::new();
        for d in 0..self.len() {
            match self.recv(d, &Cmd::Reset)? {
                Reply::Reset { fds: n } => fds.push(n),
                r => return Err(format!("d{d} answered {r:?} to Reset")),
            }
        }
        Ok(fds)
    }

    /// `kill -9` domain `d`'s process and wait until it is gone.
    pub fn kill(&mut self, d: usize) -> Result<(), String> {
        let Some(mut p) = self.procs[d].take() else { return Err(format!("domain process d{d} is gone")) };
        p.child.kill().map_err(|e| format!("kill d{d}: {e}"))?;
        let status = crate::support::payload::wait_exit(&mut p.child, Duration::from_secs(10));
        if status.signal() != Some(9) {
            return Err(format!("d{d} ended with {status} instead of SIGKILL"));
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut procs: Vec<Proc> = self.procs.iter_mut().filter_map(Option::take).collect();
        // Closing the command sockets ends the processes.
        let mut children: Vec<Child> = procs.drain(..).map(|p| p.child).collect();
        let t = Instant::now();
        while !children.is_empty() && t.elapsed() < Duration::from_secs(5) {
            children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
            std::thread::sleep(Duration::from_millis(5));
        }
        for mut c in children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
