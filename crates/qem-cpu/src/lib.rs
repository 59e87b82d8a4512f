//! `qem-cpu`: the CPU reference engine of quantem.gpu.
//!
//! It is the specification every other engine is tested against, so it is written plainly:
//! a [`FramePlan`] says how one source frame becomes one result frame (bad pixels zeroed, then
//! the detector region cropped, then count-preserving binning in u64, then the result dtype), and
//! [`load_dense`] runs that plan over the frames of a source in parallel with rayon, reading each
//! chunk's bytes once with a positional read and decoding it in the worker thread.
//! [`EncodedFrames`] holds frames in the ENCODED representation (rANS counts streams).
//! [`dpc`] holds the centre-of-mass, DPC alignment and iDPC integration math on scan-grid arrays.
//!
//! Depends on `qem-core`, `qem-codec` and `qem-io`; the façade `qem` depends on it.

pub mod dpc;
mod encoded;
mod frame;
mod load;
pub mod products;
pub mod ssb;

pub use encoded::{
    fit_model, model_params, rans_error, sample_indices, EncodedFrames, CODEC_NAME, CODEC_VERSION,
    FIT_SAMPLE_FRAMES, STREAM_TAG_ONE_FRAME,
};
pub use frame::{FramePlan, OutElem, PixelOverflow, SrcFrame};
pub use load::{load_array, load_dense, DenseLoad, LoadHooks};
pub use products::{reduce_dense, reduce_encoded};
