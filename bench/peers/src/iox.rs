//! iceoryx2 0.10, zero-copy publish-subscribe between two processes.
//!
//! Services (unique per point: `ferry-peers/<pid>/<n>/…`): `ping`
//! (source → echo) and `pong` (echo → source), payload `[u8]` slices of
//! `size` bytes with a `u64` user header carrying the sequence number;
//! history 0, one publisher and one subscriber each, subscriber buffer =
//! in-flight window (throughput: --inflight; rtt: 16, like `ferry bench`'s
//! 16-buffer pool), at most 2 borrowed samples per subscriber, 2 loaned per
//! publisher, no safe overflow (a full buffer is backpressure, never a lost
//! sample). The publisher preallocates window + 4 samples.
//!
//! The source loans an uninitialised sample, writes the sequence number into
//! the user header (with --touch also the pattern into every payload byte)
//! and sends it; the echo receives it, checks length and sequence number
//! (with --touch every byte), releases it, and sends back a *fresh* loaned
//! uninitialised sample of the same length with the same sequence number in
//! its header — pub-sub has no way to hand the received sample itself back.
//! No payload byte is copied or written by anyone without --touch
//! (`copies_user` 0); only the 8-byte user header and iceoryx2's own header.
//!
//! busy-poll: both sides spin on `Subscriber::receive`. blocking: two event
//! services `ping-ev`/`pong-ev`; after sending (a sample, or a batch of them)
//! the sender calls `Notifier::notify`, and a side with nothing to receive
//! sleeps in `Listener::timed_wait` (iceoryx2's Unix-datagram event).
//!
//! Stale resources: every run takes an exclusive lock
//! (/tmp/ferry-peers-iceoryx2.lock), then removes whatever a crashed earlier
//! run left — files with our prefix `ferrypeers_` in /dev/shm and under
//! /tmp/iceoryx2 — and asks iceoryx2 to clean up dead nodes.

use std::path::Path;
use std::time::{Duration, Instant};

use iceoryx2::config::Config;
use iceoryx2::port::listener::Listener;
use iceoryx2::port::notifier::Notifier;
use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::prelude::*;
use iceoryx2::sample::Sample;
use iceoryx2::sample_mut::SampleMut;

use crate::child::{self, EchoArgs};
use crate::pattern;
use crate::plan::{Experiment, Peer, Plan, PointPlan, RTT_PER_RUN};
use crate::report::Point;
use crate::stats::Summary;

type Svc = ipc::Service;
type Pub = Publisher<Svc, [u8], u64>;
type Sub = Subscriber<Svc, [u8], u64>;

/// File name prefix of everything this program makes iceoryx2 create.
pub const PREFIX: &str = "ferrypeers_";
const LOCK: &str = "/tmp/ferry-peers-iceoryx2.lock";
const READY: u64 = u64::MAX - 1;
const STOP: u64 = u64::MAX;
/// Rtt window (as `ferry bench`'s 16-buffer pool for rtt).
const RTT_WINDOW: usize = 16;
const WAIT_STALL: Duration = Duration::from_secs(10);

fn err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("iceoryx2: {what}: {e:?}")
}

fn config() -> Result<Config, String> {
    let mut c = Config::default();
    c.global.prefix = FileName::new(PREFIX.as_bytes()).map_err(err("prefix"))?;
    Ok(c)
}

fn node(name: &str) -> Result<Node<Svc>, String> {
    set_log_level(LogLevel::Error);
    NodeBuilder::new()
        .name(&NodeName::new(name).map_err(err("node name"))?)
        .config(&config()?)
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<Svc>()
        .map_err(err("node"))
}

fn service_name(stem: &str, what: &str) -> Result<ServiceName, String> {
    ServiceName::new(&format!("{stem}/{what}")).map_err(err("service name"))
}

