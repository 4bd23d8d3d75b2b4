//! The vector units the binaries are built for, checked before any code uses them.
//!
//! `.cargo/config.toml` builds for `x86-64-v3`: the engine's kernels and candle's products use
//! AVX2, FMA and F16C without asking. On a CPU without them the first such instruction kills
//! the process with SIGILL, far from any message; [`require_cpu_features`] says so at start.
//! It reads the kernel's flags, not `is_x86_feature_detected!`, which a build for the target
//! CPU answers at compile time.

/// The CPU level the build targets.
pub const BASELINE: &str = "x86-64-v3";

/// The `/proc/cpuinfo` flags of x86-64-v3 beyond the x86-64-v2 every 64-bit server has:
/// `abm` is how the kernel names LZCNT.
const V3_FLAGS: [&str; 8] = ["avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"];

/// The x86-64-v3 flags missing from the `flags` line of a `/proc/cpuinfo` text; `None` when
/// it has no such line (not Linux on x86-64: nothing to say).
pub fn missing_v3_flags(cpuinfo: &str) -> Option<Vec<&'static str>> {
    let line = cpuinfo.lines().find(|l| l.starts_with("flags"))?;
    let have: Vec<&str> = line.split_once(':')?.1.split_whitespace().collect();
    Some(
        V3_FLAGS
            .iter()
            .copied()
            .filter(|f| !have.contains(f))
            .collect(),
    )
}

/// Exits with status 1 and a message naming the missing features when this CPU lacks what
/// the build targets. Call first thing in `main`.
pub fn require_cpu_features() {
    let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
        return;
    };
    if let Some(missing) = missing_v3_flags(&cpuinfo).filter(|m| !m.is_empty()) {
        eprintln!(
            "this CPU lacks {} of {BASELINE} (AVX2, FMA, F16C), which this build uses: run it \
             on a CPU sold since about 2015 (Intel Haswell, AMD Excavator or later), or \
             build for yours without the target-cpu line of .cargo/config.toml",
            missing.join(", ")
        );
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v3_cpu_misses_nothing() {
        let info = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 bmi1 bmi2 f16c fma abm \
                    movbe popcnt\n";
        assert_eq!(missing_v3_flags(info), Some(vec![]));
    }

    #[test]
    fn a_v2_cpu_misses_the_v3_features() {
        let info = "processor\t: 0\nflags\t\t: fpu sse4_2 popcnt avx\n";
        assert_eq!(
            missing_v3_flags(info),
            Some(vec!["avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"])
        );
    }

    #[test]
    fn no_flags_line_says_nothing() {
        assert_eq!(missing_v3_flags("Features\t: fp asimd\n"), None);
    }

    #[test]
    fn this_machine_has_what_the_build_targets() {
        // The tests themselves run the build's code: were a flag missing they could not run.
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("Linux");
        assert_eq!(missing_v3_flags(&info), Some(vec![]));
    }
}
