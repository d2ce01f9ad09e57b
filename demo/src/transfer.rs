//! The transfer request as both endpoints accept it, and the few rules a bank
//! would apply before quoting or moving money.

use serde::Deserialize;
use serde_json::Value;
use std::time::{SystemTime, UNIX_EPOCH};

/// Largest amount a single confirm may move; above it the service answers a
/// definite 422, which the gateway must record as FAILED rather than retry.
pub const LIMIT: f64 = 10_000.0;

/// Flat fee every quote carries.
pub const FEE: &str = "1.00";

/// How long a quote stays valid (seconds).
pub const QUOTE_TTL_SECS: u64 = 900;

#[derive(Debug, Deserialize)]
pub struct TransferRequest {
    /// Kept as the caller's JSON value (number literal or decimal string) so
    /// it is echoed byte for byte: `arbitrary_precision` holds the literal.
    pub amount: Value,
    pub currency: String,
    pub payee_id: String,
    /// Free text: optional, because agents drop or rephrase it between calls.
    #[serde(default)]
    pub memo: Option<String>,
    /// The caller's own reference for this transfer, stored with it: how a caller finds a
    /// transfer again where the service ignores Idempotency-Key (`--no-keys`).
    #[serde(default)]
    pub client_ref: Option<String>,
}

/// The longest `client_ref` accepted (characters).
pub const MAX_CLIENT_REF: usize = 256;

impl TransferRequest {
    /// Parses and validates a request body; the error is the `detail` of a 400.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let req: TransferRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        if req.currency.trim().is_empty() {
            return Err("currency must not be empty".into());
        }
        if req.payee_id.trim().is_empty() {
            return Err("payee_id must not be empty".into());
        }
        if let Some(r) = &req.client_ref {
            if r.is_empty() || r.chars().count() > MAX_CLIENT_REF || r.chars().any(char::is_control) {
                return Err(format!("client_ref must be 1 to {MAX_CLIENT_REF} characters, none of them control"));
            }
        }
        let amount = req.amount_value()?;
        if !(amount.is_finite() && amount > 0.0) {
            return Err("amount must be a positive decimal".into());
        }
        Ok(req)
    }

    /// The amount as f64, only ever used for threshold checks (the echoed
    /// value never goes through it).
    pub fn amount_value(&self) -> Result<f64, String> {
        match &self.amount {
            Value::Number(n) => n.as_f64().ok_or_else(|| "amount is not a number".into()),
            Value::String(s) if is_decimal(s) => s.parse().map_err(|_| "amount is not a decimal".into()),
            Value::String(_) => Err("amount string must be a plain decimal like \"12.50\"".into()),
            _ => Err("amount must be a number or a decimal string".into()),
        }
    }

    pub fn over_limit(&self) -> bool {
        self.amount_value().is_ok_and(|a| a > LIMIT)
    }
}

/// `-?digits(.digits)?`: what a person writes as money, no exponent, no spaces.
fn is_decimal(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = match digits.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (digits, None),
    };
    let all_digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    all_digits(int) && frac.is_none_or(all_digits)
}

/// `prefix` + 16 random hex chars.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 8];
    // The OS RNG failing is not something a demo can recover from.
    getrandom::fill(&mut bytes).unwrap_or_else(|e| panic!("OS random source failed: {e}"));
    format!("{prefix}{}", hex::encode(bytes))
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_amount_literal() {
        let req = TransferRequest::parse(br#"{"amount":12.50,"currency":"EUR","payee_id":"p"}"#).unwrap();
        assert_eq!(serde_json::to_string(&req.amount).unwrap(), "12.50");
        let req = TransferRequest::parse(br#"{"amount":"0012.5","currency":"EUR","payee_id":"p"}"#).unwrap();
        assert_eq!(req.amount, Value::String("0012.5".into()));
    }

    #[test]
    fn rejects_bad_amounts() {
        for amount in [r#""12,5""#, r#""1e3""#, r#"" 12""#, "0", "-3", "null", r#""""#, "true"] {
            let body = format!(r#"{{"amount":{amount},"currency":"EUR","payee_id":"p"}}"#);
            assert!(TransferRequest::parse(body.as_bytes()).is_err(), "{amount}");
        }
    }

    #[test]
    fn client_refs_are_optional_text() {
        let base = r#""amount":"5","currency":"EUR","payee_id":"p""#;
        let with = |r: &str| TransferRequest::parse(format!("{{{base},\"client_ref\":{r}}}").as_bytes());
        assert_eq!(TransferRequest::parse(format!("{{{base}}}").as_bytes()).unwrap().client_ref, None);
        assert_eq!(with(r#""inv-7/2026""#).unwrap().client_ref.as_deref(), Some("inv-7/2026"));
        for bad in [
            r#""""#,
            "7",
            r#""a
b""#,
            &format!("\"{}\"", "x".repeat(257)),
        ] {
            assert!(with(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limit_is_inclusive() {
        let at = TransferRequest::parse(br#"{"amount":"10000.00","currency":"EUR","payee_id":"p"}"#).unwrap();
        assert!(!at.over_limit());
        let over = TransferRequest::parse(br#"{"amount":10000.01,"currency":"EUR","payee_id":"p"}"#).unwrap();
        assert!(over.over_limit());
    }

    #[test]
    fn ids_have_the_documented_shape() {
        let id = new_id("t_");
        assert_eq!(id.len(), 18);
        assert!(id[2..].bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
