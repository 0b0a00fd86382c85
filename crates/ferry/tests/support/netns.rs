//! Two fresh Linux network namespaces joined by a veth pair, for tests that need two hosts with their own
//! addresses and network stacks (made with iproute2's `ip`, so root is needed).
//!
//! Each [`NetnsPair`] gets unique namespace names (`ferry-<pid>-<n>a` / `...b`) and its own subnets:
//! 10.x.y.1/24 and 10.x.y.2/24, plus fd00:x:y::1/64 and fd00:x:y::2/64 when IPv6 is available. The
//! interface inside both namespaces is called [`VETH`]; `lo` is up too. Traffic between the two stays in
//! the namespaces: from the root namespace these addresses lead nowhere (and must not be tried).
//!
//! Programs are run inside a namespace with [`NetnsPair::command_in`]. Dropping the pair deletes both
//! namespaces, and the veth pair with them.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Name of the veth interface inside each of the two namespaces.
pub const VETH: &str = "veth0";

/// How long `create` waits for the veth link to come up.
const LINK_UP_TIMEOUT: Duration = Duration::from_secs(5);

/// Pairs created by this process so far: part of the names and addresses of the next one.
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces joined by a veth pair; see the [module documentation](self).
#[derive(Debug)]
pub struct NetnsPair {
    /// Name of the first namespace (as listed by `ip netns list`).
    pub a: String,
    /// Name of the second namespace.
    pub b: String,
    /// IPv4 address of namespace `a` on the veth link (10.x.y.1).
    pub addr_a: IpAddr,
    /// IPv4 address of namespace `b` on the veth link (10.x.y.2).
    pub addr_b: IpAddr,
    /// IPv6 address of namespace `a` (fd00:x:y::1), or `None` where IPv6 is disabled.
    pub addr6_a: Option<IpAddr>,
    /// IPv6 address of namespace `b` (fd00:x:y::2), or `None` where IPv6 is disabled.
    pub addr6_b: Option<IpAddr>,
}

impl NetnsPair {
    /// Creates the two namespaces, the veth pair between them, the addresses, and brings `lo` and the veth
    /// up (waiting until the link reports up). IPv6 addresses are added without duplicate address
    /// detection, so they are usable at once.
    ///
    /// # Errors
    /// The reason (also printed to stderr) when not running as root, when `ip` (Debian package
    /// `iproute2`) is missing, or when any `ip` command fails; whatever was created is removed again.
    /// Callers that need the namespaces should fail loudly on `Err` (CI runs as root).
    pub fn create() -> Result<NetnsPair, String> {
        NetnsPair::try_create().map_err(|reason| {
            eprintln!("NetnsPair::create: {reason}");
            reason
        })
    }

