//! `ferry demo`: Ferry's main job shown end to end with real data.
//!
//! Two flows of [ETH-BT] §5.2.4 between two domains on two threads:
//! * transmit master — the source allocates the pool, fills buffers, moves
//!   them; the sink verifies every byte and passes them back;
//! * receive master — the sink allocates the pool and passes empty buffers
//!   to the source, which fills and moves them; the sink verifies and
//!   passes them back for refilling.
//!
//! Then read-only copies: the owner copies, the holder verifies and
//! releases, and the owner gets write access back. Then the transmit-master
//! flow between this process and a `ferry echo --verify` process over shared
//! memory, over TCP, and (with the feature `fabric`) over libfabric's tcp
//! provider.

use std::time::Instant;

use clap::{Args, ValueEnum};
use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, Direction, Domain, Event, PoolConstraints, Role,
    TrustLevel,
};

use crate::args::{power_of_two, whole};
use crate::echo::{self, EchoOptions, Transport};
use crate::setup::{assign, connect_local, describe, describe_wait, next_event};
use crate::stats::Summary;
use crate::{pattern, pin, CliError};

/// Most bytes a flow of the demo moves (64 GiB: a few minutes per flow).
const MAX_BYTES: u64 = 64 << 30;
/// Largest demo buffer (64 MiB: the 64-buffer pool stays within 4 GiB).
const MAX_BUFFER: u64 = 64 << 20;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Bytes to move per flow (at least one buffer, at most 64 GiB).
    #[arg(allow_negative_numbers = true, long, default_value_t = 256 << 20, value_parser = whole::<u64>(4096, MAX_BYTES))]
    bytes: u64,
    /// Buffer size (a power of two from 4096 to 64 MiB).
    #[arg(allow_negative_numbers = true, long, default_value_t = 64 << 10, value_parser = power_of_two(4096, MAX_BUFFER))]
    buffer_size: usize,
    /// Trust level of the channels.
    #[arg(long, value_enum, default_value_t = DemoTrust::Full)]
    trust: DemoTrust,
}

/// The trust levels the demo runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DemoTrust {
    /// No protection changes.
    Full,
    /// The sender's own view is protected while a buffer is away.
    Half,
}

struct FlowReport {
    buffers: u64,
    bytes: u64,
    secs: f64,
    rtt_us: Option<Summary>,
    in_flight: usize,
}

pub fn run(args: &DemoArgs) -> Result<(), CliError> {
    let size = args.buffer_size;
    if args.bytes < size as u64 {
        return Err(CliError::Usage(format!(
            "--bytes {}: less than one buffer of --buffer-size {size}; give at least {size}",
            args.bytes
        )));
    }
    let (trust, trust_name) = match args.trust {
        DemoTrust::Full => (TrustLevel::Full, "full"),
        DemoTrust::Half => (TrustLevel::Half, "half"),
    };
    let count = args.bytes / size as u64;
    println!(
        "Ferry demo: {count} buffer{} of {} KiB per flow, trust {trust_name}",
        if count == 1 { "" } else { "s" },
        size >> 10
    );
    println!("local backend: two domains, one thread each, pinned to cores 0 and 1\n");

    let r = transmit_master(count, size, trust)?;
    report("transmit master", &r);
    let r = receive_master(count, size, trust)?;
    report("receive master ", &r);
    copies(size, trust)?;
    println!("\nshm backend: this process and a `ferry echo --verify` process it starts, pinned to cores 0 and 1");
    let (r, _) = between_processes(Transport::Shm, count, size, trust)?;
    report("two processes  ", &r);
    println!("\nTCP backend (loopback): the same flow, the pool mirrored in the echo process, payloads both ways");
    let (r, stats) = between_processes(Transport::Tcp, count, size, trust)?;
    report("over TCP       ", &r);
    zero_copy("sendmsg calls", "over TCP", stats)?;
    fabric(count, size, trust)?;
    println!("\nall checks passed: every byte arrived intact, ownership came back, nothing was copied by Ferry");
    Ok(())
}

