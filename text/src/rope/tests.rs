//! Reading RoPE settings from both config.json layouts, and refusing what the engine does
//! not compute.

use serde_json::json;

use super::*;

fn read(config: Value) -> Result<Rope, String> {
    Rope::from_hf(config.as_object().unwrap(), 4096)
}

#[test]
fn plain_rope_takes_the_base_from_either_layout() {
    let plain = |theta| Rope {
        theta,
        scaling: RopeScaling::None,
    };
    assert_eq!(read(json!({})), Ok(plain(10_000.0)));
    assert_eq!(
        read(json!({"rope_theta": 5e5, "rope_scaling": null})),
        Ok(plain(5e5))
    );
    // transformers 5: the base lives in rope_parameters, and wins over a top-level one.
    let v5 =
        json!({"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
    assert_eq!(read(v5), Ok(plain(1e6)));
}

#[test]
fn llama3_takes_its_original_context_from_the_top_level_first() {
    let scaling = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let want = |original| RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    };
    let v4 = read(json!({"rope_theta": 5e5, "rope_scaling": scaling.clone()})).unwrap();
    assert_eq!((v4.theta, v4.scaling), (5e5, want(8192.0)));
    let top = read(json!({"rope_scaling": scaling, "original_max_position_embeddings": 2048}));
    assert_eq!(top.unwrap().scaling, want(2048.0));
    let missing = json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}});
    assert_eq!(
        read(missing),
        Err("rope_scaling.low_freq_factor is missing for rope type \"llama3\"".into())
    );
}

#[test]
fn yarn_fills_in_transformers_defaults() {
    let yarn = read(json!({"rope_scaling": {"type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768}}))
    .unwrap();
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        attention_factor,
        beta_fast,
        beta_slow,
        truncate,
    } = yarn.scaling
    else {
        panic!("{yarn:?}")
    };
    assert_eq!((factor, original_max_position_embeddings), (4.0, 32768.0));
    assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, true));
    // No factor: the ratio of the contexts; mscale over mscale_all_dim when both are set.
    let derived = read(json!({"rope_parameters": {"rope_type": "yarn",
        "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 0.5}}))
    .unwrap();
    let RopeScaling::Yarn {
        factor,
        attention_factor,
        ..
    } = derived.scaling
    else {
        panic!("{derived:?}")
    };
    assert_eq!(factor, 4.0);
    let m = |s: f64| 0.1 * s * 4f64.ln() + 1.0;
    assert!((attention_factor - m(1.0) / m(0.5)).abs() < 1e-12);
}

#[test]
fn what_the_engine_does_not_compute_is_refused_by_name() {
    let refused = |config: Value| read(config).unwrap_err();
    let dynamic = refused(json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}));
    assert!(
        dynamic.contains("\"dynamic\" is not supported"),
        "{dynamic}"
    );
    let unknown = refused(json!({"rope_scaling": {"rope_type": "mrope"}}));
    assert!(unknown.contains("\"mrope\" is not supported"), "{unknown}");
    let long = json!({"original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}});
    assert_eq!(
        refused(long),
        "rope_scaling.long_factor must be a list of numbers"
    );
    assert_eq!(
        refused(json!({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}})),
        "rope_scaling.low_freq_factor is not supported for rope type \"linear\""
    );
    assert_eq!(
        refused(json!({"rope_parameters": {"rope_type": "default", "factor": 2.0}})),
        "rope_parameters.factor is not supported for rope type \"default\""
    );
    let partial = |v: serde_json::Value| partial_rotary_factor(v.as_object().unwrap());
    assert_eq!(partial(json!({"partial_rotary_factor": 0.75})), Ok(0.75));
    let inside = json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}});
    assert_eq!(partial(inside), Ok(0.5));
    assert_eq!(partial(json!({})), Ok(1.0));
    assert_eq!(
        refused(json!({"rope_scaling": {"type": "linear", "factor": "2"}})),
        "rope_scaling.factor must be a number, got \"2\""
    );
}

/// LongRoPE takes the long factors for a context past the original one, the short ones
/// within it, and transformers' attention factor from the stretch.
#[test]
fn longrope_takes_the_factors_of_the_served_context() {
    let config = json!({"original_max_position_embeddings": 64, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}});
    let of = |max: usize| {
        Rope::from_hf(config.as_object().unwrap(), max)
            .unwrap()
            .scaling
    };
    let stretch: f64 = 4096.0 / 64.0;
    assert_eq!(
        of(4096),
        RopeScaling::LongRope {
            factors: vec![3.0, 4.0],
            original_max_position_embeddings: 64.0,
            attention_factor: (1.0 + stretch.ln() / 64f64.ln()).sqrt(),
        }
    );
    assert_eq!(
        of(64),
        RopeScaling::LongRope {
            factors: vec![1.0, 2.0],
            original_max_position_embeddings: 64.0,
            attention_factor: 1.0,
        }
    );
}
