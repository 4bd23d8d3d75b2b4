//! Compiles the protos with protoc: the machine's, or the pinned one `scripts/get-protoc.sh`
//! fetches from crates.io (through `PROTOC`). etcd-client's build runs protoc too, so a
//! pure-Rust compiler here (protox) would leave the build needing one all the same, and add
//! its parser's crates (protox-parse, prost-reflect, logos, miette) to every build.

fn main() {
    let files = ["tandem/v1/tandem.proto"];
    tonic_prost_build::configure()
        .compile_protos(&files, &["."])
        .expect("the protos compile (without a protoc: export PROTOC=\"$(bash scripts/get-protoc.sh)\")");
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
}