/// Print a link's counters, and fail if a payload byte was copied in user
/// space (`calls`: what its send calls are; `over`: the backend, in words).
fn zero_copy(calls: &str, over: &str, stats: Option<ferry::LinkStats>) -> Result<(), CliError> {
    let Some(s) = stats else { return Ok(()) };
    println!(
        "  {} sent straight from buffers, {} received straight into buffers, {} bytes staged in user space, \
         {} frames in {} {calls}",
        amount(s.payload_sent),
        amount(s.payload_received),
        s.payload_staged,
        s.frames_sent,
        s.send_calls
    );
    if s.payload_staged != 0 {
        return Err(CliError::Failed(format!(
            "{} payload bytes were copied in user space {over}, where none should be; the zero-copy path is broken",
            s.payload_staged
        )));
    }
    Ok(())
}

/// The flow over the fabric backend (libfabric's tcp provider on
/// loopback), if this ferry has it and the machine has libfabric.
#[cfg(feature = "fabric")]
fn fabric(count: u64, size: usize, trust: TrustLevel) -> Result<(), CliError> {
    println!("\nfabric backend (libfabric, tcp provider, loopback): the same flow, each payload one RMA write into the echo process's buffer");
    // libfabric is loaded when the first fabric endpoint opens: a machine
    // without it skips this flow and says why; any other failure fails.
    let options = ferry::FabricOptions::default().with_provider("tcp");
    let probe = ferry::Endpoint::fabric_with(([127, 0, 0, 1], 0).into(), options);
    match Channel::create(&Domain::new("probe"), &probe, ChannelSetup::default()) {
        Err(e) if matches!(e.kind(), ferry::ErrorKind::FabricUnavailable(_)) => {
            println!("skipped: {e}");
            return Ok(());
        }
        probed => drop(probed),
    }
    let (r, stats) = between_processes(Transport::Fabric, count, size, trust)?;
    report("over the fabric", &r);
    zero_copy("posted sends and RMA writes", "over the fabric", stats)
}

/// Without the fabric backend built in: say how to get it.
#[cfg(not(feature = "fabric"))]
fn fabric(_: u64, _: usize, _: TrustLevel) -> Result<(), CliError> {
    println!("\nfabric backend: not built into this ferry (scripts/setup fabric, then scripts/demo again; or cargo build -p ferry-cli --features fabric)");
    Ok(())
}

