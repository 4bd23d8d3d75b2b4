//! Shared helpers for the engine's integration tests.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Device};
use engine::testmodel::{write_model, ModelSize};

/// The generated tiny model, written once per test binary into the target folder.
pub fn tiny_model_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tiny-model-{}", std::process::id()));
        write_model(
            &dir,
            ModelSize::Tiny,
            DType::F32,
            engine::testmodel::DEFAULT_SEED,
        )
        .expect("writing the tiny model");
        dir
    })
    .clone()
}

/// The generated tiny model turned Qwen3 (q/k norms, no q/k/v biases), written once per
/// test binary into the target folder.
pub fn tiny_qwen3_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tiny-qwen3-{}", std::process::id()));
        let seed = engine::testmodel::DEFAULT_SEED;
        write_model(&dir, ModelSize::Tiny, DType::F32, seed).expect("writing the tiny model");
        engine::testmodel::into_qwen3(&dir, seed).expect("turning it Qwen3");
        dir
    })
    .clone()
}

/// The generated tiny model turned Mistral (no biases, a sliding window of
/// `engine::testmodel::MISTRAL_WINDOW` positions), written once per test binary.
pub fn tiny_mistral_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| turned("mistral", engine::testmodel::into_mistral))
        .clone()
}

/// The generated tiny model turned Llama 3.1 (no biases, Llama 3's RoPE scaling), written
/// once per test binary.
pub fn tiny_llama3_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| turned("llama3", engine::testmodel::into_llama3))
        .clone()
}

/// The generated tiny model turned Qwen3-MoE (8 experts per layer, 2 per token), written
/// once per test binary.
pub fn tiny_qwen3_moe_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        turned("qwen3-moe", |dir| {
            engine::testmodel::into_qwen3_moe(dir, engine::testmodel::DEFAULT_SEED)
        })
    })
    .clone()
}

/// The generated tiny model turned Mixtral (no biases, 8 experts per layer, 2 per token),
/// written once per test binary.
pub fn tiny_mixtral_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        turned("mixtral", |dir| {
            engine::testmodel::into_mixtral(dir, engine::testmodel::DEFAULT_SEED)
        })
    })
    .clone()
}

/// The generated tiny model turned Qwen2-MoE (8 experts per layer, 2 per token, and a
/// shared expert), written once per test binary.
pub fn tiny_qwen2_moe_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        turned("qwen2-moe", |dir| {
            engine::testmodel::into_qwen2_moe(dir, engine::testmodel::DEFAULT_SEED)
        })
    })
    .clone()
}

/// The generated tiny model turned Gemma 2 (alternating windows, soft caps), written once
/// per test binary.
pub fn tiny_gemma2_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        turned("gemma2", |dir| {
            engine::testmodel::into_gemma2(dir, engine::testmodel::DEFAULT_SEED)
        })
    })
    .clone()
}

/// The generated tiny model turned Gemma 3 (q/k norms, five sliding layers of six, a
/// local and a global RoPE), written once per test binary.
pub fn tiny_gemma3_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        turned("gemma3", |dir| {
            engine::testmodel::into_gemma3(dir, engine::testmodel::DEFAULT_SEED)
        })
    })
    .clone()
}

/// The generated tiny model turned Phi-3 (fused projections, partial rotary, LongRoPE),
/// written once per test binary.
pub fn tiny_phi3_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| turned("phi3", engine::testmodel::into_phi3))
        .clone()
}

/// The tiny model written into the target folder and turned into `family` by `turn`.
fn turned(family: &str, turn: fn(&std::path::Path) -> engine::Result<()>) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tiny-{family}-{}", std::process::id()));
    let seed = engine::testmodel::DEFAULT_SEED;
    write_model(&dir, ModelSize::Tiny, DType::F32, seed).expect("writing the tiny model");
    turn(&dir).expect("turning the tiny model");
    dir
}

/// The device engine tests run on: CUDA when the build has it, else CPU.
pub fn device() -> Device {
    Device::cuda_if_available(0).expect("device")
}

/// Where fetched models live: `$TANDEM_MODELS`, or `models/` at the repository root.
pub fn models_dir() -> PathBuf {
    std::env::var_os("TANDEM_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

/// A fixture file under `engine/tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Checks `logits` against a fixture's `first_step_top5` (`ids`, `logits`), each within
/// 1e-3 relative: what the oracle scripts record of a reference's first step.
pub fn assert_top5(name: &str, logits: &[f32], top: &serde_json::Value) {
    let ids = top["ids"].as_array().unwrap();
    for (id, want) in ids.iter().zip(top["logits"].as_array().unwrap()) {
        let got = logits[id.as_u64().unwrap() as usize];
        let want = want.as_f64().unwrap() as f32;
        assert!(
            (got - want).abs() < 1e-3 * want.abs().max(1.0),
            "{name}: logit of {id}: {got} vs {want}"
        );
    }
}

/// `n` greedy tokens after `prompt`.
pub fn greedy(model: &engine::Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache().unwrap();
    let default = engine::SamplingParams::default();
    engine::generate::generate(model, &mut cache, prompt, &default, n, &[])
        .unwrap()
        .iter()
        .map(|s| s.token)
        .collect()
}
