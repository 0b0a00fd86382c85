//! Ferry's C interface as C programs see it.
//!
//! Installs the library, headers and pkg-config file with `scripts/install-c`
//! into a prefix under the target directory (once per run), compiles every
//! program of `tests/c/` with the system C compiler through `pkg-config`
//! (`-std=c11 -Wall -Wextra -Werror`, and again with AddressSanitizer,
//! LeakSanitizer and UBSan), compiles every installed header on its own as C11
//! and as C++17, and runs the programs as real processes, each with a
//! deadline, checking exit status, fatal signal and output.
//!
//! Programs that must fault (a read or write of a buffer the program no longer
//! owns at trust NONE) are run with the sanitizers' own SIGSEGV/SIGBUS
//! handlers off, so that the signal ends the process and is seen here.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// Deadline of one program run that moves little data.
const SHORT: Duration = Duration::from_secs(60);
/// Deadline of one bulk run (1 GiB, or less under the sanitizers).
const LONG: Duration = Duration::from_secs(150);

/// Bytes moved by the bulk runs of the plain build.
const BULK_BYTES: u64 = 1 << 30;
/// Bytes moved by the bulk runs of the sanitizer build (instrumented
/// checksums are several times slower).
const BULK_BYTES_SANITIZED: u64 = 64 << 20;

/// The workspace root (the directory of `scripts/`).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// The C sources of the test programs.
fn sources() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c")
}

/// Where `scripts/install-c` put Ferry for this run.
struct Install {
    prefix: PathBuf,
    /// `pkg-config --cflags --libs ferry`, split into words.
    flags: Vec<String>,
}

/// Installs Ferry into a fresh prefix, once per test binary run (a failed
/// installation fails every test that needs it, with its output, without
/// being tried again).
fn install() -> &'static Install {
    static INSTALL: OnceLock<Result<Install, String>> = OnceLock::new();
    match INSTALL.get_or_init(try_install) {
        Ok(i) => i,
        Err(e) => panic!("{e}"),
    }
}

