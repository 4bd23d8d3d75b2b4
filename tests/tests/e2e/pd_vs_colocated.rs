//! Correctness first: a request through router → P → D gives exactly the tokens of the
//! colocated worker and of one in-process engine, for the same seed. This test stays.

use candle_core::Device;
use e2e::{smollm2, tiny_model, tiny_model_turned, Cluster, Mode};
use serde_json::{json, Value};

/// What one process makes of `prompt`: the engine's plain generation loop.
fn one_process(
    model: &std::path::Path,
    prompt: &str,
    params: &engine::SamplingParams,
    n: usize,
) -> String {
    let loaded = engine::load(model, &Device::Cpu).expect("loading the model");
    let tokens = one_process_tokens(&loaded, prompt, params, n, &[]);
    loaded.tokenizer.decode(&tokens, true).unwrap()
}

/// The tokens one process makes of `prompt`, ending after any of `stop_ids`.
fn one_process_tokens(
    loaded: &engine::Loaded,
    prompt: &str,
    params: &engine::SamplingParams,
    n: usize,
    stop_ids: &[u32],
) -> Vec<u32> {
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let mut cache = loaded.model.new_cache().unwrap();
    let out =
        engine::generate::generate(&loaded.model, &mut cache, &ids, params, n, stop_ids).unwrap();
    out.iter().map(|s| s.token).collect()
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .or(v["choices"][0]["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

#[tokio::test]
async fn pd_equals_colocated_equals_one_process() {
    let model = tiny_model();
    // Small transfer messages (every layer's K/V crosses in several), and the prompt
    // computed in chunks of 4 tokens, 6 tokens a step: chunked prefill gives the same
    // tokens as one pass.
    let pd = Cluster::start_with(
        Mode::Pd,
        &model,
        &[],
        &[
            "--transfer-chunk-bytes",
            "256",
            "--chunk-tokens",
            "4",
            "--step-tokens",
            "6",
        ],
    )
    .await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let prompt = "The router speaks the OpenAI chat completions API.";
    let cases = [
        (json!({"temperature": 0}), engine::SamplingParams::default()),
        (
            json!({"temperature": 0.8, "seed": 42}),
            engine::SamplingParams {
                temperature: 0.8,
                seed: 42,
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 1.2, "top_k": 20, "top_p": 0.9, "seed": 18446744073709551615u64,
                   "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}),
            engine::SamplingParams {
                temperature: 1.2,
                top_k: 20,
                top_p: 0.9,
                seed: u64::MAX,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.5,
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 1.5, "seed": 99, "min_p": 0.2,
                   "logit_bias": {"5": 4.0, "17": -100, "40": 2.5}}),
            engine::SamplingParams {
                temperature: 1.5,
                seed: 99,
                min_p: 0.2,
                logit_bias: vec![(5, 4.0), (17, -100.0), (40, 2.5)],
                ..Default::default()
            },
        ),
    ];
    for (sampling, params) in cases {
        let mut body =
            json!({"model": "test", "prompt": prompt, "max_tokens": 24, "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(sampling.as_object().unwrap().clone());
        let (s1, a) = pd.post("/v1/completions", &body).await;
        let (s2, b) = colo.post("/v1/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        let expected = one_process(&model, prompt, &params, 24);
        assert_eq!(text_of(&a), expected, "PD against one process, {sampling}");
        assert_eq!(
            text_of(&b),
            expected,
            "colocated against one process, {sampling}"
        );
        assert_eq!(a["usage"]["completion_tokens"], 24);
        assert_eq!(b["usage"]["completion_tokens"], 24);
    }
}

/// Qwen3 (per-head q/k norms, wide heads), Mistral (a sliding window of 16 positions),
/// the mixtures Qwen3-MoE, Mixtral and Qwen2-MoE (8 experts, 2 per token; Qwen2-MoE's
/// shared expert), Gemma 2 and 3 (windows of 16 in some layers, soft caps, a RoPE per
/// layer type) and Phi-3 (fused projections, partial rotary, LongRoPE), with a prompt past
/// the window computed in chunks of 4 on the prefill node: PD, colocated and one process
/// give the same tokens, greedy and sampled.
#[tokio::test]
async fn pd_equals_colocated_equals_one_process_for_each_family() {
    let prompt = "Every request ends with tokens, an error, or a clean finish reason, \
                  whichever node computed its prompt.";
    for family in engine::testmodel::Family::SERVED {
        let model = tiny_model_turned(family);
        let loaded = engine::load(&model, &Device::Cpu).expect("loading the model");
        let window = engine::testmodel::MISTRAL_WINDOW.max(engine::testmodel::GEMMA_WINDOW);
        assert!(loaded.tokenizer.encode(prompt).unwrap().len() > 2 * window);
        same_tokens_three_ways(&model, &loaded, prompt, 7, &format!("{family:?}"), &[]).await;
    }
}

/// The K-quant kernels under PD: llama.cpp's Q4_K_M, Q5_K_M and Q5_0 of the wide Qwen3,
/// whose every matrix runs on our Q4_K, Q5_K or Q6_K kernel or (Q5_0's) on our Q8_0 one,
/// the prompt computed in chunks of 4
/// on the prefill node: PD, colocated and one process give the same tokens, greedy and
/// sampled.
#[tokio::test]
async fn pd_equals_colocated_equals_one_process_on_k_quants() {
    let prompt = "A row's outputs never depend on the rows batched beside it.";
    for file in [
        "tiny-qwen3_wide-q4_k_m.gguf",
        "tiny-qwen3_wide-q5_k_m.gguf",
        "tiny-qwen3_wide-q5_0.gguf",
    ] {
        let model = e2e::root().join("engine/tests/fixtures/gguf").join(file);
        let loaded = engine::load(&model, &Device::Cpu).expect("loading the model");
        same_tokens_three_ways(&model, &loaded, prompt, 11, file, &[]).await;
    }
}

/// Caches of Q8_0 blocks in every process (the tiny Qwen3's heads are one block wide): the
/// router pairs only workers that register them, the prefill node sends them as they are,
/// and PD, colocated and one process give the same tokens; the PD cluster's log-probabilities
/// are one process's over Q8_0 caches, not over f16 ones (whose tokens are the same here).
#[tokio::test]
async fn pd_equals_colocated_equals_one_process_over_q8_0_caches() {
    let model = tiny_model_turned(engine::testmodel::Family::Qwen3);
    let mut loaded = engine::load(&model, &Device::Cpu).expect("loading the model");
    loaded.model.set_kv_dtype(engine::KvDtype::Q8_0).unwrap();
    let prompt = "A cache of Q8_0 blocks means the same values on every node.";
    let kv = ["--kv-cache-dtype", "q8_0"];
    let pd = same_tokens_three_ways(&model, &loaded, prompt, 13, "Q8_0 caches", &kv).await;
    let body = json!({"model": "test", "prompt": prompt, "max_tokens": 24, "ignore_eos": true,
                      "temperature": 0, "logprobs": 0});
    let (status, v) = pd.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let served: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let greedy = engine::SamplingParams::default();
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let mut wanted = Vec::new();
    for kv in [engine::KvDtype::Q8_0, engine::KvDtype::F16] {
        loaded.model.set_kv_dtype(kv).unwrap();
        let mut cache = loaded.model.new_cache().unwrap();
        let out =
            engine::generate::generate(&loaded.model, &mut cache, &ids, &greedy, 24, &[]).unwrap();
        wanted.push(out.iter().map(|s| f64::from(s.logprob)).collect::<Vec<_>>());
    }
    let apart = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    assert_eq!(served.len(), 24);
    assert!(
        apart(&served, &wanted[0]) < 1e-6,
        "{served:?}\n{:?}",
        wanted[0]
    );
    assert!(
        apart(&served, &wanted[1]) > 1e-4,
        "as f16 caches give: {served:?}"
    );
}

/// The router's names for the caches' element types are the engine's, which it does not
/// link: a cluster configured by one name everywhere pairs its workers.
#[test]
fn the_router_names_the_engines_cache_types() {
    use clap::ValueEnum;
    let router: Vec<&str> = router::config::KvCacheDtype::value_variants()
        .iter()
        .map(|d| d.name())
        .collect();
    let engine: Vec<&str> = engine::KvDtype::ALL.iter().map(|d| d.name()).collect();
    assert_eq!(router, engine);
    for d in router::config::KvCacheDtype::value_variants() {
        let flag = d.to_possible_value().unwrap();
        assert_eq!(
            flag.get_name(),
            d.name(),
            "the flag's value is the wire's name"
        );
    }
}

/// A PD cluster, its prompts in chunks of 4 on the prefill node, a colocated one and one
/// process continue `prompt` with the same 24 tokens, greedy and sampled with `seed`, every
/// process given `args` as well. Returns the PD cluster, for more.
async fn same_tokens_three_ways(
    model: &std::path::Path,
    loaded: &engine::Loaded,
    prompt: &str,
    seed: u64,
    what: &str,
    args: &[&str],
) -> Cluster {
    let chunked = [&["--chunk-tokens", "4", "--step-tokens", "6"], args].concat();
    let pd = Cluster::start_full(Mode::Pd, model, args, &chunked, args).await;
    let colo = Cluster::start_full(Mode::Colocated, model, args, &[], args).await;
    for (sampling, params) in [
        (json!({"temperature": 0}), engine::SamplingParams::default()),
        (
            json!({"temperature": 0.9, "seed": seed}),
            engine::SamplingParams {
                temperature: 0.9,
                seed,
                ..Default::default()
            },
        ),
    ] {
        let mut body =
            json!({"model": "test", "prompt": prompt, "max_tokens": 24, "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(sampling.as_object().unwrap().clone());
        let (s1, a) = pd.post("/v1/completions", &body).await;
        let (s2, b) = colo.post("/v1/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        let expected = one_process_tokens(loaded, prompt, &params, 24, &[]);
        let expected = loaded.tokenizer.decode(&expected, true).unwrap();
        assert_eq!(text_of(&a), expected, "{what} PD, {sampling}");
        assert_eq!(text_of(&b), expected, "{what} colocated, {sampling}");
    }
    pd
}

#[tokio::test]
async fn pd_equals_colocated_on_smollm2_chat() {
    let model = smollm2();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "seed": 1234}),
    ] {
        let mut body = json!({"model": "test", "max_tokens": 32,
            "messages": [{"role": "user", "content": "Write one sentence about the sea."}]});
        body.as_object_mut()
            .unwrap()
            .extend(sampling.as_object().unwrap().clone());
        let (s1, a) = pd.post("/v1/chat/completions", &body).await;
        let (s2, b) = colo.post("/v1/chat/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        assert!(!text_of(&a).is_empty());
        assert_eq!(text_of(&a), text_of(&b), "{sampling}");
        assert_eq!(
            a["usage"]["completion_tokens"],
            b["usage"]["completion_tokens"]
        );
        assert_eq!(
            a["choices"][0]["finish_reason"],
            b["choices"][0]["finish_reason"]
        );
    }
}

/// min_tokens holds a stop token back on both nodes: P samples the first token, D the rest,
/// and the sequence must not end before its min_tokens-th token either way.
#[tokio::test]
async fn min_tokens_holds_back_a_stop_token_under_pd_and_colocated() {
    let model = tiny_model();
    let loaded = engine::load(&model, &Device::Cpu).expect("loading the model");
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let prompt = "Stop tokens wait for min_tokens.";
    let greedy = engine::SamplingParams::default();
    let free = one_process_tokens(&loaded, prompt, &greedy, 16, &[]);
    // Stop on the greedy run's first token: held back, so it is not the first one sampled.
    let stop = free[0];
    let held = engine::SamplingParams {
        min_tokens: 6,
        held: vec![stop],
        ..Default::default()
    };
    let expected = one_process_tokens(&loaded, prompt, &held, 16, &[stop]);
    assert!(expected.len() >= 6, "{expected:?}");
    assert_ne!(expected[0], stop);
    let body = |min_tokens: u32| {
        json!({"model": "test", "prompt": prompt, "max_tokens": 16, "temperature": 0,
               "ignore_eos": true, "stop_token_ids": [stop], "min_tokens": min_tokens})
    };
    for (mode, c) in [("pd", &pd), ("colocated", &colo)] {
        let (status, v) = c.post("/v1/completions", &body(0)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["usage"]["completion_tokens"], 1,
            "{mode}: the stop token comes first"
        );
        let (status, v) = c.post("/v1/completions", &body(6)).await;
        assert_eq!(status, 200, "{v}");
        let tokens = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
        assert_eq!(tokens, expected.len(), "{mode}: {v}");
        let visible: Vec<u32> = expected.iter().copied().filter(|&t| t != stop).collect();
        assert_eq!(
            text_of(&v),
            loaded.tokenizer.decode(&visible, true).unwrap(),
            "{mode}"
        );
    }
}
