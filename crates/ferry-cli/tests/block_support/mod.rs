//! A running `ferry block serve` and the client tools around it, shared by
//! the block service's tests with real NBD clients (plain and over TLS).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

/// Every wait in these tests ends within this.
pub const LIMIT: Duration = Duration::from_secs(60);

/// A running `ferry block serve`, killed when dropped.
pub struct Server {
    /// The server process.
    pub child: Child,
    /// Lines the server printed after it started listening.
    pub lines: Receiver<String>,
    /// `tcp:IP:PORT` or `unix:PATH` of each place it listens.
    pub listening: Vec<String>,
}

/// The lines a stream gives, as they come.
pub fn lines_of(stream: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ferry"));
        command.args(["block", "serve"]).args(args).stderr(Stdio::inherit());
        Server::launch(command, args)
    }

    /// A server that may have at most `nofile` file descriptors open
    /// (`ulimit -n` of the shell that becomes it), and the lines it prints
    /// on standard error.
    pub fn start_limited(nofile: u32, args: &[&str]) -> (Server, Receiver<String>) {
        let mut command = Command::new("sh");
        command
            .args(["-c", "ulimit -n \"$0\" && exec \"$@\"", &nofile.to_string(), env!("CARGO_BIN_EXE_ferry")])
            .args(["block", "serve"])
            .args(args)
            .stderr(Stdio::piped());
        let mut server = Server::launch(command, args);
        let errors = lines_of(server.child.stderr.take().expect("piped"));
        (server, errors)
    }

    pub fn launch(mut command: Command, args: &[&str]) -> Server {
        let mut child = command
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start ferry block serve");
        let out = child.stdout.take().expect("piped");
        let lines = lines_of(out);
        let mut server = Server { child, lines, listening: Vec::new() };
        let want = args.iter().filter(|a| **a == "--nbd").count();
        while server.listening.len() < want {
            let line = server.next_line().unwrap_or_else(|| panic!("ferry block serve {args:?} did not start"));
            if let Some(at) = line.strip_prefix("listening for NBD clients on ") {
                // The address only, without what follows it (a TLS note).
                server.listening.push(at.split(' ').next().expect("an address").to_string());
            }
        }
        server
    }

    /// The next line the server prints (None if it ended or stayed silent
    /// for [`LIMIT`]).
    pub fn next_line(&self) -> Option<String> {
        self.lines.recv_timeout(LIMIT).ok()
    }

    /// The NBD URI of the first TCP address.
    pub fn uri(&self) -> String {
        let at = self.listening.iter().find_map(|l| l.strip_prefix("tcp:")).expect("a TCP listener");
        format!("nbd://{at}/")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Run a tool to its end (killed after [`LIMIT`]); panics with its output
/// if it is missing.
pub fn run(program: &str, args: &[&str]) -> Output {
    run_with_input(program, args, None)
}

pub fn run_with_input(program: &str, args: &[&str], input: Option<&str>) -> Output {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}); scripts/setup installs it"));
    if let Some(text) = input {
        child.stdin.take().expect("piped").write_all(text.as_bytes()).expect("write stdin");
    }
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(LIMIT) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{program} {args:?} did not finish within {LIMIT:?}");
        }
    }
}