    fn try_create() -> Result<NetnsPair, String> {
        if !Path::new("/proc/self/ns/net").exists() {
            return Err("network namespaces are not supported here (no /proc/self/ns/net)".into());
        }
        match effective_uid() {
            Some(0) => {}
            Some(uid) => return Err(format!("network namespaces need root, running as uid {uid}")),
            None => return Err("cannot read the effective uid from /proc/self/status".into()),
        }
        match Command::new("ip").arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status() {
            Ok(status) if status.success() => {}
            Ok(status) => return Err(format!("`ip -V` failed ({status}): is iproute2 installed?")),
            Err(e) => return Err(format!("cannot run `ip` ({e}): install the Debian package iproute2")),
        }

        let pid = std::process::id();
        // Name the pair after the pid and a counter; skip names left behind by an earlier process with the
        // same pid (a crashed run).
        let (n, a, b) = loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let (a, b) = (format!("ferry-{pid}-{n}a"), format!("ferry-{pid}-{n}b"));
            if !netns_exists(&a) && !netns_exists(&b) {
                break (n, a, b);
            }
        };
        // Subnet 10.x.y.0/24, x in 1..=254 from the pid and y from the counter. Uniqueness is a courtesy:
        // every pair lives in its own namespaces, so equal subnets in two pairs would not clash anyway.
        let x = (pid.wrapping_mul(31).wrapping_add(n / 256) % 254 + 1) as u8;
        let y = (n % 256) as u8;
        let ipv6 = ipv6_enabled();
        let mut pair = NetnsPair {
            a,
            b,
            addr_a: IpAddr::V4(Ipv4Addr::new(10, x, y, 1)),
            addr_b: IpAddr::V4(Ipv4Addr::new(10, x, y, 2)),
            addr6_a: ipv6.then(|| IpAddr::V6(Ipv6Addr::new(0xfd00, x.into(), y.into(), 0, 0, 0, 0, 1))),
            addr6_b: ipv6.then(|| IpAddr::V6(Ipv6Addr::new(0xfd00, x.into(), y.into(), 0, 0, 0, 0, 2))),
        };
        // From here on, dropping `pair` on an error removes whatever exists of it.
        ip(["netns", "add", &pair.a])?;
        ip(["netns", "add", &pair.b])?;
        ip(["-n", &pair.a, "link", "add", VETH, "type", "veth", "peer", "name", VETH, "netns", &pair.b])?;
        let mut ipv6_ok = true;
        for (ns, addr, addr6) in [(&pair.a, pair.addr_a, pair.addr6_a), (&pair.b, pair.addr_b, pair.addr6_b)] {
            ip(["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", VETH])?;
            if let Some(addr6) = addr6 {
                // IPv6 is optional: without it the pair is still usable over IPv4.
                if let Err(e) = ip(["-n", ns, "addr", "add", &format!("{addr6}/64"), "dev", VETH, "nodad"]) {
                    eprintln!("NetnsPair::create: no IPv6 on the veth link: {e}");
                    ipv6_ok = false;
                }
            }
            ip(["-n", ns, "link", "set", "lo", "up"])?;
            ip(["-n", ns, "link", "set", VETH, "up"])?;
        }
        if !ipv6_ok {
            pair.addr6_a = None;
            pair.addr6_b = None;
        }
        pair.wait_link_up()?;
        Ok(pair)
    }

    /// A [`Command`] that runs `program` inside namespace `ns` (normally `self.a` or `self.b`), as
    /// `ip netns exec NS PROGRAM`; add the program's arguments, stdio and environment as usual.
    pub fn command_in(&self, ns: &str, program: &Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]).arg(program);
        command
    }

    /// Waits until the veth reports `state UP` on both sides.
    fn wait_link_up(&self) -> Result<(), String> {
        let deadline = Instant::now() + LINK_UP_TIMEOUT;
        for ns in [&self.a, &self.b] {
            loop {
                let show = ip(["-n", ns, "-o", "link", "show", "dev", VETH])?;
                if show.contains("state UP") {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(format!("{VETH} in namespace {ns} did not come up: {show}"));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }
}

impl Drop for NetnsPair {
    /// Deletes both namespaces (`ip netns del`); the veth pair goes with them. A namespace in which a
    /// process still runs lives on, nameless, until that process exits: stop the children first.
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            if netns_exists(ns) {
                if let Err(e) = ip(["netns", "del", ns]) {
                    eprintln!("NetnsPair::drop: {e}");
                }
            }
        }
    }
}

/// Runs `ip ARGS`, returning its stdout, or an error with its stderr.
fn ip<I, S>(args: I) -> Result<String, String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new("ip");
    command.args(args).stdin(Stdio::null());
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!("{command:?} failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim()))
    }
}

/// Whether a named network namespace exists (`ip netns add` mounts it under /run/netns).
fn netns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("Uid:"))?;
    // "Uid: real effective saved filesystem"
    line.split_whitespace().nth(2)?.parse().ok()
}

/// IPv6 is usable unless the kernel has it off (the sysctl is missing without IPv6, "1" when disabled).
fn ipv6_enabled() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/default/disable_ipv6").is_ok_and(|v| v.trim() == "0")
}