fn try_install() -> Result<Install, String> {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    remove_stale_prefixes(tmp);
    let prefix = tmp.join(format!("ferry-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    std::fs::create_dir_all(&prefix).map_err(|e| format!("create {}: {e}", prefix.display()))?;
    let script = workspace().join("scripts/install-c");
    let out = Command::new(&script)
        .arg(&prefix)
        .current_dir(workspace())
        .output()
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/install-c {} failed ({}):\n{}\n{}",
            prefix.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let pc = Command::new("pkg-config")
        .args(["--cflags", "--libs", "ferry"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .map_err(|e| format!("run pkg-config: {e}"))?;
    if !pc.status.success() {
        return Err(format!("pkg-config --cflags --libs ferry failed: {}", String::from_utf8_lossy(&pc.stderr)));
    }
    let flags = String::from_utf8_lossy(&pc.stdout).split_whitespace().map(String::from).collect();
    for dir in ["bin", "run"] {
        std::fs::create_dir_all(prefix.join(dir)).map_err(|e| format!("create {dir} in the prefix: {e}"))?;
    }
    Ok(Install { prefix, flags })
}

/// Removes the prefixes of earlier runs whose process is gone.
fn remove_stale_prefixes(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("ferry-c-")) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// How a program is built.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Build {
    /// `-O2`, warnings as errors.
    Plain,
    /// Also `-fsanitize=address,undefined`, leaks included.
    Sanitized,
}

impl Build {
    fn name(self) -> &'static str {
        match self {
            Build::Plain => "plain",
            Build::Sanitized => "asan",
        }
    }
}

const STRICT_C: [&str; 4] = ["-std=c11", "-Wall", "-Wextra", "-Werror"];

/// Compiles `path` (a C source) once per build and returns the executable.
fn compile_path(path: &Path, build: Build) -> PathBuf {
    type Slot = Arc<OnceLock<PathBuf>>;
    static BUILT: OnceLock<Mutex<HashMap<(PathBuf, Build), Slot>>> = OnceLock::new();
    let slot = BUILT.get_or_init(Default::default).lock().unwrap().entry((path.to_owned(), build)).or_default().clone();
    slot.get_or_init(|| {
        let inst = install();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let exe = inst.prefix.join("bin").join(format!("{stem}-{}", build.name()));
        let mut cc = Command::new("cc");
        cc.args(STRICT_C).arg("-g");
        match build {
            Build::Plain => cc.arg("-O2"),
            Build::Sanitized => {
                cc.args(["-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"])
            }
        };
        cc.arg(path).arg("-o").arg(&exe).args(&inst.flags);
        cc.arg(format!("-Wl,-rpath,{}", inst.prefix.join("lib").display()));
        let out = cc.output().expect("run cc");
        assert!(
            out.status.success(),
            "compiling {} ({:?}) failed:\n{:?}\n{}{}",
            path.display(),
            build,
            cc,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
    .clone()
}

/// Compiles the test program `tests/c/NAME`.
fn compile(name: &str, build: Build) -> PathBuf {
    compile_path(&sources().join(name), build)
}

/// A path for a Unix socket, unique in this run.
fn socket_path(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    install().prefix.join("run").join(format!("{tag}-{n}.sock"))
}

/// What a running program is expected to do with SIGSEGV/SIGBUS.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Faults {
    /// A fault is a failure; the sanitizers report it.
    No,
    /// The program is meant to fault: the signal must end it.
    Expected,
}

/// One program running as a child process, its stdout and stderr read line by
/// line (interleaved as they come) by two threads.
struct Proc {
    what: String,
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn spawn(exe: &Path, args: &[&str], env: &[(&str, &str)], build: Build, faults: Faults) -> Proc {
        let mut cmd = Command::new(exe);
        cmd.args(args).envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        if build == Build::Sanitized {
            let mut asan = String::from("detect_leaks=1:abort_on_error=0:exitcode=86");
            if faults == Faults::Expected {
                asan.push_str(":handle_segv=0:handle_sigbus=0");
            }
            cmd.env("ASAN_OPTIONS", asan);
            cmd.env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
            cmd.env("LSAN_OPTIONS", "exitcode=87");
        }
        let what = format!("{} {}", exe.file_name().unwrap().to_string_lossy(), args.join(" "));
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let (tx, rx) = mpsc::channel();
        for stream in
            [Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>, Box::new(child.stderr.take().unwrap())]
        {
            let tx = tx.clone();
            thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    match line {
                        Ok(l) => {
                            if tx.send(l).is_err() {
                                break;
                            }
                        }
                        Err(_) => break,
                    }
                }
            });
        }
        Proc { what, child, lines: rx, seen: Vec::new() }
    }

    /// Output seen so far.
    fn transcript(&self) -> String {
        self.seen.join("\n")
    }

    /// Waits (at most `within`) for a line containing `needle`; returns it.
    fn wait_for_line(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l.contains(needle);
                    self.seen.push(l.clone());
                    if hit {
                        return l;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    panic!("{}: no line with {needle:?} within {within:?}; output:\n{}", self.what, self.transcript());
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    panic!(
                        "{}: ended ({status:?}) without a line with {needle:?}; output:\n{}",
                        self.what,
                        self.transcript()
                    );
                }
            }
        }
    }

    /// Waits (at most `within`) for the program to end; returns its status
    /// and its whole output. Kills it and fails the test at the deadline.
    fn finish(mut self, within: Duration) -> Ended {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // The readers end at EOF, once the program (and anything
                // that inherited its pipes) is gone.
                while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
                    self.seen.push(l);
                }
                return Ended { what: self.what, status, output: self.seen.join("\n") };
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                while let Ok(l) = self.lines.try_recv() {
                    self.seen.push(l);
                }
                panic!("{}: still running after {within:?}; output:\n{}", self.what, self.transcript());
            }
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(20)) {
                self.seen.push(l);
            }
        }
    }

    /// Ends a program that is meant to be waiting forever: it must still be
    /// running. Returns its output.
    fn kill_waiting(mut self) -> String {
        let early = self.child.try_wait().expect("try_wait");
        let _ = self.child.kill();
        let _ = self.child.wait();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(l);
        }
        assert!(
            early.is_none(),
            "{}: was to wait for its peer but ended ({early:?}); output:\n{}",
            self.what,
            self.transcript()
        );
        self.transcript()
    }
}

/// A program that ended.
struct Ended {
    what: String,
    status: ExitStatus,
    output: String,
}

impl Ended {
    /// Exit status 0.
    fn success(&self) -> &Self {
        assert!(self.status.success(), "{}: {}; output:\n{}", self.what, self.status, self.output);
        self
    }

