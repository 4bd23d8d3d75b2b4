use std::io::Write;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::*;
use crate::kquant::{KFormat, KPart};
use crate::q4::Q41Matrix;
use crate::q8::Q80Matrix;

const COLS: usize = 512;

/// A scratch folder of this test's own, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-pack-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ggml(rows: usize, dtype: GgmlDType) -> Vec<u8> {
    let w = Tensor::randn(0f32, 1.0, (rows, COLS), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype)
        .unwrap()
        .data()
        .unwrap()
        .into_owned()
}

/// A Q4_K matrix of 13 rows stacked on a Q6_K one of 8: two parts, the first padded.
fn stacked() -> KMatrix {
    let (q4k, q6k) = (ggml(13, GgmlDType::Q4K), ggml(8, GgmlDType::Q6K));
    let parts = [
        KPart {
            format: KFormat::Q4K,
            bytes: &q4k,
            rows: 13,
        },
        KPart {
            format: KFormat::Q6K,
            bytes: &q6k,
            rows: 8,
        },
    ];
    KMatrix::stack(&parts, COLS).unwrap()
}

/// A model file to name as a pack's source, and its identity.
fn source(dir: &Path) -> (PathBuf, SourceId) {
    let model = dir.join("model.gguf");
    std::fs::write(&model, b"weights").unwrap();
    let id = SourceId::of(&model).unwrap();
    (model, id)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `m` as a pack holds it.
fn k(m: KMatrix) -> PackedMatrix {
    PackedMatrix::K(Arc::new(m))
}

#[test]
fn a_mapped_matrix_multiplies_as_the_repacked_one() {
    let dir = scratch("round-trip");
    let (model, id) = source(&dir);
    let down = KMatrix::from_ggml(KFormat::Q5K, &ggml(3, GgmlDType::Q5K), 3, COLS).unwrap();
    // Eleven rows: a group of eight and three loose rows after it.
    let head = Q80Matrix::from_ggml(&ggml(11, GgmlDType::Q8_0), 11, COLS).unwrap();
    let gate = Q41Matrix::from_ggml(ggml(11, GgmlDType::Q4_1), 11, COLS).unwrap();
    let path = path_for(&dir, &model);
    let matrices = [
        ("q+v".to_string(), k(stacked())),
        ("down".into(), k(down)),
        ("head".into(), PackedMatrix::Q80(Arc::new(head))),
        ("gate".into(), PackedMatrix::Q41(Arc::new(gate))),
    ];
    write(&path, id, &matrices).unwrap();
    let mapped = Mapped::open(&path, id).unwrap();
    let x = Tensor::randn(0f32, 1.0, (5, COLS), &Device::Cpu).unwrap();
    let x: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    for (key, want) in &matrices {
        let got = mapped.matrix(key, want.rows_cols()).expect("in the pack");
        assert_eq!(got.shape(), want.shape());
        assert_eq!(got.data(), want.data());
        assert_eq!(bits(&got.matmul(&x, 5)), bits(&want.matmul(&x, 5)));
    }
    assert!(
        mapped.matrix("head", (12, COLS)).is_none(),
        "a Q8_0 shape the loader does not expect"
    );
    assert!(
        mapped.matrix("gate", (11, COLS + 32)).is_none(),
        "a Q4_1 shape the loader does not expect"
    );
    assert!(
        mapped.matrix("q+v", (20, COLS)).is_none(),
        "a shape the loader does not expect"
    );
    assert!(
        mapped.matrix("k", (21, COLS)).is_none(),
        "a key the pack does not have"
    );
}

#[test]
fn a_pack_of_another_model_file_or_layout_is_refused() {
    let dir = scratch("refused");
    let (model, id) = source(&dir);
    let path = path_for(&dir, &model);
    write(&path, id, &[("q".into(), k(stacked()))]).unwrap();
    // The model file rewritten: another length, and so another identity.
    std::fs::write(&model, b"other weights").unwrap();
    let now = SourceId::of(&model).unwrap();
    assert!(matches!(Mapped::open(&path, now), Err(PackError::Stale)));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&(LAYOUT_VERSION + 1).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        Mapped::open(&path, id),
        Err(PackError::Layout { found }) if found == LAYOUT_VERSION + 1
    ));
    assert!(matches!(
        Mapped::open(&dir.join("none.tpack"), id),
        Err(PackError::Missing)
    ));
}

