use candle_core::DType;

use super::*;

fn header(
    name: &str,
    elements: u64,
    stored: u64,
    dims: usize,
    ggml: Option<GgmlDType>,
) -> TensorHeader {
    TensorHeader {
        name: name.into(),
        elements,
        stored,
        dims,
        ggml,
    }
}

#[test]
fn a_folder_holds_its_tensors_in_f32_and_its_mapped_files_not_at_all() {
    let widened = WeightFile::Folder(DenseMatrices::F32);
    let f32 = [header("a", 100, 400, 2, None), header("b", 10, 40, 1, None)];
    assert_eq!(peak_weight_bytes(&f32, widened), 440);
    let bf16 = [header("a", 100, 200, 2, None), header("b", 10, 20, 1, None)];
    assert_eq!(peak_weight_bytes(&bf16, widened), 440);
}

#[test]
fn a_folder_held_as_stored_keeps_its_half_matrices_in_two_bytes() {
    let as_stored = WeightFile::Folder(DenseMatrices::AsStored);
    // The bf16 matrix as stored, the vector widened.
    let bf16 = [header("a", 100, 200, 2, None), header("b", 10, 20, 1, None)];
    assert_eq!(peak_weight_bytes(&bf16, as_stored), 200 + 40);
    let f32 = [header("a", 100, 400, 2, None), header("b", 10, 40, 1, None)];
    assert_eq!(peak_weight_bytes(&f32, as_stored), 440);
}

#[test]
fn a_folder_used_in_place_counts_its_half_matrices_in_two_bytes() {
    let in_place = WeightFile::Folder(DenseMatrices::InPlace);
    let bf16 = [header("a", 100, 200, 2, None), header("b", 10, 20, 1, None)];
    assert_eq!(peak_weight_bytes(&bf16, in_place), 200 + 40);
    let f32 = [header("a", 100, 400, 2, None), header("b", 10, 40, 1, None)];
    assert_eq!(peak_weight_bytes(&f32, in_place), 440);
}

#[test]
fn a_gpu_holds_a_folders_matrices_as_stored_and_the_cpu_uses_them_in_place() {
    let cpu = match crate::dense_matrix::DenseMatrix::supported() {
        true => DenseMatrices::InPlace,
        false => DenseMatrices::F32,
    };
    assert_eq!(DenseMatrices::for_device(&Device::Cpu), cpu);
    assert_eq!(DenseMatrices::InPlace.held(DType::F16), DType::F16);
    assert_eq!(DenseMatrices::InPlace.held(DType::F32), DType::F32);
    assert_eq!(DenseMatrices::AsStored.held(DType::BF16), DType::BF16);
    assert_eq!(DenseMatrices::AsStored.held(DType::F16), DType::F16);
    assert_eq!(DenseMatrices::AsStored.held(DType::F32), DType::F32);
    assert_eq!(DenseMatrices::F32.held(DType::BF16), DType::F32);
}

#[test]
fn a_gguf_holds_vectors_as_f32_the_embedding_as_stored_and_matrices_in_our_form() {
    let q41 = Some(GgmlDType::Q4_1);
    let untied = [
        header("token_embd.weight", 64, 40, 2, q41),
        header("output.weight", 64, 40, 2, Some(GgmlDType::Q8_0)),
        header("blk.0.attn_q.weight", 64, 40, 2, q41),
        header("blk.0.attn_norm.weight", 8, 32, 1, Some(GgmlDType::F32)),
    ];
    // embedding 40 as stored; head 40 as stored; Q4_1 32 + 2 blocks of 8; norm 32.
    assert_eq!(
        peak_weight_bytes(&untied, WeightFile::Gguf),
        40 + 40 + 48 + 32
    );
    // Tied: the table as stored, and the head in our kernel's form.
    let tied = [header("token_embd.weight", 64, 40, 2, q41)];
    assert_eq!(peak_weight_bytes(&tied, WeightFile::Gguf), 40 + 48);
    // A dense table used in place is the tied head's own pages; else candle's f32 copy.
    let in_place = crate::dense_matrix::DenseMatrix::supported();
    for (dtype, stored) in [
        (GgmlDType::F32, 256),
        (GgmlDType::F16, 128),
        (GgmlDType::BF16, 128),
    ] {
        let tied = [header("token_embd.weight", 64, stored, 2, Some(dtype))];
        let head = if in_place { 0 } else { 256 };
        let held = peak_weight_bytes(&tied, WeightFile::Gguf);
        assert_eq!(held, stored + head, "{dtype:?}");
    }
    // The K-quants' super-blocks with their scales unpacked to a byte each: Q4_K 144 + 4,
    // Q5_K 176 + 4; Q6_K's are its own 210.
    let k = |dtype, stored| [header("blk.0.attn_q.weight", 512, stored, 2, Some(dtype))];
    assert_eq!(
        peak_weight_bytes(&k(GgmlDType::Q4K, 288), WeightFile::Gguf),
        2 * 148
    );
    assert_eq!(
        peak_weight_bytes(&k(GgmlDType::Q5K, 352), WeightFile::Gguf),
        2 * 180
    );
    assert_eq!(
        peak_weight_bytes(&k(GgmlDType::Q6K, 420), WeightFile::Gguf),
        2 * 210
    );
}

