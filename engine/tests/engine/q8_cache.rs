//! KV caches of Q8_0 blocks (`--kv-cache-dtype q8_0`): they travel between instances and
//! decode as they would have at home, a decode step over them gives each sequence its
//! whole prompt's logits, and a model whose heads they cannot hold is refused at load, as
//! is a model on a GPU (they are computed on the CPU in every build). What
//! the blocks mean is the attention kernels' unit tests' (against candle's dequantization);
//! how close their tokens stay to llama.cpp's own Q8_0 caches is `llama_cpp`'s.

use candle_core::Device;
use engine::{EngineError, KvAssembler, KvDtype, KvLayout};

use crate::common;
use crate::kv_and_batching::{round_trip_matches_uninterrupted_decode, step_against_whole_prompts};

/// The tiny Qwen3's heads are 32 wide: one Q8_0 block a row.
#[test]
fn a_q8_0_cache_travels_between_instances_and_decodes_as_at_home() {
    round_trip_matches_uninterrupted_decode(&common::tiny_qwen3_dir(), KvDtype::Q8_0);
}

#[test]
fn a_decode_step_over_q8_0_caches_gives_each_sequence_its_whole_prompt_s_logits() {
    step_against_whole_prompts(&common::tiny_qwen3_dir(), &[5, 17, 40, 300], KvDtype::Q8_0);
}

/// Q8_0 caches are the CPU's alone: the tests' device takes them where it is the CPU, and
/// where it is a GPU refuses them, naming them, rather than compute on caches no kernel of
/// its reads.
#[test]
fn q8_0_caches_are_taken_on_the_cpu_alone() {
    let device = common::device();
    let mut m = engine::Model::load(&common::tiny_qwen3_dir(), &device).unwrap();
    match m.set_kv_dtype(KvDtype::Q8_0) {
        Ok(()) => assert!(device.is_cpu(), "Q8_0 caches on {device:?}"),
        Err(err) => {
            assert!(!device.is_cpu(), "{err}");
            assert!(
                matches!(err, EngineError::KvDtypeUnsupported { head_dim: 32, .. }),
                "{err}"
            );
        }
    }
}

/// The tiny model's heads are 16 wide, half a block: refused before any weight is read,
/// and so is a transfer whose layout says so.
#[test]
fn heads_of_part_of_a_block_are_refused() {
    let options = engine::LoadOptions {
        reserve: engine::KvReserve {
            dtype: KvDtype::Q8_0,
            ..Default::default()
        },
        ..Default::default()
    };
    let dir = common::tiny_model_dir();
    let err = engine::load_reporting(&dir, &Device::Cpu, &options, &mut |_| {})
        .err()
        .expect("a Q8_0 cache of heads of 16");
    assert!(
        matches!(err, EngineError::KvDtypeUnsupported { head_dim: 16, .. }),
        "{err}"
    );
    assert!(!err.is_request_fault());
    let layout = KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 16,
        dtype: KvDtype::Q8_0,
    };
    let err = KvAssembler::new(layout, vec![1, 2], 8, &Device::Cpu).unwrap_err();
    assert!(matches!(err, EngineError::BadKv(_)), "{err}");
}

/// Every 32 values take 34 bytes in Q8_0 blocks, 64 in f16.
#[test]
fn a_q8_0_cache_takes_34_bytes_for_32_values() {
    let dir = common::tiny_qwen3_dir();
    let mut bytes = Vec::new();
    for kv in KvDtype::ALL {
        let m = crate::kv_and_batching::model_holding(&dir, kv);
        let mut cache = m.new_cache().unwrap();
        cache.reserve_exact(100).unwrap();
        assert_eq!(
            cache.allocated_bytes(),
            100 * m.kv_layout().bytes_per_position()
        );
        bytes.push(cache.allocated_bytes());
    }
    assert_eq!(bytes[1] * 64, bytes[0] * 34, "{bytes:?}");
}
