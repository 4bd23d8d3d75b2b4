//! Compiles the protos with protoc (Debian's `protobuf-compiler`), which etcd-client's build
//! needs too.

fn main() {
    let files = ["tandem/v1/tandem.proto"];
    tonic_prost_build::configure()
        .compile_protos(&files, &["."])
        .expect("the protos compile");
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
}
