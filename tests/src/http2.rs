//! An HTTP/2 client with prior knowledge (h2c, no TLS, no upgrade) on the `h2` crate, for the requests an
//! ordinary client never makes: a body that ends in trailers (HEADERS, DATA without END_STREAM, then a
//! trailers HEADERS frame with END_STREAM), a request that is only headers and trailers, and header fields
//! repeated as the caller lists them. Envoy's HTTP connection manager (`codec_type` AUTO, the default in
//! envoy/e2e.yaml and istio-like.yaml) takes h2c prior knowledge on the same listener as HTTP/1.1.

use crate::{Answer, BoxError};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use std::time::Duration;

/// One request, frame by frame.
#[derive(Debug, Clone, Default)]
pub struct H2Request {
    pub method: String,
    pub path: String,
    /// In order; a name listed twice is sent as two header fields.
    pub headers: Vec<(String, String)>,
    /// One DATA frame each (an empty list: no DATA at all).
    pub data: Vec<Vec<u8>>,
    /// `Some`: the stream ends with a trailers frame (END_STREAM on it, none on the DATA); `None`: the last
    /// DATA frame (or the HEADERS, without data) ends the stream.
    pub trailers: Option<Vec<(String, String)>>,
}

impl H2Request {
    pub fn post(path: &str) -> H2Request {
        H2Request { method: "POST".into(), path: path.into(), ..Default::default() }
    }

    pub fn header(mut self, name: &str, value: &str) -> H2Request {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A JSON body in one DATA frame, with its content type (and no content-length: h2 needs none).
    pub fn json(self, body: &serde_json::Value) -> H2Request {
        self.header("content-type", "application/json").data(body.to_string().into_bytes())
    }

    pub fn data(mut self, chunk: Vec<u8>) -> H2Request {
        self.data.push(chunk);
        self
    }

    /// End the stream with these trailers.
    pub fn trailers(mut self, fields: &[(&str, &str)]) -> H2Request {
        self.trailers = Some(fields.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect());
        self
    }
}

/// What came back: the answer, and the response's trailers if it had any.
#[derive(Debug)]
pub struct H2Answer {
    pub answer: Answer,
    pub trailers: Option<HeaderMap>,
}

fn header_map(fields: &[(String, String)]) -> Result<HeaderMap, BoxError> {
    let mut map = HeaderMap::new();
    for (k, v) in fields {
        map.append(HeaderName::from_bytes(k.as_bytes())?, HeaderValue::from_str(v)?);
    }
    Ok(map)
}

/// Send `req` on a new connection to 127.0.0.1:`port` and read the whole answer (30 s at most).
pub async fn send(port: u16, req: &H2Request) -> Result<H2Answer, BoxError> {
    match tokio::time::timeout(Duration::from_secs(30), exchange(port, req)).await {
        Ok(r) => r,
        Err(_) => Err(format!("no HTTP/2 answer within 30 s to {} {}", req.method, req.path).into()),
    }
}

async fn exchange(port: u16, req: &H2Request) -> Result<H2Answer, BoxError> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let (client, connection) = ::h2::client::handshake(tcp).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut client = client.ready().await?;
    let uri = format!("http://127.0.0.1:{port}{}", req.path);
    let mut request = http::Request::builder().method(req.method.as_str()).uri(uri).body(())?;
    *request.headers_mut() = header_map(&req.headers)?;
    let end_on_headers = req.data.is_empty() && req.trailers.is_none();
    let (response, mut stream) = client.send_request(request, end_on_headers)?;
    // The gateway may answer (and reset the stream) before the request is complete: a failed send is
    // no error as long as an answer arrives.
    let mut send_error = None;
    for (i, chunk) in req.data.iter().enumerate() {
        let last = i + 1 == req.data.len() && req.trailers.is_none();
        if let Err(e) = stream.send_data(Bytes::from(chunk.clone()), last) {
            send_error = Some(e);
            break;
        }
    }
    if let (Some(trailers), None) = (&req.trailers, &send_error) {
        if let Err(e) = stream.send_trailers(header_map(trailers)?) {
            send_error = Some(e);
        }
    }
    let response = match response.await {
        Ok(r) => r,
        Err(e) => {
            driver.abort();
            return Err(format!("HTTP/2 request failed: {e} (sending: {send_error:?})").into());
        }
    };
    let (parts, mut body) = response.into_parts();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await?;
    driver.abort();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Ok(H2Answer {
        answer: Answer { status: parts.status.as_u16(), headers: parts.headers, body: bytes, json },
        trailers,
    })
}
