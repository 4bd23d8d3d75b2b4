//! A model whose K-quant, Q8_0 and Q4_1 matrices are mapped from a pack computes the bits of
//! one repacked at load, and a pack that no longer matches its model file, or is damaged, is
//! rebuilt.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use candle_core::Device;
use engine::pack::PackError;
use engine::LoadOptions;

use crate::common;

const PROBE: [u32; 12] = [5, 77, 300, 12, 9, 401, 33, 250, 18, 19, 64, 2];

/// The logits after each probe token (as bits), and what the load did with its pack.
fn load(model: &Path, packs: Option<&Path>) -> (Vec<u32>, Option<engine::weights::PackReport>) {
    let options = LoadOptions {
        pack_dir: packs.map(Path::to_path_buf),
        ..Default::default()
    };
    let loaded = engine::load_reporting(model, &Device::Cpu, &options, &mut |_| {}).unwrap();
    let logits = loaded.model.logits_for(&PROBE).unwrap();
    (logits.iter().map(|v| v.to_bits()).collect(), loaded.pack)
}

/// A copy of `fixture` in a scratch folder of `name`, loaded without a pack and then twice
/// with one: the first load builds every matrix the pack holds, the second maps them all,
/// and all three give the same logits. Returns the copy, its pack folder, the logits and
/// how many matrices the pack holds.
fn packed_twice(fixture: &str, name: &str) -> (PathBuf, PathBuf, Vec<u32>, usize) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("packs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let packs = dir.join("packs");
    std::fs::create_dir_all(&packs).unwrap();
    // A copy, so that its modification time can change.
    let model = dir.join(Path::new(fixture).file_name().unwrap());
    std::fs::copy(common::fixture(fixture), &model).unwrap();

    let (plain, none) = load(&model, None);
    assert!(none.is_none());
    let (first, report) = load(&model, Some(&packs));
    let report = report.unwrap();
    assert!(
        report.built > 0 && report.mapped == 0,
        "{fixture}: {report:?}"
    );
    assert!(
        report.path.exists() && report.unwritten.is_none(),
        "{fixture}: {report:?}"
    );
    let matrices = report.built;
    let (second, report) = load(&model, Some(&packs));
    let report = report.unwrap();
    assert_eq!(
        (report.mapped, report.built),
        (matrices, 0),
        "{fixture}: {report:?}"
    );
    assert!(report.refused.is_none());
    assert_eq!(first, plain, "{fixture}");
    assert_eq!(second, plain, "{fixture}");
    (model, packs, plain, matrices)
}

#[test]
fn q8_0_q5_0_and_q4_1_matrices_and_experts_come_from_the_pack_as_they_were_built() {
    for (fixture, name) in [
        ("gguf/tiny-qwen3_wide-q8_0.gguf", "q8_0"),
        ("gguf/tiny-qwen3_wide-q5_0.gguf", "q5_0"),
        ("gguf/tiny-qwen3_moe-q8_0.gguf", "moe-q8_0"),
        ("gguf/tiny-qwen3-q4_1.gguf", "q4_1"),
        ("gguf/tiny-mixtral-q4_1.gguf", "mixtral-q4_1"),
    ] {
        packed_twice(fixture, name);
    }
}

#[test]
fn a_packed_model_computes_as_a_repacked_one_and_a_stale_or_damaged_pack_is_rebuilt() {
    let (model, packs, plain, matrices) =
        packed_twice("gguf/tiny-qwen3_wide-q4_k_m.gguf", "q4_k_m");

    // The model file replaced by a copy of itself: a new modification time.
    let later = SystemTime::now() + Duration::from_secs(60);
    let file = std::fs::File::options().write(true).open(&model).unwrap();
    file.set_modified(later).unwrap();
    drop(file);
    let (third, report) = load(&model, Some(&packs));
    let report = report.unwrap();
    assert!(
        matches!(report.refused, Some(PackError::Stale)),
        "{report:?}"
    );
    assert_eq!((report.mapped, report.built), (0, matrices));
    assert_eq!(third, plain);

    // Cut short, the pack is refused before anything is mapped from it, and rebuilt.
    let pack = report.path;
    let len = std::fs::metadata(&pack).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&pack)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let (fourth, report) = load(&model, Some(&packs));
    let report = report.unwrap();
    assert!(
        matches!(report.refused, Some(PackError::Damaged(_))),
        "{report:?}"
    );
    assert_eq!(report.built, matrices);
    assert_eq!(fourth, plain);
    assert_eq!(load(&model, Some(&packs)).1.unwrap().mapped, matrices);
}

#[test]
fn a_pack_folder_that_cannot_be_written_leaves_the_load_as_it_was() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("packs-unwritable-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::fixture("gguf/tiny-qwen3_wide-q4_k_m.gguf");
    let (plain, _) = load(&model, None);
    // A file where the folder should be: nothing can be written under it.
    let packs = dir.join("not-a-folder");
    std::fs::write(&packs, b"").unwrap();
    let (logits, report) = load(&model, Some(&packs));
    let report = report.unwrap();
    assert!(
        matches!(report.unwritten, Some(PackError::Io(_))),
        "{report:?}"
    );
    assert_eq!(logits, plain);
}
