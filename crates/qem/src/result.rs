//! [`ResultProvenance`]: the record every computed result (detector products, CoM/DPC, SSB)
//! carries — which dataset it came from (that dataset's own provenance), which operation with
//! which parameters, on which backend and device, and how long its stages took.

use crate::dataset::Dataset;
use qem_core::{Provenance, StageTiming};

/// How a result was computed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ResultProvenance {
    /// Operation name, e.g. `"detector.products"`, `"dpc.run"`.
    pub operation: String,
    /// Engine that computed it (`"cpu"`, `"cuda"`).
    pub backend: String,
    /// Device description (GPU model, driver, CUDA version on CUDA).
    pub device: String,
    /// Representation the data was read from (`"dense"`, `"encoded"`).
    pub representation: String,
    /// The operation's resolved parameters (defaults filled in, e.g. the fitted BF disk).
    pub params: serde_json::Value,
    /// Stage times of this operation (synchronized wall intervals), seconds.
    pub timings: Vec<StageTiming>,
    /// The dataset's own provenance (source identity, shapes, dtypes, regions, bins, mask).
    pub dataset: Provenance,
}

impl ResultProvenance {
    /// A record for `operation` on `ds` with its resolved `params`; add stage times with
    /// [`ResultProvenance::stage`].
    pub fn new(ds: &Dataset, operation: &str, params: serde_json::Value) -> Self {
        ResultProvenance {
            operation: operation.to_string(),
            backend: ds.backend().name().to_string(),
            device: ds.device().to_string(),
            representation: ds.representation().name().to_string(),
            params,
            timings: Vec::new(),
            dataset: ds.provenance().clone(),
        }
    }

    /// Record a stage time.
    pub fn stage(&mut self, stage: &str, seconds: f64) {
        self.timings.push(StageTiming::new(stage, seconds));
    }
}
