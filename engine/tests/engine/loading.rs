//! Every supported way to store weights gives the model the generated folder defines, and
//! streaming detokenization never splits a character.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use engine::gguf_export::export_gguf;
use engine::testmodel::{write_model, ModelSize, DEFAULT_SEED};
use engine::Model;
use serde_json::json;
use text::{ChatInput, IncrementalDecoder, Tokenizer};

use crate::common;

/// Copies everything but the weights from the tiny model into `dir`.
fn copy_side_files(from: &Path, dir: &Path) {
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
}

const PROBE: [u32; 12] = [5, 77, 300, 12, 9, 401, 33, 250, 18, 19, 64, 2];

fn logits(path: &Path) -> Vec<f32> {
    Model::load(path, &Device::Cpu)
        .unwrap()
        .logits_for(&PROBE)
        .unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}

/// A sharded checkpoint with `model.safetensors.index.json` is the same model.
#[test]
fn sharded_safetensors_load_like_one_file() {
    let src = common::tiny_model_dir();
    let dir = common::scratch("sharded");
    copy_side_files(&src, &dir);
    let tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    let mut shards: [HashMap<String, Tensor>; 2] = Default::default();
    for (i, name) in names.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        shards[i % 2].insert((*name).clone(), tensors[*name].clone());
        weight_map.insert((*name).clone(), json!(file));
    }
    for (i, shard) in shards.iter().enumerate() {
        candle_core::safetensors::save(
            shard,
            dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
        )
        .unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    assert_eq!(logits(&dir), logits(&src));
}

