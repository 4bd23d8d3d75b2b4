use serde_json::json;

use super::*;
use crate::rope::RopeScaling;

fn hf(arch: Architecture, v: serde_json::Value) -> Result<Option<Gemma>, String> {
    from_hf(arch, v.as_object().unwrap(), 1024)
}

#[test]
fn gemma2_caps_by_default_and_a_null_turns_a_cap_off() {
    let g = hf(Architecture::Gemma2, json!({})).unwrap().unwrap();
    assert_eq!(g.attn_logit_softcapping, Some(50.0));
    assert_eq!(g.final_logit_softcapping, Some(30.0));
    assert_eq!(g.query_pre_attn_scalar, 256.0);
    assert_eq!(g.sliding_rope, None);
    let off = json!({"attn_logit_softcapping": null, "final_logit_softcapping": 5.0,
        "query_pre_attn_scalar": 24});
    let g = hf(Architecture::Gemma2, off).unwrap().unwrap();
    assert_eq!(
        (g.attn_logit_softcapping, g.final_logit_softcapping),
        (None, Some(5.0))
    );
    assert_eq!(g.query_pre_attn_scalar, 24.0);
    let g3 = hf(Architecture::Gemma3, json!({})).unwrap().unwrap();
    assert_eq!(
        (g3.attn_logit_softcapping, g3.final_logit_softcapping),
        (None, None)
    );
}

#[test]
fn what_gemma_does_not_run_and_what_others_do_not_read_is_refused_by_name() {
    let gelu = hf(Architecture::Gemma2, json!({"hidden_activation": "gelu"})).unwrap_err();
    assert!(gelu.starts_with("hidden_activation \"gelu\""), "{gelu}");
    let both_ways = hf(
        Architecture::Gemma3,
        json!({"use_bidirectional_attention": true}),
    );
    assert!(both_ways.unwrap_err().contains("causal"));
    let local = hf(
        Architecture::Gemma2,
        json!({"rope_local_base_freq": 10000.0}),
    )
    .unwrap_err();
    assert!(local.starts_with("rope_local_base_freq is not read by transformers' gemma2"));
    let llama = hf(Architecture::Llama, json!({"query_pre_attn_scalar": 64})).unwrap_err();
    assert!(
        llama.starts_with("query_pre_attn_scalar is not read"),
        "{llama}"
    );
    assert_eq!(
        hf(
            Architecture::Llama,
            json!({"final_logit_softcapping": null})
        ),
        Ok(None)
    );
}

#[test]
fn gemma3_rotates_sliding_layers_by_the_local_base_in_either_layout() {
    let v4 = json!({"rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}});
    let ropes = Rope::by_layer_type(v4.as_object().unwrap(), 1024).unwrap();
    assert_eq!(ropes.full.theta, 1e6);
    assert_eq!(ropes.full.scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!(
        ropes.sliding,
        Rope {
            theta: 1e4,
            scaling: RopeScaling::None
        }
    );
    let v5 = json!({"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}});
    assert_eq!(
        Rope::by_layer_type(v5.as_object().unwrap(), 1024),
        Ok(ropes.clone())
    );
    let defaults = Rope::by_layer_type(json!({}).as_object().unwrap(), 1024).unwrap();
    assert_eq!((defaults.full.theta, defaults.sliding.theta), (1e6, 1e4));
    assert_eq!(
        hf(Architecture::Gemma3, v4).unwrap().unwrap().sliding_rope,
        Some(ropes.sliding)
    );
    let flat = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
    assert!(Rope::by_layer_type(flat.as_object().unwrap(), 1024).is_err());
}

fn shape<'a>(arch: Architecture, layers: usize, rope: &'a Rope) -> GgufShape<'a> {
    GgufShape {
        arch,
        layers,
        hidden: 64,
        heads: 4,
        head_dim: 32,
        rope,
    }
}

#[test]
fn gguf_gemma_reads_windows_caps_and_bases_as_llama_cpp_does() {
    use super::super::gguf::tests::meta;
    let rope = Rope {
        theta: 1e6,
        scaling: RopeScaling::Linear { factor: 8.0 },
    };
    let g3 = meta(&[
        ("gemma3.attention.sliding_window", GgufValue::U32(8)),
        ("gemma3.final_logit_softcapping", GgufValue::F32(5.0)),
    ]);
    let (g, windows) = from_gguf(&g3, &shape(Architecture::Gemma3, 7, &rope)).unwrap();
    assert_eq!(windows[4..], [Some(8), None, Some(8)]);
    assert_eq!(g.query_pre_attn_scalar, 32.0);
    assert_eq!(
        (g.attn_logit_softcapping, g.final_logit_softcapping),
        (None, Some(5.0))
    );
    assert_eq!(
        g.sliding_rope,
        Some(Rope {
            theta: 1e4,
            scaling: RopeScaling::None
        })
    );
    let (_, whole) = from_gguf(&meta(&[]), &shape(Architecture::Gemma3, 2, &rope)).unwrap();
    assert_eq!(whole, [None, None]);
    let (g2, windows) = from_gguf(&meta(&[]), &shape(Architecture::Gemma2, 46, &rope)).unwrap();
    assert_eq!(windows[..2], [Some(4096), None]);
    assert_eq!(g2.query_pre_attn_scalar, 16.0, "27B: hidden / heads");
    let flags = meta(&[
        ("gemma2.attention.sliding_window", GgufValue::U32(8)),
        (
            "gemma2.attention.sliding_window_pattern",
            GgufValue::Array(vec![GgufValue::Bool(false), GgufValue::Bool(true)]),
        ),
    ]);
    let (_, windows) = from_gguf(&flags, &shape(Architecture::Gemma2, 2, &rope)).unwrap();
    assert_eq!(windows, [None, Some(8)]);
}
