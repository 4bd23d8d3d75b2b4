//! Mixture-of-experts feed-forwards, read from a `config.json` as each architecture's
//! transformers configuration class reads it, or from a GGUF file as llama.cpp reads it.

use serde_json::{Map, Value};

use super::windows::flag;
use super::Architecture;

use crate::gguf::{Metadata, Value as GgufValue};

/// The feed-forward of a mixture-of-experts model's sparse layers: a router picks
/// `experts_per_token` of `experts` gated MLPs for each token and sums their outputs
/// weighted by the router's softmax.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Each expert's hidden width.
    pub expert_intermediate_size: usize,
    /// Whether the chosen experts' weights are divided by their sum (Mixtral always;
    /// Qwen3-MoE as `norm_topk_prob` says).
    pub normalize_top_k: bool,
    /// Per layer, whether its feed-forward is the mixture (`true`) or the dense MLP.
    pub sparse_layers: Vec<bool>,
    /// The width of the expert every token also runs, its output scaled by a sigmoid
    /// gate (Qwen2-MoE's); `None` without one.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// The fields only a mixture-of-experts config has; a dense architecture carrying one is
/// refused, since it would not run them. Qwen's mixtures read all but the last, which
/// only Qwen2-MoE has.
pub(super) const MOE_FIELDS: [&str; 8] = [
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
];

/// The mixture of `arch`'s config, `None` for a dense architecture:
/// - Qwen3-MoE and Qwen2-MoE: `num_experts` (or transformers 5's `num_local_experts`),
///   top `num_experts_per_tok`, experts `moe_intermediate_size` wide, `norm_topk_prob`;
///   layer `i` is sparse unless `mlp_only_layers` names it, when
///   `(i + 1) % decoder_sparse_step` is 0; Qwen2-MoE's shared expert
///   `shared_expert_intermediate_size` wide. Absent fields take the configuration class's
///   defaults.
/// - Mixtral: `num_local_experts`, top `num_experts_per_tok`, experts
///   `intermediate_size` wide, always normalized, every layer sparse.
pub(super) fn from_hf(
    arch: Architecture,
    raw: &Map<String, Value>,
    intermediate_size: usize,
    layers: usize,
) -> Result<Option<MoeConfig>, String> {
    let count = |keys: &[&str], default: u64| -> Result<usize, String> {
        match keys.iter().find_map(|k| raw.get(*k).map(|v| (k, v))) {
            None => Ok(default as usize),
            Some((key, v)) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{key} must be a count, got {v}")),
        }
    };
    let moe = match arch {
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            let qwen2 = arch == Architecture::Qwen2Moe;
            let read = if qwen2 {
                &MOE_FIELDS[..]
            } else {
                &MOE_FIELDS[..7]
            };
            refuse_fields_but(arch, raw, read)?;
            let step = count(&["decoder_sparse_step"], 1)?;
            let dense = mlp_only_layers(raw)?;
            // (experts, per token, width) by default: Qwen2MoeConfig's, Qwen3MoeConfig's.
            let defaults = if qwen2 { (60, 4, 1408) } else { (128, 8, 768) };
            MoeConfig {
                experts: count(&["num_experts", "num_local_experts"], defaults.0)?,
                experts_per_token: count(&["num_experts_per_tok"], defaults.1)?,
                expert_intermediate_size: count(&["moe_intermediate_size"], defaults.2)?,
                normalize_top_k: flag(raw, "norm_topk_prob")?,
                sparse_layers: (0..layers)
                    .map(|i| !dense.contains(&i) && step > 0 && (i + 1) % step == 0)
                    .collect(),
                shared_expert_intermediate_size: qwen2
                    .then(|| count(&["shared_expert_intermediate_size"], 5632))
                    .transpose()?,
            }
        }
        Architecture::Mixtral => {
            refuse_fields_but(arch, raw, &["num_local_experts", "num_experts_per_tok"])?;
            MoeConfig {
                experts: count(&["num_local_experts"], 8)?,
                experts_per_token: count(&["num_experts_per_tok"], 2)?,
                expert_intermediate_size: intermediate_size,
                normalize_top_k: true,
                sparse_layers: vec![true; layers],
                shared_expert_intermediate_size: None,
            }
        }
        _ => {
            refuse_fields_but(arch, raw, &[])?;
            return Ok(None);
        }
    };
    moe.validate().map(|()| Some(moe))
}