/// GGUF from the same weights: f32 is the same model; quantized types stay close; the
/// tokenizer rebuilt from GGUF metadata and the embedded template behave like the folder's.
#[test]
fn gguf_exports_load_with_their_tokenizer_and_template() {
    let src = common::tiny_model_dir();
    let dir = common::scratch("gguf");
    let reference = logits(&src);
    let hf = engine::load(&src, &Device::Cpu).unwrap();
    let texts = [
        "Hello, world! 12345",
        "你好，世界！😀",
        "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call>",
        "  spaces\n\n\ttabs  ",
    ];
    let chat = ChatInput {
        messages: json!([{"role": "user", "content": "Weather?"}]),
        tools: Some(json!([{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        add_generation_prompt: true,
        ..Default::default()
    };
    for (quant, min_cosine) in [
        (GgmlDType::F32, 1.0),
        (GgmlDType::F16, 0.9999),
        (GgmlDType::Q8_0, 0.999),
        (GgmlDType::Q4_1, 0.95),
        (GgmlDType::Q4_0, 0.95),
    ] {
        let path = dir.join(format!("{quant:?}.gguf"));
        export_gguf(&src, &path, quant).unwrap();
        let got = logits(&path);
        let c = cosine(&got, &reference);
        assert!(
            c >= min_cosine - 1e-6,
            "{quant:?}: cosine {c} < {min_cosine}"
        );
        if quant == GgmlDType::F32 {
            let max = got
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max < 1e-4, "f32 GGUF differs from safetensors by {max}");
            let g = engine::load(&path, &Device::Cpu).unwrap();
            for t in texts {
                assert_eq!(
                    g.tokenizer.encode(t).unwrap(),
                    hf.tokenizer.encode(t).unwrap(),
                    "{t:?}"
                );
            }
            let tmpl = g.template.expect("template in GGUF metadata");
            assert_eq!(
                tmpl.render(&chat).unwrap(),
                hf.template.as_ref().unwrap().render(&chat).unwrap()
            );
            assert_eq!(
                g.model.config().eos_token_ids,
                vec![hf.tokenizer.token_id("<|im_end|>").unwrap()]
            );
        }
    }
}

#[test]
fn unsupported_configs_are_refused_at_load() {
    let src = common::tiny_model_dir();
    let dir = common::scratch("rope-scaling");
    copy_side_files(&src, &dir);
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["rope_scaling"] = json!({"type": "dynamic", "factor": 4.0});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let err = Model::load(&dir, &Device::Cpu)
        .err()
        .expect("rope_scaling must be refused");
    assert!(
        err.to_string()
            .contains("rope_scaling rope type \"dynamic\""),
        "{err}"
    );
    let missing = Model::load(&dir.join("nope"), &Device::Cpu)
        .err()
        .expect("missing path");
    assert!(missing.to_string().contains("nope"), "{missing}");
}

/// A tensor the engine never reads is part of a model it does not implement: the load is
/// refused, naming it, rather than run without it.
#[test]
fn a_tensor_the_engine_does_not_read_is_refused_by_name() {
    let src = common::tiny_model_dir();
    let dir = common::scratch("unread-tensor");
    copy_side_files(&src, &dir);
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let extra = "model.layers.0.self_attn.q_norm.weight";
    tensors.insert(
        extra.into(),
        candle_core::Tensor::ones(16, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let err = Model::load(&dir, &Device::Cpu)
        .err()
        .expect("an unread tensor must be refused");
    assert!(err.to_string().contains(extra), "{err}");
    assert!(err.to_string().contains("1 tensor(s) of the file"), "{err}");
}

/// Mistral has no q/k/v biases in transformers: a folder that holds them (here the tiny
/// Qwen2's, put back beside a Mistral config) is refused rather than run with them.
#[test]
fn biases_a_mistral_does_not_have_are_refused() {
    let dir = common::scratch("mistral-biases");
    let mistral = common::tiny_mistral_dir();
    copy_side_files(&mistral, &dir);
    std::fs::copy(mistral.join("config.json"), dir.join("config.json")).unwrap();
    let qwen2 = common::tiny_model_dir().join("model.safetensors");
    std::fs::copy(qwen2, dir.join("model.safetensors")).unwrap();
    let err = Model::load(&dir, &Device::Cpu)
        .err()
        .expect("biases Mistral does not read must be refused");
    assert!(err.to_string().contains("self_attn.k_proj.bias"), "{err}");
}

/// What the footprint check predicts from the headers the loader holds is what it holds
/// (the peak adds a mixture's experts while they are split, checked in its unit test): for GGUF
/// files of every quantization the tests have (tied and untied heads, our kernels and
/// candle's), and for folders in f32 and bf16 (as the CPU holds them: used in place, or
/// converted), with heads of their own and tied to the embeddings.
#[test]
fn the_predicted_weight_memory_is_what_the_loader_holds() {
    use engine::footprint::{held_weight_bytes, read_headers, WeightFile};
    let widened = WeightFile::Folder(engine::weights::DenseMatrices::F32);
    let mut ggufs: Vec<PathBuf> = [
        "tiny-qwen3-q8_0",
        "tiny-qwen3-q4_1",
        "tiny-llama3-q8_0",
        "tiny-qwen3_moe-q8_0",
        "tiny-mixtral-q4_1",
        "tiny-qwen2_moe-q8_0",
        "tiny-gemma2-q4_1",
        "tiny-gemma3-q8_0",
        "tiny-phi3-q8_0",
    ]
    .iter()
    .map(|n| common::fixture(&format!("gguf/{n}.gguf")))
    .collect();
    ggufs.push(crate::smollm2::gguf_path());
    // Q5_0, held as Q8_0: every matrix, the head and the embedding table; F16, BF16 and
    // F32, used where they lie on the CPU (copied in f32 by candle where it runs no kernel
    // of ours).
    for quant in [
        GgmlDType::Q5_0,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::F32,
    ] {
        let path = common::scratch(&format!("footprint-{quant:?}")).join("model.gguf");
        export_gguf(&common::tiny_model_dir(), &path, quant).unwrap();
        ggufs.push(path);
    }
    for path in ggufs {
        let model = Model::load(&path, &Device::Cpu).unwrap();
        let predicted = held_weight_bytes(&read_headers(&path).unwrap(), WeightFile::Gguf);
        assert_eq!(
            predicted,
            model.resident_bytes() as u64,
            "{}",
            path.display()
        );
    }
    for f32_dir in [
        common::tiny_qwen3_dir(),
        common::tiny_mixtral_dir(),
        common::tiny_qwen2_moe_dir(),
        common::tiny_gemma2_dir(),
        common::tiny_gemma3_dir(),
        common::tiny_phi3_dir(),
    ] {
        let model = Model::load(&f32_dir, &Device::Cpu).unwrap();
        let headers = read_headers(&f32_dir).unwrap();
        assert_eq!(
            held_weight_bytes(&headers, widened),
            model.resident_bytes() as u64
        );
    }
    // Untied, and tied (Gemma 2's head is its embedding table, converted once).
    for tied in [false, true] {
        let bf16_dir = common::scratch(&format!("bf16-footprint-{tied}"));
        let seed = DEFAULT_SEED;
        write_model(&bf16_dir, ModelSize::Tiny, DType::BF16, seed).unwrap();
        if tied {
            engine::testmodel::into_gemma2(&bf16_dir, seed).unwrap();
        }
        let model = Model::load(&bf16_dir, &Device::Cpu).unwrap();
        let headers = read_headers(&bf16_dir).unwrap();
        let cpu = engine::weights::DenseMatrices::for_device(&Device::Cpu);
        assert_eq!(
            held_weight_bytes(&headers, WeightFile::Folder(cpu)),
            model.resident_bytes() as u64,
            "tied: {tied}"
        );
    }
}

/// A node whose KV reserve and weights exceed the machine is refused before any weight is
/// read, with both numbers; this machine's own limit is the bound. For a folder and for
/// a GGUF file (whose header the check and the weights share).
#[test]
fn a_model_and_reserve_past_the_machines_memory_are_refused_at_load() {
    let machine = engine::footprint::machine_memory().expect("a Linux machine's MemTotal");
    let dir = common::tiny_model_dir();
    let gguf = common::scratch("footprint").join("model-q8_0.gguf");
    engine::gguf_export::export_gguf(&dir, &gguf, GgmlDType::Q8_0).unwrap();
    for path in [dir, gguf] {
        let fits = engine::KvReserve {
            bytes: 1 << 20,
            positions: 1024,
            ..Default::default()
        };
        assert!(engine::load_within(&path, &Device::Cpu, fits).is_ok());
        let past = engine::KvReserve {
            bytes: machine.bytes,
            positions: 0,
            ..Default::default()
        };
        let err = engine::load_within(&path, &Device::Cpu, past)
            .err()
            .expect("a reserve of the whole machine plus weights must be refused");
        let text = err.to_string();
        assert!(
            matches!(err, engine::EngineError::OutOfMemory { .. }),
            "{text}"
        );
        assert!(
            text.contains(&engine::footprint::size(machine.bytes)),
            "{text}"
        );
        assert!(text.contains("does not fit"), "{text}");
    }
}

/// The KV reserve is held where the caches live: on the CPU in the machine's memory, on a
/// GPU in the GPU's, and a reserve past it is refused naming that memory (on a GPU the
/// machine's memory only passes the weights through).
#[test]
fn a_reserve_is_checked_against_the_memory_of_the_device_it_is_held_on() {
    let device = common::device();
    let past = engine::KvReserve {
        bytes: 1 << 50,
        positions: 0,
        ..Default::default()
    };
    let err = engine::load_within(&common::tiny_model_dir(), &device, past)
        .err()
        .expect("a reserve of a PiB must be refused");
    let engine::EngineError::OutOfMemory {
        source_of_limit, ..
    } = err
    else {
        panic!("{err}");
    };
    let want = match device.is_cpu() {
        true => engine::footprint::machine_memory().unwrap().source,
        false => "the GPU's free memory",
    };
    assert_eq!(source_of_limit, want);
}

/// Streaming pieces are whole characters and add up to the full decode.
#[test]
fn incremental_decoding_never_splits_characters() {
    let tok = Tokenizer::from_file(&common::models_dir().join("qwen3/tokenizer.json")).unwrap();
    for (text, skip) in [
        (
            "你好，世界！今天天气很好。🦀🎉 emoji ❤️ and English.",
            false,
        ),
        ("<|im_start|>assistant\n中文<|im_end|>", true),
        ("<|im_start|>assistant\n中文<|im_end|>", false),
    ] {
        let ids = tok.encode(text).unwrap();
        let mut dec = IncrementalDecoder::new(skip);
        let mut pieces = Vec::new();
        for &id in &ids {
            if let Some(p) = dec.push(&tok, id).unwrap() {
                pieces.push(p);
            }
        }
        pieces.extend(dec.flush(&tok).unwrap());
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), tok.decode(&ids, skip).unwrap());
        assert!(
            pieces.len() >= 3,
            "expected a piece per word or so, got {pieces:?}"
        );
    }
    // A kept special token shows while the others are skipped: a tool format's marker
    // reaches the output's parser.
    let text = "<|im_start|>assistant\n中文<|im_end|>ok";
    let ids = tok.encode(text).unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    let mut dec = IncrementalDecoder::new(true).keeping([end].into());
    let mut shown: String = ids
        .iter()
        .filter_map(|&id| dec.push(&tok, id).unwrap())
        .collect();
    shown.extend(dec.flush(&tok).unwrap());
    assert_eq!(shown, "assistant\n中文<|im_end|>ok");
    // A character cut off at the end of a stream is still reported, as a full decode shows it.
    let tok = Tokenizer::from_file(&common::tiny_model_dir().join("tokenizer.json")).unwrap();
    let ids = tok.encode("🦀").unwrap();
    assert!(ids.len() > 1, "the crab should take several byte tokens");
    let mut dec = IncrementalDecoder::new(false);
    assert_eq!(dec.push(&tok, ids[0]).unwrap(), None);
    assert_eq!(dec.flush(&tok).unwrap().as_deref(), Some("\u{FFFD}"));
}

/// Token bytes add up to the text, pieces of a character included; specials are their text.
#[test]
fn token_bytes_are_the_raw_bytes_of_each_piece() {
    let qwen3 = Tokenizer::from_file(&common::models_dir().join("qwen3/tokenizer.json")).unwrap();
    let tiny = Tokenizer::from_file(&common::tiny_model_dir().join("tokenizer.json")).unwrap();
    for tok in [&qwen3, &tiny] {
        let text = "北京 🦀 naïve\ttabs\n";
        let ids = tok.encode(text).unwrap();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tok.token_bytes(id).unwrap())
            .collect();
        assert_eq!(bytes, text.as_bytes());
        let end = tok.token_id("<|im_end|>").unwrap();
        assert_eq!(tok.token_bytes(end).unwrap(), b"<|im_end|>");
    }
    let crab = tiny.encode("🦀").unwrap();
    assert!(std::str::from_utf8(&tiny.token_bytes(crab[0]).unwrap()).is_err());
}

/// Ids spread over the vocabulary and a little past it, deterministic per seed.
fn some_ids(n: usize, below: u32, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % u64::from(below)) as u32
        })
        .collect()
}

