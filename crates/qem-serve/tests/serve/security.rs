//! The token on every route, the cookie flow, static traversal, catalog confinement, refused
//! starts, a closed shared dataset, and bad input answered with a 4xx JSON error.

use crate::common::*;
use qem_serve::{ServeOptions, ServeRoot, SharedDataset, TokenMode};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_is_required_on_page_static_and_api() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, _) = TestServer::fixture(dir.path());
    let token = s.token.clone().expect("a random token");
    assert_eq!(token.len(), 64);
    assert!(s.server.url().ends_with(&format!("/?token={token}")));
    let c = &s.client;
    for path in [
        "/",
        "/static/app.js",
        "/static/style.css",
        "/api/v1/capabilities",
        "/api/v1/acquisitions",
        "/nowhere",
    ] {
        let url = format!("{}{path}", s.base);
        s.send(c.get(&url)).await.assert_error(401, "unauthorized");
        s.send(c.get(&url).bearer_auth("0".repeat(64)))
            .await
            .assert_error(401, "unauthorized");
        let sep = if path.contains('?') { '&' } else { '?' };
        let wrong = format!("{url}{sep}token={}", &token[..63]);
        s.send(c.get(wrong)).await.assert_error(401, "unauthorized");
        let ok = s.send(c.get(format!("{url}{sep}token={token}"))).await;
        let want = if path == "/nowhere" { 404 } else { 200 };
        assert_eq!(ok.status, want, "{path}");
    }
    let page = s.get("/").await;
    assert!(String::from_utf8_lossy(&page.body).contains("<html"));
    assert!(page.header("content-type").starts_with("text/html"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_sets_an_httponly_strict_cookie_that_authorises() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, _) = TestServer::fixture(dir.path());
    let token = s.token.clone().expect("token");
    let a = s
        .send(s.client.get(format!("{}/?token={token}", s.base)))
        .await;
    assert_eq!(a.status, 200);
    let cookie = a.header("set-cookie").to_string();
    assert!(
        cookie.starts_with(&format!("qem_token={token}")),
        "{cookie}"
    );
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    // The page's assets carry the token, so a framed page (no cookie sent) still loads them.
    let html = String::from_utf8_lossy(&a.body).to_string();
    for asset in ["static/app.js", "static/style.css"] {
        let with = format!("\"{asset}?token={token}\"");
        assert!(html.contains(&with), "{asset} without the token");
        let r = s
            .send(s.client.get(format!("{}/{asset}?token={token}", s.base)))
            .await;
        assert_eq!(r.status, 200, "{asset}");
    }
    // Bearer-authorised page loads set no cookie and put no token in the page.
    let plain = s.get("/").await;
    assert_eq!(plain.header("set-cookie"), "");
    assert!(!String::from_utf8_lossy(&plain.body).contains(&token));
    let with = |v: String| {
        s.client
            .get(format!("{}/api/v1/capabilities", s.base))
            .header("cookie", v)
    };
    assert_eq!(s.send(with(format!("qem_token={token}"))).await.status, 200);
    assert_eq!(
        s.send(with(format!("other=1; qem_token={token}")))
            .await
            .status,
        200
    );
    s.send(with("qem_token=nope".into()))
        .await
        .assert_error(401, "unauthorized");
}

/// A raw request line, so the client cannot normalise `..` away.
fn raw_get(addr: std::net::SocketAddr, target: &str, token: &str) -> (u16, String) {
    let mut t = std::net::TcpStream::connect(addr).expect("connect");
    write!(t, "GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut s = String::new();
    t.read_to_string(&mut s).expect("read");
    let status = s
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_traversal_and_unknown_ids_are_404() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("secret.txt"), "SECRET").expect("write");
    let (s, _) = TestServer::fixture(dir.path());
    let token = s.token.clone().expect("token");
    let addr = s.server.addr();
    for target in [
        "/static/../Cargo.toml",
        "/static/..%2F..%2FCargo.toml",
        "/static/%2e%2e/secret.txt",
        "/static/..%5csecret.txt",
        "/static/app.js%00",
        "/static/",
        "/static/index.html",
        "/static//etc/passwd",
    ] {
        let (status, text) = tokio::task::spawn_blocking({
            let token = token.clone();
            move || raw_get(addr, target, &token)
        })
        .await
        .expect("join");
        assert!((400..500).contains(&status), "{target}: {status}");
        assert!(
            !text.contains("SECRET") && !text.contains("[package]"),
            "{target}"
        );
    }
    for path in [
        "/api/v1/acquisitions/0000000000000000",
        "/api/v1/acquisitions/..%2Fscan_master.h5/dp",
        "/api/v1/jobs/none",
    ] {
        s.get(path).await.assert_error(404, "not_found");
    }
    // axum's own rejections are JSON too: a path segment that is not UTF-8, a wrong method.
    s.get("/api/v1/acquisitions/%FF%FE/dp")
        .await
        .assert_error(400, "bad_request");
    s.post("/api/v1/capabilities", Vec::new())
        .await
        .assert_error(405, "bad_request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_leaving_the_folder_is_not_listed() {
    let outside = tempfile::tempdir().expect("tmp");
    write_acquisition(outside.path(), "outside", (2, 2), (4, 4));
    let dir = tempfile::tempdir().expect("tmp");
    write_acquisition(dir.path(), "inside", (2, 3), (4, 4));
    std::os::unix::fs::symlink(
        outside.path().join("outside_master.h5"),
        dir.path().join("evil_master.h5"),
    )
    .expect("symlink");
    std::os::unix::fs::symlink(outside.path(), dir.path().join("linked_dir")).expect("symlink");
    let s = TestServer::start(ServeRoot::Path(dir.path().to_path_buf()), cpu_opts());
    let l = s.get("/api/v1/acquisitions").await.json();
    let paths: Vec<&str> = l
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|e| e["path"].as_str())
        .collect();
    assert_eq!(paths, vec!["inside_master.h5"]);
}