/// Bytes for people: whole MiB from 1 MiB up, else KiB.
fn amount(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// The source got something other than a buffer back.
fn source_got(ev: &Option<Event>) -> CliError {
    CliError::Failed(format!("the source expected a buffer back but got {}; {AGAIN}", describe(ev)))
}

/// What to do when a flow fails.
const AGAIN: &str = "run the demo again";

/// Tear the source's channel down and wait until it is closed.
fn close(source: &mut Channel) -> Result<(), CliError> {
    source.teardown()?;
    match source.wait(Some(std::time::Duration::from_secs(10))) {
        Ok(Event::Closed { .. }) => Ok(()),
        ev => Err(CliError::Failed(format!(
            "the teardown did not complete: the channel gave {}; {AGAIN}",
            describe_wait(&ev)
        ))),
    }
}

fn report(name: &str, r: &FlowReport) {
    let gbs = r.bytes as f64 / r.secs / 1e9;
    print!(
        "{name}: {} buffer{}, {} moved and verified byte by byte in {:.3} s = {:.2} GB/s ({:.3} M buffers/s)",
        r.buffers,
        if r.buffers == 1 { "" } else { "s" },
        amount(r.bytes),
        r.secs,
        gbs,
        r.buffers as f64 / r.secs / 1e6
    );
    if let Some(s) = r.rtt_us {
        print!("; {} in flight, each back after {:.0} µs (median)", r.in_flight, s.median);
    }
    println!();
}

/// (creator domain, binder domain, creator end, binder end).
fn channel_pair(
    trust: TrustLevel,
    creator_dir: Direction,
    creator_role: Role,
) -> Result<(Domain, Domain, Channel, Channel), CliError> {
    let (a, b) = (Domain::new("creator"), Domain::new("binder"));
    let setup = ChannelSetup {
        direction: creator_dir,
        role: creator_role,
        trust,
        meta_size: 16,
        queue_depth: 256,
        ..ChannelSetup::default()
    };
    let (c, d) = connect_local(&a, &b, setup, BindParams::default())?;
    Ok((a, b, c, d))
}

/// Sink side shared by both flows: verify each moved buffer, pass it back.
fn verifying_sink(mut sink: Channel, expect: u64) -> Result<u64, String> {
    let mut verified = 0u64;
    while verified < expect {
        match next_event(&mut sink, false) {
            Some(Event::MoveReceived { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().map_err(|_| "short meta")?);
                if !pattern::check(&buffer, seq) {
                    return Err(format!("buffer {} (sequence {seq}) arrived corrupted", buffer.id().index));
                }
                verified += 1;
                sink.pass(buffer, &[]).map_err(|e| e.to_string())?;
            }
            ev => return Err(format!("the sink expected a moved buffer but got {}; {AGAIN}", describe(&ev))),
        }
    }
    // Stay until the source closes.
    match next_event(&mut sink, false) {
        Some(Event::Closed { .. }) => Ok(verified),
        ev => Err(format!("the sink expected the close but got {}; {AGAIN}", describe(&ev))),
    }
}

fn transmit_master(count: u64, size: usize, trust: TrustLevel) -> Result<FlowReport, CliError> {
    let (a, _b, mut source, mut sink) = channel_pair(trust, Direction::Tx, Role::Master)?;
    let alloc = Allocator::new(&a, 64, size, PoolConstraints::default())?;
    assign(&mut source, &mut sink, alloc.pool())?;
    let sink_thread = std::thread::spawn(move || {
        pin::to_cpu(1);
        verifying_sink(sink, count)
    });
    pin::to_cpu(0);
    let t0 = Instant::now();
    let (mut sent, mut back) = (0u64, 0u64);
    let mut rtts = Vec::new();
    let mut sent_at = std::collections::HashMap::new();
    while back < count {
        while sent < count {
            let Some(mut buf) = alloc.alloc() else { break };
            pattern::fill(buf.as_mut_slice()?, sent);
            sent_at.insert(buf.id().index, Instant::now());
            source.move_buffer(buf, &sent.to_le_bytes())?;
            sent += 1;
        }
        match next_event(&mut source, false) {
            Some(Event::BufferPassed { buffer, .. }) => {
                if let Some(t) = sent_at.remove(&buffer.id().index) {
                    rtts.push(t.elapsed().as_secs_f64() * 1e6);
                }
                back += 1;
            }
            ev => return Err(source_got(&ev)),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    close(&mut source)?;
    let verified =
        sink_thread.join().map_err(|_| CliError::Failed("sink panicked".into()))?.map_err(CliError::Failed)?;
    if verified != count || alloc.available() != 64 {
        return Err(CliError::Failed(format!("verified {verified}/{count}, {} of 64 buffers home", alloc.available())));
    }
    Ok(FlowReport {
        buffers: count,
        bytes: count * size as u64,
        secs,
        rtt_us: Summary::of(&rtts),
        in_flight: count.min(64) as usize,
    })
}

fn receive_master(count: u64, size: usize, trust: TrustLevel) -> Result<FlowReport, CliError> {
    // The consumer creates the channel as the receiving master.
    let (consumer, _producer, mut sink, mut source) = channel_pair(trust, Direction::Rx, Role::Master)?;
    if source.direction() != Direction::Tx || source.role() != Role::Slave {
        return Err(CliError::Failed("negotiation gave the binder the wrong direction or role".into()));
    }
    let alloc = Allocator::new(&consumer, 64, size, PoolConstraints::default())?;
    assign(&mut sink, &mut source, alloc.pool())?;
    // Hand every (empty) buffer to the source first.
    while let Some(buf) = alloc.alloc() {
        sink.pass(buf, &[])?;
    }
    let sink_thread = std::thread::spawn(move || {
        pin::to_cpu(1);
        verifying_sink(sink, count).map(|v| (v, alloc))
    });
    pin::to_cpu(0);
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < count {
        match next_event(&mut source, false) {
            Some(Event::BufferPassed { mut buffer, .. }) => {
                pattern::fill(buffer.as_mut_slice()?, sent);
                source.move_buffer(buffer, &sent.to_le_bytes())?;
                sent += 1;
            }
            ev => return Err(source_got(&ev)),
        }
    }
    source.teardown()?;
    // Drain the buffers passed back after the last move, then the close.
    loop {
        match source.wait(Some(std::time::Duration::from_secs(10))) {
            Ok(Event::BufferPassed { .. }) => continue,
            Ok(Event::Closed { .. }) => break,
            ev => {
                return Err(CliError::Failed(format!("at the teardown the source got {}; {AGAIN}", describe_wait(&ev))))
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let (verified, _alloc) =
        sink_thread.join().map_err(|_| CliError::Failed("sink panicked".into()))?.map_err(CliError::Failed)?;
    if verified != count {
        return Err(CliError::Failed(format!("verified {verified}/{count}")));
    }
    Ok(FlowReport { buffers: count, bytes: count * size as u64, secs, rtt_us: None, in_flight: count.min(64) as usize })
}

fn copies(size: usize, trust: TrustLevel) -> Result<(), CliError> {
    let (a, b, mut owner, mut holder) = channel_pair(trust, Direction::Tx, Role::Master)?;
    let alloc = Allocator::new(&a, 4, size, PoolConstraints::default())?;
    assign(&mut owner, &mut holder, alloc.pool())?;
    let mut buf = alloc.alloc().ok_or_else(|| CliError::Failed("empty pool".into()))?;
    pattern::fill(buf.as_mut_slice()?, 99);
    owner.copy(&buf, b"copy")?;
    let ok_ro = a.buffer_state(buf.id()) == BufferState::ReadOnlyOwned && buf.as_mut_slice().is_err();
    let copy = match holder.wait(Some(std::time::Duration::from_secs(10))) {
        Ok(Event::CopyReceived { copy, .. }) => copy,
        ev => {
            return Err(CliError::Failed(format!(
                "the copy holder expected a copy but got {}; {AGAIN}",
                describe_wait(&ev)
            )))
        }
    };
    let intact = pattern::check(&copy, 99) && b.buffer_state(copy.id()) == BufferState::ReadOnly;
    holder.release(copy)?;
    let writable =
        matches!(owner.wait(Some(std::time::Duration::from_secs(10))), Ok(Event::CopyReleased { writable: true, .. }));
    let rw = buf.as_mut_slice().is_ok();
    if !(ok_ro && intact && writable && rw) {
        return Err(CliError::Failed(format!(
            "copy semantics: read-only while out {ok_ro}, copy intact {intact}, released {writable}, writable again {rw}"
        )));
    }
    println!("read-only copy : owner read-only while the copy was out, holder saw every byte, owner read-write after the release");
    Ok(())
}

/// Transmit master between two processes: the pool goes to the echo
/// process (its memfd over shared memory; mirrored over TCP), which checks
/// every byte of every buffer and passes it back; we check what comes back.
fn between_processes(
    transport: Transport,
    count: u64,
    size: usize,
    trust: TrustLevel,
) -> Result<(FlowReport, Option<ferry::LinkStats>), CliError> {
    let a = Domain::new("producer");
    let setup = ChannelSetup {
        direction: Direction::Tx,
        role: Role::Master,
        trust,
        meta_size: 16,
        queue_depth: 256,
        ..ChannelSetup::default()
    };
    let opts = EchoOptions { verify: true, ..EchoOptions::default() };
    let (mut source, child) = echo::spawn_process_on(transport, &a, setup, opts)?;
    let alloc = Allocator::new(&a, 64, size, PoolConstraints::default())?;
    source.assign_pool(alloc.pool())?;
    match source.wait(Some(std::time::Duration::from_secs(10))) {
        Ok(Event::PoolAssigned(_)) => {}
        ev => {
            return Err(CliError::Failed(format!(
                "the echo process did not take the pool: the channel gave {}; {AGAIN}",
                describe_wait(&ev)
            )))
        }
    }
    pin::to_cpu(0);
    let t0 = Instant::now();
    let (mut sent, mut back) = (0u64, 0u64);
    while back < count {
        while sent < count {
            let Some(mut buf) = alloc.alloc() else { break };
            pattern::fill(buf.as_mut_slice()?, sent);
            source.move_buffer(buf, &sent.to_le_bytes())?;
            sent += 1;
        }
        match next_event(&mut source, false) {
            Some(Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().map_err(|_| CliError::Failed("short meta".into()))?);
                if !pattern::check(&buffer, seq) {
                    return Err(CliError::Failed(format!("buffer {seq} came back corrupted")));
                }
                back += 1;
            }
            ev => return Err(source_got(&ev)),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let stats = source.link_stats();
    close(&mut source)?;
    let out = child.wait_with_output().map_err(|e| CliError::Failed(format!("echo process: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.trim() != format!("echoed {count}") {
        return Err(CliError::Failed(format!("echo process: {} {}", out.status, text.trim())));
    }
    if alloc.available() != 64 {
        return Err(CliError::Failed(format!("{} of 64 buffers came home", alloc.available())));
    }
    Ok((
        FlowReport {
            buffers: count,
            bytes: count * size as u64,
            secs,
            rtt_us: None,
            in_flight: count.min(64) as usize,
        },
        stats,
    ))
}
