//! Client-key mode: the caller's own `Idempotency-Key` header
//! (draft-ietf-httpapi-idempotency-key-header-07) on the same state machine.
//!
//! The header is an RFC 8941 structured-field string (`"8e03978e-…"`); the bare
//! token form (`8e03978e-…`) is accepted too, since many clients send it. The
//! operation key idemd stores is derived from (subject, scope, client key), so
//! two callers who pick the same key never share an operation, and the
//! upstream sees that derived key, one per operation.

use crate::canonical::{self, BoundField};
use crate::protocol::OpKey;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Longest accepted key, after unescaping (the draft sets no limit; UUIDs are 36).
pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    Missing,
    /// Why the value is not one key.
    Invalid(&'static str),
}

/// The key in an `Idempotency-Key` header value.
pub fn parse_header(value: Option<&str>) -> Result<String, KeyError> {
    let raw = value.map(str::trim).filter(|v| !v.is_empty()).ok_or(KeyError::Missing)?;
    let key = match raw.strip_prefix('"') {
        Some(rest) => sf_string(rest)?,
        None => {
            let bare = |c: char| c.is_ascii_alphanumeric() || "-._~:/+=@!$%&'*#^`|".contains(c);
            if raw.contains(',') {
                return Err(KeyError::Invalid("one key per request: the header holds a list"));
            }
            if !raw.chars().all(bare) {
                return Err(KeyError::Invalid("a bare key may use letters, digits and - . _ ~ : / + = only"));
            }
            raw.to_string()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Invalid("the key is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::Invalid("the key is longer than 255 characters"));
    }
    Ok(key)
}

/// The rest of an RFC 8941 sf-string after its opening quote: printable ASCII,
/// `\"` and `\\` escapes, and nothing after the closing quote.
fn sf_string(rest: &str) -> Result<String, KeyError> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    loop {
        match chars.next() {
            None => return Err(KeyError::Invalid("the quoted key has no closing quote")),
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => out.push(c),
                _ => return Err(KeyError::Invalid("only \\\" and \\\\ may be escaped in a quoted key")),
            },
            Some(c) if (' '..='~').contains(&c) => out.push(c),
            Some(_) => return Err(KeyError::Invalid("a quoted key is printable ASCII")),
        }
    }
    match chars.as_str().trim() {
        "" => Ok(out),
        tail if tail.starts_with(',') => Err(KeyError::Invalid("one key per request: the header holds a list")),
        _ => Err(KeyError::Invalid("nothing may follow the quoted key")),
    }
}

/// The operation key for a client key: bound to the subject and the scope.
pub fn operation_key(subject_hash: &str, scope: &str, client_key: &str) -> OpKey {
    let mut h = Sha256::new();
    for part in ["idem-client-key-v1", subject_hash, scope, client_key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let bytes: [u8; 16] = digest.get(..16).and_then(|b| b.try_into().ok()).unwrap_or([0u8; 16]);
    OpKey::from_bytes(bytes)
}

/// What "the same payload" means for a route that binds no fields: method,
/// path and the whole body (canonical JSON when it is JSON, else its bytes).
pub fn request_hash(method: &str, path: &str, body: &[u8], json: Option<&Value>) -> String {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update(b" ");
    h.update(path.as_bytes());
    h.update(b"\n");
    let canonical = json.and_then(|v| canonical::canonical_params(v, &[BoundField::new("", false)]).ok());
    match canonical {
        Some(text) => {
            h.update(b"json:");
            h.update(text.as_bytes());
        }
        None => {
            h.update(b"raw:");
            h.update(body);
        }
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quoted_and_bare_keys() {
        assert_eq!(
            parse_header(Some(r#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)).as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(
            parse_header(Some("8e03978e-40d5-43e8-bc93-6894a57f9324")).as_deref(),
            Ok("8e03978e-40d5-43e8-bc93-6894a57f9324")
        );
        assert_eq!(parse_header(Some(r#" "a \"b\" \\c" "#)).as_deref(), Ok(r#"a "b" \c"#));
        assert_eq!(parse_header(None), Err(KeyError::Missing));
        assert_eq!(parse_header(Some("  ")), Err(KeyError::Missing));
        for bad in [r#""a", "b""#, "a,b", r#""open"#, r#""a"b"#, r#""\n""#, "a b", r#""""#, "é"] {
            assert!(matches!(parse_header(Some(bad)), Err(KeyError::Invalid(_))), "{bad}");
        }
        assert!(parse_header(Some(&"k".repeat(255))).is_ok());
        assert!(parse_header(Some(&"k".repeat(256))).is_err());
        assert!(parse_header(Some(&format!("\"{}\"", "k".repeat(256)))).is_err());
    }

    #[test]
    fn operation_keys_are_per_subject_and_scope() {
        let a = operation_key("alice", "pay", "k-1");
        assert_eq!(a, operation_key("alice", "pay", "k-1"));
        assert_ne!(a, operation_key("bob", "pay", "k-1"));
        assert_ne!(a, operation_key("alice", "refund", "k-1"));
        assert_ne!(a, operation_key("alice", "pay", "k-2"));
        // Length-prefixed parts: no two splits of one string collide.
        assert_ne!(operation_key("ab", "c", "k"), operation_key("a", "bc", "k"));
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn request_hash_is_canonical_for_json() {
        let one = json!({"b": 1, "a": "x"});
        let two = json!({"a": "x", "b": 1.0});
        assert_eq!(request_hash("POST", "/p", b"", Some(&one)), request_hash("POST", "/p", b"", Some(&two)));
        assert_ne!(request_hash("POST", "/p", b"", Some(&one)), request_hash("PUT", "/p", b"", Some(&one)));
        assert_ne!(request_hash("POST", "/p", b"", Some(&one)), request_hash("POST", "/q", b"", Some(&one)));
        assert_ne!(request_hash("POST", "/p", b"x", None), request_hash("POST", "/p", b"y", None));
    }
}