/// Held for the whole run: no other instance of this program uses iceoryx2 meanwhile.
pub struct RunLock(#[allow(dead_code)] std::fs::File);

/// Take the lock, then remove what earlier (crashed) runs left behind.
pub fn clean_stale() -> Result<RunLock, String> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK)
        .map_err(|e| format!("{LOCK}: {e}"))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|_| format!("another ferry-peers iceoryx2 run holds {LOCK}"))?;
    let mut removed = 0usize;
    remove_prefixed(Path::new("/dev/shm"), false, &mut removed);
    remove_prefixed(Path::new("/tmp/iceoryx2"), true, &mut removed);
    if removed > 0 {
        eprintln!("ferry-peers: removed {removed} stale iceoryx2 files ({PREFIX}*) of an earlier run");
    }
    Ok(RunLock(f))
}

fn remove_prefixed(dir: &Path, recurse: bool, removed: &mut usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && recurse {
            let before = *removed;
            remove_prefixed(&path, true, removed);
            if *removed > before {
                // A node directory that held only our files (fails harmlessly if anything is left).
                let _ = std::fs::remove_dir(&path);
            }
        } else if !is_dir && is_stale_candidate(&e.file_name().to_string_lossy()) && std::fs::remove_file(&path).is_ok()
        {
            *removed += 1;
        }
    }
}

/// Ours, and not iceoryx2's persistent global-management file (recreated at will, kept on purpose).
fn is_stale_candidate(name: &str) -> bool {
    name.starts_with(PREFIX) && !name.ends_with(".global_mgmt")
}

/// The ports of one side.
struct Side {
    publ: Pub,
    sub: Sub,
    notifier: Option<Notifier<Svc>>,
    listener: Option<Listener<Svc>>,
    size: usize,
}

impl Side {
    /// Loan a sample and make message `seq` in it (the pattern in every byte with `touch`).
    fn prepare(&self, seq: u64, touch: bool) -> Result<SampleMut<Svc, [u8], u64>, String> {
        let mut s = self.publ.loan_slice_uninit(self.size).map_err(err("loan"))?;
        *s.user_header_mut() = seq;
        if touch {
            pattern::fill_uninit(s.payload_mut(), seq);
        }
        // SAFETY: without --touch the payload is not written. Its bytes are
        // memory of a POSIX shared-memory segment, zero-filled by the kernel
        // when first mapped and possibly holding older payloads since: never
        // indeterminate at the machine level, and nobody reads them unless
        // they were written above.
        Ok(unsafe { s.assume_init() })
    }

    fn send(&self, s: SampleMut<Svc, [u8], u64>) -> Result<(), String> {
        s.send().map_err(err("send"))?;
        Ok(())
    }

    fn notify(&self) -> Result<(), String> {
        if let Some(n) = &self.notifier {
            n.notify().map_err(err("notify"))?;
        }
        Ok(())
    }

    /// Wait for something to receive: spin (busy-poll) or sleep on the listener.
    /// Returns the first sample; errors after [`WAIT_STALL`].
    fn wait(&self) -> Result<Sample<Svc, [u8], u64>, String> {
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(s) = self.sub.receive().map_err(err("receive"))? {
                return Ok(s);
            }
            match &self.listener {
                Some(l) => {
                    l.timed_wait(|_| {}, Duration::from_millis(100)).map_err(err("wait"))?;
                }
                None => std::hint::spin_loop(),
            }
            spins = spins.wrapping_add(1);
            if (self.listener.is_some() || spins.is_multiple_of(1 << 16)) && t0.elapsed() > WAIT_STALL {
                return Err(format!("nothing received for {} s", WAIT_STALL.as_secs()));
            }
        }
    }

    fn check(&self, s: &Sample<Svc, [u8], u64>, seq: u64) -> Result<(), String> {
        let (len, got) = (s.payload().len(), *s.user_header());
        if len != self.size || got != seq {
            return Err(format!("expected message {seq} of {} bytes, got {got} of {len} bytes", self.size));
        }
        Ok(())
    }
}