/// Refuses a mixture-of-experts field other than those `arch` reads.
fn refuse_fields_but(
    arch: Architecture,
    raw: &Map<String, Value>,
    read: &[&str],
) -> Result<(), String> {
    match MOE_FIELDS
        .iter()
        .find(|k| !read.contains(k) && raw.contains_key(**k))
    {
        Some(key) => Err(format!(
            "{key} is a mixture-of-experts field that transformers' {arch} does not read"
        )),
        None => Ok(()),
    }
}

/// The mixture of a GGUF file of `arch`, as llama.cpp's graphs run it: `expert_count`
/// experts of `expert_feed_forward_length` (a llama file's, Mixtral's, are
/// `feed_forward_length` wide), top `expert_used_count`, in every layer; llama.cpp's
/// `qwen3moe` and `llama` graphs always normalize the chosen weights, its `qwen2moe`
/// never, and runs its shared expert `expert_shared_feed_forward_length` wide.
pub(super) fn from_gguf(
    meta: &Metadata,
    arch: Architecture,
    feed_forward: usize,
    layers: usize,
) -> Result<Option<MoeConfig>, String> {
    let name = arch.gguf_name();
    let num = |key: &str| {
        meta.get(&format!("{name}.{key}"))
            .and_then(GgufValue::to_u64)
            .map(|v| v as usize)
    };
    let Some(experts) = num("expert_count").filter(|&n| n > 0) else {
        return Ok(None);
    };
    let required = |key: &str| num(key).ok_or_else(|| format!("missing {name}.{key}"));
    let (width, shared) = match arch {
        Architecture::Qwen3Moe => (required("expert_feed_forward_length")?, None),
        Architecture::Qwen2Moe => (
            required("expert_feed_forward_length")?,
            Some(required("expert_shared_feed_forward_length")?),
        ),
        Architecture::Llama => (feed_forward, None),
        _ => return Err(format!("{name}.expert_count: {name} has no experts")),
    };
    let moe = MoeConfig {
        experts,
        experts_per_token: required("expert_used_count")?,
        expert_intermediate_size: width,
        normalize_top_k: arch != Architecture::Qwen2Moe,
        sparse_layers: vec![true; layers],
        shared_expert_intermediate_size: shared,
    };
    moe.validate().map(|()| Some(moe))
}

/// The GGUF `{arch}.*` keys [`from_gguf`] reads.
pub(super) const GGUF_KEYS: [&str; 4] = [
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
];

impl MoeConfig {
    fn validate(&self) -> Result<(), String> {
        if self.experts == 0
            || self.experts_per_token == 0
            || self.experts_per_token > self.experts
            || self.expert_intermediate_size == 0
        {
            return Err(format!(
                "inconsistent mixture of experts: {} of {} experts, {} wide",
                self.experts_per_token, self.experts, self.expert_intermediate_size
            ));
        }
        Ok(())
    }
}

