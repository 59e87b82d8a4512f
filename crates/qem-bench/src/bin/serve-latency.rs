//! `serve-latency`: round trips of the browse service (`qem_serve`) over HTTP loopback.
//!
//! ```text
//! serve-latency --source PATH|demo [--backend auto|cpu|cuda] [--requests N] [--out FILE.json]
//! ```
//! Starts the service in this process on the source (a master file, a folder, or `demo` for
//! the built-in simulated acquisition), loads it with one request, then times `N` sequential
//! requests (after 3 warm-ups) of each view: a virtual BF image, a frame, frames binned 2 and
//! 4, an annulus virtual image at `det_bin=2`, and the DP of a scan ROI (a quarter of the scan
//! in each direction, centred). p50/p90 of the client's round trip and of the engine time the
//! service reports (`X-Elapsed-Ms`).
//!
//! Then a drag: a client asks for a disk virtual image with a new centre every 50 ms, 100 times,
//! never with more than one request in flight: a new geometry replaces one still waiting to be
//! sent (coalescing), as the page does. It records how many updates were displayed, the rate
//! achieved, the round trips of those sent and the delay from a geometry's creation to its
//! image arriving. Benchmarks print and record; nothing here asserts a time.

use qem_serve::{ServeOptions, ServeRoot, TokenMode};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Geometries the drag asks for, and their interval.
const DRAG_STEPS: usize = 100;
const DRAG_INTERVAL: Duration = Duration::from_millis(50);

struct Args {
    source: String,
    backend: qem::BackendRequest,
    requests: usize,
    out: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: serve-latency --source PATH|demo [--backend auto|cpu|cuda] [--requests N] \
         [--out FILE.json]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut a = Args {
        source: String::new(),
        backend: qem::BackendRequest::Auto,
        requests: 50,
        out: None,
    };
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_else(|| usage());
        match argv[i].as_str() {
            "--source" => a.source = v,
            "--backend" => a.backend = v.parse().unwrap_or_else(|_| usage()),
            "--requests" => a.requests = v.parse::<usize>().unwrap_or_else(|_| usage()).max(1),
            "--out" => a.out = Some(PathBuf::from(v)),
            _ => usage(),
        }
        i += 2;
    }
    if a.source.is_empty() {
        usage()
    }
    a
}

/// p-th percentile of `v` (numpy's linear definition), milliseconds.
fn pct(v: &[f64], p: f64) -> f64 {
    qem_core::stats::percentile(v, p)
}

fn stats(v: &[f64]) -> Value {
    json!({"p50": pct(v, 50.0), "p90": pct(v, 90.0), "min": pct(v, 0.0), "max": pct(v, 100.0),
        "n": v.len()})
}

/// One client of the service.
struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

/// One answer: round trip (ms), engine time (ms), body bytes.
struct Timed {
    rtt_ms: f64,
    engine_ms: f64,
    bytes: usize,
}

