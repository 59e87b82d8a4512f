//! Running a long library call off the Python thread, honouring Ctrl-C and progress callbacks.
//!
//! The call runs on a worker thread with the GIL released. The calling (Python) thread wakes every
//! few tens of milliseconds, re-attaches, runs Python's signal handlers and forwards progress to
//! the user's callback: the engine's threads never touch Python. A `KeyboardInterrupt` (or an
//! exception from the callback) sets the cancel flag the engine polls through
//! [`qem::Progress::cancelled`], waits a short grace period for the engine to stop, and then
//! raises without waiting any longer: not every engine loop polls the flag, and Ctrl-C must
//! answer at once. The worker then finishes in the background. That is safe because the work
//! owns everything it touches (`'static`: datasets are shared through an `Arc`, see
//! [`crate::dataset`]) and never touches a Python object; its result is dropped on the worker
//! thread.
//!
//! A signal that arrives while the result is on its way back is raised instead of converting
//! the result: converting after Python has an exception pending is what made numpy's lazy API
//! import fail (a Rust panic, `PanicException`) before.

use crate::errors::to_pyerr;
use pyo3::prelude::*;
use qem::{Error, Progress};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

const TICK: Duration = Duration::from_millis(40);

/// How long an interrupted call waits for the engine to notice the cancel flag before it raises
/// anyway (the tick plus this stays well under the 0.2 s a Ctrl-C may take).
const GRACE: Duration = Duration::from_millis(60);

#[derive(Debug, Default)]
struct Stages {
    /// Stages that ended since the last report: (name, done, total).
    finished: Vec<(String, u64, u64)>,
    /// The running stage: (name, total).
    current: Option<(String, u64)>,
    /// What the callback saw last, to skip unchanged reports.
    last_reported: Option<(String, u64)>,
}

/// A [`Progress`] that only records; the Python thread reads it.
#[derive(Debug, Default)]
pub struct Watch {
    cancel: AtomicBool,
    done: AtomicU64,
    stages: Mutex<Stages>,
}

impl Watch {
    fn stages(&self) -> std::sync::MutexGuard<'_, Stages> {
        self.stages.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Events to report now: ended stages, then the running one if it moved.
    fn pending(&self) -> Vec<(String, u64, u64)> {
        let mut st = self.stages();
        let mut out = std::mem::take(&mut st.finished);
        if let Some((name, total)) = st.current.clone() {
            let done = self.done.load(Ordering::Relaxed);
            if st.last_reported.as_ref() != Some(&(name.clone(), done)) {
                st.last_reported = Some((name.clone(), done));
                out.push((name, done, total));
            }
        }
        out
    }
}

impl Watch {
    /// Set the running stage's count and total (a total that grows as the work learns more,
    /// e.g. the Nelder–Mead part of an SSB fit); starts the stage `what` if another runs.
    pub fn set(&self, what: &str, done: u64, total: u64) {
        let running = {
            let mut st = self.stages();
            match &mut st.current {
                Some((name, t)) if name == what => {
                    *t = total;
                    true
                }
                _ => false,
            }
        };
        if !running {
            self.begin(what, total);
        }
        self.done.store(done, Ordering::Relaxed);
    }
}

impl Progress for Watch {
    fn begin(&self, what: &str, total: u64) {
        let mut st = self.stages();
        if let Some((name, t)) = st.current.take() {
            let done = self.done.load(Ordering::Relaxed);
            st.finished.push((name, done, t));
        }
        self.done.store(0, Ordering::Relaxed);
        st.current = Some((what.to_string(), total));
        st.last_reported = None;
    }
    fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
    fn end(&self) {
        let mut st = self.stages();
        if let Some((name, total)) = st.current.take() {
            let done = self.done.load(Ordering::Relaxed);
            st.finished.push((name, done, total));
        }
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Run `work(watch)` on a worker thread; see the module docs. `op` names the operation in the
/// errors of the machinery itself (a thread that cannot start, an engine panic).
pub fn run_watched<T, F>(
    py: Python<'_>,
    op: &str,
    callback: Option<Py<PyAny>>,
    work: F,
) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(Arc<Watch>) -> qem::Result<T> + Send + 'static,
{
    let watch = Arc::new(Watch::default());
    let (tx, mut rx) = mpsc::channel::<qem::Result<T>>();
    let worker_watch = Arc::clone(&watch);
    let worker_op = op.to_string();
    std::thread::Builder::new()
        .name(format!("quantem {op}"))
        .spawn(move || {
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(worker_watch)))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(Error::internal(
                            &worker_op,
                            format!("the engine panicked: {what}"),
                        ))
                    });
            // The receiver may be gone after a second Ctrl-C; nothing is waiting then.
            let _ = tx.send(result);
        })
        .map_err(|e| to_pyerr(Error::internal(op, format!("cannot start a thread: {e}"))))?;

    loop {
        let (msg, back) = py.detach(move || (rx.recv_timeout(TICK), rx));
        rx = back;
        match msg {
            Ok(result) => {
                // A Ctrl-C that arrived while the result came back is raised, not converted.
                py.check_signals()?;
                if let Some(cb) = &callback {
                    for (stage, done, total) in watch.pending() {
                        cb.call1(py, (stage, done, total))?;
                    }
                }
                return result.map_err(to_pyerr);
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(to_pyerr(Error::internal(
                    op,
                    "the worker thread ended without a result",
                )));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        let stop = match py.check_signals() {
            Err(err) => Some(err),
            Ok(()) => callback.as_ref().and_then(|cb| {
                watch
                    .pending()
                    .into_iter()
                    .find_map(|(stage, done, total)| cb.call1(py, (stage, done, total)).err())
            }),
        };
        if let Some(err) = stop {
            watch.cancel.store(true, Ordering::Relaxed);
            // Give an engine that polls the flag a moment to stop (its thread then ends with the
            // call); one that does not finishes in the background, its result dropped there.
            let _ = py.detach(move || rx.recv_timeout(GRACE));
            return Err(err);
        }
    }
}
