//! One address that moves: a TCP forwarder whose target a test switches, as a
//! Kubernetes Service, a VIP or a proxy (HAProxy, PgBouncer) follows the primary
//! on failover. The client keeps the address it was given; the forwarder closes
//! every connection it carries when it moves (the old primary is gone; a client
//! notices on its next call) and sends new ones to the new target.
//!
//! Also a link that can be cut: every open connection dies and new ones are
//! closed on arrival until it is moved again (a standby cut off from its
//! primary, which then lags).
//!
//! Plain threads, no runtime: the fixture serves async and blocking tests alike.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::BoxError;

#[derive(Default)]
struct Route {
    /// Where new connections go; `None`: cut.
    target: Option<SocketAddr>,
    /// Bumped on every move or cut: a connection opened under an older one is closed.
    generation: u64,
    /// Both ends of every connection of this generation, to close them on the next move.
    open: Vec<TcpStream>,
}

pub struct Forwarder {
    addr: SocketAddr,
    route: Arc<Mutex<Route>>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Listen on a free port of 127.0.0.1 and forward to `target`.
    pub fn start(target: SocketAddr) -> Result<Forwarder, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let route = Arc::new(Mutex::new(Route { target: Some(target), ..Route::default() }));
        let stop = Arc::new(AtomicBool::new(false));
        let (route2, stop2) = (Arc::clone(&route), Arc::clone(&stop));
        let accept = std::thread::Builder::new()
            .name(format!("forwarder-{}", addr.port()))
            .spawn(move || accept_loop(&listener, &route2, &stop2))?;
        Ok(Forwarder { addr, route, stop, accept: Some(accept) })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where new connections go now (`None`: cut).
    pub fn target(&self) -> Option<SocketAddr> {
        lock(&self.route).target
    }

    /// Follow the primary to `target`: every open connection is closed, new ones go there.
    pub fn move_to(&self, target: SocketAddr) {
        self.switch(Some(target));
    }

    /// Every open connection dies and new ones are closed on arrival, until `move_to`.
    pub fn cut(&self) {
        self.switch(None);
    }

    fn switch(&self, target: Option<SocketAddr>) {
        let mut route = lock(&self.route);
        route.target = target;
        route.generation += 1;
        for s in route.open.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn lock(route: &Mutex<Route>) -> std::sync::MutexGuard<'_, Route> {
    route.lock().unwrap_or_else(PoisonError::into_inner)
}

fn accept_loop(listener: &TcpListener, route: &Arc<Mutex<Route>>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((inbound, _)) => {
                let route = Arc::clone(route);
                // Connecting may take a while (a dead target): not on the accept thread.
                let _ = std::thread::Builder::new().name("forwarder-link".into()).spawn(move || link(inbound, &route));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Carry one connection to the target of the moment, until either side closes or the route moves.
fn link(inbound: TcpStream, route: &Mutex<Route>) {
    let (target, generation) = {
        let r = lock(route);
        (r.target, r.generation)
    };
    let Some(target) = target else { return };
    let _ = inbound.set_nonblocking(false);
    let Ok(outbound) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else { return };
    let _ = outbound.set_nodelay(true);
    let _ = inbound.set_nodelay(true);
    let (Ok(in2), Ok(out2)) = (inbound.try_clone(), outbound.try_clone()) else { return };
    {
        let mut r = lock(route);
        if r.generation != generation {
            // Moved while we connected: this connection belongs to the old target.
            return;
        }
        match (inbound.try_clone(), outbound.try_clone()) {
            (Ok(a), Ok(b)) => r.open.extend([a, b]),
            _ => return,
        }
    }
    let upstream = std::thread::Builder::new().name("forwarder-up".into()).spawn(move || pump(in2, out2));
    pump(outbound, inbound);
    if let Ok(t) = upstream {
        let _ = t.join();
    }
}

/// Copy `from` to `to` until `from` ends or fails, then close both directions of both.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-line echo server that prefixes what it echoes with its name.
    fn echo(name: &'static str) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(format!("{name}:").as_bytes()).is_err() {
                            break;
                        }
                        let _ = s.write_all(&buf[..n]);
                    }
                });
            }
        });
        addr
    }

    fn ask(s: &mut TcpStream, what: &str) -> String {
        s.write_all(what.as_bytes()).unwrap();
        let mut buf = [0u8; 64];
        let mut got = String::new();
        while !got.ends_with(what) {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            got.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        }
        got
    }

    #[test]
    fn moves_close_old_connections_and_send_new_ones_to_the_new_target() {
        let (a, b) = (echo("a"), echo("b"));
        let f = Forwarder::start(a).unwrap();
        let mut first = TcpStream::connect(f.addr()).unwrap();
        assert_eq!(ask(&mut first, "x"), "a:x");
        f.move_to(b);
        let mut buf = [0u8; 8];
        first.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(first.read(&mut buf), Ok(0) | Err(_)), "the old connection is closed");
        let mut second = TcpStream::connect(f.addr()).unwrap();
        assert_eq!(ask(&mut second, "y"), "b:y");
        f.cut();
        let mut third = TcpStream::connect(f.addr()).unwrap();
        third.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = third.write_all(b"z");
        assert!(matches!(third.read(&mut buf), Ok(0) | Err(_)), "cut: closed on arrival");
    }
}
