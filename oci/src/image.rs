//! One image: `plugin.wasm` in a single tar+gzip layer, an image config, an OCI
//! manifest; written as an OCI image layout directory and as one tar that both
//! `docker load` (its `manifest.json`/`repositories`) and OCI tools (`index.json`,
//! `oci-layout`) read — the same shape `docker save` writes since Docker 25.

use crate::{digest, Error};
use serde_json::{json, Value};
use std::path::Path;

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// The only layer type Istio's compat-variant fetcher accepts in an OCI manifest.
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The file name Istio looks for in the layer.
pub const WASM_FILE: &str = "plugin.wasm";
/// `docker load`'s file name inside the docker tar.
pub const DOCKER_TAR: &str = "agent-idempotency-filter.tar";
pub const DEFAULT_NAME: &str = "agent-idempotency-filter";

/// The image's name and tag (`agent-idempotency-filter:0.1.0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub name: String,
    pub tag: String,
}

impl Reference {
    /// `name:tag`; the tag is whatever follows the last `:` after the last `/` (a registry port is not a tag).
    pub fn parse(s: &str) -> Result<Reference, Error> {
        let slash = s.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match s[slash..].rfind(':') {
            Some(i) => (&s[..slash + i], &s[slash + i + 1..]),
            None => (s, "latest"),
        };
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && tag.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
            && !tag.starts_with(['.', '-']);
        if name.is_empty() || !tag_ok || name.chars().any(|c| c.is_ascii_uppercase() || c.is_whitespace()) {
            return Err(format!("not an image reference (lower-case name, `:tag` of [A-Za-z0-9_.-]): {s:?}").into());
        }
        Ok(Reference { name: name.to_owned(), tag: tag.to_owned() })
    }
}

impl Reference {
    /// The fully qualified name containerd (and `docker save`) record: `docker.io/library/` is implied for a
    /// bare name, `docker.io/` for `user/name`; a first component with `.` or `:`, or `localhost`, is a registry.
    pub fn full_name(&self) -> String {
        let registry = self
            .name
            .split_once('/')
            .map(|(first, _)| first)
            .filter(|f| f.contains('.') || f.contains(':') || *f == "localhost");
        match (registry, self.name.contains('/')) {
            (Some(_), _) => self.to_string(),
            (None, true) => format!("docker.io/{self}"),
            (None, false) => format!("docker.io/library/{self}"),
        }
    }
}