    /// Killed by SIGSEGV or SIGBUS (a protected buffer was touched).
    fn faulted(&self) -> &Self {
        let sig = self.status.signal();
        assert!(
            sig == Some(libc::SIGSEGV) || sig == Some(libc::SIGBUS),
            "{}: expected to die by SIGSEGV or SIGBUS, ended with {}; output:\n{}",
            self.what,
            self.status,
            self.output
        );
        self
    }

    fn contains(&self, needle: &str) -> &Self {
        assert!(self.output.contains(needle), "{}: no {needle:?} in the output:\n{}", self.what, self.output);
        self
    }

    fn lacks(&self, needle: &str) -> &Self {
        assert!(!self.output.contains(needle), "{}: {needle:?} in the output:\n{}", self.what, self.output);
        self
    }

    /// The value of `key=VALUE` on the last line that has it.
    fn value(&self, key: &str) -> String {
        let pat = format!("{key}=");
        self.output
            .lines()
            .rev()
            .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(&pat)))
            .unwrap_or_else(|| panic!("{}: no {pat}... in the output:\n{}", self.what, self.output))
            .to_string()
    }
}

/// Runs one program to its end.
fn run(exe: &Path, args: &[&str], build: Build, within: Duration) -> Ended {
    Proc::spawn(exe, args, &[], build, Faults::No).finish(within)
}

// ---------------------------------------------------------------------------
// Headers

/// The headers the interface promises.
const HEADERS: [&str; 6] =
    ["bulk_transfer.h", "bulk_allocator.h", "bulk_local.h", "bulk_sm.h", "bulk_net.h", "barrelfish_compat.h"];

/// Compiles a translation unit that includes only `header`, with `compiler`
/// and `flags`.
fn compile_header_alone(header: &str, compiler: &str, lang: &str, flags: &[&str]) {
    let inst = install();
    let include = inst.prefix.join("include");
    let out = Command::new(compiler)
        .args(flags)
        .args(["-x", lang, "-c", "-o", "/dev/null", "-I"])
        .arg(&include)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            writeln!(c.stdin.take().unwrap(), "#include <bulk_transfer/{header}>")?;
            c.wait_with_output()
        })
        .expect("run the compiler");
    assert!(
        out.status.success(),
        "<bulk_transfer/{header}> alone does not compile with {compiler} {flags:?} -x {lang}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_header_is_installed_and_compiles_alone_as_c11() {
    let inst = install();
    for h in HEADERS {
        assert!(inst.prefix.join("include/bulk_transfer").join(h).is_file(), "{h} is not installed");
        compile_header_alone(h, "cc", "c", &["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"]);
    }
}

#[test]
fn every_header_compiles_alone_as_cpp17() {
    let inst = install();
    for h in HEADERS {
        assert!(inst.prefix.join("include/bulk_transfer").join(h).is_file(), "{h} is not installed");
        compile_header_alone(h, "g++", "c++", &["-std=c++17", "-Wall", "-Werror"]);
    }
}

/// A C++ program links against the C library: the headers declare the
/// functions `extern "C"`.
#[test]
fn cpp_program_links_and_runs() {
    let inst = install();
    let exe = inst.prefix.join("bin/cpp_links");
    let out = Command::new("g++")
        .args(["-std=c++17", "-Wall", "-Werror", "-x", "c++"])
        .arg(sources().join("cpp_links.cpp"))
        .args(["-x", "none", "-o"])
        .arg(&exe)
        .args(&inst.flags)
        .arg(format!("-Wl,-rpath,{}", inst.prefix.join("lib").display()))
        .output()
        .expect("run g++");
    assert!(out.status.success(), "g++ cpp_links.cpp failed:\n{}", String::from_utf8_lossy(&out.stderr));
    run(&exe, &[], Build::Plain, SHORT).success().contains("cpp_links: ok");
}

/// The implementation's own example, if it has one, builds and runs.
#[test]
fn example_hello_builds_and_runs() {
    let hello = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/hello.c");
    if !hello.exists() {
        eprintln!("no examples/hello.c: nothing to build");
        return;
    }
    for build in [Build::Plain, Build::Sanitized] {
        let exe = compile_path(&hello, build);
        run(&exe, &[], build, SHORT).success();
    }
}

// ---------------------------------------------------------------------------
// The scenarios of the original interface's test programs

/// Lines of mini_scenario saying a round ended.
fn rounds_reported(output: &str) -> usize {
    output.lines().filter(|l| l.contains("mini_scenario: round ") && l.contains(" of 4 complete")).count()
}

