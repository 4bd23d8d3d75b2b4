//! The GPU decode step's kernels (`engine/src/attention/step.cu`) checked where there is no
//! GPU: their source compiled as C++ over `emulated/shim.h`, which stands in for the GPU
//! (each block's threads on OS threads, barriers for `__syncthreads` and the warps'
//! shuffles), against attention computed in f64 (`emulated/check.cpp`). The development
//! and CI machines have no GPU; on one, `scripts/gpu-check.sh` runs the kernels themselves
//! through the engine's other tests, and skips this one.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &str = include_str!("../../src/attention/step.cu");
const SHIM: &str = include_str!("emulated/shim.h");
const CHECK: &str = include_str!("emulated/check.cpp");

/// `step.cu` as the shim compiles it: without CUDA's header, its dynamic shared memory the
/// shim's array.
fn emulated_source() -> String {
    let mut source = KERNELS.to_owned();
    for (cuda, emulated) in [
        ("#include <cuda_fp16.h>", ""),
        (
            "extern __shared__ float merged[];",
            "float* merged = dynamic_shared;",
        ),
    ] {
        assert!(source.contains(cuda), "step.cu no longer has `{cuda}`");
        source = source.replace(cuda, emulated);
    }
    source
}

#[test]
fn the_step_kernels_attend_as_attention_does_on_an_emulated_gpu() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("step-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("shim.h"), SHIM).unwrap();
    std::fs::write(dir.join("check.cpp"), CHECK).unwrap();
    std::fs::write(dir.join("step.cpp"), emulated_source()).unwrap();
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "check.cpp", "-o", "check"])
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| panic!("{compiler} (a C++20 compiler) cannot run: {e}"));
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(dir.join("check")).output().unwrap();
    let report = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success(), "{report}");
    assert!(report.contains("0 failures"), "{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