impl Default for Reference {
    fn default() -> Self {
        Reference { name: DEFAULT_NAME.into(), tag: env!("CARGO_PKG_VERSION").into() }
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

/// The built image: every blob's bytes, and the small files around them.
#[derive(Debug, Clone)]
pub struct Image {
    pub reference: Reference,
    /// The layer uncompressed (its digest is the config's `diff_ids[0]`).
    pub layer_tar: Vec<u8>,
    /// The layer blob (gzip of `layer_tar`).
    pub layer: Vec<u8>,
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
    pub index: Vec<u8>,
}

fn descriptor(media_type: &str, bytes: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": digest(bytes), "size": bytes.len()})
}

fn blob_path(bytes: &[u8]) -> String {
    format!("blobs/{}", digest(bytes).replacen(':', "/", 1))
}

/// A tar with `files` in order, every entry owned by 0:0, mode 0644, mtime 0.
fn deterministic_tar(files: &[(&str, &[u8])]) -> Result<Vec<u8>, Error> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.mode(tar::HeaderMode::Deterministic);
    for (path, bytes) in files {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        builder.append_data(&mut header, path, *bytes)?;
    }
    Ok(builder.into_inner()?)
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>, Error> {
    use std::io::Write as _;
    // No file name, mtime 0: the same input always gives the same blob.
    let mut enc = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::best());
    enc.write_all(bytes)?;
    Ok(enc.finish()?)
}

fn to_json(v: &Value) -> Result<Vec<u8>, Error> {
    Ok(serde_json::to_vec(v)?)
}

impl Image {
    /// The image of `wasm`. Refuses anything that is not a WebAssembly module.
    pub fn build(wasm: &[u8], reference: Reference) -> Result<Image, Error> {
        if !wasm.starts_with(b"\0asm") {
            return Err("not a WebAssembly module (no \\0asm magic)".into());
        }
        let layer_tar = deterministic_tar(&[(WASM_FILE, wasm)])?;
        let layer = gzip(&layer_tar)?;
        // Platform fields: Istio ignores them; `docker load` refuses an `os` other
        // than its own, and `FROM scratch` built on the usual host says linux/amd64.
        let config = to_json(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [digest(&layer_tar)]},
            "history": [{"created_by": format!("oci-pack: {WASM_FILE} ({} bytes)", wasm.len())}],
        }))?;
        let manifest = to_json(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": descriptor(CONFIG_MEDIA_TYPE, &config),
            "layers": [descriptor(LAYER_MEDIA_TYPE, &layer)],
            "annotations": {
                "module.wasm.image/variant": "compat",
                "org.opencontainers.image.title": reference.name,
            },
        }))?;
        let mut manifest_desc = descriptor(MANIFEST_MEDIA_TYPE, &manifest);
        manifest_desc["annotations"] = json!({
            // `oras cp --from-oci-layout dir:<tag>` and `skopeo oci:dir:<tag>` find the image by this.
            "org.opencontainers.image.ref.name": reference.tag,
            "io.containerd.image.name": reference.full_name(),
        });
        let index = to_json(&json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [manifest_desc],
        }))?;
        Ok(Image { reference, layer_tar, layer, config, manifest, index })
    }

    /// `sha256:…` of the manifest: what a registry reports for the pushed tag, what
    /// `url: oci://…@sha256:<hex>` pins and WasmPlugin's `sha256` field checks.
    pub fn manifest_digest(&self) -> String {
        digest(&self.manifest)
    }

    /// The blobs, each with its path under the layout (`blobs/sha256/<hex>`), sorted by path.
    pub fn blobs(&self) -> Vec<(String, &[u8])> {
        let mut blobs: Vec<(String, &[u8])> = [self.layer.as_slice(), self.config.as_slice(), self.manifest.as_slice()]
            .into_iter()
            .map(|b| (blob_path(b), b))
            .collect();
        blobs.sort_by(|a, b| a.0.cmp(&b.0));
        blobs
    }

    pub const OCI_LAYOUT: &'static [u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;

    /// `docker load`'s `manifest.json` (paths into the same blobs).
    pub fn docker_manifest(&self) -> Result<Vec<u8>, Error> {
        to_json(&json!([{
            "Config": blob_path(&self.config),
            "RepoTags": [self.reference.to_string()],
            "Layers": [blob_path(&self.layer)],
        }]))
    }

    /// The legacy `repositories` file: name → tag → top layer.
    pub fn docker_repositories(&self) -> Result<Vec<u8>, Error> {
        let layer_hex = digest(&self.layer).replacen("sha256:", "", 1);
        to_json(&json!({ (self.reference.name.clone()): { (self.reference.tag.clone()): layer_hex } }))
    }

    /// Every file of the layout, sorted by path (what `write_layout` writes and the docker tar holds, minus
    /// `manifest.json`/`repositories`).
    pub fn layout_files(&self) -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<(String, Vec<u8>)> = self.blobs().into_iter().map(|(p, b)| (p, b.to_vec())).collect();
        files.push(("index.json".into(), self.index.clone()));
        files.push(("oci-layout".into(), Self::OCI_LAYOUT.to_vec()));
        files.sort_by(|a, b| a.0.cmp(&b.0));
        files
    }

    /// One tar for `docker load -i` (Docker reads `manifest.json`; Docker ≥ 25, `crane`, `skopeo` also read
    /// it as an OCI layout).
    pub fn docker_tar(&self) -> Result<Vec<u8>, Error> {
        let mut files = self.layout_files();
        files.push(("manifest.json".into(), self.docker_manifest()?));
        files.push(("repositories".into(), self.docker_repositories()?));
        files.sort_by(|a, b| a.0.cmp(&b.0));
        let refs: Vec<(&str, &[u8])> = files.iter().map(|(p, b)| (p.as_str(), b.as_slice())).collect();
        deterministic_tar(&refs)
    }

    /// Writes the OCI image layout under `dir` (replacing a previous one's `blobs/`, `index.json`,
    /// `oci-layout`) and the docker tar `dir/agent-idempotency-filter.tar`.
    pub fn write_layout(&self, dir: &Path) -> Result<(), Error> {
        let blobs = dir.join("blobs");
        if blobs.exists() {
            std::fs::remove_dir_all(&blobs)?;
        }
        std::fs::create_dir_all(blobs.join("sha256"))?;
        for (path, bytes) in self.layout_files() {
            std::fs::write(dir.join(path), bytes)?;
        }
        std::fs::write(dir.join(DOCKER_TAR), self.docker_tar()?)?;
        Ok(())
    }
}
