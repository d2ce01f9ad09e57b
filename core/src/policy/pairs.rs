//! Envoy's pairs encoding of a metadata struct: how a route's annotation reaches the `.wasm`
//! in one property read, and the bytes the native module builds from its per-route
//! configuration, so both hosts key the route cache by the same bytes.

/// Envoy hands string leaves as bytes and number leaves as doubles.
#[derive(Debug, Clone, PartialEq)]
pub enum LeafValue {
    Str(String),
    Num(f64),
}

/// Envoy's answer to `get_property` on a metadata struct (the route's whole
/// `agent_idempotency` annotation): proxy-wasm's pairs encoding — a little-endian
/// u32 count, then a (key length, value length) u32 pair per entry, then each key
/// and value followed by a NUL. String leaves are UTF-8, number leaves 8 bytes of
/// a double (see [`leaf_value`]). `None` if the bytes are not that shape.
pub fn decode_pairs(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let u32_at = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(b)).ok()
    };
    let count = u32_at(0)?;
    // Every entry costs at least 10 bytes: two lengths and two NULs.
    if count > bytes.len() / 10 + 1 {
        return None;
    }
    let mut sizes = Vec::with_capacity(count);
    let mut at = 4usize;
    for _ in 0..count {
        sizes.push((u32_at(at)?, u32_at(at.checked_add(4)?)?));
        at = at.checked_add(8)?;
    }
    let mut out = Vec::with_capacity(count);
    for (key_len, value_len) in sizes {
        let key = bytes.get(at..at.checked_add(key_len)?)?;
        at = at.checked_add(key_len)?;
        if bytes.get(at) != Some(&0) {
            return None;
        }
        at = at.checked_add(1)?;
        let value = bytes.get(at..at.checked_add(value_len)?)?;
        at = at.checked_add(value_len)?;
        if bytes.get(at) != Some(&0) {
            return None;
        }
        at = at.checked_add(1)?;
        out.push((String::from_utf8(key.to_vec()).ok()?, value.to_vec()));
    }
    (at == bytes.len()).then_some(out)
}

/// The pairs encoding of `entries` (the inverse of [`decode_pairs`]), for tests and tools.
pub fn encode_pairs(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&u32::try_from(entries.len()).unwrap_or(u32::MAX).to_le_bytes());
    for (k, v) in entries {
        out.extend_from_slice(&u32::try_from(k.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&u32::try_from(v.len()).unwrap_or(u32::MAX).to_le_bytes());
    }
    for (k, v) in entries {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Decode one annotation leaf as Envoy returns it from `get_property`: a
/// string leaf as raw UTF-8, a number leaf as 8 bytes of a little-endian
/// double. The key tells which one to expect; anything else goes to the
/// parser as text, which rejects "15m" loudly.
/// Whether an annotation field holds a number (a TTL or a delay: `…_s`, `…_ms`).
pub fn is_numeric_key(key: &str) -> bool {
    key.ends_with("_s") || key.ends_with("_ms")
}

pub fn leaf_value(key: &str, raw: Vec<u8>) -> LeafValue {
    let numeric = is_numeric_key(key);
    if numeric && raw.len() == 8 && !raw.iter().all(u8::is_ascii_digit) {
        if let Ok(bytes) = <[u8; 8]>::try_from(raw.as_slice()) {
            return LeafValue::Num(f64::from_le_bytes(bytes));
        }
    }
    LeafValue::Str(String::from_utf8_lossy(&raw).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes Envoy 1.40 returned for a route's annotation struct (recorded in a
    /// real run): a number leaf is 8 bytes of a double, strings are UTF-8.
    #[test]
    fn the_annotation_struct_decodes_as_envoy_sends_it() -> Result<(), Box<dyn std::error::Error>> {
        let ttl = 900f64.to_le_bytes();
        let bytes = encode_pairs(&[("fingerprint_ttl_s", &ttl), ("role", b"preview"), ("scope", b"payments.transfer")]);
        let pairs = decode_pairs(&bytes).ok_or("does not decode")?;
        assert_eq!(pairs.len(), 3);
        let get = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| leaf_value(k, v.clone()));
        assert_eq!(get("fingerprint_ttl_s"), Some(LeafValue::Num(900.0)));
        assert_eq!(get("role"), Some(LeafValue::Str("preview".into())));
        for bad in [&bytes[..bytes.len() - 1], &bytes[..3], b"\xff\xff\xff\xff".as_slice(), b"".as_slice()] {
            assert_eq!(decode_pairs(bad), None);
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(decode_pairs(&trailing), None);
        Ok(())
    }
}