fn mini_scenario(build: Build) {
    let exe = compile("mini_scenario.c", build);
    let ended = run(&exe, &[], build, SHORT);
    ended.success().contains("mini_scenario: all 4 rounds complete").lacks("CHECK FAILED");
    assert_eq!(
        rounds_reported(&ended.output),
        4,
        "mini_scenario: four rounds of move, pass, copy, release expected:\n{}",
        ended.output
    );
}

#[test]
fn mini_scenario_local() {
    mini_scenario(Build::Plain);
}

#[test]
fn mini_scenario_local_sanitized() {
    mini_scenario(Build::Sanitized);
}

/// Runs test `test` of shm_scenario: agent 1 creates the channel, agent 2
/// is started once agent 1 listens.
fn shm_scenario(test: u32, build: Build) {
    let exe = compile("shm_scenario.c", build);
    let sock = socket_path(&format!("shm_scenario{test}-{}", build.name()));
    let sock = sock.to_str().unwrap();
    let t = test.to_string();
    let env = [("SHM_SCENARIO_SOCKET", sock)];
    // Which agent faults: 2, 5 and 6 agent 2; 3 and 4 agent 1.
    let a1_faults = matches!(test, 3 | 4);
    let a2_faults = matches!(test, 2 | 5 | 6);
    let f = |b: bool| if b { Faults::Expected } else { Faults::No };
    let mut a1 = Proc::spawn(&exe, &["1", &t], &env, build, f(a1_faults));
    a1.wait_for_line("agent 1: channel created; waiting for agent 2", SHORT);
    let a2 = Proc::spawn(&exe, &["2", &t], &env, build, f(a2_faults));
    // The line an agent prints just before the access that must fault.
    let announce = |agent: u32, what: &str| format!("agent {agent}: test {test}: {what}; this access must fault");
    let survived = "FAILED: no fault";
    match test {
        0 | 1 => {
            a2.finish(SHORT)
                .success()
                .contains("agent 2: moved data verified")
                .contains("agent 2: copied data verified")
                .contains("agent 2: finished");
            a1.finish(SHORT)
                .success()
                .contains("agent 1: copied buffer writable again after the release")
                .contains("agent 1: finished");
        }
        2 => {
            a2.finish(SHORT).faulted().contains(&announce(2, "reading the buffer it passed")).lacks(survived);
            a1.kill_waiting();
        }
        3 => {
            a1.finish(SHORT).faulted().contains(&announce(1, "reading the buffer it moved")).lacks(survived);
            a2.finish(SHORT).success().contains("agent 2: test 3 leaves the fault to agent 1; exiting");
        }
        4 => {
            a1.finish(SHORT).faulted().contains(&announce(1, "writing the buffer it copied out")).lacks(survived);
            a2.kill_waiting();
        }
        5 => {
            a2.finish(SHORT).faulted().contains(&announce(2, "writing the copy it received")).lacks(survived);
            a1.kill_waiting();
        }
        6 => {
            a2.finish(SHORT).faulted().contains(&announce(2, "reading the copy it released")).lacks(survived);
            a1.finish(SHORT).success().contains("agent 1: finished");
        }
        _ => unreachable!(),
    }
}

macro_rules! shm_scenario_tests {
    ($($plain:ident, $sanitized:ident = $n:expr;)*) => {$(
        #[test]
        fn $plain() {
            shm_scenario($n, Build::Plain);
        }
        #[test]
        fn $sanitized() {
            shm_scenario($n, Build::Sanitized);
        }
    )*};
}

shm_scenario_tests! {
    shm_scenario_0_trusted, shm_scenario_0_trusted_sanitized = 0;
    shm_scenario_1_untrusted, shm_scenario_1_untrusted_sanitized = 1;
    shm_scenario_2_no_access_after_pass, shm_scenario_2_no_access_after_pass_sanitized = 2;
    shm_scenario_3_no_access_after_move, shm_scenario_3_no_access_after_move_sanitized = 3;
    shm_scenario_4_no_write_to_copied, shm_scenario_4_no_write_to_copied_sanitized = 4;
    shm_scenario_5_no_write_to_received_copy, shm_scenario_5_no_write_to_received_copy_sanitized = 5;
    shm_scenario_6_no_access_after_release, shm_scenario_6_no_access_after_release_sanitized = 6;
}

// ---------------------------------------------------------------------------
// Two processes moving data

