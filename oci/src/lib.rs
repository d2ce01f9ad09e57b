//! The filter as an OCI image, the way Istio pulls Wasm plugins, and the
//! deploy/ manifests read the way Istio reads them.
//!
//! [`image`]: the *compat* variant of the Wasm image specification
//! (github.com/solo-io/wasm, spec-compat.md), which Istio's fetcher
//! (`pkg/wasm/imagefetcher.go`, `extractOCIStandardImage`) accepts: an OCI
//! image manifest with exactly one `application/vnd.oci.image.layer.v1.tar+gzip`
//! layer holding a file `plugin.wasm` — what `FROM scratch` + `COPY plugin.wasm ./`
//! builds, without needing a Docker engine. Deterministic: fixed mtimes, owners
//! and modes, gzip without a timestamp, so the digests are reproducible.
//!
//! [`istio`]: a WasmPlugin's `pluginConfig` turned into the JSON string the
//! filter receives, as istiod does it.

#![forbid(unsafe_code)]

pub mod image;
pub mod istio;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// `sha256:<hex>` of `bytes`, the OCI digest form.
pub fn digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}
