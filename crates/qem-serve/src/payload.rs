//! Array answers: the raw little-endian C-order body with `X-Shape`, `X-Dtype`, `X-Divisor`,
//! `X-Det-Bin`, `X-Scan-Bin`, `X-Elapsed-Ms`, or with `format=npy` a `.npy` file (header by the
//! `npyz` crate) as an attachment.

use crate::error::{ApiError, ApiResult};
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use npyz::WriterBuilder;

/// The elements of an array answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ArrayData {
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    F32(Vec<f32>),
}

impl ArrayData {
    fn dtype(&self) -> &'static str {
        match self {
            ArrayData::U8(_) => "uint8",
            ArrayData::U16(_) => "uint16",
            ArrayData::U32(_) => "uint32",
            ArrayData::U64(_) => "uint64",
            ArrayData::F32(_) => "float32",
        }
    }
    fn raw(&self) -> Vec<u8> {
        fn le<const N: usize, T: Copy>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            let mut out = Vec::with_capacity(v.len() * N);
            for &x in v {
                out.extend_from_slice(&f(x));
            }
            out
        }
        match self {
            ArrayData::U8(v) => v.clone(),
            ArrayData::U16(v) => le(v, u16::to_le_bytes),
            ArrayData::U32(v) => le(v, u32::to_le_bytes),
            ArrayData::U64(v) => le(v, u64::to_le_bytes),
            ArrayData::F32(v) => le(v, f32::to_le_bytes),
        }
    }
    fn npy(&self, shape: &[u64]) -> std::io::Result<Vec<u8>> {
        fn write<T: npyz::AutoSerialize + Copy>(
            v: &[T],
            shape: &[u64],
        ) -> std::io::Result<Vec<u8>> {
            let mut buf = Vec::new();
            let mut w = npyz::WriteOptions::new()
                .default_dtype()
                .shape(shape)
                .writer(&mut buf)
                .begin_nd()?;
            w.extend(v.iter().copied())?;
            w.finish()?;
            Ok(buf)
        }
        match self {
            ArrayData::U8(v) => write(v, shape),
            ArrayData::U16(v) => write(v, shape),
            ArrayData::U32(v) => write(v, shape),
            ArrayData::U64(v) => write(v, shape),
            ArrayData::F32(v) => write(v, shape),
        }
    }
}

/// An array answer and what its headers say.
#[derive(Debug, Clone)]
pub(crate) struct ArrayOut {
    pub data: ArrayData,
    pub shape: Vec<usize>,
    pub divisor: Option<u64>,
    pub det_bin: Option<usize>,
    pub scan_bin: Option<usize>,
    pub elapsed_ms: f64,
}

impl ArrayOut {
    /// An answer of `data` in `shape`, no bins or divisor.
    pub fn new(data: ArrayData, shape: Vec<usize>) -> Self {
        ArrayOut {
            data,
            shape,
            divisor: None,
            det_bin: None,
            scan_bin: None,
            elapsed_ms: 0.0,
        }
    }

    /// The response: raw, or `.npy` named `name.npy` when `npy`.
    pub fn respond(self, npy: bool, name: &str) -> ApiResult<Response> {
        let shape_s = self
            .shape
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut headers = vec![
            ("x-shape", shape_s),
            ("x-dtype", self.data.dtype().to_string()),
            ("x-elapsed-ms", format!("{:.3}", self.elapsed_ms)),
        ];
        if let Some(d) = self.divisor {
            headers.push(("x-divisor", d.to_string()));
        }
        if let Some(b) = self.det_bin {
            headers.push(("x-det-bin", b.to_string()));
        }
        if let Some(b) = self.scan_bin {
            headers.push(("x-scan-bin", b.to_string()));
        }
        let (body, ctype) = if npy {
            let shape: Vec<u64> = self.shape.iter().map(|&d| d as u64).collect();
            let b = self
                .data
                .npy(&shape)
                .map_err(|e| ApiError::internal(format!("writing .npy: {e}")))?;
            headers.push((
                "content-disposition",
                format!("attachment; filename=\"{name}.npy\""),
            ));
            (b, "application/octet-stream")
        } else {
            (self.data.raw(), "application/octet-stream")
        };
        let mut resp = body.into_response();
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
        for (k, v) in headers {
            let v = HeaderValue::from_str(&v)
                .map_err(|_| ApiError::internal("a header value is not ASCII"))?;
            h.insert(HeaderName::from_static(k), v);
        }
        Ok(resp)
    }
}