/// Starts the sink (creator) of `transfer.c` and, once it listens, the
/// source (binder); returns both.
fn start_transfer(backend: &str, build: Build, bytes: u64, trust: &str, mode: &str) -> (Proc, Proc) {
    let exe = compile("transfer.c", build);
    let bytes = bytes.to_string();
    let bufsz = (1usize << 20).to_string();
    let path = socket_path(&format!("transfer-{backend}-{}", build.name()));
    let create_addr = if backend == "net" { "127.0.0.1".to_string() } else { path.to_str().unwrap().to_string() };
    let source_faults = if mode == "stream" { Faults::No } else { Faults::Expected };
    let mut sink =
        Proc::spawn(&exe, &[backend, "create", &create_addr, &bytes, &bufsz, trust, mode], &[], build, Faults::No);
    let listening = sink.wait_for_line("listening", SHORT);
    let bind_addr = if backend == "net" {
        listening
            .split_whitespace()
            .find_map(|w| w.strip_prefix("port="))
            .unwrap_or_else(|| panic!("no port in {listening:?}"))
            .to_string()
    } else {
        create_addr
    };
    let source =
        Proc::spawn(&exe, &[backend, "bind", &bind_addr, &bytes, &bufsz, trust, mode], &[], build, source_faults);
    (sink, source)
}

/// Moves `bytes` in 1 MiB buffers from the source to the sink and back;
/// both must end cleanly with the same checksum over the same bytes.
fn transfer(backend: &str, build: Build, bytes: u64, trust: &str) {
    let (sink, source) = start_transfer(backend, build, bytes, trust, "stream");
    let source = source.finish(LONG);
    source.success().contains("veto: continuation err=");
    let sink = sink.finish(LONG);
    sink.success();
    assert_eq!(source.value("bytes"), bytes.to_string(), "source: bytes moved");
    assert_eq!(sink.value("bytes"), bytes.to_string(), "sink: bytes received");
    assert_eq!(sink.value("buffers"), (bytes >> 20).to_string(), "sink: buffers received");
    assert_eq!(
        source.value("checksum"),
        sink.value("checksum"),
        "checksums differ:\nsource:\n{}\nsink:\n{}",
        source.output,
        sink.output
    );
}

#[test]
fn transfer_1gib_over_shm() {
    transfer("sm", Build::Plain, BULK_BYTES, "full");
}

#[test]
fn transfer_1gib_over_tcp() {
    transfer("net", Build::Plain, BULK_BYTES, "full");
}

#[test]
fn transfer_over_shm_untrusted() {
    transfer("sm", Build::Plain, BULK_BYTES / 4, "none");
}

#[test]
fn transfer_over_shm_sanitized() {
    transfer("sm", Build::Sanitized, BULK_BYTES_SANITIZED, "half");
}

#[test]
fn transfer_over_tcp_sanitized() {
    transfer("net", Build::Sanitized, BULK_BYTES_SANITIZED, "full");
}

/// The source moves one buffer, then touches it: it must die by the
/// signal, after saying it is about to; the sink hears of its death as a
/// teardown and ends cleanly.
fn touch_after_move(backend: &str, build: Build, trust: &str, mode: &str, announce: &str) {
    let (sink, source) = start_transfer(backend, build, 1 << 20, trust, mode);
    source.finish(SHORT).faulted().contains(announce).lacks("without a fault");
    sink.finish(SHORT).success();
}

#[test]
fn trust_none_read_after_move_faults_over_shm() {
    touch_after_move("sm", Build::Plain, "none", "fault-read", "reading a moved buffer");
}

#[test]
fn trust_none_read_after_move_faults_over_shm_sanitized() {
    touch_after_move("sm", Build::Sanitized, "none", "fault-read", "reading a moved buffer");
}

#[test]
fn trust_none_read_after_move_faults_over_tcp() {
    touch_after_move("net", Build::Plain, "none", "fault-read", "reading a moved buffer");
}

#[test]
fn trust_half_write_after_move_faults_over_shm() {
    touch_after_move("sm", Build::Plain, "half", "fault-write", "writing a moved buffer");
}

#[test]
fn trust_half_write_after_move_faults_over_tcp() {
    touch_after_move("net", Build::Plain, "half", "fault-write", "writing a moved buffer");
}

// ---------------------------------------------------------------------------
// One process

/// A one-process C program built as `build` and run without arguments:
/// it ends well and its last word is `<program>: ok`.
fn passes(program: &str, build: Build) {
    let name = program.trim_end_matches(".c");
    run(&compile(program, build), &[], build, SHORT).success().contains(&format!("{name}: ok"));
}