/// Our byte-level decode gives what the `tokenizers` crate gives: every token alone, and
/// random runs of tokens (pieces of characters, special tokens skipped or not, ids the
/// vocabulary lacks).
pub fn check_byte_level_decode(name: &str, tok: &Tokenizer) {
    assert!(
        matches!(
            tok.inner().get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        ),
        "{name}: expected a byte-level decoder"
    );
    let vocab = tok.vocab_size() as u32;
    for skip in [false, true] {
        for id in 0..vocab + 3 {
            assert_eq!(
                tok.decode(&[id], skip).unwrap(),
                tok.inner().decode(&[id], skip).unwrap(),
                "{name}: id {id}, skip {skip}"
            );
        }
        for seed in 0..300 {
            let ids = some_ids(1 + (seed as usize % 24), vocab + 3, seed);
            assert_eq!(
                tok.decode(&ids, skip).unwrap(),
                tok.inner().decode(&ids, skip).unwrap(),
                "{name}: {ids:?}, skip {skip}"
            );
        }
    }
}

#[test]
fn byte_level_decoding_equals_the_tokenizers_crate() {
    for name in ["qwen3", "deepseek_v3"] {
        let path = common::models_dir().join(name).join("tokenizer.json");
        check_byte_level_decode(name, &Tokenizer::from_file(&path).unwrap());
    }
    let tiny = common::tiny_model_dir().join("tokenizer.json");
    check_byte_level_decode("tiny", &Tokenizer::from_file(&tiny).unwrap());
}

