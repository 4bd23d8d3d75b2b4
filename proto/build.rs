//! Compiles the protos with protox (pure Rust), so no protoc is needed.

fn main() {
    let files = ["tandem/v1/tandem.proto"];
    let fds = protox::compile(files, ["."]).expect("the protos compile");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("tonic code generates");
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
}
