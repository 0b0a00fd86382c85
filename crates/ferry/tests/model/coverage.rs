//! Coverage floors of the model-based suites, and the rounds that meet them.
//!
//! A suite's comparison must not pass vacuously, so each suite asks that its
//! counters (operations accepted and refused, aggregates forwarded, fault
//! probes, ...) reach floors proportional to the number of sequences asked
//! for. With few sequences a rare kind of step can fall short of its floor
//! by chance alone, and a check that fails by chance gets ignored. So a
//! suite that is short after its sequences runs more rounds of the same
//! number (seeds derived from its own, so the verdict for a seed is always
//! the same) and fails only if a floor is still not reached after
//! [`TOP_UP_ROUNDS`] more: a kind of step then happens at a quarter of the
//! floor's rate or less, which no chance explains and a regression does.

/// Most extra rounds run while a floor is short.
pub const TOP_UP_ROUNDS: u32 = 3;

/// The floors a suite's counters must reach; what is short, named.
#[derive(Debug, Default)]
pub struct Floors {
    short: Vec<String>,
}

impl Floors {
    /// Require `have >= floor` of the counter named `what`.
    pub fn at_least(&mut self, what: &str, have: usize, floor: usize) -> &mut Self {
        if have < floor {
            self.short.push(format!("{what}: {have} < {floor}"));
        }
        self
    }

    /// What is short, if anything.
    pub fn short(&self) -> Option<String> {
        (!self.short.is_empty()).then(|| self.short.join(", "))
    }
}

/// Run `round(0)`, then `round(1)`, ... while `floors()` names a floor not
/// reached, at most [`TOP_UP_ROUNDS`] extra rounds; panic naming the
/// counters still short after that. Returns the number of rounds run.
pub fn run_covered(test: &str, mut round: impl FnMut(u32), floors: impl Fn() -> Floors) -> u32 {
    for k in 0..=TOP_UP_ROUNDS {
        round(k);
        match floors().short() {
            None => return k + 1,
            Some(short) if k < TOP_UP_ROUNDS => eprintln!("{test}: short after {} round(s) ({short}): one more", k + 1),
            Some(short) => panic!("{test}: coverage still short after {} rounds: {short}", k + 1),
        }
    }
    unreachable!("the last round returns or panics")
}

/// The seed of a suite's random sequences: `FERRY_MODEL_SEED`, else a
/// fresh one. Printed, so that a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("FERRY_MODEL_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(std::process::id().into());
        h.finish()
    });
    eprintln!("{test}: seed {seed} (replay with FERRY_MODEL_SEED={seed})");
    seed
}

/// The seed of a suite's round: the first runs the suite's own seed (so
/// `FERRY_MODEL_SEED` replays it), a top-up round one derived from it
/// (which, given as `FERRY_MODEL_SEED`, replays that round).
pub fn round_seed(seed: u64, round: u32) -> u64 {
    seed.wrapping_add(u64::from(round).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_floor_runs_more_rounds_and_then_fails() {
        let mut rounds = 0;
        let ran = run_covered("t", |_| rounds += 1, Floors::default);
        assert_eq!((ran, rounds), (1, 1));
        let count = std::cell::Cell::new(0usize);
        let ran = run_covered(
            "t",
            |_| count.set(count.get() + 1),
            || {
                let mut f = Floors::default();
                f.at_least("events", count.get(), 3);
                f
            },
        );
        assert_eq!(ran, 3);
        let never = std::panic::catch_unwind(|| {
            run_covered(
                "t",
                |_| {},
                || {
                    let mut f = Floors::default();
                    f.at_least("events", 0, 1);
                    f
                },
            )
        });
        assert!(never.is_err());
    }
}