pub fn measure(plan: &Plan) -> Result<(), String> {
    let _lock = clean_stale()?;
    let node = node("ferry-peers-source")?;
    let cleaned = node.try_cleanup_dead_nodes();
    if cleaned.cleanups > 0 || cleaned.failed_cleanups > 0 {
        eprintln!(
            "ferry-peers: iceoryx2 cleaned up {} dead nodes ({} failed)",
            cleaned.cleanups, cleaned.failed_cleanups
        );
    }
    for (i, &pp) in plan.points.iter().enumerate() {
        let stem = format!("ferry-peers/{}/{i}", std::process::id());
        let point = run_point(plan, pp, &node, &stem)?;
        point.print();
    }
    Ok(())
}

fn run_point<'a>(plan: &'a Plan, pp: PointPlan, node: &Node<Svc>, stem: &str) -> Result<Point<'a>, String> {
    let window = match plan.experiment {
        Experiment::Rtt | Experiment::Fbufs => RTT_WINDOW,
        Experiment::Throughput => plan.inflight,
    };
    let pubsub = |what| -> Result<_, String> {
        node.service_builder(&service_name(stem, what)?)
            .publish_subscribe::<[u8]>()
            .user_header::<u64>()
            .max_publishers(1)
            .max_subscribers(1)
            .max_nodes(2)
            .history_size(0)
            .subscriber_max_buffer_size(window)
            .subscriber_max_borrowed_samples(2)
            .enable_safe_overflow(false)
            .create()
            .map_err(err("create pub-sub service"))
    };
    let event = |what| -> Result<_, String> {
        node.service_builder(&service_name(stem, what)?)
            .event()
            .max_notifiers(1)
            .max_listeners(1)
            .max_nodes(2)
            .disable_notifier_created_event()
            .disable_notifier_dropped_event()
            .disable_notifier_dead_event()
            .create()
            .map_err(err("create event service"))
    };
    let (ping, pong) = (pubsub("ping")?, pubsub("pong")?);
    let events = if plan.busy { None } else { Some((event("ping-ev")?, event("pong-ev")?)) };
    let side = Side {
        publ: ping
            .publisher_builder()
            .initial_max_slice_len(pp.size)
            .max_loaned_samples(2)
            .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
            .create()
            .map_err(err("publisher"))?,
        sub: pong.subscriber_builder().buffer_size(window).create().map_err(err("subscriber"))?,
        notifier: match &events {
            Some((p, _)) => Some(p.notifier_builder().create().map_err(err("notifier"))?),
            None => None,
        },
        listener: match &events {
            Some((_, q)) => Some(q.listener_builder().create().map_err(err("listener"))?),
            None => None,
        },
        size: pp.size,
    };
    let mut e = EchoArgs::new(Peer::Iceoryx2, pp.size);
    (e.touch, e.busy_poll, e.inflight, e.service, e.die_after) =
        (plan.touch, plan.busy, window, Some(stem.to_string()), plan.die_after);
    let mut proc = child::spawn(&e, Duration::from_secs(plan.timeout_s))?;
    // The echo's first sample says its ports exist (history 0: nothing sent before is kept).
    let ready = side.wait()?;
    side.check(&ready, READY)?;
    drop(ready);

    let mut seq = 0u64; // next to send
    let mut next = 0u64; // next expected back
    let summary = match plan.experiment {
        Experiment::Rtt => {
            let mut samples = Vec::with_capacity(plan.runs * RTT_PER_RUN);
            for run in 0..=plan.runs {
                for _ in 0..RTT_PER_RUN {
                    let s = side.prepare(seq, plan.touch)?;
                    plan.idle();
                    let t0 = Instant::now();
                    side.send(s)?;
                    side.notify()?;
                    let back = side.wait()?;
                    let dt = t0.elapsed();
                    side.check(&back, seq)?;
                    drop(back);
                    (seq, next) = (seq + 1, next + 1);
                    if run > 0 {
                        samples.push(dt.as_secs_f64() * 1e6);
                    }
                }
                proc.tick();
            }
            Summary::of(&samples)
        }
        Experiment::Fbufs => return Err("fbufs: copying peers only".into()),
        Experiment::Throughput => {
            let (moves, window) = (pp.moves as u64, window as u64);
            let mut rates = Vec::with_capacity(plan.runs);
            for run in 0..=plan.runs {
                let end = next + moves;
                let t0 = Instant::now();
                while next < end {
                    let mut batch = 0;
                    while seq < end && seq - next < window {
                        let s = side.prepare(seq, plan.touch)?;
                        side.send(s)?;
                        seq += 1;
                        batch += 1;
                    }
                    if batch > 0 {
                        side.notify()?;
                    }
                    // Take every echo that is there, at least one.
                    let first = side.wait()?;
                    side.check(&first, next)?;
                    drop(first);
                    next += 1;
                    while let Some(s) = side.sub.receive().map_err(err("receive"))? {
                        side.check(&s, next)?;
                        next += 1;
                    }
                }
                let secs = t0.elapsed().as_secs_f64();
                if run > 0 {
                    rates.push(moves as f64 / secs / 1e6);
                }
                proc.tick();
            }
            Summary::of(&rates)
        }
    };
    proc.disarm();
    let s = side.prepare(STOP, false)?;
    side.send(s)?;
    side.notify()?;
    let echoed = proc.finish()?;
    if echoed != seq {
        return Err(format!("the echo saw {echoed} messages, expected {seq}"));
    }
    let moves = (plan.experiment == Experiment::Throughput).then_some(pp.moves);
    Ok(Point { plan, size: pp.size, summary: summary.ok_or("no samples")?, moves, run_medians: None })
}

