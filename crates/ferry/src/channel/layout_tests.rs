//! Where the two ends of a local channel keep what they write per message.

use crate::{BindParams, Channel, ChannelSetup, Domain, Endpoint, Event};
use std::time::Duration;

type Ranges = Vec<(&'static str, usize, usize)>;

/// The 128-byte blocks (two cache lines: adjacent-line prefetch moves
/// them in pairs) that `ranges` touch.
fn blocks(ranges: &Ranges) -> Vec<(usize, &'static str)> {
    ranges.iter().flat_map(|&(name, a, n)| (a / 128..=(a + n - 1) / 128).map(move |b| (b, name))).collect()
}

/// Nothing either end writes for every message shares a 128-byte block
/// with what the other writes, or the two cores would pull those lines
/// from each other at every message.
fn assert_apart(source: &Ranges, sink: &Ranges) {
    let theirs = blocks(sink);
    let shared: Vec<_> = blocks(source)
        .into_iter()
        .flat_map(|(a, n)| theirs.iter().filter(move |&&(b, _)| b == a).map(move |&(_, m)| (n, m, a * 128)))
        .collect();
    assert!(
        shared.is_empty(),
        "source and sink write on the same lines: {shared:x?}\nsource {source:x?}\nsink {sink:x?}"
    );
}

/// Two domains and a local channel between them, made one after the other
/// on this thread as `ferry bench` makes them: the source has taken the
/// bind request, the sink is still to connect.
fn local_pair() -> (Channel, Channel, Domain, Domain) {
    let source_domain = Domain::new("source");
    let sink_domain = Domain::new("sink");
    let ep = Endpoint::local();
    let mut source = Channel::create(&source_domain, &ep, ChannelSetup::default()).unwrap();
    let sink = Channel::bind(&sink_domain, &ep, BindParams::default()).unwrap();
    assert!(matches!(source.wait(Some(WAIT)), Ok(Event::BindRequest { .. })));
    (source, sink, source_domain, sink_domain)
}

/// How long a step of the set-up may take.
const WAIT: Duration = Duration::from_secs(10);

/// As `ferry bench` sets a local channel up: domains and channels made on
/// one thread, the sink then connected and served on another.
#[test]
fn local_ends_write_on_lines_of_their_own() {
    let (source, mut sink, _source_domain, sink_domain) = local_pair();
    let sink_side = std::thread::spawn(move || {
        assert!(matches!(sink.wait(Some(WAIT)), Ok(Event::Bound)));
        (sink.private_memory(), sink, sink_domain)
    });
    let (sink_mem, _sink, _sink_domain) = sink_side.join().unwrap();
    assert_apart(&source.private_memory(), &sink_mem);
}

/// Both ends connected on one thread (the sink handed to another one
/// afterwards): everything of both ends comes from one allocator.
#[test]
fn local_ends_connected_on_one_thread_write_on_lines_of_their_own() {
    let (source, mut sink, _source_domain, _sink_domain) = local_pair();
    assert!(matches!(sink.wait(Some(WAIT)), Ok(Event::Bound)));
    assert_apart(&source.private_memory(), &sink.private_memory());
}
