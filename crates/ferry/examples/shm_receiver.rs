//! The smallest receiver: connect to a sender's shared-memory endpoint,
//! accept its pools, pass every buffer it moves back, until it closes the
//! channel. `main` returns `Result<(), ferry::Error>`: when something
//! fails, the program prints the error's sentence (what it was doing, on
//! which endpoint, what went wrong and what to do) and exits with status 1.
//!
//! ```text
//! cargo run -p ferry --example shm_receiver -- /tmp/ferry.sock [TIMEOUT_MS]
//! ```
//!
//! With nobody listening on the path, after TIMEOUT_MS (10 s if not given):
//!
//! ```text
//! Error: connect to the shm endpoint /tmp/ferry.sock: no channel is listening on that endpoint; create a channel there first, or check the endpoint's name or address [EndpointNotListening]
//! ```

use std::time::Duration;

use ferry::{BindParams, Channel, Domain, Endpoint, Event, PoolPolicy, WaitError};

/// Connect, pass every buffer back until the sender closes the channel.
pub fn main() -> Result<(), ferry::Error> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "/tmp/ferry.sock".into());
    let timeout = args.next().and_then(|ms| ms.parse().ok()).map_or(Duration::from_secs(10), Duration::from_millis);
    let domain = Domain::new("receiver");
    let mut ch = Channel::connect(&domain, &Endpoint::shm(path), BindParams::default(), timeout)?;
    ch.set_pool_policy(PoolPolicy::AcceptAll);
    let mut passed = 0u64;
    loop {
        match ch.wait(None) {
            Ok(Event::MoveReceived { buffer, .. }) => {
                ch.pass(buffer, &[])?;
                passed += 1;
            }
            Ok(Event::Error(e)) => return Err(e),
            Ok(_) => {}
            // Closed: the sender is done.
            Err(WaitError::Closed) => break,
            Err(e @ WaitError::TimedOut) => return Err(e.into()),
        }
    }
    println!("passed {passed} buffers back");
    Ok(())
}
