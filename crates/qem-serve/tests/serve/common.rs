//! Shared fixtures: a small acquisition written with known counts, a server over it, an HTTP
//! client and the independent arithmetic the tests compare against (plain loops over the
//! counts the test wrote; nothing from the crate under test).

use qem::{DType, Shape2};
use qem_io::writer::{self, WriteCompression, WriteLayout, WriteParams};
use qem_serve::{ServeOptions, ServeRoot, Server};
use reqwest::header::HeaderMap;
use std::path::Path;

/// Scan and detector of the fixture: rectangular, odd, detector sides not multiples of 4 or 8.
pub const SCAN: (usize, usize) = (9, 11);
pub const DET: (usize, usize) = (21, 18);

/// The counts written: a bright disk of radius 5 at (10, 8.5) on a varying background, with a
/// few large values so sums need more than 16 bits.
pub fn counts(scan: (usize, usize), det: (usize, usize)) -> Vec<u16> {
    let n = scan.0 * scan.1;
    let mut v = Vec::with_capacity(n * det.0 * det.1);
    for f in 0..n {
        for i in 0..det.0 {
            for j in 0..det.1 {
                let (dr, dc) = (i as f64 - 10.0, j as f64 - 8.5);
                let disk = if dr * dr + dc * dc <= 25.0 {
                    300 + (f % 7) as u16 * 10
                } else {
                    0
                };
                let bg = ((f * 7 + i * 3 + j * 5) % 13) as u16;
                let spike = if (f + i + j) % 97 == 0 { 60_000 } else { 0 };
                v.push(disk + bg + spike);
            }
        }
    }
    v
}

/// Write `counts(scan, det)` as `{name}_master.h5` + shards under `dir`; returns the counts.
pub fn write_acquisition(
    dir: &Path,
    name: &str,
    scan: (usize, usize),
    det: (usize, usize),
) -> Vec<u16> {
    let data = counts(scan, det);
    let frame_len = det.0 * det.1;
    let p = WriteParams {
        prefix: dir.join(name),
        scan_shape: Shape2::new(scan.0, scan.1),
        detector_shape: Shape2::new(det.0, det.1),
        dtype: DType::U16,
        frames_per_file: 40,
        frames_per_chunk: 1,
        block_elems: 0,
        compression: WriteCompression::Bslz4,
        layout: WriteLayout::Shards,
        pixel_mask: None,
        calibration: writer::Calibration {
            energy_ev: Some(300e3),
            semiangle_mrad: Some(20.0),
            scan_step_a: Some((0.5, 0.5)),
            ..Default::default()
        },
        skip_frames: Vec::new(),
        write_scan_shape: true,
    };
    writer::write_acquisition(&p, |n, buf| {
        let src = &data[n as usize * frame_len..(n as usize + 1) * frame_len];
        for (d, &x) in buf.chunks_exact_mut(2).zip(src) {
            d.copy_from_slice(&x.to_le_bytes());
        }
    })
    .expect("write the fixture");
    data
}

/// A running server and a client for it.
pub struct TestServer {
    pub server: Server,
    pub base: String,
    pub token: Option<String>,
    pub client: reqwest::Client,
}

/// One answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, k: &str) -> &str {
        self.headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn shape(&self) -> Vec<usize> {
        self.header("x-shape")
            .split(',')
            .map(|s| s.parse().expect("shape"))
            .collect()
    }
    /// A 4xx answer with a JSON error of `kind`.
    pub fn assert_error(&self, status: u16, kind: &str) {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(self.json()["error"]["kind"], kind);
    }
}

/// The little-endian `N`-byte values of `b`, each read by `from` (`u64::from_le_bytes`, ...).
fn le<const N: usize, T>(b: &[u8], from: impl Fn([u8; N]) -> T) -> Vec<T> {
    b.chunks_exact(N)
        .map(|c| from(c.try_into().expect("N bytes")))
        .collect()
}
pub fn le_u64(b: &[u8]) -> Vec<u64> {
    le(b, u64::from_le_bytes)
}
pub fn le_u32(b: &[u8]) -> Vec<u32> {
    le(b, u32::from_le_bytes)
}
/// `uint32` values widened to `u64` (to compare with the exact `u64` references).
pub fn le_u32_as_u64(b: &[u8]) -> Vec<u64> {
    le(b, |c| u64::from(u32::from_le_bytes(c)))
}
pub fn le_u16(b: &[u8]) -> Vec<u16> {
    le(b, u16::from_le_bytes)
}
pub fn le_f32(b: &[u8]) -> Vec<f32> {
    le(b, f32::from_le_bytes)
}

