//! Shared by the HTTP-level tests: `diskformer serve`'s library entry on a free loopback port, on
//! its own runtime thread, so a test talks to it over real HTTP.

use std::net::SocketAddr;
use std::time::Duration;

/// A running test server; dropping it stops the server.
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Starts `server::serve(config)` on a two-worker runtime and waits for its address (up to 120 s:
/// preloaded models load before it listens).
pub fn start(config: server::Config) -> TestServer {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            server::serve(config, move |a| addr_tx.send(a).unwrap(), shutdown).await.unwrap();
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(120)).expect("server started");
    TestServer { addr, _stop: stop_tx }
}