impl Client {
    /// The answer to `GET path` with the token.
    async fn send(&self, path: &str) -> Result<reqwest::Response, String> {
        self.http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| format!("{path}: {e}"))
    }
    async fn get(&self, path: &str) -> Result<Timed, String> {
        let t = Instant::now();
        let r = self.send(path).await?;
        let status = r.status();
        let engine_ms = r
            .headers()
            .get("x-elapsed-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        let body = r.bytes().await.map_err(|e| format!("{path}: {e}"))?;
        let rtt_ms = t.elapsed().as_secs_f64() * 1e3;
        if !status.is_success() {
            return Err(format!(
                "{path}: {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        Ok(Timed {
            rtt_ms,
            engine_ms,
            bytes: body.len(),
        })
    }
    async fn json(&self, path: &str) -> Result<Value, String> {
        let r = self.send(path).await?;
        r.json::<Value>().await.map_err(|e| format!("{path}: {e}"))
    }
}

/// `requests` sequential round trips of `path` after 3 warm-ups.
async fn case(c: &Client, name: &str, path: &str, requests: usize) -> Result<Value, String> {
    for _ in 0..3 {
        c.get(path).await?;
    }
    let (mut rtt, mut eng, mut bytes) = (Vec::new(), Vec::new(), 0);
    for _ in 0..requests {
        let t = c.get(path).await?;
        rtt.push(t.rtt_ms);
        eng.push(t.engine_ms);
        bytes = t.bytes;
    }
    println!(
        "{name:<28} p50 {:>8.2} ms  p90 {:>8.2} ms  (engine p50 {:>8.2} ms, {bytes} B)",
        pct(&rtt, 50.0),
        pct(&rtt, 90.0),
        pct(&eng, 50.0)
    );
    Ok(
        json!({"name": name, "path": path, "round_trip_ms": stats(&rtt),
        "engine_ms": stats(&eng), "body_bytes": bytes}),
    )
}

/// The coalescing drag (module docs).
async fn drag(c: std::sync::Arc<Client>, acq: &str, det: (f64, f64)) -> Result<Value, String> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Result<Timed, String>)>();
    let geometry = |i: usize| {
        let t = i as f64 * 0.15;
        let (cr, cc) = (
            det.0 / 2.0 + det.0 / 8.0 * t.sin(),
            det.1 / 2.0 + det.1 / 8.0 * t.cos(),
        );
        format!(
            "/api/v1/acquisitions/{acq}/virtual?mode=disk&cr={cr:.3}&cc={cc:.3}&radius={:.3}",
            det.0.min(det.1) / 6.0
        )
    };
    let send = |path: String, created: Instant| {
        let (c, tx) = (std::sync::Arc::clone(&c), tx.clone());
        tokio::spawn(async move {
            let r = c.get(&path).await;
            let _ = tx.send((created, r));
        });
    };
    let mut ticker = tokio::time::interval(DRAG_INTERVAL);
    let (mut generated, mut sent, mut replaced) = (0usize, 0usize, 0usize);
    let mut pending: Option<(String, Instant)> = None;
    let mut busy = false;
    let (mut rtt, mut delay) = (Vec::new(), Vec::new());
    let start = Instant::now();
    let mut last_display = start;
    while generated < DRAG_STEPS || busy || pending.is_some() {
        tokio::select! {
            _ = ticker.tick(), if generated < DRAG_STEPS => {
                if pending.replace((geometry(generated), Instant::now())).is_some() {
                    replaced += 1;
                }
                generated += 1;
            }
            Some((created, r)) = rx.recv(), if busy => {
                let t = r?;
                rtt.push(t.rtt_ms);
                delay.push(created.elapsed().as_secs_f64() * 1e3);
                last_display = Instant::now();
                busy = false;
            }
        }
        if !busy {
            if let Some((path, created)) = pending.take() {
                send(path, created);
                sent += 1;
                busy = true;
            }
        }
    }
    let secs = last_display.duration_since(start).as_secs_f64();
    let rate = rtt.len() as f64 / secs.max(1e-9);
    println!(
        "drag: {generated} geometries every {} ms, {} displayed ({replaced} coalesced), {rate:.1} \
         updates/s, round trip p50 {:.2} ms, geometry-to-image p50 {:.2} ms p90 {:.2} ms",
        DRAG_INTERVAL.as_millis(),
        rtt.len(),
        pct(&rtt, 50.0),
        pct(&delay, 50.0),
        pct(&delay, 90.0)
    );
    Ok(json!({
        "geometries": generated, "interval_ms": DRAG_INTERVAL.as_millis() as u64,
        "sent": sent, "displayed": rtt.len(), "coalesced": replaced,
        "max_in_flight": 1, "duration_s": secs, "displayed_updates_per_s": rate,
        "asked_updates_per_s": 1e3 / DRAG_INTERVAL.as_millis() as f64,
        "round_trip_ms": stats(&rtt), "geometry_to_image_ms": stats(&delay),
    }))
}

