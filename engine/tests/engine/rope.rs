//! The generated tiny model under each rotary scaling the engine reads, against
//! `transformers` on the same weights: `engine/tests/fixtures/rope_reference.json` comes from
//! `scripts/oracle_rope.py`, which ran each variant's config.json (kept whole in the
//! fixture) on a prompt longer than its original context. Both config layouts are covered:
//! transformers 4's `rope_theta` / `rope_scaling` and transformers 5's `rope_parameters`.
//! The same fixture lists the fields of the configuration classes the engine runs.

use std::path::PathBuf;

use serde_json::Value;

use crate::common;

/// The tiny model's folder with `config` as its config.json.
fn variant(name: &str, config: &Value) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rope-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(common::tiny_model_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn every_rope_scaling_matches_transformers() {
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("rope_reference.json")).unwrap(),
    )
    .unwrap();
    let variants = fx["variants"].as_array().unwrap();
    assert!(variants.len() >= 5);
    for v in variants {
        let name = v["name"].as_str().unwrap();
        let model = engine::Model::load(&variant(name, &v["config"]), &common::device())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids: Vec<u32> = serde_json::from_value(v["prompt_ids"].clone()).unwrap();
        common::assert_top5(
            name,
            &model.logits_for(&ids).unwrap(),
            &v["first_step_top5"],
        );
        let want: Vec<u32> = serde_json::from_value(v["generated_ids"].clone()).unwrap();
        let got = common::greedy(&model, &ids, want.len());
        assert_eq!(got, want, "{name}: greedy tokens");
    }
}

/// Every field transformers writes for the configuration classes the engine runs
/// (recorded by `scripts/oracle_rope.py`) is one the engine reads, leaves as transformers
/// leaves it at inference, or runs at one value and refuses at others: none is skipped
/// unknown.
#[test]
fn every_field_of_the_supported_config_classes_is_known() {
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("rope_reference.json")).unwrap(),
    )
    .unwrap();
    let classes = fx["config_fields"].as_object().unwrap();
    assert_eq!(
        classes.len(),
        10,
        "Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, \
         Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config and Qwen3MoeConfig"
    );
    for (class, fields) in classes {
        for field in fields.as_array().unwrap() {
            let field = field.as_str().unwrap();
            assert!(
                text::config::field_use(field).is_some(),
                "{class}.{field} is neither used, ignored nor refused"
            );
        }
    }
}
