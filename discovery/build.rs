//! Compiles etcd's API subset with protox (pure Rust), so no protoc is needed.

fn main() {
    let files = ["etcd/etcd.proto"];
    let fds = protox::compile(files, ["."]).expect("the protos compile");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)
        .expect("tonic code generates");
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
}