async fn measure(a: &Args, client: Client, command: String) -> Result<Value, String> {
    let caps = client.json("/api/v1/capabilities").await?;
    let list = client.json("/api/v1/acquisitions").await?;
    let acq = list[0]["id"]
        .as_str()
        .ok_or("the catalog is empty")?
        .to_string();
    let t = Instant::now();
    let detail = client.json(&format!("/api/v1/acquisitions/{acq}")).await?;
    let load_s = t.elapsed().as_secs_f64();
    if detail.get("error").is_some() {
        return Err(format!("loading the acquisition: {detail}"));
    }
    let shape: Vec<usize> = detail["shape"]
        .as_array()
        .ok_or("no shape")?
        .iter()
        .filter_map(Value::as_u64)
        .map(|v| v as usize)
        .collect();
    let [sr, sc, kr, kc] = shape[..] else {
        return Err(format!("shape {shape:?}"));
    };
    println!(
        "source {} : {sr}x{sc} scan, {kr}x{kc} detector, {} {}, backend {}, load {load_s:.2} s",
        a.source, detail["dtype"], detail["representation"], caps["backend"]
    );
    let base = format!("/api/v1/acquisitions/{acq}");
    let (cr, cc) = (kr as f64 / 2.0 / 2.0, kc as f64 / 2.0 / 2.0);
    let r = kr.min(kc) as f64 / 8.0;
    let roi = format!(
        "r0={}&r1={}&c0={}&c1={}",
        sr * 3 / 8,
        (sr * 5 / 8).max(sr * 3 / 8 + 1),
        sc * 3 / 8,
        (sc * 5 / 8).max(sc * 3 / 8 + 1)
    );
    let cases = [
        ("virtual bf", format!("{base}/virtual?mode=bf")),
        ("frame", format!("{base}/frame?r={}&c={}", sr / 2, sc / 2)),
        (
            "frame det_bin 2",
            format!("{base}/frame?r={}&c={}&det_bin=2", sr / 2, sc / 2),
        ),
        (
            "frame det_bin 4",
            format!("{base}/frame?r={}&c={}&det_bin=4", sr / 2, sc / 2),
        ),
        (
            "annulus det_bin 2",
            format!(
                "{base}/virtual?mode=annulus&cr={cr}&cc={cc}&inner={}&outer={}&det_bin=2",
                r / 2.0,
                r
            ),
        ),
        ("roi-dp", format!("{base}/roi-dp?{roi}")),
    ];
    let mut out = Vec::new();
    for (name, path) in &cases {
        out.push(case(&client, name, path, a.requests).await?);
    }
    let drag = drag(std::sync::Arc::new(client), &acq, (kr as f64, kc as f64)).await?;
    Ok(json!({
        "benchmark": "serve-latency",
        "command": command,
        "git_revision": qem::GIT_REVISION,
        "package_version": env!("CARGO_PKG_VERSION"),
        "backend": caps["backend"],
        "devices": caps["devices"],
        "memory": caps["memory"],
        "source": a.source,
        "shape": shape,
        "dtype": detail["dtype"],
        "representation": detail["representation"],
        "device": detail["device"],
        "first_request_with_load_s": load_s,
        "requests_per_case": a.requests,
        "transport": "HTTP/1.1 over loopback, one client, keep-alive",
        "cases": out,
        "drag": drag,
    }))
}

fn main() {
    let a = parse_args();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let root = if a.source == "demo" {
        ServeRoot::Demo
    } else {
        ServeRoot::Path(PathBuf::from(&a.source))
    };
    let opts = ServeOptions {
        backend: a.backend,
        token: TokenMode::Random,
        ..ServeOptions::default()
    };
    let server = match qem_serve::start(root, opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("serve-latency: {e}");
            std::process::exit(e.kind.exit_code())
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("serve-latency: no runtime: {e}");
            std::process::exit(1)
        }
    };
    let client = Client {
        http: reqwest::Client::new(),
        base: format!("http://{}", server.addr()),
        token: server.token().unwrap_or_default(),
    };
    let result = rt.block_on(measure(&a, client, command));
    server.stop();
    match result {
        Ok(record) => {
            if let Some(out) = &a.out {
                let text = serde_json::to_string_pretty(&record).unwrap_or_default();
                if let Err(e) = std::fs::write(out, text + "\n") {
                    eprintln!("serve-latency: writing {}: {e}", out.display());
                    std::process::exit(1)
                }
                println!("wrote {}", out.display());
            }
        }
        Err(e) => {
            eprintln!("serve-latency: {e}");
            std::process::exit(1)
        }
    }
}