/// Random text built from what trips tokenizers up: added tokens and pieces of them,
/// contractions in either case, runs of spaces and newlines, digits, punctuation, accents
/// composed and not, CJK, emoji, and the tokenizer's own added tokens.
fn tricky_text(rng: &mut engine::fuzz::Rng, added: &[String]) -> String {
    const PARTS: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im",
        "_start|>",
        "<think>",
        "</think>",
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        " \n",
        " \t ",
        "'s",
        "'S",
        "'ll",
        "'RE",
        "'",
        "\u{2019}",
        "a",
        "Hello",
        " world",
        "ABC",
        "don't",
        "x1",
        "123",
        "4567",
        "3.14",
        "!",
        "?!",
        "...",
        "(",
        ")",
        "{\"k\": 1}",
        "-",
        "_",
        "#",
        "\u{e9}",
        "\u{c9}",
        "e\u{301}",
        "\u{df}",
        "\u{4e2d}\u{6587}",
        "\u{65e5}\u{672c}\u{8a9e}",
        "\u{30ab}\u{30bf}",
        "\u{3072}\u{3089}",
        "\u{1f600}",
        "\u{1f44d}\u{1f3fd}",
        "\u{3a9}",
        "\u{212a}",
        "\u{661}\u{662}",
        "\u{a0}",
        "\u{3000}",
        "\u{fb01}",
    ];
    let mut text = String::new();
    for _ in 0..1 + rng.below(30) {
        if !added.is_empty() && rng.chance(8) {
            let token: &String = rng.pick(added);
            text.push_str(token);
        } else {
            let part: &&str = rng.pick(PARTS);
            text.push_str(part);
        }
    }
    text
}

