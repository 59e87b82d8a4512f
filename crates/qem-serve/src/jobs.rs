//! Background jobs (SSB fits): an id, progress `{done, total}` and the outcome, polled through
//! `GET /api/v1/jobs/{job}`.

use crate::error::{ApiError, ApiResult};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One job.
#[derive(Debug, Default)]
pub(crate) struct Job {
    done: AtomicUsize,
    total: AtomicUsize,
    outcome: Mutex<Option<ApiResult<Value>>>,
}

impl Job {
    /// Record progress.
    pub fn progress(&self, done: usize, total: usize) {
        self.total.store(total, Ordering::Relaxed);
        self.done.store(done, Ordering::Relaxed);
    }
    /// Record the outcome (a finished job shows `done == total`).
    pub fn finish(&self, outcome: ApiResult<Value>) {
        if outcome.is_ok() {
            let d = self.done.load(Ordering::Relaxed);
            self.total.store(d, Ordering::Relaxed);
        }
        if let Ok(mut o) = self.outcome.lock() {
            *o = Some(outcome);
        }
    }
    /// `{state, progress: {done, total}, result | error}`.
    pub fn status(&self) -> Value {
        let progress = json!({"done": self.done.load(Ordering::Relaxed),
            "total": self.total.load(Ordering::Relaxed)});
        let outcome = self.outcome.lock().ok().and_then(|o| o.clone());
        match outcome {
            None => json!({"state": "running", "progress": progress}),
            Some(Ok(v)) => json!({"state": "done", "progress": progress, "result": v}),
            Some(Err(e)) => json!({"state": "failed", "progress": progress,
                "error": {"kind": e.kind, "message": e.message}}),
        }
    }
}

/// Finished jobs kept at most (the oldest finished ones are forgotten first).
const MAX_JOBS: usize = 256;

/// The jobs of this service: every running one, and the latest finished ones.
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    next: AtomicU64,
    map: Mutex<HashMap<String, Arc<Job>>>,
}

impl Jobs {
    /// A new running job and its id.
    pub fn create(&self) -> ApiResult<(String, Arc<Job>)> {
        let id = format!("job-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let job = Arc::new(Job::default());
        let mut map = self
            .map
            .lock()
            .map_err(|_| ApiError::internal("the job table lock was poisoned"))?;
        if map.len() >= MAX_JOBS {
            let mut finished: Vec<(u64, String)> = map
                .iter()
                .filter(|(_, j)| j.outcome.lock().map(|o| o.is_some()).unwrap_or(true))
                .map(|(k, _)| (k.trim_start_matches("job-").parse().unwrap_or(0), k.clone()))
                .collect();
            finished.sort();
            let excess = map.len() + 1 - MAX_JOBS;
            for (_, k) in finished.into_iter().take(excess) {
                map.remove(&k);
            }
        }
        map.insert(id.clone(), Arc::clone(&job));
        Ok((id, job))
    }
    /// The job `id`, or 404.
    pub fn get(&self, id: &str) -> ApiResult<Arc<Job>> {
        self.map
            .lock()
            .map_err(|_| ApiError::internal("the job table lock was poisoned"))?
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("no job \"{id}\"")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_jobs_are_forgotten_oldest_first_running_ones_never() {
        let jobs = Jobs::default();
        let (first, running) = jobs.create().unwrap_or_else(|_| panic!("create"));
        let mut ids = Vec::new();
        for _ in 0..MAX_JOBS + 10 {
            let (id, j) = jobs.create().unwrap_or_else(|_| panic!("create"));
            j.finish(Ok(json!({})));
            ids.push(id);
        }
        assert!(jobs.get(&first).is_ok(), "a running job was dropped");
        assert!(jobs.get(&ids[0]).is_err() && jobs.get(&ids[10]).is_err());
        assert!(jobs.get(&ids[11]).is_ok() && jobs.get(&ids[ids.len() - 1]).is_ok());
        running.finish(Ok(json!({})));
    }
}