#[test]
fn a_damaged_pack_is_refused_without_reading_past_its_end() {
    let dir = scratch("damaged");
    let (model, id) = source(&dir);
    let path = path_for(&dir, &model);
    write(&path, id, &[("q".into(), k(stacked()))]).unwrap();
    let whole = std::fs::read(&path).unwrap();
    // Cut inside the matrix's bytes: the header says more than the file has.
    std::fs::write(&path, &whole[..whole.len() - 100]).unwrap();
    assert!(matches!(
        Mapped::open(&path, id),
        Err(PackError::Damaged(_))
    ));
    // A header length past the end of the file, and one no file has.
    for len in [whole.len() as u64, u64::MAX - 8] {
        let mut bytes = whole.clone();
        bytes[12..20].copy_from_slice(&len.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            Mapped::open(&path, id),
            Err(PackError::Damaged(_))
        ));
    }
    // A header that is not JSON.
    let mut bytes = whole.clone();
    bytes[PREAMBLE] = b'!';
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        Mapped::open(&path, id),
        Err(PackError::Damaged(_))
    ));
    for junk in [&b"TANDEMP"[..], &b"GGUF and more bytes than a preamble"[..]] {
        std::fs::File::create(&path)
            .unwrap()
            .write_all(junk)
            .unwrap();
        assert!(matches!(Mapped::open(&path, id), Err(PackError::NotAPack)));
    }
}

#[test]
fn a_matrix_whose_parts_do_not_make_its_bytes_is_not_taken() {
    let dir = scratch("parts");
    let (model, id) = source(&dir);
    let path = path_for(&dir, &model);
    let m = stacked();
    // The same bytes described as a Q4_K matrix of 21 rows: more bytes than there are.
    let lying = KMatrix::from_packed(
        vec![PartShape {
            format: KFormat::Q4K,
            rows: 21,
        }],
        COLS,
        Bytes::copy_from_slice(m.data()),
    );
    assert!(lying.is_err());
    write(&path, id, &[("q".into(), k(m))]).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let header =
        String::from_utf8(bytes[PREAMBLE..PREAMBLE + header_len(&bytes) as usize].to_vec())
            .unwrap();
    // 17 rows take a third group: the bytes no longer fit the parts.
    let edited = header.replacen("\"rows\":13", "\"rows\":17", 1);
    assert_ne!(edited, header);
    bytes[PREAMBLE..PREAMBLE + header.len()].copy_from_slice(edited.as_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let mapped = Mapped::open(&path, id).unwrap();
    assert!(mapped.matrix("q", (21, COLS)).is_none());
    assert!(mapped.matrix("q", (25, COLS)).is_none());
}

#[test]
fn packs_of_two_models_of_one_name_do_not_collide() {
    let dir = scratch("names");
    let a = path_for(&dir, Path::new("/models/a/model.gguf"));
    let b = path_for(&dir, Path::new("/models/b/model.gguf"));
    assert_ne!(a, b);
    assert!(a
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("model.gguf."));
}

#[test]
fn a_pack_is_written_into_a_cache_folder_not_yet_made() {
    let dir = scratch("new-folder");
    let (model, id) = source(&dir);
    let path = path_for(&dir.join("cache").join("packs"), &model);
    write(&path, id, &[("q+v".to_string(), k(stacked()))]).unwrap();
    assert!(Mapped::open(&path, id)
        .unwrap()
        .matrix("q+v", (21, COLS))
        .is_some());
}
