//! Shared helpers for the engine's integration tests.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device};
use engine::testmodel::{write_model, Family, ModelSize};

/// An empty folder of the target folder's for a test's files, `name` naming it within this
/// test binary's run.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("scratch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

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
    turned(Family::Qwen3)
}

/// The generated tiny model turned Mistral (no biases, a sliding window of
/// `engine::testmodel::MISTRAL_WINDOW` positions), written once per test binary.
pub fn tiny_mistral_dir() -> PathBuf {
    turned(Family::Mistral)
}

/// The generated tiny model turned Llama 3.1 (no biases, Llama 3's RoPE scaling), written
/// once per test binary.
pub fn tiny_llama3_dir() -> PathBuf {
    turned(Family::Llama3)
}

/// The generated tiny model turned Qwen3-MoE (8 experts per layer, 2 per token), written
/// once per test binary.
pub fn tiny_qwen3_moe_dir() -> PathBuf {
    turned(Family::Qwen3Moe)
}

/// The generated tiny model turned Mixtral (no biases, 8 experts per layer, 2 per token),
/// written once per test binary.
pub fn tiny_mixtral_dir() -> PathBuf {
    turned(Family::Mixtral)
}

/// The generated tiny model turned Qwen2-MoE (8 experts per layer, 2 per token, and a
/// shared expert), written once per test binary.
pub fn tiny_qwen2_moe_dir() -> PathBuf {
    turned(Family::Qwen2Moe)
}

/// The generated tiny model turned Gemma 2 (alternating windows, soft caps), written once
/// per test binary.
pub fn tiny_gemma2_dir() -> PathBuf {
    turned(Family::Gemma2)
}

/// The generated tiny model turned Gemma 3 (q/k norms, five sliding layers of six, a
/// local and a global RoPE), written once per test binary.
pub fn tiny_gemma3_dir() -> PathBuf {
    turned(Family::Gemma3)
}

/// The generated tiny model turned Phi-3 (fused projections, partial rotary, LongRoPE),
/// written once per test binary.
pub fn tiny_phi3_dir() -> PathBuf {
    turned(Family::Phi3)
}

/// The generated tiny model turned `family`, written once per test binary.
fn turned(family: Family) -> PathBuf {
    static DIRS: Mutex<Vec<(Family, PathBuf)>> = Mutex::new(Vec::new());
    let mut dirs = DIRS.lock().expect("no test panics while holding the list");
    if let Some((_, dir)) = dirs.iter().find(|(f, _)| *f == family) {
        return dir.clone();
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tiny-{}-{}",
        family.name(),
        std::process::id()
    ));
    let seed = engine::testmodel::DEFAULT_SEED;
    write_model(&dir, ModelSize::Tiny, DType::F32, seed).expect("writing the tiny model");
    family.turn(&dir, seed).expect("turning the tiny model");
    dirs.push((family, dir.clone()));
    dir
}

/// The device engine tests run on: CUDA when the build has it, else CPU. One for the
/// whole binary: each CUDA device made is a context, streams and cuBLAS handles of its own.
pub fn device() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| Device::cuda_if_available(0).expect("device"))
        .clone()
}

/// The device the tests compute caches of `kv` on: [`device`] where it holds them, else
/// the CPU. Q8_0 caches are the CPU's alone (a model on a GPU refuses them), so their tests
/// check the CPU's kernels in every build; `q8_cache` checks that a GPU refuses them.
pub fn device_for(kv: engine::KvDtype) -> Device {
    match kv {
        engine::KvDtype::F16 => device(),
        engine::KvDtype::Q8_0 => Device::Cpu,
    }
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
