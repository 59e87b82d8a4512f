//! Starting and stopping: [`start`] checks the options, binds synchronously, then serves on a
//! thread of its own with a tokio runtime; [`Server::stop`] shuts it down gracefully.

use crate::catalog::Catalog;
use crate::config::{ServeOptions, ServeRoot, TokenMode};
use crate::state::AppState;
use qem::{Backend, Error, ErrorKind, Result};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A running service. [`Server::stop`] stops it; so does dropping it.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    token: Option<String>,
    shutdown: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    stopped: Arc<(Mutex<bool>, Condvar)>,
    /// The demo's files, removed when the server is dropped.
    _demo_dir: Option<tempfile::TempDir>,
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
        let (lock, cv) = &*self.stopped;
        let Ok(mut done) = lock.lock() else { return };
        while !*done {
            match cv.wait(done) {
                Ok(d) => done = d,
                Err(_) => return,
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A dropped handle leaves no thread serving and no port bound (stop is idempotent).
        self.stop();
    }
}

fn invalid(detail: impl Into<String>) -> Error {
    Error::invalid("serve", detail)
}

/// Half of the machine's memory (`/proc/meminfo`), else 8 GiB.
fn host_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(8 << 30, |kb| kb * 1024 / 2)
}

/// 80 % of the GPU's memory, else the host's budget.
fn cuda_budget() -> u64 {
    qem::backend::cuda_total_memory()
        .filter(|&t| t > 0)
        .map_or_else(host_budget, |t| t / 5 * 4)
}

/// Start serving `root` with `opts`. Binds before returning (so [`Server::addr`] is the real
/// port). A refused configuration (a non-loopback host with the token disabled, an empty fixed
/// token, a zero budget) is `InvalidArgument`; a failed bind `Io`; a missing path `Source`; an
/// unusable backend `BackendUnavailable`.
pub fn start(root: ServeRoot, opts: ServeOptions) -> Result<Server> {
    let addr = (opts.host.as_str(), opts.port)
        .to_socket_addrs()
        .map_err(|e| invalid(format!("host \"{}\" does not resolve: {e}", opts.host)))?
        .next()
        .ok_or_else(|| invalid(format!("host \"{}\" has no address", opts.host)))?;
    let token = match &opts.token {
        TokenMode::Random => Some(crate::auth::random_token()?),
        TokenMode::Fixed(t) if t.is_empty() || !t.chars().all(|c| c.is_ascii_graphic()) => {
            return Err(invalid("a fixed token must be non-empty printable ASCII"))
        }
        TokenMode::Fixed(t) => Some(t.clone()),
        TokenMode::Disabled if !is_loopback(addr.ip()) => {
            return Err(invalid(format!(
                "refusing to serve {} without a token: only loopback addresses may disable it",
                addr.ip()
            ))
            .with_expected("a token, or a loopback host such as 127.0.0.1")
            .with_found(opts.host.clone()))
        }
        TokenMode::Disabled => None,
    };
    if opts.memory_budget == Some(0) {
        return Err(invalid("the memory budget must be > 0"));
    }
    let mut demo_dir = None;
    let (catalog, backend) = match root {
        ServeRoot::Path(p) => (Catalog::of_path(&p)?, qem::resolve_backend(opts.backend)?),
        ServeRoot::Demo => {
            let dir = tempfile::tempdir()
                .map_err(|e| Error::io("serve --demo", &std::env::temp_dir(), &e))?;
            qem_sim::demo::write_demo(dir.path(), &qem_sim::SimParams::default())?;
            let c = Catalog::of_path(dir.path())?;
            demo_dir = Some(dir);
            (c, qem::resolve_backend(opts.backend)?)
        }
        ServeRoot::Dataset { name, handle } => {
            let mut facts = None;
            handle.with_dataset(&mut |ds| facts = Some((ds.backend(), ds.nbytes_resident())))?;
            let (b, n) = facts.ok_or_else(|| invalid("the shared dataset was not run"))?;
            (Catalog::of_shared(name, handle, n), b)
        }
    };
    let budget = opts.memory_budget.unwrap_or_else(|| match backend {
        Backend::Cuda => cuda_budget(),
        Backend::Cpu => host_budget(),
    });
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| Error::new(ErrorKind::Io, "serve", format!("cannot bind {addr}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::new(ErrorKind::Io, "serve", e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::new(ErrorKind::Io, "serve", e.to_string()))?;
    let state = Arc::new(AppState {
        token: token.clone(),
        backend,
        representation: opts.representation,
        budget,
        catalog,
        device: Arc::new(tokio::sync::Semaphore::new(1)),
        jobs: Default::default(),
        job_slot: Arc::new(tokio::sync::Semaphore::new(1)),
    });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let stopped = Arc::new((Mutex::new(false), Condvar::new()));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("qem-serve")
        .enable_all()
        .build()
        .map_err(|e| Error::new(ErrorKind::Io, "serve", format!("no tokio runtime: {e}")))?;
    let stopped2 = Arc::clone(&stopped);
    let thread = std::thread::Builder::new()
        .name("qem-serve".into())
        .spawn(move || {
            runtime.block_on(async move {
                if let Ok(l) = tokio::net::TcpListener::from_std(listener) {
                    let app = crate::routes::router(state);
                    let _ = axum::serve(l, app)
                        .with_graceful_shutdown(async {
                            let _ = rx.await;
                        })
                        .await;
                }
            });
            // Blocking engine tasks still running finish in the background.
            runtime.shutdown_background();
            let (lock, cv) = &*stopped2;
            if let Ok(mut d) = lock.lock() {
                *d = true;
            }
            cv.notify_all();
        })
        .map_err(|e| Error::new(ErrorKind::Io, "serve", format!("no server thread: {e}")))?;
    Ok(Server {
        addr,
        token,
        shutdown: Mutex::new(Some(tx)),
        thread: Mutex::new(Some(thread)),
        stopped,
        _demo_dir: demo_dir,
    })
}

fn is_loopback(ip: IpAddr) -> bool {
    ip.is_loopback()
}
