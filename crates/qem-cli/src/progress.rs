//! Terminal progress bars (indicatif) for long operations, only when stderr is a terminal.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

/// A [`qem::Progress`] drawing one indicatif bar per stage on stderr.
#[derive(Debug, Default)]
pub struct TermProgress {
    bar: Mutex<Option<ProgressBar>>,
}

impl TermProgress {
    /// A progress receiver when stderr is a terminal, else `None` (no bars when piped).
    pub fn for_stderr() -> Option<Arc<dyn qem::Progress>> {
        if std::io::stderr().is_terminal() {
            Some(Arc::new(TermProgress::default()))
        } else {
            None
        }
    }

    fn with_bar(&self, f: impl FnOnce(&mut Option<ProgressBar>)) {
        // A poisoned lock only means another thread panicked while drawing: keep going.
        let mut guard = match self.bar.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut guard);
    }
}

impl qem::Progress for TermProgress {
    fn begin(&self, what: &str, total: u64) {
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {pos}/{len} ({elapsed_precise}, eta {eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        self.with_bar(|b| {
            if let Some(old) = b.replace(bar) {
                old.finish_and_clear();
            }
        });
    }

    fn advance(&self, n: u64) {
        self.with_bar(|b| {
            if let Some(bar) = b {
                bar.inc(n);
            }
        });
    }

    fn end(&self) {
        self.with_bar(|b| {
            if let Some(bar) = b.take() {
                bar.finish_and_clear();
            }
        });
    }
}
