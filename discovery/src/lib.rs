//! Worker discovery, two ways:
//! - etcd: each worker registers what it serves under a key tied to a lease it keeps
//!   alive, and the router watches the prefix to follow the worker set (`etcd-client`,
//!   whose build runs protoc);
//! - Kubernetes: the EndpointSlices of the workers' Services, with the pods' readiness
//!   ([`kube`], through kube-rs).

mod etcd;
pub mod kube;
mod register;
mod watch;

use serde::{Deserialize, Serialize};

pub use etcd::{EtcdClient, EtcdError, EtcdSecurity, Password};
pub use register::Registration;
pub use watch::{watch_workers, WorkerSet};

/// The key prefix workers register under unless configured otherwise.
pub const DEFAULT_PREFIX: &str = "/tandem/workers/";

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    /// The role's name in keys, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role a worker of this kind proves with its certificate under mutual TLS.
    pub fn certified(self) -> tls::Role {
        match self {
            Role::Prefill => tls::Role::Prefill,
            Role::Decode => tls::Role::Decode,
        }
    }
}

/// The KV cache layout a worker computes; a prefill and a decode node pair only when theirs
/// are equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
}

/// How much a worker can hold; 0 where it does not apply.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Capacity {
    /// KV blocks of a decode node's budget.
    pub kv_blocks: u64,
    /// Positions per KV block.
    pub block_tokens: u64,
    /// Sequences per decode step.
    pub max_batch: u64,
    /// Requests that may wait in the worker's queue.
    pub max_queue: u64,
}

/// One worker's registration: the value stored under its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub role: Role,
    /// The gRPC address (host:port) routers and prefill nodes dial.
    pub addr: String,
    /// What routers call the worker in their metrics, never its address: in Kubernetes,
    /// its pod's name. Empty in a registration that gives none.
    #[serde(default)]
    pub name: String,
    /// The model's folder or file name.
    pub model: String,
    pub layout: Layout,
    /// The version of the engine that computes the KV cache.
    pub engine_version: String,
    #[serde(default)]
    pub capacity: Capacity,
}

/// One worker as discovery sees it: where it serves, and what it registered, if anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub role: Role,
    /// The gRPC address (host:port) routers and prefill nodes dial.
    pub addr: String,
    /// What routers call it in their metrics: its pod's name, or its registration's.
    pub name: String,
    /// What it registered about itself (etcd). None where discovery sees only its address
    /// (Kubernetes): routers check what it serves in its health replies either way.
    pub registration: Option<WorkerInfo>,
}

impl From<WorkerInfo> for Member {
    fn from(info: WorkerInfo) -> Self {
        Self {
            role: info.role,
            addr: info.addr.clone(),
            name: info.name.clone(),
            registration: Some(info),
        }
    }
}

impl WorkerInfo {
    /// The key this worker registers under.
    pub fn key(&self, prefix: &str) -> String {
        format!("{prefix}{}/{}", self.role.as_str(), self.addr)
    }
}

/// The name a model is known by in registrations: its folder or file name, without a
/// GGUF file's extension.
pub fn model_identity(path: &std::path::Path) -> String {
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    stem.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_round_trip_as_json() {
        let info = WorkerInfo {
            role: Role::Decode,
            addr: "10.0.0.7:50052".into(),
            name: "decode-0".into(),
            model: "qwen".into(),
            layout: Layout {
                n_layers: 24,
                n_kv_heads: 2,
                head_dim: 64,
                dtype: "f32".into(),
            },
            engine_version: "0.1.0".into(),
            capacity: Capacity {
                kv_blocks: 100,
                block_tokens: 16,
                max_batch: 32,
                max_queue: 256,
            },
        };
        let text = serde_json::to_string(&info).unwrap();
        assert!(text.contains(r#""role":"decode""#), "{text}");
        assert_eq!(serde_json::from_str::<WorkerInfo>(&text).unwrap(), info);
        assert_eq!(info.key("/t/"), "/t/decode/10.0.0.7:50052");
        // A registration without capacity (written by hand, say) still parses.
        let bare = r#"{"role":"prefill","addr":"a:1","model":"m","engine_version":"x",
            "layout":{"n_layers":1,"n_kv_heads":1,"head_dim":1,"dtype":"f32"}}"#;
        let bare: WorkerInfo = serde_json::from_str(bare).unwrap();
        assert_eq!(bare.capacity, Capacity::default());
        assert_eq!(bare.name, "");
    }
}
