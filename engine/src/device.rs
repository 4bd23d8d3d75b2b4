//! Where a node computes: the processor, or a CUDA GPU where the build has the `cuda`
//! feature (docs/gpu.md).

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::error::{EngineError, Result};

/// The device a node's model, KV caches and activations live on, as `--device` names it:
/// `cpu`, or `cuda` / `cuda:N` for the GPU of ordinal `N` (0 when not given).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    Cuda(usize),
}

/// A `--device` value that names no device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device: cpu, cuda or cuda:N")]
pub struct BadDeviceName(String);

impl FromStr for DeviceChoice {
    type Err = BadDeviceName;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad = || BadDeviceName(s.to_owned());
        match s.split_once(':') {
            None if s == "cpu" => Ok(Self::Cpu),
            None if s == "cuda" => Ok(Self::Cuda(0)),
            // Digits alone: `usize`'s parser would also take a leading `+`.
            Some(("cuda", n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                n.parse().map(Self::Cuda).map_err(|_| bad())
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceChoice {
    /// Whether this build can compute on GPUs (the `cuda` feature).
    pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

    /// Opens the device: a GPU's context and streams are made here, so a missing driver
    /// or ordinal fails at start, before any weight is read.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(_) if !Self::CUDA_BUILT => Err(EngineError::DeviceUnavailable {
                device: self.to_string(),
                reason: "this build has no CUDA support (build with `--features cuda`)".into(),
            }),
            Self::Cuda(n) => Device::new_cuda(n).map_err(|e| EngineError::DeviceUnavailable {
                device: self.to_string(),
                reason: e.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_devices_and_back() {
        for (name, want, shown) in [
            ("cpu", DeviceChoice::Cpu, "cpu"),
            ("cuda", DeviceChoice::Cuda(0), "cuda:0"),
            ("cuda:0", DeviceChoice::Cuda(0), "cuda:0"),
            ("cuda:7", DeviceChoice::Cuda(7), "cuda:7"),
        ] {
            let got: DeviceChoice = name.parse().unwrap();
            assert_eq!(got, want, "{name}");
            assert_eq!(got.to_string(), shown);
        }
        for bad in [
            "", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda:1:2", "cpu:0", "metal",
        ] {
            let err = bad.parse::<DeviceChoice>().unwrap_err();
            assert_eq!(err, BadDeviceName(bad.into()), "{bad}");
        }
        let err = "cuda:99999999999999999999999".parse::<DeviceChoice>();
        assert!(err.is_err(), "an ordinal past usize");
    }

    #[test]
    fn the_processor_always_opens() {
        assert!(DeviceChoice::Cpu.open().unwrap().is_cpu());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_gpu_without_the_feature_is_refused_by_name() {
        let err = DeviceChoice::Cuda(1).open().unwrap_err();
        assert!(matches!(
            &err,
            EngineError::DeviceUnavailable { device, .. } if device == "cuda:1"
        ));
        assert!(err.to_string().contains("--features cuda"), "{err}");
    }
}
