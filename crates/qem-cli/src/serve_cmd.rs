//! `quantem-gpu serve`: start the browse service (`qem_serve`), print its URL, serve until
//! Ctrl-C (or SIGTERM), then stop it gracefully and exit 0. Refused options (a non-loopback
//! host without a token, an empty token) exit 2 through the error's kind.

use crate::args::ServeArgs;
use crate::print_out;
use anyhow::Context;
use qem_serve::{ServeOptions, ServeRoot, TokenMode};

pub fn run(a: &ServeArgs) -> anyhow::Result<()> {
    let root = match (&a.path, a.demo) {
        (_, true) => ServeRoot::Demo,
        (Some(p), false) => ServeRoot::Path(p.clone()),
        (None, false) => anyhow::bail!(qem::Error::invalid("serve", "give a PATH or --demo")),
    };
    let token = match (&a.token, a.no_token) {
        (_, true) => TokenMode::Disabled,
        (Some(t), false) => TokenMode::Fixed(t.clone()),
        (None, false) => TokenMode::Random,
    };
    let opts = ServeOptions {
        host: a.host.clone(),
        port: a.port,
        token,
        backend: a.backend,
        representation: a.representation,
        memory_budget: a.memory_budget,
    };
    let server = qem_serve::start(root, opts).context("starting the browse service")?;
    // The handlers are in place before the URL is printed, so a Ctrl-C right after it stops
    // the service gracefully instead of killing the process.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("a runtime to wait for Ctrl-C")?;
    let signals = rt.block_on(async { Signals::install() })?;
    let url = server.url();
    print_out(&format!("serving on {url}\n(Ctrl-C to stop)\n"))?;
    if a.open {
        open_browser(&url);
    }
    rt.block_on(signals.wait())?;
    server.stop();
    Ok(())
}

/// Ctrl-C (SIGINT) or SIGTERM, listened for from [`Signals::install`] on.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    #[cfg(unix)]
    fn install() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("listening for Ctrl-C")?,
            term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
        })
    }
    #[cfg(not(unix))]
    fn install() -> anyhow::Result<Signals> {
        Ok(Signals {})
    }
    #[cfg(unix)]
    async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    async fn wait(self) -> anyhow::Result<()> {
        tokio::signal::ctrl_c()
            .await
            .context("listening for Ctrl-C")
    }
}

/// Ask the desktop to open `url`; a failure is a note on stderr, not an error.
fn open_browser(url: &str) {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    if let Err(e) = std::process::Command::new(opener)
        .arg(url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        eprintln!("note: could not open a browser ({opener}: {e}); open {url} yourself");
    }
}