#[test]
fn a_gguf_mixture_peaks_with_a_layers_split_experts_and_one_whole_tensor() {
    let q41 = Some(GgmlDType::Q4_1);
    let q3k = Some(GgmlDType::Q3K);
    let ours = [
        header("blk.0.ffn_gate_exps.weight", 1024, 640, 3, q41),
        header("blk.0.ffn_up_exps.weight", 1024, 640, 3, q41),
        header("blk.0.ffn_down_exps.weight", 2048, 1280, 3, q41),
        header("blk.1.ffn_gate_exps.weight", 1024, 640, 3, q41),
        header("blk.0.attn_q.weight", 64, 40, 2, q41),
    ];
    // Layer 0's slices (2560) beside the largest tensor read whole (1280).
    assert_eq!(expert_transient_bytes(&ours), 2560 + 1280);
    let held = held_weight_bytes(&ours, WeightFile::Gguf);
    assert_eq!(peak_weight_bytes(&ours, WeightFile::Gguf), held + 3840);
    // candle's types keep the slices as the held matrices: only the whole tensor is extra.
    let candles = [
        header("blk.0.ffn_gate_exps.weight", 1024, 440, 3, q3k),
        header("blk.0.ffn_down_exps.weight", 2048, 880, 3, q3k),
    ];
    assert_eq!(expert_transient_bytes(&candles), 880);
    let dense = [header("blk.0.attn_q.weight", 64, 40, 2, q41)];
    assert_eq!(
        peak_weight_bytes(&dense, WeightFile::Gguf),
        held_weight_bytes(&dense, WeightFile::Gguf)
    );
}

#[test]
fn limits_read_from_cgroups_and_meminfo() {
    assert_eq!(cgroup_limit("8589934592\n"), Some(8 << 30));
    assert_eq!(cgroup_limit("max\n"), None);
    assert_eq!(cgroup_limit("9223372036854771712\n"), None);
    let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000 kB\n";
    assert_eq!(mem_total(meminfo), Some(24_576_000 * 1024));
    assert_eq!(mem_total("MemFree: 1 kB\n"), None);
}

#[test]
fn a_model_past_the_machine_is_refused_with_both_numbers() {
    let machine = MachineMemory {
        bytes: 8 << 30,
        source: "MemTotal in /proc/meminfo",
    };
    let path = Path::new("/models/big.gguf");
    assert!(check_fits(path, 4 << 30, 4 << 30, &machine).is_ok());
    let err = check_fits(path, 6 << 30, 3 << 30, &machine).unwrap_err();
    let text = err.to_string();
    for part in [
        "6.00 GiB", "3.00 GiB", "9.00 GiB", "8.00 GiB", "MemTotal", "big.gguf",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    assert!(!err.is_request_fault());
}

#[test]
fn a_reserve_counts_each_position_in_every_layers_k_and_v() {
    let layout = KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
        dtype: crate::KV_DTYPE,
    };
    let reserve = KvReserve {
        bytes: 1000,
        positions: 10,
        ..KvReserve::default()
    };
    // 2 layers x (K and V) x 2 heads x 4 dims x 2 bytes = 64 bytes a position.
    assert_eq!(reserve.bytes_for(&layout), 1000 + 640);
    // Heads of 64 in Q8_0: two blocks of 34 bytes a row, 2 x 2 x 2 x 68 = 544 a position.
    let q8 = KvLayout {
        head_dim: 64,
        dtype: crate::KvDtype::Q8_0,
        ..layout
    };
    assert_eq!(reserve.bytes_for(&q8), 1000 + 5440);
}

#[test]
fn sizes_read_in_gib_or_mib() {
    assert_eq!(size(3 << 29), "1.50 GiB");
    assert_eq!(size(564_120), "0.54 MiB");
}
