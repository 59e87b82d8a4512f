//! `quantem-gpu serve`: prints its URL, answers with the token it printed, stops on Ctrl-C
//! (SIGINT) with exit 0; refused options exit 2.

use super::{assert_fails, code, qg, stderr};
use crate::fixtures::disk_acquisition;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};

/// `GET path` over a plain socket with a bearer token: (status, body).
fn get(addr: &str, path: &str, token: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn serve_prints_its_url_answers_and_stops_on_ctrl_c() {
    let (dir, _, _) = disk_acquisition();
    let mut child = Command::new(env!("CARGO_BIN_EXE_quantem-gpu"))
        .args([
            "serve",
            dir.path().to_str().expect("utf-8"),
            "--backend",
            "cpu",
            "--token",
            "t0k3n",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("line");
    let url = line
        .trim()
        .strip_prefix("serving on ")
        .expect("the URL line")
        .to_string();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/?token=t0k3n"),
        "{url}"
    );
    let addr = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .expect("addr")
        .to_string();
    let (status, body) = get(&addr, "/api/v1/capabilities", "t0k3n");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"protocol\":\"quantem-gpu-browse\""),
        "{body}"
    );
    assert_eq!(get(&addr, "/api/v1/capabilities", "wrong").0, 401);
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(ok.success());
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(0));
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "still listening"
    );
}

#[test]
fn serve_refuses_a_public_host_without_a_token() {
    let (dir, _, _) = disk_acquisition();
    let p = dir.path().to_str().expect("utf-8");
    let o = qg(&[
        "serve",
        p,
        "--host",
        "0.0.0.0",
        "--no-token",
        "--backend",
        "cpu",
    ]);
    assert_fails(&o, 2, "without a token");
    let o = qg(&["serve", p, "--token", "x", "--no-token"]);
    assert_eq!(code(&o), 2);
    let o = qg(&["serve"]);
    assert_eq!(code(&o), 2);
    let o = qg(&["serve", p, "--token", ""]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}