fn mlp_only_layers(raw: &Map<String, Value>) -> Result<Vec<usize>, String> {
    match raw.get("mlp_only_layers") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .and_then(|l| {
                l.iter()
                    .map(|i| i.as_u64().map(|i| i as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| format!("mlp_only_layers must list layer indices, got {v}")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn gguf(values: &[(&str, u32)]) -> Metadata {
        Metadata {
            values: values
                .iter()
                .map(|(k, v)| (k.to_string(), GgufValue::U32(*v)))
                .collect(),
            tensors: Default::default(),
        }
    }

    #[test]
    fn gguf_experts_are_read_as_llama_cpp_runs_them() {
        let qwen = gguf(&[
            ("qwen3moe.expert_count", 8),
            ("qwen3moe.expert_used_count", 2),
            ("qwen3moe.expert_feed_forward_length", 16),
        ]);
        let moe = from_gguf(&qwen, Architecture::Qwen3Moe, 48, 2)
            .unwrap()
            .unwrap();
        assert_eq!((moe.experts, moe.experts_per_token), (8, 2));
        assert_eq!(moe.expert_intermediate_size, 16);
        assert!(moe.normalize_top_k);
        assert_eq!(moe.sparse_layers, [true, true]);
        let mixtral = gguf(&[("llama.expert_count", 4), ("llama.expert_used_count", 2)]);
        let moe = from_gguf(&mixtral, Architecture::Llama, 48, 1)
            .unwrap()
            .unwrap();
        assert_eq!(moe.expert_intermediate_size, 48);
        assert_eq!(from_gguf(&gguf(&[]), Architecture::Llama, 48, 1), Ok(None));
        let shared = gguf(&[
            ("qwen2moe.expert_count", 8),
            ("qwen2moe.expert_used_count", 2),
            ("qwen2moe.expert_feed_forward_length", 16),
            ("qwen2moe.expert_shared_feed_forward_length", 32),
        ]);
        let moe = from_gguf(&shared, Architecture::Qwen2Moe, 48, 1)
            .unwrap()
            .unwrap();
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
        assert!(!moe.normalize_top_k);
        let dense = gguf(&[("qwen3.expert_count", 8), ("qwen3.expert_used_count", 2)]);
        assert!(from_gguf(&dense, Architecture::Qwen3, 48, 1).is_err());
        let unused = gguf(&[("llama.expert_count", 4)]);
        assert!(from_gguf(&unused, Architecture::Llama, 48, 1).is_err());
    }

    fn hf(arch: Architecture, v: Value, layers: usize) -> Result<Option<MoeConfig>, String> {
        from_hf(arch, v.as_object().unwrap(), 48, layers)
    }

    #[test]
    fn qwen3_moe_layers_are_sparse_by_step_unless_listed_dense() {
        let cfg = json!({"num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "norm_topk_prob": true,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]});
        let moe = hf(Architecture::Qwen3Moe, cfg, 5).unwrap().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, false, false]);
        assert_eq!((moe.experts, moe.experts_per_token), (8, 2));
        assert_eq!(moe.expert_intermediate_size, 16);
        assert!(moe.normalize_top_k);
        let v5 = json!({"num_local_experts": 4, "num_experts_per_tok": 2});
        let v5 = hf(Architecture::Qwen3Moe, v5, 1).unwrap();
        assert_eq!(v5.unwrap().experts, 4);
    }

    #[test]
    fn qwen2_moe_has_a_shared_expert_and_its_own_defaults() {
        let moe = hf(
            Architecture::Qwen2Moe,
            json!({"shared_expert_intermediate_size": 96}),
            1,
        );
        let moe = moe.unwrap().unwrap();
        assert_eq!((moe.experts, moe.experts_per_token), (60, 4));
        assert_eq!(moe.shared_expert_intermediate_size, Some(96));
        assert!(!moe.normalize_top_k);
        let qwen3 = hf(Architecture::Qwen3Moe, json!({"num_experts_per_tok": 2}), 1).unwrap();
        assert_eq!(qwen3.unwrap().shared_expert_intermediate_size, None);
        let shared = json!({"shared_expert_intermediate_size": 8});
        assert!(hf(Architecture::Qwen3Moe, shared, 1).is_err());
    }

    #[test]
    fn mixtral_normalizes_and_reads_its_experts_at_intermediate_size() {
        let moe = hf(Architecture::Mixtral, json!({"num_local_experts": 4}), 2).unwrap();
        let moe = moe.unwrap();
        assert_eq!((moe.experts, moe.experts_per_token), (4, 2));
        assert_eq!(moe.expert_intermediate_size, 48);
        assert!(moe.normalize_top_k);
        assert_eq!(moe.sparse_layers, [true, true]);
        assert!(hf(Architecture::Mixtral, json!({"norm_topk_prob": false}), 1).is_err());
    }

    #[test]
    fn expert_fields_on_a_dense_model_or_impossible_counts_are_refused() {
        assert_eq!(hf(Architecture::Llama, json!({}), 1), Ok(None));
        let err = hf(Architecture::Llama, json!({"num_experts": 8}), 1).unwrap_err();
        assert!(
            err.starts_with("num_experts is a mixture-of-experts field"),
            "{err}"
        );
        assert!(hf(Architecture::Mixtral, json!({"num_experts": 8}), 1).is_err());
        let cfg = json!({"num_experts": 2, "num_experts_per_tok": 3});
        assert!(hf(Architecture::Qwen3Moe, cfg, 1).is_err());
    }
}