/// `Tokenizer::encode` skips the `tokenizers` crate's bookkeeping for byte-level BPE
/// tokenizers; it must give the crate's ids for every text, the generated model's, Qwen3's
/// (NFC: the short path takes ASCII text only) and DeepSeek-V3's (three splits) alike.
#[test]
fn fast_encoding_equals_the_tokenizers_crate() {
    let corpus =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/corpus.txt"))
            .unwrap();
    let mut tokenizers = vec![(
        "tiny".to_string(),
        Tokenizer::from_file(&common::tiny_model_dir().join("tokenizer.json")).unwrap(),
    )];
    for name in ["qwen3", "deepseek_v3"] {
        let path = common::models_dir().join(name).join("tokenizer.json");
        tokenizers.push((name.to_string(), Tokenizer::from_file(&path).unwrap()));
    }
    let (seed, _) = engine::fuzz::settings(0);
    let mut rng = engine::fuzz::Rng(seed | 1);
    for (name, tok) in &tokenizers {
        assert!(tok.encodes_fast(), "{name}: the short path is not taken");
        let added: Vec<String> = tok
            .inner()
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let mut texts: Vec<String> = (0..3000).map(|_| tricky_text(&mut rng, &added)).collect();
        texts.extend(corpus.lines().take(200).map(str::to_string));
        texts.push(String::new());
        for text in &texts {
            let want = tok.inner().encode_fast(text.as_str(), false).unwrap();
            assert_eq!(
                tok.encode(text).unwrap(),
                want.get_ids(),
                "{name}: {text:?} (seed {seed})"
            );
        }
    }
}

/// Loading reports each layer built, in order: what a node logs while large weights load.
#[test]
fn loading_reports_each_layer_in_order() {
    use engine::LoadStep::LayerBuilt;
    let steps = |path: &std::path::Path| {
        let mut steps = Vec::new();
        let options = engine::LoadOptions::default();
        engine::load_reporting(path, &Device::Cpu, &options, &mut |s| steps.push(s)).unwrap();
        steps
    };
    let layers = |n| (1..=n).map(move |done| LayerBuilt { done, layers: n });
    assert_eq!(
        steps(&common::tiny_model_dir()),
        layers(2).collect::<Vec<_>>()
    );
    let gguf = common::fixture("gguf/tiny-qwen3-q8_0.gguf");
    assert_eq!(steps(&gguf), layers(2).collect::<Vec<_>>());
}
