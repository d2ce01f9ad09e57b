//! `make oci`'s image, read back the way Istio's fetcher and `docker load` read it:
//! every descriptor's digest and size, the media types Istio accepts (spelled out
//! here, not taken from the crate), and `plugin.wasm` byte-identical to the built
//! filter.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;

type TestResult = Result<(), Box<dyn std::error::Error>>;
type Files = BTreeMap<String, Vec<u8>>;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The filter `make wasm` builds (`make test` builds it before running the tests).
fn built_wasm() -> Result<(PathBuf, Vec<u8>), Box<dyn std::error::Error>> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let p = target.join("wasm32-wasip1/wasm/agent_idempotency_filter.wasm");
    let bytes =
        std::fs::read(&p).map_err(|e| format!("{}: {e}: run `make wasm` (or `make test`) first", p.display()))?;
    Ok((p, bytes))
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// `oci-pack` as `make oci` runs it.
fn oci_pack(wasm: &Path, out: &Path, extra: &[&str]) -> Result<String, Box<dyn std::error::Error>> {
    let o = Command::new(env!("CARGO_BIN_EXE_oci-pack")).arg(wasm).arg(out).args(extra).output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(format!("oci-pack failed: {text}").into());
    }
    Ok(text)
}

fn read_dir_files(dir: &Path) -> Result<Files, Box<dyn std::error::Error>> {
    let mut files = Files::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let p = entry?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir)?.to_string_lossy().into_owned();
                files.insert(rel, std::fs::read(&p)?);
            }
        }
    }
    Ok(files)
}

/// The entries of a tar: path → bytes; every entry a regular file owned by 0:0 with mtime 0.
fn untar(bytes: &[u8]) -> Result<Files, Box<dyn std::error::Error>> {
    let mut files = Files::new();
    let mut archive = tar::Archive::new(bytes);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let h = entry.header();
        assert_eq!(h.entry_type(), tar::EntryType::Regular, "only regular files");
        assert_eq!((h.mtime()?, h.uid()?, h.gid()?), (0, 0, 0), "fixed mtime and owner");
        let path = entry.path()?.to_string_lossy().into_owned();
        let mut data = Vec::new();
        entry.read_to_end(&mut data)?;
        assert!(files.insert(path.clone(), data).is_none(), "{path} twice");
    }
    Ok(files)
}

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut out)?;
    Ok(out)
}

/// The blob a descriptor names, after checking its digest and size.
fn blob<'a>(files: &'a Files, desc: &Value) -> Result<&'a [u8], Box<dyn std::error::Error>> {
    let digest = desc["digest"].as_str().ok_or("descriptor without digest")?;
    let hex = digest.strip_prefix("sha256:").ok_or("not a sha256 digest")?;
    let bytes = files.get(&format!("blobs/sha256/{hex}")).ok_or_else(|| format!("no blob {digest}"))?;
    assert_eq!(sha256(bytes), digest, "the blob's content has the digest its name and descriptor say");
    assert_eq!(desc["size"].as_u64(), Some(bytes.len() as u64), "descriptor size of {digest}");
    Ok(bytes)
}

