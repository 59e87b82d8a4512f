//! The progress observer of the call running on this thread, for operations whose signatures
//! carry none (detector products, CoM/DPC, the mean-DP pass of SSB preparation).
//!
//! [`with_progress`] installs an observer for the length of one call; the engine pass
//! ([`crate::detector::reduce`]) then runs in blocks of frames, reporting each block and
//! stopping between blocks when the observer asks for it. Without an observer the pass is one
//! engine call, as before. A thread-local keeps the dozen public detector signatures unchanged;
//! the observer never crosses threads (the engine's own worker threads do not report).

use qem_core::Progress;
use std::cell::RefCell;
use std::sync::Arc;

thread_local! {
    static CURRENT: RefCell<Option<(Arc<dyn Progress>, String)>> = const { RefCell::new(None) };
}

/// Restores the previous observer when the call ends (also on unwinding).
struct Restore(Option<(Arc<dyn Progress>, String)>);

impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = prev);
    }
}

/// Run `f` with `progress` as this thread's observer; engine passes inside report stages named
/// `label` (e.g. `"detector.products"`) in frames.
pub fn with_progress<R>(progress: Arc<dyn Progress>, label: &str, f: impl FnOnce() -> R) -> R {
    let prev = CURRENT.with(|c| c.borrow_mut().replace((progress, label.to_string())));
    let _restore = Restore(prev);
    f()
}

/// The observer installed by [`with_progress`] on this thread, with its stage label.
pub(crate) fn current() -> Option<(Arc<dyn Progress>, String)> {
    CURRENT.with(|c| c.borrow().clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Log(Mutex<Vec<String>>);
    impl Progress for Log {
        fn begin(&self, what: &str, total: u64) {
            self.0.lock().unwrap().push(format!("{what}:{total}"));
        }
        fn advance(&self, _n: u64) {}
        fn end(&self) {}
    }

    #[test]
    fn installed_for_the_call_only_and_restored() {
        assert!(current().is_none());
        let log = Arc::new(Log::default());
        with_progress(log.clone(), "outer", || {
            let (p, label) = current().expect("installed");
            assert_eq!(label, "outer");
            p.begin("x", 3);
            with_progress(Arc::new(Log::default()), "inner", || {
                assert_eq!(current().unwrap().1, "inner");
            });
            assert_eq!(current().unwrap().1, "outer");
        });
        assert!(current().is_none());
        assert_eq!(*log.0.lock().unwrap(), vec!["x:3".to_string()]);
    }
}
