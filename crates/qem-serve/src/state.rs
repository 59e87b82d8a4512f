//! The service's shared state and the one way engine work is run ([`AppState::engine`]): a
//! permit of the device's semaphore taken in async context, then the work on a blocking thread.
//! A request whose client went away is dropped while it waits for the permit, so it never
//! computes.

use crate::catalog::{Acq, Catalog};
use crate::error::{ApiError, ApiResult};
use crate::jobs::Jobs;
use qem::{Backend, Dataset, Representation};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Everything a route may use.
#[derive(Debug)]
pub(crate) struct AppState {
    /// The token requests must carry (`None`: disabled).
    pub token: Option<String>,
    /// The engine of acquisitions the service loads.
    pub backend: Backend,
    /// Their representation (`None`: the backend's default).
    pub representation: Option<Representation>,
    /// Bytes the service may keep loaded.
    pub budget: u64,
    /// What is served.
    pub catalog: Catalog,
    /// One engine call at a time on the device.
    pub device: Arc<Semaphore>,
    /// Background jobs (SSB fits).
    pub jobs: Jobs,
    /// One background job computing at a time (the others wait their turn).
    pub job_slot: Arc<Semaphore>,
}

impl AppState {
    /// Run `f` on `acq`'s dataset on a blocking thread, holding the device permit; the answer
    /// and the engine time in milliseconds.
    pub async fn engine<T, F>(&self, acq: &Acq, f: F) -> ApiResult<(T, f64)>
    where
        T: Send + 'static,
        F: FnOnce(&Dataset, &Acq) -> ApiResult<T> + Send + 'static,
    {
        self.run(acq, f, true).await
    }

    /// [`AppState::engine`] for a background job: on the CPU engine it runs beside the views
    /// (rayon shares the cores; a minute-long SSB fit must not freeze the page), on CUDA it
    /// queues for the device like any call (a fit there takes seconds).
    pub async fn job<T, F>(&self, acq: &Acq, f: F) -> ApiResult<(T, f64)>
    where
        T: Send + 'static,
        F: FnOnce(&Dataset, &Acq) -> ApiResult<T> + Send + 'static,
    {
        let _slot = self
            .job_slot
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the job semaphore was closed"))?;
        self.run(acq, f, self.backend == Backend::Cuda).await
    }

    /// The device permit (one engine call or load at a time), waited for in async context.
    pub async fn device_permit(&self) -> ApiResult<OwnedSemaphorePermit> {
        self.device
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("the device semaphore was closed"))
    }

    async fn run<T, F>(&self, acq: &Acq, f: F, hold_device: bool) -> ApiResult<(T, f64)>
    where
        T: Send + 'static,
        F: FnOnce(&Dataset, &Acq) -> ApiResult<T> + Send + 'static,
    {
        let permit = if hold_device {
            Some(self.device_permit().await?)
        } else {
            None
        };
        let acq = acq.clone();
        let out = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let t = Instant::now();
            let r = acq.with(|ds| f(ds, &acq));
            r.map(|v| (v, t.elapsed().as_secs_f64() * 1e3))
        })
        .await
        .map_err(|e| ApiError::internal(format!("an engine task failed: {e}")))?;
        out
    }
}