/// Checks an OCI image layout (as files) the way Istio's compat-variant fetcher reads the image, and that
/// its `plugin.wasm` is `wasm`. Returns the manifest's descriptor in index.json.
fn check_layout(files: &Files, wasm: &[u8], tag: &str) -> Result<Value, Box<dyn std::error::Error>> {
    let layout: Value = serde_json::from_slice(files.get("oci-layout").ok_or("no oci-layout")?)?;
    assert_eq!(layout, json!({"imageLayoutVersion": "1.0.0"}));
    let index: Value = serde_json::from_slice(files.get("index.json").ok_or("no index.json")?)?;
    assert_eq!(index["schemaVersion"], 2);
    assert_eq!(index["mediaType"], "application/vnd.oci.image.index.v1+json");
    let manifests = index["manifests"].as_array().ok_or("no manifests")?;
    assert_eq!(manifests.len(), 1, "{index}");
    let desc = &manifests[0];
    assert_eq!(desc["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(desc["annotations"]["org.opencontainers.image.ref.name"], tag, "oras/skopeo find the tag");

    let manifest: Value = serde_json::from_slice(blob(files, desc)?)?;
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(manifest["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(manifest["annotations"]["module.wasm.image/variant"], "compat");
    assert_eq!(manifest["config"]["mediaType"], "application/vnd.oci.image.config.v1+json");
    let layers = manifest["layers"].as_array().ok_or("no layers")?;
    assert_eq!(layers.len(), 1, "Istio: the compat image must be single-layered");
    assert_eq!(layers[0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip", "the type Istio accepts");

    let layer = blob(files, &layers[0])?;
    let layer_tar = gunzip(layer)?;
    let config: Value = serde_json::from_slice(blob(files, &manifest["config"])?)?;
    assert_eq!(
        config["rootfs"],
        json!({"type": "layers", "diff_ids": [sha256(&layer_tar)]}),
        "diff_id = uncompressed layer"
    );
    assert_eq!(config["os"], "linux", "docker load refuses another os");
    let entries = untar(&layer_tar)?;
    assert_eq!(entries.keys().collect::<Vec<_>>(), ["plugin.wasm"], "FROM scratch + plugin.wasm, nothing else");
    assert!(entries["plugin.wasm"] == wasm, "plugin.wasm is byte-identical to the built filter");

    let referenced: Vec<String> = [desc, &manifest["config"], &layers[0]]
        .iter()
        .map(|d| format!("blobs/{}", d["digest"].as_str().unwrap_or_default().replacen(':', "/", 1)))
        .collect();
    for path in files.keys().filter(|p| p.starts_with("blobs/")) {
        assert!(referenced.contains(path), "unreferenced blob {path}");
    }
    Ok(desc.clone())
}

#[test]
fn the_oci_layout_holds_the_built_filter() -> TestResult {
    let (wasm_path, wasm) = built_wasm()?;
    let out = tempfile::tempdir()?;
    let printed = oci_pack(&wasm_path, out.path(), &[])?;
    let mut files = read_dir_files(out.path())?;
    files.remove("agent-idempotency-filter.tar").ok_or("no docker tar next to the layout")?;
    let desc = check_layout(&files, &wasm, env!("CARGO_PKG_VERSION"))?;
    let digest = desc["digest"].as_str().ok_or("no digest")?;
    assert!(printed.contains(digest), "oci-pack prints the manifest digest to pin in the WasmPlugin: {printed}");
    Ok(())
}

#[test]
fn the_docker_tar_holds_the_same_image() -> TestResult {
    let (wasm_path, wasm) = built_wasm()?;
    let out = tempfile::tempdir()?;
    oci_pack(&wasm_path, out.path(), &["--tag", "registry.example.com:5000/agents/idem-filter:v1"])?;
    let mut tarred = untar(&std::fs::read(out.path().join("agent-idempotency-filter.tar"))?)?;
    let docker_manifest: Value = serde_json::from_slice(&tarred.remove("manifest.json").ok_or("no manifest.json")?)?;
    let repositories: Value = serde_json::from_slice(&tarred.remove("repositories").ok_or("no repositories")?)?;

    // The rest of the tar is the same OCI layout as the directory (Docker ≥ 25 and crane read it that way).
    let desc = check_layout(&tarred, &wasm, "v1")?;
    let mut on_disk = read_dir_files(out.path())?;
    on_disk.remove("agent-idempotency-filter.tar");
    assert!(on_disk == tarred, "the tar and the directory hold the same layout");
    assert_eq!(desc["annotations"]["io.containerd.image.name"], "registry.example.com:5000/agents/idem-filter:v1");

    // What `docker load` reads: manifest.json's config and layers, by path.
    let manifest: Value = serde_json::from_slice(blob(&tarred, &desc)?)?;
    let path_of = |d: &Value| format!("blobs/{}", d["digest"].as_str().unwrap_or_default().replacen(':', "/", 1));
    assert_eq!(
        docker_manifest,
        json!([{
            "Config": path_of(&manifest["config"]),
            "RepoTags": ["registry.example.com:5000/agents/idem-filter:v1"],
            "Layers": [path_of(&manifest["layers"][0])],
        }])
    );
    let layer_hex = manifest["layers"][0]["digest"].as_str().ok_or("no layer digest")?.replacen("sha256:", "", 1);
    assert_eq!(repositories, json!({"registry.example.com:5000/agents/idem-filter": {"v1": layer_hex}}));
    Ok(())
}

#[test]
fn the_image_is_reproducible_and_follows_its_input() -> TestResult {
    let (wasm_path, mut wasm) = built_wasm()?;
    let (a, b, c) = (tempfile::tempdir()?, tempfile::tempdir()?, tempfile::tempdir()?);
    oci_pack(&wasm_path, a.path(), &[])?;
    oci_pack(&wasm_path, b.path(), &[])?;
    assert!(read_dir_files(a.path())? == read_dir_files(b.path())?, "same .wasm, same bytes everywhere");

    // One byte more (a custom section would do the same): every digest moves.
    wasm.push(0);
    let changed = c.path().join("changed.wasm");
    std::fs::write(&changed, &wasm)?;
    oci_pack(&changed, c.path(), &[])?;
    let (first, second) = (read_dir_files(a.path())?, read_dir_files(c.path())?);
    check_layout(
        &second.into_iter().filter(|(k, _)| !k.ends_with(".tar")).collect(),
        &wasm,
        env!("CARGO_PKG_VERSION"),
    )?;
    assert_ne!(first["index.json"], read_dir_files(c.path())?["index.json"]);
    Ok(())
}

#[test]
fn oci_pack_refuses_what_is_not_a_wasm_module() -> TestResult {
    let dir = tempfile::tempdir()?;
    let not_wasm = dir.path().join("x.wasm");
    std::fs::write(&not_wasm, b"#!/bin/sh\n")?;
    let err = oci_pack(&not_wasm, dir.path(), &[]).err().ok_or("packed a shell script")?;
    assert!(err.to_string().contains("not a WebAssembly module"), "{err}");
    let err = oci_pack(&dir.path().join("missing.wasm"), dir.path(), &[]).err().ok_or("packed nothing")?;
    assert!(err.to_string().contains("make wasm"), "{err}");
    let err = oci_pack(&not_wasm, dir.path(), &["--tag", "Upper:Case"]).err().ok_or("took a bad tag")?;
    assert!(err.to_string().contains("not an image reference"), "{err}");
    Ok(())
}
