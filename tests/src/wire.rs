//! HTTP/1.1 written by hand, byte for byte, for what no client library sends: a Content-Length that lies,
//! chunk extensions and trailers, `Expect: 100-continue` handled at the wire, header lines in any number
//! and order. One request per connection; the answer is read until it is complete (by Content-Length or
//! the last chunk) or the connection closes.

use crate::{Answer, BoxError};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `METHOD path HTTP/1.1`, `Host`, the given header lines (as they are), a blank line: the head of a
/// request whose body the caller frames itself.
pub fn head(method: &str, path: &str, lines: &[String]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n");
    for line in lines {
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.into_bytes()
}

/// A body in chunks, each chunk's size line carrying `extension` (e.g. `;ext=1`), then `trailers` lines.
pub fn chunked(chunks: &[&[u8]], extension: &str, trailers: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(format!("{:x}{extension}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("0{extension}\r\n").as_bytes());
    for t in trailers {
        out.extend_from_slice(t.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// What happened on the connection.
#[derive(Debug)]
pub struct Exchange {
    /// The final (non-1xx) answer, if one came.
    pub answer: Option<Answer>,
    /// Interim answers (`100 Continue`), by status.
    pub interim: Vec<u16>,
    /// Bytes after the answer (a second answer on the same connection, say).
    pub rest: Vec<u8>,
}

/// Write `bytes`, optionally half-close (`shutdown`), and read for at most `wait`.
pub async fn exchange(port: u16, bytes: &[u8], shutdown: bool, wait: Duration) -> Result<Exchange, BoxError> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.write_all(bytes).await?;
    if shutdown {
        tcp.shutdown().await?;
    }
    read_answer(&mut tcp, wait).await
}

/// Write `first`, wait for an interim or final answer's first bytes (at most `wait`), then write `second`.
pub async fn exchange_in_two(port: u16, first: &[u8], second: &[u8], wait: Duration) -> Result<Exchange, BoxError> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.write_all(first).await?;
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout_at(deadline, tcp.read(&mut chunk)).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            Ok(Err(e)) => return Err(e.into()),
        }
    }
    let interim_only = parse(&buf).is_some_and(|(status, _, _)| (100..200).contains(&status));
    if interim_only || buf.is_empty() {
        let _ = tcp.write_all(second).await;
    }
    read_answer_from(&mut tcp, buf, wait).await
}

/// Write `bytes` (several pipelined requests, say), read until the connection closes or `wait` passes, and
/// return every complete final answer in order.
pub async fn exchange_all(port: u16, bytes: &[u8], wait: Duration) -> Result<Vec<Answer>, BoxError> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.write_all(bytes).await?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut chunk)).await {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
            Ok(Ok(n)) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
        }
    }
    let mut answers = Vec::new();
    let mut rest = buf;
    while let Some(Exchange { answer: Some(a), rest: r, .. }) = complete(&rest) {
        answers.push(a);
        rest = r;
    }
    Ok(answers)
}

async fn read_answer(tcp: &mut tokio::net::TcpStream, wait: Duration) -> Result<Exchange, BoxError> {
    read_answer_from(tcp, Vec::new(), wait).await
}

async fn read_answer_from(
    tcp: &mut tokio::net::TcpStream,
    mut buf: Vec<u8>,
    wait: Duration,
) -> Result<Exchange, BoxError> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut chunk = [0u8; 16384];
    loop {
        if let Some(done) = complete(&buf) {
            return Ok(done);
        }
        match tokio::time::timeout_at(deadline, tcp.read(&mut chunk)).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            // A reset after the answer was written: what arrived is the answer.
            Ok(Err(_)) => break,
        }
    }
    Ok(complete(&buf).unwrap_or_else(|| Exchange { answer: None, interim: interims(&buf), rest: buf }))
}

fn interims(mut buf: &[u8]) -> Vec<u16> {
    let mut out = Vec::new();
    while let Some((status, _, len)) = parse(buf) {
        if !(100..200).contains(&status) {
            break;
        }
        out.push(status);
        buf = buf.get(len..).unwrap_or_default();
    }
    out
}

/// (status, headers, head length) of the answer head at the start of `buf`.
fn parse(buf: &[u8]) -> Option<(u16, HeaderMap, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = String::from_utf8_lossy(buf.get(..end)?).into_owned();
    let mut lines = text.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let mut headers = HeaderMap::new();
    for line in lines.filter(|l| !l.is_empty()) {
        let (k, v) = line.split_once(':')?;
        headers.append(HeaderName::from_bytes(k.trim().as_bytes()).ok()?, HeaderValue::from_str(v.trim()).ok()?);
    }
    Some((status, headers, end))
}

/// The complete final answer in `buf` (after any 1xx), if it is all there.
fn complete(buf: &[u8]) -> Option<Exchange> {
    let mut interim = Vec::new();
    let mut at = 0;
    loop {
        let (status, headers, len) = parse(buf.get(at..)?)?;
        at += len;
        if (100..200).contains(&status) {
            interim.push(status);
            continue;
        }
        let rest = buf.get(at..)?;
        let (body, used) = if headers.get("transfer-encoding").is_some_and(|v| v.as_bytes().ends_with(b"chunked")) {
            dechunk(rest)?
        } else {
            let len: usize = headers.get("content-length").and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0);
            (rest.get(..len)?.to_vec(), len)
        };
        let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        let answer = Answer { status, headers, body, json };
        return Some(Exchange { answer: Some(answer), interim, rest: rest.get(used..)?.to_vec() });
    }
}

/// A chunked body's bytes and how many bytes of `buf` it took, if complete.
fn dechunk(buf: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let line_end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")? + at;
        let size_text = String::from_utf8_lossy(buf.get(at..line_end)?).into_owned();
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            // Trailers, up to the blank line.
            let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
            if end == 0 {
                return Some((out, at + 2));
            }
            let all = buf.get(at..)?.windows(4).position(|w| w == b"\r\n\r\n")?;
            return Some((out, at + all + 4));
        }
        out.extend_from_slice(buf.get(at..at + size)?);
        at += size + 2;
    }
}
