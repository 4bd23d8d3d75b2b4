//! A GGUF file's RoPE scaling, read as llama.cpp reads it.

use super::keys_under;
use crate::config::Architecture;
use crate::gguf::{Metadata, Value};
use crate::rope::{mscale, RopeScaling};

/// Keys llama.cpp's loader never reads, each with the only value at which ignoring it
/// leaves the model its writer meant: beta_fast and beta_slow are llama.cpp's defaults,
/// the extrapolation factor is the 1 it takes for YaRN, no log multiplier is its 0.
const DEFAULT_ONLY: [(&str, f64); 4] = [
    ("yarn_beta_fast", 32.0),
    ("yarn_beta_slow", 1.0),
    ("yarn_ext_factor", 1.0),
    ("yarn_log_multiplier", 0.0),
];

/// The `{arch}.rope.scaling.*` keys of a GGUF file, read as llama.cpp reads them:
/// - the type is `linear` when the key is absent (llama.cpp's default), and `none` turns
///   a factor off;
/// - `linear` divides every frequency by `factor` (or the older `rope.scale_linear`,
///   which llama.cpp reads first);
/// - `yarn` blends interpolated and original frequencies between the dimensions that
///   turn 32 and 1 times in `original_context_length` (else the training context
///   `context_length`), and scales cos and sin by `0.1 ln(factor) + 1` times
///   `attn_factor`, as transformers' YaRN does;
/// - an `attn_factor` other than 1 outside YaRN, and any other key, are refused.
pub(super) fn scaling(
    meta: &Metadata,
    arch: Architecture,
    context_length: usize,
) -> Result<RopeScaling, String> {
    let name = arch.gguf_name();
    let prefix = format!("{name}.rope.scaling.");
    let number = |name: &str| meta.get(&format!("{prefix}{name}")).and_then(Value::to_f64);
    let kind = meta
        .get(&format!("{prefix}type"))
        .and_then(Value::as_str)
        .unwrap_or("linear");
    let yarn = kind == "yarn";
    // llama.cpp's converter writes Phi-3's LongRoPE as its factors' tensors, an
    // attention factor and the original context.
    let longrope = arch == Architecture::Phi3 && meta.tensors.contains("rope_factors_long.weight");
    if !matches!(kind, "none" | "linear" | "yarn") {
        return Err(format!(
            "{prefix}type {kind:?} is not supported (none, linear and yarn are)"
        ));
    }
    for (key, name) in keys_under(meta, &prefix) {
        let value = meta.get(key).and_then(Value::to_f64);
        let allowed = match name {
            "type" | "factor" | "original_context_length" | "finetuned" => true,
            "attn_factor" => yarn || longrope || value == Some(1.0),
            _ => DEFAULT_ONLY
                .iter()
                .any(|&(n, default)| n == name && value == Some(default)),
        };
        if !allowed {
            return Err(format!("{key} is not supported"));
        }
    }
    let factor = meta
        .get(&format!("{name}.rope.scale_linear"))
        .and_then(Value::to_f64)
        .or_else(|| number("factor"))
        .filter(|&f| f != 0.0)
        .unwrap_or(1.0);
    let original = meta
        .get(&format!("{prefix}original_context_length"))
        .and_then(Value::to_u64)
        .unwrap_or(context_length as u64) as f64;
    if longrope {
        return Ok(RopeScaling::LongRope {
            factors: Vec::new(),
            original_max_position_embeddings: original,
            attention_factor: number("attn_factor").unwrap_or(1.0),
        });
    }
    Ok(match kind {
        "yarn" => RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            attention_factor: mscale(factor, 1.0) * number("attn_factor").unwrap_or(1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        },
        "linear" if factor != 1.0 => RopeScaling::Linear { factor },
        _ => RopeScaling::None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::meta;
    use super::*;

    fn kind(t: &str) -> Value {
        Value::String(t.into())
    }

    #[test]
    fn a_gguf_factor_scales_linearly_as_llama_cpp_reads_it() {
        let linear = RopeScaling::Linear { factor: 4.0 };
        assert_eq!(
            scaling(&meta(&[]), Architecture::Llama, 64),
            Ok(RopeScaling::None)
        );
        let typed = meta(&[
            ("llama.rope.scaling.type", kind("linear")),
            ("llama.rope.scaling.factor", Value::F32(4.0)),
        ]);
        assert_eq!(scaling(&typed, Architecture::Llama, 64), Ok(linear.clone()));
        // Without a type llama.cpp takes linear, and reads the old key first.
        let untyped = meta(&[("qwen2.rope.scale_linear", Value::F32(4.0))]);
        assert_eq!(scaling(&untyped, Architecture::Qwen2, 64), Ok(linear));
        let none = meta(&[
            ("llama.rope.scaling.type", kind("none")),
            ("llama.rope.scaling.factor", Value::F32(4.0)),
            ("llama.rope.scaling.attn_factor", Value::F32(1.0)),
            (
                "llama.rope.scaling.original_context_length",
                Value::U32(8192),
            ),
        ]);
        assert_eq!(
            scaling(&none, Architecture::Llama, 64),
            Ok(RopeScaling::None)
        );
    }

    #[test]
    fn gguf_yarn_is_read_with_llama_cpps_defaults() {
        let yarn = meta(&[
            ("qwen2.rope.scaling.type", kind("yarn")),
            ("qwen2.rope.scaling.factor", Value::F32(4.0)),
            ("qwen2.rope.scaling.yarn_beta_fast", Value::F32(32.0)),
        ]);
        let expected = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 2048.0,
            attention_factor: 0.1 * 4.0_f64.ln() + 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        };
        assert_eq!(scaling(&yarn, Architecture::Qwen2, 2048), Ok(expected));
        let scaled = meta(&[
            ("qwen2.rope.scaling.type", kind("yarn")),
            ("qwen2.rope.scaling.factor", Value::F32(4.0)),
            ("qwen2.rope.scaling.original_context_length", Value::U32(64)),
            ("qwen2.rope.scaling.attn_factor", Value::F32(0.5)),
        ]);
        let Ok(RopeScaling::Yarn {
            original_max_position_embeddings,
            attention_factor,
            ..
        }) = scaling(&scaled, Architecture::Qwen2, 2048)
        else {
            panic!("yarn");
        };
        assert_eq!(original_max_position_embeddings, 64.0);
        assert!((attention_factor - 0.5 * (0.1 * 4.0_f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn gguf_scaling_the_engine_does_not_compute_is_refused_by_key() {
        let longrope = meta(&[("phi3.rope.scaling.type", kind("longrope"))]);
        assert_eq!(
            scaling(&longrope, Architecture::Phi3, 64),
            Err(
                "phi3.rope.scaling.type \"longrope\" is not supported (none, linear and yarn are)"
                    .into()
            )
        );
        let attn = meta(&[("llama.rope.scaling.attn_factor", Value::F32(0.8))]);
        assert_eq!(
            scaling(&attn, Architecture::Llama, 64),
            Err("llama.rope.scaling.attn_factor is not supported".into())
        );
        let beta = meta(&[
            ("qwen2.rope.scaling.type", kind("yarn")),
            ("qwen2.rope.scaling.yarn_beta_fast", Value::F32(16.0)),
        ]);
        assert!(scaling(&beta, Architecture::Qwen2, 64).is_err());
        let other = meta(&[("llama.rope.scaling.yarn_log_multiplier", Value::F32(0.1))]);
        assert!(scaling(&other, Architecture::Llama, 64).is_err());
    }
}
