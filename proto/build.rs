//! Compiles the protos with protox (pure Rust), so no protoc is needed.

fn main() {
    let files = ["tandem/v1/tandem.proto"];
    let fds = protox::compile(files, ["."]).expect("the protos compile");
    tonic_prost_build::configure()
        // KV payloads stay in the buffers they arrive in rather than being copied out.
        .bytes(".tandem.v1.KvChunk")
        .compile_fds(fds)
        .expect("tonic code generates");
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
}
