//! `oci-pack <filter.wasm> <out-dir> [--tag name:tag]`: the filter as an OCI image
//! (Istio's compat variant) in `<out-dir>` (an OCI image layout) and
//! `<out-dir>/agent-idempotency-filter.tar` (for `docker load`). `make oci` runs it.

#![forbid(unsafe_code)]

use idem_oci::image::{Image, Reference, DOCKER_TAR};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: oci-pack <filter.wasm> <out-dir> [--tag name:tag]";

fn run() -> Result<(), idem_oci::Error> {
    let mut args = std::env::args().skip(1);
    let mut positional = Vec::new();
    let mut reference = Reference::default();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tag" => reference = Reference::parse(&args.next().ok_or(USAGE)?)?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            _ if a.starts_with('-') => return Err(format!("unknown option {a}\n{USAGE}").into()),
            _ => positional.push(PathBuf::from(a)),
        }
    }
    let [wasm_path, out] = <[PathBuf; 2]>::try_from(positional).map_err(|_| USAGE)?;
    let wasm =
        std::fs::read(&wasm_path).map_err(|e| format!("{}: {e} (build it with `make wasm`)", wasm_path.display()))?;
    let image = Image::build(&wasm, reference)?;
    image.write_layout(&out)?;
    println!("image:    {} ({} bytes of plugin.wasm, {})", image.reference, wasm.len(), idem_oci::digest(&wasm));
    println!(
        "layout:   {}  (oras cp --from-oci-layout {}:{} <registry>/<repo>:<tag>)",
        out.display(),
        out.display(),
        image.reference.tag
    );
    println!("docker:   {}  (docker load -i)", out.join(DOCKER_TAR).display());
    println!("manifest: {}  (WasmPlugin url …@{0}, or its sha256 field without the prefix)", image.manifest_digest());
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oci-pack: {e}");
            ExitCode::FAILURE
        }
    }
}