#[test]
fn refused_starts() {
    let dir = tempfile::tempdir().expect("tmp");
    write_acquisition(dir.path(), "scan", (2, 2), (4, 4));
    let root = || ServeRoot::Path(dir.path().to_path_buf());
    for host in ["0.0.0.0", "::"] {
        let e = qem_serve::start(
            root(),
            ServeOptions {
                host: host.into(),
                token: TokenMode::Disabled,
                ..cpu_opts()
            },
        )
        .expect_err("a non-loopback host without a token");
        assert_eq!(e.kind, qem::ErrorKind::InvalidArgument, "{e}");
    }
    let e = qem_serve::start(
        root(),
        ServeOptions {
            token: TokenMode::Fixed(String::new()),
            ..cpu_opts()
        },
    )
    .expect_err("an empty token");
    assert_eq!(e.kind, qem::ErrorKind::InvalidArgument);
    let e = qem_serve::start(ServeRoot::Path(dir.path().join("missing")), cpu_opts())
        .expect_err("missing");
    assert_eq!(e.kind, qem::ErrorKind::Source);
    // Loopback without a token is allowed, and the URL then has no token.
    let s = qem_serve::start(
        root(),
        ServeOptions {
            token: TokenMode::Disabled,
            ..cpu_opts()
        },
    )
    .expect("start");
    assert_eq!(s.token(), None);
    assert!(!s.url().contains("token"));
    // A port in use is an Io error.
    let e = qem_serve::start(
        root(),
        ServeOptions {
            port: s.addr().port(),
            ..cpu_opts()
        },
    )
    .expect_err("in use");
    assert_eq!(e.kind, qem::ErrorKind::Io);
    s.stop();
    s.stop();
    s.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_4xx_json_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, _) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    let a = |q: &str| format!("/api/v1/acquisitions/{id}/{q}");
    for q in [
        "frame?r=0&c=0&det_bin=3",
        "frame?r=0&c=0&det_bin=-1",
        "frame?r=9&c=0",
        "frame?r=0",
        "frame?r=99999999999999999999999&c=0",
        "frame?r=1e30&c=0",
        "virtual?mode=bf&scan_bin=0",
        "virtual?mode=bf&scan_bin=3",
        "virtual?mode=bf&scan_bin=16",
        "virtual?mode=disk&cr=NaN&cc=1&radius=2",
        "virtual?mode=disk&cr=inf&cc=1&radius=2",
        "virtual?mode=disk&cr=1e300&cc=1&radius=2",
        "virtual?mode=annulus&cr=1&cc=1&inner=3&outer=2",
        "virtual?mode=disk&cr=1&cc=1&radius=-1",
        "virtual?mode=sparkle",
        "virtual",
        "virtual?mode=bf&region=0,0,1,1",
        "virtual?mode=bf&region=0,10,0,11",
        "virtual?mode=bf&region=a,b",
        "roi-dp?r0=3&r1=2&c0=0&c1=1",
        "roi-dp?r0=0&r1=1&c0=0&c1=1&reduce=median",
        "dp?format=tiff",
        "ssb/reconstruct?C10=1",
    ] {
        s.get(&a(q)).await.assert_error(400, "bad_request");
    }
    for (q, body) in [
        ("virtual-mask?det_bin=2", vec![1u8; 10]),
        ("virtual-mask", vec![1u8; DET.0 * DET.1 + 1]),
        ("ssb/prepare", b"{\"voltage_kv\": -3}".to_vec()),
        ("ssb/prepare", b"{\"unknown\": 1}".to_vec()),
        ("ssb/prepare", b"not json".to_vec()),
        ("ssb/fit", b"{\"global_evals\": 100000000}".to_vec()),
    ] {
        s.post(&a(q), body).await.assert_error(400, "bad_request");
    }
    s.post(&a("virtual-mask"), vec![0u8; (16 << 20) + 1])
        .await
        .assert_error(413, "too_large");
    // Still serving after all that.
    assert_eq!(s.get(&a("frame?r=0&c=0")).await.status, 200);
}

/// A caller's dataset that can be closed.
#[derive(Debug)]
struct Closable {
    ds: qem::Dataset,
    closed: AtomicBool,
}

impl SharedDataset for Closable {
    fn with_dataset(&self, f: &mut dyn FnMut(&qem::Dataset)) -> qem::Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(qem::Error::invalid("browse", "the dataset has been closed"));
        }
        f(&self.ds);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_dataset_is_served_until_closed() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = write_acquisition(dir.path(), "scan", SCAN, DET);
    let ds = load_cpu(&dir.path().join("scan_master.h5"));
    let h = Arc::new(Closable {
        ds,
        closed: AtomicBool::new(false),
    });
    let root = ServeRoot::Dataset {
        name: "mine".into(),
        handle: h.clone(),
    };
    let s = TestServer::start(root, cpu_opts());
    let l = s.get("/api/v1/acquisitions").await.json();
    assert_eq!(
        (l[0]["name"].as_str(), l[0]["loaded"].as_bool()),
        (Some("mine"), Some(true))
    );
    let id = l[0]["id"].as_str().expect("id").to_string();
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/frame?r=1&c=2"))
        .await;
    assert_eq!(le_u16(&a.body), frame(&data, DET, SCAN.1 + 2));
    h.closed.store(true, Ordering::SeqCst);
    s.get(&format!("/api/v1/acquisitions/{id}/frame?r=1&c=2"))
        .await
        .assert_error(410, "closed");
    s.get(&format!("/api/v1/acquisitions/{id}/dp"))
        .await
        .assert_error(410, "closed");
}