/// The echo: receive a ping, check it, send a pong with the same sequence number.
pub fn echo(a: &EchoArgs) -> Result<u64, String> {
    let stem = a.service.as_deref().ok_or("iceoryx2 echo: expected --service")?;
    let node = node("ferry-peers-echo")?;
    let open = |what| -> Result<_, String> {
        node.service_builder(&service_name(stem, what)?)
            .publish_subscribe::<[u8]>()
            .user_header::<u64>()
            .open()
            .map_err(err("open pub-sub service"))
    };
    let open_event = |what| -> Result<_, String> {
        node.service_builder(&service_name(stem, what)?).event().open().map_err(err("open event service"))
    };
    let (ping, pong) = (open("ping")?, open("pong")?);
    let events = if a.busy_poll { None } else { Some((open_event("ping-ev")?, open_event("pong-ev")?)) };
    let side = Side {
        publ: pong
            .publisher_builder()
            .initial_max_slice_len(a.size)
            .max_loaned_samples(2)
            .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
            .create()
            .map_err(err("publisher"))?,
        sub: ping.subscriber_builder().buffer_size(a.inflight).create().map_err(err("subscriber"))?,
        notifier: match &events {
            Some((_, q)) => Some(q.notifier_builder().create().map_err(err("notifier"))?),
            None => None,
        },
        listener: match &events {
            Some((p, _)) => Some(p.listener_builder().create().map_err(err("listener"))?),
            None => None,
        },
        size: a.size,
    };
    let s = side.prepare(READY, false)?;
    side.send(s)?;
    side.notify()?;
    let mut n = 0u64;
    loop {
        // Sleep (or spin) until a ping is there; the source may pause between points for long.
        let first = loop {
            match side.wait() {
                Ok(s) => break s,
                Err(e) if e.starts_with("nothing received") => {}
                Err(e) => return Err(e),
            }
        };
        let mut got = Some(first);
        while let Some(ping) = got {
            let seq = *ping.user_header();
            if seq == STOP {
                return Ok(n);
            }
            side.check(&ping, n)?;
            if a.touch && !pattern::check(ping.payload(), seq) {
                return Err(format!("message {seq}: payload mangled"));
            }
            drop(ping);
            let s = side.prepare(seq, false)?;
            side.send(s)?;
            n += 1;
            a.maybe_die(n);
            got = side.sub.receive().map_err(err("receive"))?;
        }
        side.notify()?;
    }
}
