//! `qem-cuda`: the CUDA engine (work in progress).
