//! A look inside fingerprints (DESIGN §3: base64url JSON payload "." MAC), unverified.

use crate::BoxError;
use serde_json::Value;

/// The claims (`n`, `u`, `s`, `p`, `exp`, …) of a fingerprint.
pub fn claims(fingerprint: &str) -> Result<Value, BoxError> {
    use base64::Engine as _;
    let payload = fingerprint.split('.').next().ok_or("empty fingerprint")?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload)?;
    Ok(serde_json::from_slice(&bytes)?)
}

/// The nonce: idemd's key and the downstream's Idempotency-Key.
pub fn nonce(fingerprint: &str) -> Result<String, BoxError> {
    Ok(claims(fingerprint)?["n"].as_str().ok_or("no nonce in the fingerprint")?.to_owned())
}
