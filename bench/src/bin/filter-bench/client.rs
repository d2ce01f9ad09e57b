//! A minimal HTTP/1.1 keep-alive load client, and the requests the cases send.
//!
//! Hand-rolled so the load generator costs little CPU next to Envoy on a 2-core
//! machine: requests are pre-serialized, responses are framed (content-length
//! or chunked) and their body kept for the few checks that need it.

use base64::Engine as _;
use idem_e2e::{transfer, BoxError, SUBJECT};
use serde_json::Value;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: bench\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn bad_data(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

struct Conn {
    port: u16,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
    body: Vec<u8>,
}

impl Conn {
    fn new(port: u16) -> Conn {
        Conn { port, stream: None, buf: Vec::with_capacity(16 * 1024), body: Vec::with_capacity(4096) }
    }

    /// Send one request and read one response; the body is in `self.body`.
    async fn exchange(&mut self, req: &[u8]) -> io::Result<u16> {
        let r = match tokio::time::timeout(EXCHANGE_TIMEOUT, self.exchange_inner(req)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time")),
        };
        if r.is_err() {
            self.stream = None;
        }
        r
    }

    async fn exchange_inner(&mut self, req: &[u8]) -> io::Result<u16> {
        if self.stream.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let Some(stream) = self.stream.as_mut() else { return Err(bad_data("no connection")) };
        stream.write_all(req).await?;
        let (status, close) = read_response(stream, &mut self.buf, &mut self.body).await?;
        if close {
            self.stream = None;
        }
        Ok(status)
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.reserve(8192);
    if stream.read_buf(buf).await? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed mid-response"));
    }
    Ok(())
}

/// One response: (status, connection closes after it).
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>, body: &mut Vec<u8>) -> io::Result<(u16, bool)> {
    buf.clear();
    body.clear();
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        read_more(stream, buf).await?;
    };
    let head = std::str::from_utf8(buf.get(..head_end).unwrap_or_default()).map_err(|_| bad_data("head not UTF-8"))?;
    let status: u16 =
        head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad_data("no status in the response"))?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    for line in head.split("\r\n").skip(1) {
        let Some((k, v)) = line.split_once(':') else { continue };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            length = v.parse::<usize>().ok();
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        } else if k.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    if chunked {
        let mut pos = head_end;
        loop {
            let line_end = loop {
                if let Some(i) = buf.get(pos..).and_then(|b| find(b, b"\r\n")) {
                    break pos + i;
                }
                read_more(stream, buf).await?;
            };
            let line = std::str::from_utf8(buf.get(pos..line_end).unwrap_or_default()).unwrap_or_default();
            let size = usize::from_str_radix(line.split(';').next().unwrap_or_default().trim(), 16)
                .map_err(|_| bad_data("bad chunk size"))?;
            let data = line_end + 2;
            if size == 0 {
                // No trailers expected: the last chunk ends with an empty line.
                while buf.len() < data + 2 {
                    read_more(stream, buf).await?;
                }
                break;
            }
            while buf.len() < data + size + 2 {
                read_more(stream, buf).await?;
            }
            body.extend_from_slice(buf.get(data..data + size).unwrap_or_default());
            pos = data + size + 2;
        }
    } else if let Some(n) = length {
        while buf.len() < head_end + n {
            read_more(stream, buf).await?;
        }
        body.extend_from_slice(buf.get(head_end..head_end + n).unwrap_or_default());
    } else if !(status < 200 || status == 204 || status == 304) {
        // Close-delimited body.
        loop {
            match read_more(stream, buf).await {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e),
            }
        }
        body.extend_from_slice(buf.get(head_end..).unwrap_or_default());
        close = true;
    }
    Ok((status, close))
}

#[derive(Clone)]
pub(crate) enum Requests {
    /// The same request, over and over.
    Same(Arc<Vec<u8>>),
    /// Each request once (fresh confirms); the run ends early when they run out.
    EachOnce(Arc<Vec<Vec<u8>>>, Arc<AtomicUsize>),
}

#[derive(Default)]
pub(crate) struct Measured {
    pub(crate) ok: u64,
    pub(crate) unexpected: u64,
    pub(crate) errors: u64,
    pub(crate) secs: f64,
    pub(crate) exhausted: bool,
    pub(crate) lat: Vec<Duration>,
    pub(crate) sample: Option<String>,
}

impl Measured {
    pub(crate) fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ok as f64 / self.secs
        } else {
            0.0
        }
    }

    pub(crate) fn p50_ms(&mut self) -> f64 {
        if self.lat.is_empty() {
            return 0.0;
        }
        self.lat.sort_unstable();
        self.lat.get(self.lat.len() / 2).map(|d| d.as_secs_f64() * 1000.0).unwrap_or(0.0)
    }

    pub(crate) fn merge(&mut self, o: Measured) {
        self.ok += o.ok;
        self.unexpected += o.unexpected;
        self.errors += o.errors;
        self.exhausted |= o.exhausted;
        self.lat.extend(o.lat);
        if self.sample.is_none() {
            self.sample = o.sample;
        }
    }

    pub(crate) fn problems(&self) -> String {
        let mut s = String::new();
        if self.unexpected > 0 || self.errors > 0 {
            s = format!("  [{} unexpected, {} errors", self.unexpected, self.errors);
            if let Some(sample) = &self.sample {
                s.push_str(&format!("; e.g. {sample}"));
            }
            s.push(']');
        }
        if self.exhausted {
            s.push_str("  [ran out of fingerprints before the deadline]");
        }
        s
    }
}