/// `path` loaded with the CPU engine (what the tests compare the service with).
pub fn load_cpu(path: &Path) -> qem::Dataset {
    let params = qem::LoadParams {
        backend: qem::BackendRequest::Cpu,
        ..Default::default()
    };
    qem::load(qem::SourceArg::Path(path.to_path_buf()), &params).expect("load")
}

pub fn cpu_opts() -> ServeOptions {
    ServeOptions {
        backend: qem::BackendRequest::Cpu,
        ..ServeOptions::default()
    }
}

impl TestServer {
    pub fn start(root: ServeRoot, opts: ServeOptions) -> TestServer {
        let server = qem_serve::start(root, opts).expect("start the server");
        TestServer {
            base: format!("http://{}", server.addr()),
            token: server.token(),
            server,
            client: reqwest::Client::builder().build().expect("client"),
        }
    }
    /// A folder server over one fixture acquisition named `scan`.
    pub fn fixture(dir: &Path) -> (TestServer, Vec<u16>) {
        let data = write_acquisition(dir, "scan", SCAN, DET);
        (
            TestServer::start(ServeRoot::Path(dir.to_path_buf()), cpu_opts()),
            data,
        )
    }
    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }
    pub async fn send(&self, rb: reqwest::RequestBuilder) -> Answer {
        let r = rb.send().await.expect("request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.bytes().await.expect("body").to_vec();
        Answer {
            status,
            headers,
            body,
        }
    }
    pub async fn get(&self, path: &str) -> Answer {
        self.send(self.auth(self.client.get(format!("{}{path}", self.base))))
            .await
    }
    pub async fn post(&self, path: &str, body: Vec<u8>) -> Answer {
        self.send(self.auth(self.client.post(format!("{}{path}", self.base)).body(body)))
            .await
    }
    /// The id of the only (or first) acquisition.
    pub async fn first_id(&self) -> String {
        let a = self.get("/api/v1/acquisitions").await;
        assert_eq!(a.status, 200);
        a.json()[0]["id"].as_str().expect("id").to_string()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.server.stop();
    }
}

/// Frame `n` of `data`.
pub fn frame(data: &[u16], det: (usize, usize), n: usize) -> &[u16] {
    &data[n * det.0 * det.1..(n + 1) * det.0 * det.1]
}

/// Block sums written out plainly: block (I, J) sums pixels i in [I·b, min(I·b+b, rows)).
pub fn block_sums(img: &[u64], rows: usize, cols: usize, b: usize) -> Vec<u64> {
    let (rb, cb) = (rows.div_ceil(b), cols.div_ceil(b));
    let mut out = Vec::new();
    for bi in 0..rb {
        for bj in 0..cb {
            let mut s = 0u64;
            for i in bi * b..((bi + 1) * b).min(rows) {
                for j in bj * b..((bj + 1) * b).min(cols) {
                    s += img[i * cols + j];
                }
            }
            out.push(s);
        }
    }
    out
}

/// `V[n] = Σ_k mask[k]·I[n, k]` over every frame.
pub fn virtual_sum(data: &[u16], det: (usize, usize), mask: &[bool]) -> Vec<u64> {
    data.chunks_exact(det.0 * det.1)
        .map(|f| {
            f.iter()
                .zip(mask)
                .filter(|(_, &m)| m)
                .map(|(&v, _)| u64::from(v))
                .sum()
        })
        .collect()
}

/// Sum DP over all frames.
pub fn sum_dp(data: &[u16], det: (usize, usize)) -> Vec<u64> {
    let mut s = vec![0u64; det.0 * det.1];
    for f in data.chunks_exact(det.0 * det.1) {
        for (a, &v) in s.iter_mut().zip(f) {
            *a += u64::from(v);
        }
    }
    s
}
