//! A progress bar on stderr for long runs: shown only when stderr is a
//! terminal, and not when JSON goes into a pipe (`--json | jq`), so
//! scripted runs stay quiet.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Counts units of work (runs); a no-op when hidden.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A bar of `total` units, or a hidden one (see the module doc).
    pub fn new(total: u64, json: bool) -> Progress {
        let stderr_tty = std::io::stderr().is_terminal();
        let quiet_pipe = json && !std::io::stdout().is_terminal();
        if !stderr_tty || quiet_pipe || total == 0 {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs  {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        Progress(Some(bar))
    }

    /// A hidden bar.
    pub fn hidden() -> Progress {
        Progress(None)
    }

    /// `n` more units done.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.inc(n);
        }
    }

    /// What is being measured now.
    pub fn say(&self, msg: String) {
        if let Some(b) = &self.0 {
            b.set_message(msg);
        }
    }

    /// Print a line above the bar (or plainly to stdout without one), so
    /// results and the bar do not overwrite each other.
    pub fn println(&self, line: &str) {
        match &self.0 {
            Some(b) if std::io::stdout().is_terminal() => b.suspend(|| println!("{line}")),
            _ => println!("{line}"),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