/// Tests of one-process programs: each given test name runs its program
/// plain, and the second name (if any) under the sanitizers.
macro_rules! one_process_tests {
    ($($(#[$doc:meta])* $program:literal: $plain:ident $(, $sanitized:ident)?;)*) => {$(
        $(#[$doc])*
        #[test]
        fn $plain() {
            passes($program, Build::Plain);
        }
        $(
            #[test]
            fn $sanitized() {
                passes($program, Build::Sanitized);
            }
        )?
    )*};
}

one_process_tests! {
    /// The waitset's fd in the program's own epoll set, beside a timerfd.
    "waitset_epoll.c": waitset_fd_in_epoll_beside_timerfd, waitset_fd_in_epoll_beside_timerfd_sanitized;
    /// Busy polling an idle waitset whose fd the program never took makes no
    /// system call; once it takes the fd, the fd contract holds. With both ends
    /// of a channel on one waitset, a pass held back by the echo's callback is
    /// delivered by the next dispatch, not left for a later one.
    "busy_poll.c": busy_polling_makes_no_system_call_until_the_fd_is_taken;
    /// Every channel of a waitset gets its turn: an echo whose callbacks
    /// always send (its passes held back for batching, and published first
    /// at the next round of polls) does not keep another channel of the
    /// waitset waiting while it has more to deliver.
    "poll_turns.c": a_sending_echo_does_not_keep_other_channels_from_their_turn,
        a_sending_echo_does_not_keep_other_channels_from_their_turn_sanitized;
    /// Allocator calls racing each other and `bulk_alloc_free` from real
    /// threads: one of two simultaneous returns of a buffer succeeds, no
    /// buffer is held twice, and nothing is handed out once the free returned.
    "alloc_race.c": allocator_calls_race_each_other_and_the_free, allocator_calls_race_each_other_and_the_free_sanitized;
    /// Every call's error paths, one call each, without side effects.
    "error_paths.c": error_paths, error_paths_sanitized;
    /// A sink process destroys its channel in the middle of a stream and
    /// exits holding buffers (it forks the sink itself): the source's moves
    /// are refused cleanly, and once the sink has exited every buffer of the
    /// pool can be allocated again.
    "sink_leaves.c": a_sink_that_leaves_mid_stream_holding_buffers_gives_them_all_back,
        a_sink_that_leaves_mid_stream_holding_buffers_gives_them_all_back_sanitized;
}

/// When sends reach the peer: a send outside a callback before the call
/// returns (the source then waits without dispatching), also while another
/// thread runs a callback of the channel's waitset; sends from callbacks,
/// published in batches, at the latest when the channel is destroyed (the
/// echo destroys it right after its last callback and ends).
fn publish(build: Build) {
    let exe = compile("publish.c", build);
    for backend in ["local", "sm"] {
        for case in ["outside", "exit", "beside"] {
            run(&exe, &[backend, case], build, SHORT).success().contains("publish: ok");
        }
    }
}

#[test]
fn sends_are_published_outside_callbacks_at_once_and_from_callbacks_by_destroy() {
    publish(Build::Plain);
}

#[test]
fn sends_are_published_outside_callbacks_at_once_and_from_callbacks_by_destroy_sanitized() {
    publish(Build::Sanitized);
}

/// Calls on one channel from three worker threads while two more dispatch
/// its ends' waitsets, then its destruction in the middle of them: every
/// move comes back intact, every call returns OK or a typed error, and
/// once the destroy completed every buffer can be allocated again (what the
/// peer had sent before it saw the teardown is taken in, not lost).
fn threads(build: Build) {
    on_each_backend("threads", build);
}

/// Runs the program `name`.c once per backend (its argument `local`, `sm`
/// or `net`, see `c/pair.h`); each run must end with "`name`: ok".
fn on_each_backend(name: &str, build: Build) {
    let exe = compile(&format!("{name}.c"), build);
    for backend in ["local", "sm", "net"] {
        run(&exe, &[backend], build, SHORT).success().contains(&format!("{name}: ok"));
    }
}

#[test]
fn calls_from_many_threads_and_a_destroy_among_them_lose_nothing() {
    threads(Build::Plain);
}

#[test]
fn calls_from_many_threads_and_a_destroy_among_them_lose_nothing_sanitized() {
    threads(Build::Sanitized);
}

/// A destroyed end whose peer passes buffers back before it saw the
/// teardown, in a program that dispatches only when `bulk_waitset_fd` is
/// readable: the fd wakes for the passes and for the peer's closing, every
/// buffer comes back, and the fd is quiet after.
fn linger_epoll(build: Build) {
    on_each_backend("linger_epoll", build);
}

#[test]
fn a_destroyed_end_wakes_the_program_s_loop_for_what_its_peer_sends() {
    linger_epoll(Build::Plain);
}

#[test]
fn a_destroyed_end_wakes_the_program_s_loop_for_what_its_peer_sends_sanitized() {
    linger_epoll(Build::Sanitized);
}

// ---------------------------------------------------------------------------
// The C benchmark (its numbers are scripts/bench-c's business; here it only
// has to build warning-free and run each experiment on each backend)

#[test]
fn bench_program_runs_each_experiment() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/bulk_bench.c");
    for build in [Build::Plain, Build::Sanitized] {
        let exe = compile_path(&src, build);
        for (exp, backend, extra) in [
            ("rtt", "local", &["--runs", "1"][..]),
            ("rtt", "sm", &["--runs", "1"][..]),
            ("throughput", "local", &["--runs", "1", "--moves", "500", "--inflight", "50"][..]),
            ("throughput", "sm", &["--runs", "1", "--moves", "500", "--inflight", "50"][..]),
        ] {
            let mut args = vec![exp, backend, "--json"];
            args.extend_from_slice(extra);
            let ended = run(&exe, &args, build, SHORT);
            ended.success().contains(&format!("\"experiment\":\"{exp}\"")).contains("\"median\":");
        }
    }
}

/// The C benchmark crossed with an echo started by hand: its source listens
/// at a path (`--peer`) and its echo alone (`echo sm --peer`) binds there,
/// as `scripts/bench-c` crosses them with Rust's source and echo.
#[test]
fn bench_program_serves_an_echo_started_by_hand() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/bulk_bench.c");
    for build in [Build::Plain, Build::Sanitized] {
        let exe = compile_path(&src, build);
        let path = socket_path(&format!("bench-peer-{}", build.name()));
        let p = path.to_str().unwrap();
        let source = Proc::spawn(&exe, &["rtt", "sm", "--runs", "1", "--json", "--peer", p], &[], build, Faults::No);
        let deadline = Instant::now() + SHORT;
        while !path.exists() {
            assert!(Instant::now() < deadline, "the source did not listen at {p}");
            thread::sleep(Duration::from_millis(10));
        }
        run(&exe, &["echo", "sm", "--peer", p], build, SHORT).success();
        // One warm-up run and one measured run of 250 round trips.
        source.finish(SHORT).success().contains("\"samples\":250");
    }
}

