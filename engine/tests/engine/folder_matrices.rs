//! A folder's matrices used in place on the CPU, and bf16 and f16 ones held as stored as a
//! GPU holds them: in the memory the footprint predicts (half the widened form's for bf16
//! and f16), computing the model the widened matrices define (held as stored, to within
//! the rounding of its activations to the matrices' type); and bf16 matrices computing the
//! bits that f32 ones of the same values do, widened or in place.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use engine::footprint::{held_weight_bytes, read_headers, WeightFile};
use engine::testmodel::{into_gemma2, write_model, ModelSize, DEFAULT_SEED};
use engine::weights::DenseMatrices;
use engine::{LoadOptions, Model};

use crate::common;

const PROBE: [u32; 12] = [5, 77, 300, 12, 9, 401, 33, 250, 18, 19, 64, 2];

fn load(dir: &Path, matrices: DenseMatrices, device: &Device) -> Model {
    let options = LoadOptions {
        matrices: Some(matrices),
        ..LoadOptions::default()
    };
    engine::load_reporting(dir, device, &options, &mut |_| {})
        .unwrap()
        .model
}

/// The largest difference between `a` and `b`, as a share of `a`'s largest magnitude.
fn relative_gap(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let gap = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    gap / scale
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best })
}

/// Tiny folders of bf16 and f16 matrices, and of bf16 with a tied head (Gemma 2's head is
/// its embedding table, which the head then multiplies by).
const HALF_FOLDERS: [(DType, bool); 3] = [
    (DType::BF16, false),
    (DType::F16, false),
    (DType::BF16, true),
];

/// Tiny folders of `kinds`, named from `prefix`.
fn folders(prefix: &str, kinds: &[(DType, bool)]) -> Vec<(DType, bool, PathBuf)> {
    kinds
        .iter()
        .copied()
        .map(|(dtype, tied)| {
            let dir = common::scratch(&format!("{prefix}-{dtype:?}-{tied}"));
            write_model(&dir, ModelSize::Tiny, dtype, DEFAULT_SEED).unwrap();
            if tied {
                into_gemma2(&dir, DEFAULT_SEED).unwrap();
            }
            (dtype, tied, dir)
        })
        .collect()
}

/// `kept` holds the bytes the footprint predicts for `matrices`.
fn holds_the_predicted(dir: &Path, kept: &Model, matrices: DenseMatrices) {
    let headers = read_headers(dir).unwrap();
    let predicted = held_weight_bytes(&headers, WeightFile::Folder(matrices));
    assert_eq!(kept.resident_bytes() as u64, predicted, "{}", dir.display());
}

/// `kept` holds the bytes the footprint predicts for `matrices`, under half of what the
/// widened model holds.
fn holds_the_predicted_half(dir: &Path, kept: &Model, widened: &Model, matrices: DenseMatrices) {
    holds_the_predicted(dir, kept, matrices);
    assert!(
        2 * kept.resident_bytes() < widened.resident_bytes() + widened.resident_bytes() / 8,
        "{}: {} held against {} widened",
        dir.display(),
        kept.resident_bytes(),
        widened.resident_bytes()
    );
}

/// bf16 on disk computes exactly like f32 holding the same (bf16-rounded) values: widened
/// at load, both by candle's f32 products; used in place, both by our kernel, which widens
/// each weight exactly and sums in one order whatever the stored type.
#[test]
fn bf16_weights_load_as_their_exact_f32_values() {
    let bf16 = common::scratch("bf16");
    write_model(&bf16, ModelSize::Tiny, DType::BF16, DEFAULT_SEED).unwrap();
    let f32_dir = common::scratch("bf16-as-f32");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(bf16.join(f), f32_dir.join(f)).unwrap();
    }
    let tensors =
        candle_core::safetensors::load(bf16.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(tensors.values().all(|t| t.dtype() == DType::BF16));
    let widened: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(DType::F32).unwrap()))
        .collect();
    candle_core::safetensors::save(&widened, f32_dir.join("model.safetensors")).unwrap();
    let mut modes = vec![DenseMatrices::F32];
    if engine::dense_matrix::DenseMatrix::supported() {
        modes.push(DenseMatrices::InPlace);
    }
    for matrices in modes {
        let logits = |dir: &Path| {
            let model = load(dir, matrices, &Device::Cpu);
            model.logits_for(&PROBE).unwrap()
        };
        assert_eq!(logits(&bf16), logits(&f32_dir), "{matrices:?}");
    }
}

/// Used in place on the CPU, the matrices compute the widened model to within the order
/// of f32 sums, from the file's own pages: only the vectors are the process's memory.
#[test]
fn matrices_used_in_place_compute_the_widened_model_from_the_file() {
    if !engine::dense_matrix::DenseMatrix::supported() {
        eprintln!("skipped: this CPU runs no in-place kernel");
        return;
    }
    let kinds = [HALF_FOLDERS.as_slice(), &[(DType::F32, false)]].concat();
    for (dtype, tied, dir) in folders("in-place", &kinds) {
        let widened = load(&dir, DenseMatrices::F32, &Device::Cpu);
        let mapped = load(&dir, DenseMatrices::InPlace, &Device::Cpu);
        match dtype {
            DType::F32 => holds_the_predicted(&dir, &mapped, DenseMatrices::InPlace),
            _ => holds_the_predicted_half(&dir, &mapped, &widened, DenseMatrices::InPlace),
        }
        let want = widened.logits_for(&PROBE).unwrap();
        let got = mapped.logits_for(&PROBE).unwrap();
        let gap = relative_gap(&want, &got);
        // f32 sums in another order than candle's: the gaps seen were 1.4e-6 to 1.8e-5
        // (Gemma 2's the largest), against the 4e-3 of bf16's unit roundoff.
        assert!(gap < 1e-4, "{dtype:?} {tied}: {gap}");
        assert_eq!(argmax(&want), argmax(&got), "{dtype:?} {tied}");
    }
}

#[test]
fn half_matrices_held_as_stored_take_two_bytes_and_compute_the_same_model() {
    for (dtype, tied, dir) in folders("half", &HALF_FOLDERS) {
        let widened = load(&dir, DenseMatrices::F32, &Device::Cpu);
        let kept = load(&dir, DenseMatrices::AsStored, &common::device());
        holds_the_predicted_half(&dir, &kept, &widened, DenseMatrices::AsStored);
        let want = widened.logits_for(&PROBE).unwrap();
        let got = kept.logits_for(&PROBE).unwrap();
        // Four of the type's unit roundoffs: the gaps seen were 1.3-1.5 of one.
        let roundoff = if dtype == DType::BF16 {
            2f32.powi(-8)
        } else {
            2f32.powi(-11)
        };
        let gap = relative_gap(&want, &got);
        assert!(gap < 4.0 * roundoff, "{dtype:?} {tied}: {gap}");
        assert_eq!(argmax(&want), argmax(&got), "{dtype:?} {tied}");
    }
}

/// PD over matrices used in place: a bf16 folder's prompt computed in one instance, its
/// cache sent as chunks and decoded in another, gives the tokens of one instance.
#[test]
fn a_cache_over_matrices_used_in_place_travels_and_decodes_the_same_tokens() {
    let dir = common::scratch("in-place-pd");
    write_model(&dir, ModelSize::Tiny, DType::BF16, DEFAULT_SEED).unwrap();
    crate::kv_and_batching::round_trip_matches_uninterrupted_decode(&dir, engine::KV_DTYPE);
}
