//! Progress reporting and cancellation for long operations.
//!
//! Engines call [`Progress::begin`] once per stage, [`Progress::advance`] as work completes, and
//! check [`Progress::cancelled`] between batches (a cancelled load returns an error and frees its
//! memory). The CLI implements this with a terminal progress bar; Python with a callback that
//! also honours Ctrl-C.

/// Receiver of progress events. Implementations must be cheap and thread-safe.
pub trait Progress: Send + Sync {
    /// A stage named `what` starts with `total` units of work (frames, bytes).
    fn begin(&self, what: &str, total: u64);
    /// `n` more units are done.
    fn advance(&self, n: u64);
    /// The current stage is over.
    fn end(&self);
    /// True when the caller wants the operation stopped.
    fn cancelled(&self) -> bool {
        false
    }
}

/// A receiver shows as its role only (implementations need not be `Debug`), so that the
/// parameter structs holding one can derive `Debug`.
impl std::fmt::Debug for dyn Progress + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn begin(&self, _what: &str, _total: u64) {}
    fn advance(&self, _n: u64) {}
    fn end(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receiver_debugs_as_its_role() {
        let p: &dyn Progress = &NoProgress;
        assert_eq!(format!("{:?}", Some(p)), "Some(Progress)");
        let shared: std::sync::Arc<dyn Progress> = std::sync::Arc::new(NoProgress);
        assert_eq!(format!("{shared:?}"), "Progress");
    }
}