/// A program that uses the library runs under valgrind, whose tools do not
/// map the vDSO (the auxiliary vector is read through libc). Where valgrind
/// is not installed there is nothing to run it under.
#[test]
fn a_program_runs_under_valgrind() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!("valgrind is not installed: nothing to check");
        return;
    }
    let exe = compile_path(&Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/bulk_work.c"), Build::Plain);
    let exe = exe.to_string_lossy().into_owned();
    run(Path::new("valgrind"), &["--tool=none", "-q", &exe, "local", "100"], Build::Plain, SHORT)
        .success()
        .contains("100 round trips");
}

/// The installed pkg-config file gives the library's version, so that a
/// build can ask for one (`pkg-config --atleast-version`, CMake's
/// `pkg_check_modules(FERRY ferry>=0.1)`).
#[test]
fn pkg_config_gives_the_version() {
    let inst = install();
    let pkg_config = |args: &[&str]| {
        Command::new("pkg-config")
            .args(args)
            .env("PKG_CONFIG_PATH", inst.prefix.join("lib/pkgconfig"))
            .output()
            .expect("run pkg-config")
    };
    let v = pkg_config(&["--modversion", "ferry"]);
    assert!(v.status.success(), "pkg-config --modversion ferry: {}", String::from_utf8_lossy(&v.stderr));
    assert_eq!(String::from_utf8_lossy(&v.stdout).trim(), env!("CARGO_PKG_VERSION"));
    assert!(pkg_config(&["--atleast-version", env!("CARGO_PKG_VERSION"), "ferry"]).status.success());
    assert!(!pkg_config(&["--atleast-version", "999", "ferry"]).status.success(), "a version the library is not");
}

