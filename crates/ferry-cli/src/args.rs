//! The checks of command-line values, shared by every subcommand: each
//! parser takes the text of one flag and says, in a few words, what is
//! allowed; [`usage_line`] turns any parse error into the one line that
//! `ferry` prints (the flag, the value, what is allowed), exit code 2.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// The largest buffer or message size any experiment takes (1 GiB).
pub const MAX_SIZE: u64 = 1 << 30;

/// `lo..=hi` written for people: `1 to 16384`.
fn span(lo: u64, hi: u64) -> String {
    format!("{lo} to {hi}")
}

/// A whole number in `lo..=hi` (of any integer type that holds it).
pub fn whole<T: TryFrom<u64>>(lo: u64, hi: u64) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync {
    move |s: &str| {
        let n: u64 = s.trim().parse().map_err(|_| format!("not a whole number; give one from {}", span(lo, hi)))?;
        if n < lo || n > hi {
            return Err(format!("out of range; give a number from {}", span(lo, hi)));
        }
        T::try_from(n).map_err(|_| format!("too large for this machine; give a number from {}", span(lo, hi)))
    }
}

/// A size in bytes: a power of two from `lo` to `hi`.
pub fn power_of_two(lo: u64, hi: u64) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    move |s: &str| {
        let what = format!("give a power of two from {lo} to {hi} bytes (e.g. 4096, 65536, 1048576)");
        let n: u64 = s.trim().parse().map_err(|_| format!("not a whole number of bytes; {what}"))?;
        if !n.is_power_of_two() || n < lo {
            return Err(format!("not a power of two of at least {lo} bytes; {what}"));
        }
        if n > hi {
            return Err(format!("too large; {what}"));
        }
        usize::try_from(n).map_err(|_| format!("too large for this machine; {what}"))
    }
}

/// A CPU this machine has (`--cpu`).
pub fn cpu(s: &str) -> Result<usize, String> {
    let n = crate::pin::cpus();
    let what = format!("give a CPU number from 0 to {} (this machine has {n})", n - 1);
    let cpu: usize = s.trim().parse().map_err(|_| format!("not a CPU number; {what}"))?;
    if cpu >= n {
        return Err(format!("no such CPU; {what}"));
    }
    Ok(cpu)
}

/// `a, b or c`.
fn one_of(names: &[String]) -> String {
    match names {
        [] => "a command".to_string(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// The flag an argument of a parse error stands for: `--runs` for
/// `--runs <RUNS>`, `experiment` for `<EXPERIMENT>`.
fn flag_of(arg: &str) -> String {
    match arg.split_whitespace().next() {
        Some(f) if f.starts_with('-') => f.to_string(),
        _ => arg.trim_matches(['<', '>', '.']).to_lowercase(),
    }
}

fn strings(e: &clap::Error, kind: ContextKind) -> Vec<String> {
    match e.get(kind) {
        Some(ContextValue::String(s)) => vec![s.clone()],
        Some(ContextValue::Strings(v)) => v.clone(),
        _ => Vec::new(),
    }
}

fn one(e: &clap::Error, kind: ContextKind) -> Option<String> {
    strings(e, kind).into_iter().next()
}

/// The one line `ferry` prints for a command line it cannot run: the flag,
/// the value, what is allowed (and where to read more). `command` is the
/// subcommand's name, for the pointer to its `--help`; `commands` are the
/// commands there are where an unknown one was given.
pub fn usage_line(e: &clap::Error, command: Option<&str>, commands: &[String]) -> String {
    let help = match command {
        Some(c) => format!("`ferry {c} --help`"),
        None => "`ferry --help`".to_string(),
    };
    let arg = one(e, ContextKind::InvalidArg).map(|a| flag_of(&a));
    let value = one(e, ContextKind::InvalidValue);
    match (e.kind(), arg, value) {
        (ErrorKind::ValueValidation, Some(flag), Some(value)) => {
            let why = std::error::Error::source(e).map_or_else(|| "not allowed".to_string(), |s| s.to_string());
            format!("{flag} {value}: {why}")
        }
        (ErrorKind::InvalidValue, Some(flag), Some(value)) => {
            let valid = strings(e, ContextKind::ValidValue);
            if value.is_empty() && valid.is_empty() {
                format!("{flag} needs a value; see {help}")
            } else if value.is_empty() {
                format!("{flag} needs a value; give one of {}", valid.join(", "))
            } else if valid.is_empty() {
                format!("{flag} {value}: not allowed; see {help}")
            } else {
                format!("{flag} {value}: not one of the choices; give one of {}", valid.join(", "))
            }
        }
        (ErrorKind::InvalidSubcommand, _, _) => {
            let name = one(e, ContextKind::InvalidSubcommand).unwrap_or_default();
            format!("{name}: no such command; give {} (see {help})", one_of(commands))
        }
        (ErrorKind::UnknownArgument, _, _) => {
            let name = one(e, ContextKind::InvalidArg).unwrap_or_default();
            match one(e, ContextKind::SuggestedArg) {
                Some(s) => format!("{name}: no such flag; did you mean {s}? (see {help})"),
                None => format!("{name}: no such flag; see {help} for the flags there are"),
            }
        }
        (ErrorKind::ArgumentConflict, Some(flag), _) => {
            let other = one(e, ContextKind::PriorArg).map(|a| flag_of(&a)).unwrap_or_else(|| "another flag".into());
            if other == flag {
                format!("{flag} is given more than once; give it once")
            } else {
                format!("{flag} cannot be used with {other}; give only one of them")
            }
        }
        (ErrorKind::MissingRequiredArgument, _, _) => {
            let missing: Vec<String> = strings(e, ContextKind::InvalidArg).iter().map(|a| flag_of(a)).collect();
            format!("{} is required; see {help}", missing.join(" and "))
        }
        _ => {
            // Anything else: clap's own first line, without its prefix.
            let text = e.render().to_string();
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("bad command line").trim();
            let first = first.strip_prefix("error: ").unwrap_or(first);
            format!("{first}; see {help}")
        }
    }
}
