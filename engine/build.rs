//! With the `cuda` feature, compiles the engine's own CUDA kernels to PTX for the
//! architecture `CUDA_COMPUTE_CAP` names (90: Hopper), as candle's kernels are built, with
//! `$NVCC` or the `nvcc` on `PATH` (docs/gpu.md says where it comes from). The driver
//! compiles the PTX for the GPU it runs on when the kernels are first loaded.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &str = "src/attention/step.cu";

fn main() {
    println!("cargo::rerun-if-changed={KERNELS}");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .expect("the cuda feature needs CUDA_COMPUTE_CAP, the GPU's compute capability (90)");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(out.join("step.ptx"))
        .arg(KERNELS)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {nvcc}: {e}"));
    assert!(status.success(), "{nvcc} failed on {KERNELS}");
}
