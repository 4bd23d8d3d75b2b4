//! Beam search on the decode node over the transferred KV: the same hypotheses as a beam
//! search in one process that recomputes every beam from scratch (no cache, no forks), in
//! PD and colocated mode, and 002's streamed example as written.

use candle_core::Device;
use e2e::{sse_chunks, tiny_model, Cluster, Mode};
use engine::beam::{first_tokens, BeamSearch};
use engine::sampling::ranked;
use engine::SeqInput;
use serde_json::{json, Value};

/// The texts of the `n` best hypotheses of a width-`width` search of `max_tokens` tokens
/// (ignoring EOS), every step recomputing each beam's whole sequence.
fn reference(prompt: &str, width: usize, n: usize, max_tokens: usize) -> Vec<String> {
    let loaded = engine::load(&tiny_model(), &Device::Cpu).unwrap();
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let logits_after = |tokens: &[u32]| -> Vec<f32> {
        let mut cache = loaded.model.new_cache().unwrap();
        let l = loaded
            .model
            .forward(&mut [SeqInput {
                tokens,
                cache: &mut cache,
            }])
            .unwrap();
        l.squeeze(0).unwrap().to_vec1().unwrap()
    };
    let first = first_tokens(&logits_after(&ids), width, 0);
    let mut search = BeamSearch::new(
        ids.len(),
        vec![],
        first.into_iter().map(|s| (s, ())).collect(),
        |_| (),
    );
    for _ in 1..max_tokens {
        let n = search.ranked_len(0);
        let ranked: Vec<_> = search
            .live()
            .iter()
            .map(|b| ranked(&logits_after(&[ids.clone(), b.tokens.clone()].concat()), n))
            .collect();
        search
            .step(&ranked, 0, |_| Ok::<_, ()>(()), |_| (), |_, _| {})
            .unwrap();
    }
    search
        .finish(n)
        .iter()
        .map(|b| loaded.tokenizer.decode(&b.tokens, true).unwrap())
        .collect()
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("no choices: {v}"))
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn beam_search_under_pd_and_colocated_equals_one_process() {
    let prompt = "The decode node keeps several beams";
    let expected = reference(prompt, 3, 2, 6);
    assert_ne!(expected[0], expected[1], "two different hypotheses");
    let pd = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let colo = Cluster::start(Mode::Colocated, &tiny_model(), &[]).await;
    let body = json!({"model": "test", "prompt": prompt, "max_tokens": 6, "ignore_eos": true,
        "use_beam_search": true, "n": 2, "best_of": 3, "temperature": 1, "logprobs": 1});
    for (mode, c) in [("pd", &pd), ("colocated", &colo)] {
        let (status, v) = c.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{mode}: {v}");
        assert_eq!(texts(&v), expected, "{mode}: {v}");
        assert_eq!(
            v["usage"]["completion_tokens"], 12,
            "{mode}: two hypotheses of 6"
        );
        for choice in v["choices"].as_array().unwrap() {
            assert_eq!(choice["finish_reason"], "length");
            let lp = &choice["logprobs"];
            assert_eq!(lp["tokens"].as_array().unwrap().len(), 6, "{mode}: {lp}");
            assert!(lp["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|x| x.as_f64().unwrap() <= 0.0));
        }
        let sum = |i: usize| -> f64 {
            v["choices"][i]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .sum()
        };
        assert!(sum(0) >= sum(1), "{mode}: the best hypothesis comes first");
    }
    // Beam search is deterministic: no seed, and a second run gives the same hypotheses.
    let (_, again) = pd.post("/v1/completions", &body).await;
    assert_eq!(texts(&again), expected);

    // Chat takes it too (000 lists use_beam_search for chat).
    let chat = json!({"model": "test", "max_tokens": 4, "use_beam_search": true, "n": 2,
        "temperature": 0.5, "messages": [{"role": "user", "content": prompt}]});
    let (status, v) = pd.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
}

#[tokio::test]
async fn the_seed_002_streamed_beam_search_example_as_written() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let body = json!({"model": "test", "prompt": "who are you", "temperature": 1,
        "max_tokens": 5, "use_beam_search": true, "ignore_eos": true, "n": 2, "best_of": 2,
        "stream": true, "logprobs": 2});
    let (status, data) = c.post_sse("/v1/completions", &body).await;
    assert_eq!(status, 200, "{data:?}");
    let chunks = sse_chunks(&data);
    assert_eq!(chunks.len(), 1, "one chunk with every choice: {data:?}");
    let chunk = &chunks[0];
    assert_eq!(chunk["object"], "text_completion");
    assert_eq!(texts(chunk), reference("who are you", 2, 2, 5));
    for (i, choice) in chunk["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "length");
        let top = choice["logprobs"]["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        assert!(top
            .iter()
            .all(|t| (2..=3).contains(&t.as_object().unwrap().len())));
    }
    let usage = &chunk["usage"];
    assert_eq!(usage["completion_tokens"], 10);
    assert_eq!(usage["batch_size"].as_array().unwrap().len(), 10);
    // 002's text_offset continues across choices: the second starts after the first's text.
    let first_len = texts(chunk)[0].chars().count();
    assert_eq!(
        chunk["choices"][1]["logprobs"]["text_offset"][0].as_u64(),
        Some(first_len as u64)
    );
    assert!(
        chunk.get("full_text").is_none(),
        "only with fullTextEnabled"
    );

    // With fullTextEnabled the last chunk carries full_text (001: "全量文本结果,配置项
    // fullTextEnabled=true时才有此返回值"): for a beam search, the best hypothesis's.
    let full = Cluster::start(Mode::Pd, &tiny_model(), &["--full-text-enabled"]).await;
    let (_, data) = full.post_sse("/v1/completions", &body).await;
    let chunk = &sse_chunks(&data)[0];
    assert_eq!(chunk["full_text"], texts(chunk)[0].as_str(), "{chunk}");

    // Beam search refuses stop strings, as the seeds say.
    let mut stop = body.clone();
    stop["stop"] = json!(["x"]);
    let (status, v) = c.post("/v1/completions", &stop).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("use_beam_search")),
        "{v}"
    );
}