/// A program links against libferry.a (pkg-config --static for what the Rust
/// standard library needs) and runs without libferry.so.
#[test]
fn static_library_links_and_runs() {
    let inst = install();
    let pc = Command::new("pkg-config")
        .args(["--static", "--libs", "ferry"])
        .env("PKG_CONFIG_PATH", inst.prefix.join("lib/pkgconfig"))
        .output()
        .expect("run pkg-config");
    assert!(pc.status.success(), "pkg-config --static --libs ferry: {}", String::from_utf8_lossy(&pc.stderr));
    let archive = inst.prefix.join("lib/libferry.a");
    let libs: Vec<String> = String::from_utf8_lossy(&pc.stdout)
        .split_whitespace()
        .map(|w| if w == "-lferry" { archive.display().to_string() } else { w.to_string() })
        .collect();
    let exe = inst.prefix.join("bin/mini_scenario-static");
    let out = Command::new("cc")
        .args(STRICT_C)
        .args(["-O2", "-I"])
        .arg(inst.prefix.join("include"))
        .arg(sources().join("mini_scenario.c"))
        .arg("-o")
        .arg(&exe)
        .args(&libs)
        .output()
        .expect("run cc");
    assert!(out.status.success(), "static link of mini_scenario.c failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let dynamic = Command::new("readelf").arg("-d").arg(&exe).output().expect("run readelf");
    let needed = String::from_utf8_lossy(&dynamic.stdout);
    assert!(!needed.contains("libferry"), "the static build still needs libferry.so:\n{needed}");
    let ended = run(&exe, &[], Build::Plain, SHORT);
    ended.success().contains("mini_scenario: all 4 rounds complete");
    assert_eq!(rounds_reported(&ended.output), 4, "static mini_scenario: four rounds expected:\n{}", ended.output);
}

/// The source ends its process while the sink holds four of its buffers:
/// the sink hears of it as a teardown and ends cleanly (no hang, no leak).
fn peer_dies(backend: &str, build: Build, trust: &str) {
    let (sink, source) = start_transfer(backend, build, 4 << 20, trust, "die");
    source.finish(SHORT).success().contains("source: ending without a teardown");
    sink.finish(SHORT).success().contains("buffers=4");
}

#[test]
fn peer_death_is_a_teardown_over_shm() {
    peer_dies("sm", Build::Plain, "half");
}

#[test]
fn peer_death_is_a_teardown_over_shm_sanitized() {
    peer_dies("sm", Build::Sanitized, "none");
}

#[test]
fn peer_death_is_a_teardown_over_tcp_sanitized() {
    peer_dies("net", Build::Sanitized, "full");
}

/// The short program of the README's "Using Ferry from C" is
/// examples/hello.c, which `example_hello_builds_and_runs` builds and runs.
#[test]
fn readme_program_is_the_example() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("read README.md");
    let section = readme.split("## Using Ferry from C").nth(1).expect("README has \"## Using Ferry from C\"");
    let block = section
        .split("```c\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("a ```c block in the README's C section");
    let hello = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/hello.c"))
        .expect("read examples/hello.c");
    assert_eq!(block.trim_end(), hello.trim_end(), "the README's C program is not examples/hello.c");
}

/// Trust HALF over a local channel: writes to a moved buffer, to a buffer
/// with a copy out, and to a received copy fault; the owner's write to its
/// own buffer does not.
#[test]
fn trust_half_protects_local_channels() {
    let exe = compile("local_protect.c", Build::Plain);
    for mode in ["write-moved", "write-copied", "write-copy"] {
        Proc::spawn(&exe, &[mode], &[], Build::Plain, Faults::Expected)
            .finish(SHORT)
            .faulted()
            .contains("touching buffer")
            .lacks("without a fault");
    }
    run(&exe, &["write-owned"], Build::Plain, SHORT).success().contains("wrote it without a fault");
}

#[test]
fn trust_half_protects_local_channels_sanitized() {
    let exe = compile("local_protect.c", Build::Sanitized);
    for mode in ["write-moved", "write-copied", "write-copy"] {
        Proc::spawn(&exe, &[mode], &[], Build::Sanitized, Faults::Expected)
            .finish(SHORT)
            .faulted()
            .contains("touching buffer")
            .lacks("without a fault");
    }
    run(&exe, &["write-owned"], Build::Sanitized, SHORT).success().contains("wrote it without a fault");
}
