//! Running a long library call off the Python thread, honouring Ctrl-C and progress callbacks.
//!
//! The call runs on a worker thread with the GIL released. The calling (Python) thread wakes every
//! few tens of milliseconds, re-attaches, runs Python's signal handlers and forwards progress to
//! the user's callback: the engine's threads never touch Python. A `KeyboardInterrupt` (or an
//! exception from the callback) sets the cancel flag the engine polls through
//! [`qem::Progress::cancelled`] and waits for the engine to stop; a second Ctrl-C returns at once
//! and lets the worker finish in the background.

use crate::errors::to_pyerr;
use pyo3::prelude::*;
use qem::{Error, Progress};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

const TICK: Duration = Duration::from_millis(40);

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

/// Run `work(watch)` on a worker thread; see the module docs.
pub fn run_watched<T, F>(py: Python<'_>, callback: Option<Py<PyAny>>, work: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(Arc<Watch>) -> qem::Result<T> + Send + 'static,
{
    let watch = Arc::new(Watch::default());
    let (tx, mut rx) = mpsc::channel::<qem::Result<T>>();
    let worker_watch = Arc::clone(&watch);
    std::thread::Builder::new()
        .name("quantem-load".into())
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
                            "load",
                            format!("the engine panicked: {what}"),
                        ))
                    });
            // The receiver may be gone after a second Ctrl-C; nothing is waiting then.
            let _ = tx.send(result);
        })
        .map_err(|e| {
            to_pyerr(Error::internal(
                "load",
                format!("cannot start a thread: {e}"),
            ))
        })?;

    // The first Python error seen (Ctrl-C or a callback's exception); then we only wait.
    let mut stop: Option<PyErr> = None;
    loop {
        let (msg, back) = py.detach(move || (rx.recv_timeout(TICK), rx));
        rx = back;
        match msg {
            Ok(result) => {
                if let Some(err) = stop {
                    return Err(err);
                }
                if let Some(cb) = &callback {
                    for (stage, done, total) in watch.pending() {
                        cb.call1(py, (stage, done, total))?;
                    }
                }
                return result.map_err(to_pyerr);
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(stop.unwrap_or_else(|| {
                    to_pyerr(Error::internal(
                        "load",
                        "the worker thread ended without a result",
                    ))
                }));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        if let Err(err) = py.check_signals() {
            if stop.is_some() {
                // Second interrupt: stop waiting for the engine to notice.
                return Err(err);
            }
            watch.cancel.store(true, Ordering::Relaxed);
            stop = Some(err);
            continue;
        }
        if stop.is_none() {
            if let Some(cb) = &callback {
                for (stage, done, total) in watch.pending() {
                    if let Err(err) = cb.call1(py, (stage, done, total)) {
                        watch.cancel.store(true, Ordering::Relaxed);
                        stop = Some(err);
                        break;
                    }
                }
            }
        }
    }
}