async fn http_worker(port: u16, reqs: Requests, expect: u16, deadline: Instant) -> Measured {
    let mut conn = Conn::new(port);
    let mut m = Measured { lat: Vec::with_capacity(1 << 14), ..Default::default() };
    while Instant::now() < deadline {
        let req = match &reqs {
            Requests::Same(r) => r.as_slice(),
            Requests::EachOnce(all, next) => match all.get(next.fetch_add(1, Ordering::Relaxed)) {
                Some(r) => r.as_slice(),
                None => {
                    m.exhausted = true;
                    break;
                }
            },
        };
        let t = Instant::now();
        match conn.exchange(req).await {
            Ok(s) if s == expect => {
                m.ok += 1;
                m.lat.push(t.elapsed());
            }
            Ok(s) => {
                m.unexpected += 1;
                if m.sample.is_none() {
                    let body: String = String::from_utf8_lossy(&conn.body).chars().take(240).collect();
                    m.sample = Some(format!("HTTP {s} {body}"));
                }
            }
            Err(e) => {
                m.errors += 1;
                if m.sample.is_none() {
                    m.sample = Some(format!("{e}"));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    m
}

/// `conns` keep-alive connections send `reqs` to `port` for `secs`.
pub(crate) async fn drive(port: u16, reqs: &Requests, expect: u16, conns: usize, secs: f64) -> Measured {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        set.spawn(http_worker(port, reqs.clone(), expect, deadline));
    }
    let mut total = Measured::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(m) => total.merge(m),
            Err(e) => total.sample = Some(format!("worker failed: {e}")),
        }
    }
    total.secs = start.elapsed().as_secs_f64();
    total
}

/// One exchange on a fresh connection, for the checks before the timed phases.
pub(crate) async fn once(port: u16, req: &[u8]) -> Result<(u16, Value, String), BoxError> {
    let mut c = Conn::new(port);
    let status = c.exchange(req).await?;
    let text = String::from_utf8_lossy(&c.body).into_owned();
    Ok((status, serde_json::from_slice(&c.body).unwrap_or(Value::Null), text))
}

/// Preview through the filter `n` times and keep the fingerprints (untimed).
pub(crate) async fn mint(port: u16, n: usize, conns: usize) -> Result<Vec<String>, BoxError> {
    let req = Arc::new(preview_request("/v1/transfers/preview"));
    let issued = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let (req, issued) = (req.clone(), issued.clone());
        set.spawn(async move {
            let mut conn = Conn::new(port);
            let mut out = Vec::new();
            while issued.fetch_add(1, Ordering::Relaxed) < n {
                let status = conn.exchange(&req).await.map_err(|e| e.to_string())?;
                let v: Value = serde_json::from_slice(&conn.body).unwrap_or(Value::Null);
                match (status, v["fingerprint"].as_str()) {
                    (200, Some(fp)) => out.push(fp.to_owned()),
                    _ => return Err(format!("preview answered {status}: {}", String::from_utf8_lossy(&conn.body))),
                }
            }
            Ok::<_, String>(out)
        });
    }
    let mut all = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        all.extend(r??);
    }
    Ok(all)
}

pub(crate) fn body() -> Vec<u8> {
    serde_json::to_vec(&transfer(Value::String("100.00".into()), "bench")).unwrap_or_default()
}

pub(crate) fn preview_request(path: &str) -> Vec<u8> {
    request("POST", path, &[("x-agent-subject", SUBJECT)], &body())
}

pub(crate) fn confirm_request(fingerprint: &str, idempotency_key: Option<&str>) -> Vec<u8> {
    confirm_request_to("/v1/transfers", fingerprint, idempotency_key)
}

/// The same confirm (headers and body) to another path, e.g. a standalone proxy's route to the demo.
pub(crate) fn confirm_request_to(path: &str, fingerprint: &str, idempotency_key: Option<&str>) -> Vec<u8> {
    let mut h = vec![("x-agent-subject", SUBJECT), ("agent-fingerprint", fingerprint)];
    if let Some(k) = idempotency_key {
        h.push(("idempotency-key", k));
    }
    request("POST", path, &h, &body())
}

pub(crate) fn nonce_of(fingerprint: &str) -> Option<String> {
    let payload = fingerprint.split('.').next()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    let claims: Value = serde_json::from_slice(&bytes).ok()?;
    claims["n"].as_str().map(str::to_owned)
}
