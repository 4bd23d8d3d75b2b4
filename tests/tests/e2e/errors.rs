//! Bad requests and dead workers get precise errors, quickly, never a hang.

use std::time::{Duration, Instant};

use e2e::{free_port, tiny_model, Cluster, Mode};
use serde_json::json;

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (status, v) = c
        .post(
            "/v1/chat/completions",
            &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));

    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.url))
        .header("content-type", "application/json")
        .body("{\"model\": \"test\", \"messages\": [")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let cases = [
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}]}),
            "messages",
        ),
        (json!({"n": 3, "temperature": 0}), "n"),
        (
            json!({"use_beam_search": true, "stop": "x"}),
            "use_beam_search",
        ),
    ];
    for (patch, param) in cases {
        let mut body = json!({"model": "test", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(patch.as_object().unwrap().clone());
        let (status, v) = c.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{patch}: {v}");
        assert_eq!(v["error"]["param"], param, "{patch}: {v}");
    }
    let (status, v) = c.post("/v1/nowhere", &json!({})).await;
    assert_eq!(status, 404, "{v}");
}

/// Asks once and checks the answer is a 503 error object within a few seconds.
async fn expect_503(c: &Cluster) {
    let started = Instant::now();
    let (status, v) = c
        .post(
            "/v1/completions",
            &json!({"model": "test", "prompt": "hello", "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 503, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_dead_decode_node_gives_503_not_a_hang() {
    let mut c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    c.procs[0].kill(); // the decode node
    expect_503(&c).await;
}

#[tokio::test]
async fn a_dead_prefill_node_gives_503_not_a_hang() {
    let mut c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    c.procs[1].kill(); // the prefill node
    expect_503(&c).await;
    let ready = reqwest::get(format!("http://{}/health/ready", c.ops))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "not ready without a prefill node");
}

#[tokio::test]
async fn a_router_with_no_reachable_worker_is_not_ready() {
    let port = free_port();
    let ops = format!("127.0.0.1:{}", free_port());
    let dead = format!("127.0.0.1:{}", free_port());
    let router = e2e::Proc::spawn(
        &e2e::bin("tandem-router"),
        &[
            "--model".into(),
            tiny_model().display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--metrics-listen".into(),
            ops.clone(),
            "--prefill-nodes".into(),
            dead.clone(),
            "--decode-nodes".into(),
            dead,
        ],
        &format!("lonely-router-{port}"),
    );
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(r) = client
            .get(format!("http://{ops}/health/ready"))
            .send()
            .await
        {
            break r.status();
        }
        assert!(
            Instant::now() < deadline,
            "router never answered:\n{}",
            std::fs::read_to_string(&router.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, 503);
    let model = tiny_model()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let (status, v) = e2e::post(
        &format!("{url}/v1/completions"),
        &json!({"model": model, "prompt": "hello"}),
    )
    .await;
    assert_eq!(status, 503, "{v}");
}

/// A worker's failure carries its reason in the status details, across real gRPC: the
/// router decides who failed (the prefill node or its decode node) by that value.
#[tokio::test]
async fn worker_errors_carry_a_typed_reason() {
    use proto::v1::prefill_client::PrefillClient;
    use proto::v1::{ErrorReason, PrefillRequest};

    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let prefill = c.prefill.clone().expect("a PD cluster has a prefill node");
    let mut client = PrefillClient::connect(format!("http://{prefill}"))
        .await
        .expect("the prefill node accepts gRPC");
    let request = |prompt: Vec<u32>| PrefillRequest {
        request_id: "forged-ticket".into(),
        prompt,
        decode_addr: c.decode.clone(),
        max_tokens: 2,
        n: 1,
        // No decode node issued this ticket: the decode node refuses the transfer.
        kv_ticket: vec![7; 32],
        ..PrefillRequest::default()
    };

    let refused = client.prefill(request(vec![1, 2, 3])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(
        proto::error_reason(&refused),
        ErrorReason::KvTransfer,
        "{refused:?}"
    );

    let bad = client.prefill(request(vec![u32::MAX])).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert_eq!(
        proto::error_reason(&bad),
        ErrorReason::InvalidRequest,
        "{bad:?}"
    );
}

/// Sampling settings that would make every step of a batch cost more, or a logit NaN, are
/// refused by both nodes whoever sends them: checked where the nodes take them, not only by
/// the router.
#[tokio::test]
async fn workers_refuse_sampling_a_peer_could_abuse() {
    use proto::v1::{GenerateRequest, LogitBias, PrefillRequest, SamplingParams};

    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (mut p, mut d) = node_clients(&c).await;
    let abusive = [
        SamplingParams {
            logit_bias: vec![
                LogitBias {
                    token: 1,
                    bias: 1.0
                };
                proto::limits::MAX_LOGIT_BIAS + 1
            ],
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![LogitBias {
                token: 1,
                bias: f32::NAN,
            }],
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![LogitBias {
                token: u32::MAX,
                bias: 1.0,
            }],
            ..Default::default()
        },
        SamplingParams {
            min_p: f32::INFINITY,
            ..Default::default()
        },
    ];
    for sampling in abusive {
        refused_as_invalid(
            p.prefill(PrefillRequest {
                request_id: "abusive-sampling".into(),
                prompt: vec![1, 2, 3],
                sampling: Some(sampling.clone()),
                decode_addr: c.decode.clone(),
                max_tokens: 2,
                kv_ticket: vec![7; 32],
                ..PrefillRequest::default()
            })
            .await,
        );
        refused_as_invalid(
            d.generate(GenerateRequest {
                request_id: "abusive-sampling".into(),
                prompt: vec![1, 2, 3],
                sampling: Some(sampling),
                max_tokens: 2,
                prefill_here: true,
                ..GenerateRequest::default()
            })
            .await,
        );
    }
}

/// What a request means costs too: more stop token ids than the limit (each checked against
/// every token of every sequence) and grammars past their limits (a compile each) are
/// refused by both nodes whoever sends them, before any compile.
#[tokio::test]
async fn workers_refuse_lists_and_grammars_past_their_limits() {
    use proto::limits::{MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES, MAX_STOP_TOKEN_IDS};
    use proto::v1::grammar::Kind;
    use proto::v1::{Choices, GenerateRequest, Grammar, PrefillRequest, SamplingParams};

    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (mut p, mut d) = node_clients(&c).await;
    let grammar = |kind| SamplingParams {
        grammar: Some(Grammar { kind: Some(kind) }),
        ..Default::default()
    };
    let cases = [
        (SamplingParams::default(), vec![1; MAX_STOP_TOKEN_IDS + 1]),
        (
            grammar(Kind::Choice(Choices {
                choices: vec!["a".into(); MAX_GUIDED_CHOICES + 1],
            })),
            Vec::new(),
        ),
        (
            grammar(Kind::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1))),
            Vec::new(),
        ),
    ];
    for (sampling, stop_token_ids) in cases {
        refused_as_invalid(
            p.prefill(PrefillRequest {
                request_id: "past-limits".into(),
                prompt: vec![1, 2, 3],
                sampling: Some(sampling.clone()),
                stop_token_ids: stop_token_ids.clone(),
                decode_addr: c.decode.clone(),
                max_tokens: 2,
                kv_ticket: vec![7; 32],
                ..PrefillRequest::default()
            })
            .await,
        );
        refused_as_invalid(
            d.generate(GenerateRequest {
                request_id: "past-limits".into(),
                prompt: vec![1, 2, 3],
                sampling: Some(sampling),
                stop_token_ids,
                max_tokens: 2,
                prefill_here: true,
                ..GenerateRequest::default()
            })
            .await,
        );
    }
}

/// A resumed request (stream migration) must leave a prompt before its output, and only one
/// sequence can resume: both nodes refuse anything else from any peer.
#[tokio::test]
async fn workers_refuse_a_resume_they_cannot_continue() {
    use proto::v1::{GenerateRequest, PrefillRequest};

    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (mut p, mut d) = node_clients(&c).await;
    // (resumed, sequences, beam) against a prompt of three tokens.
    for (resumed, n, beam) in [(3, 1, false), (9, 1, false), (1, 2, false), (1, 2, true)] {
        refused_as_invalid(
            p.prefill(PrefillRequest {
                request_id: "bad-resume".into(),
                prompt: vec![1, 2, 3],
                decode_addr: c.decode.clone(),
                max_tokens: 2,
                kv_ticket: vec![7; 32],
                n,
                beam_search: beam,
                resumed,
                ..PrefillRequest::default()
            })
            .await,
        );
        refused_as_invalid(
            d.generate(GenerateRequest {
                request_id: "bad-resume".into(),
                prompt: vec![1, 2, 3],
                max_tokens: 2,
                prefill_here: true,
                n,
                beam_width: if beam { n } else { 0 },
                resumed,
                ..GenerateRequest::default()
            })
            .await,
        );
    }
    // The nodes still serve.
    let body = serde_json::json!({"model": c.model_name, "prompt": "still", "max_tokens": 2});
    assert_eq!(c.post("/v1/completions", &body).await.0, 200);
}

/// A prompt the model cannot run (an id outside its vocabulary, no position left to
/// generate into) is refused by the call itself on both nodes, before any memory is
/// reserved for it, with the same message from each.
#[tokio::test]
async fn workers_refuse_a_prompt_their_model_cannot_run() {
    use proto::v1::{GenerateRequest, PrefillRequest};

    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (mut p, mut d) = node_clients(&c).await;
    let context = engine::testmodel::ModelSize::Tiny.max_positions();
    for (prompt, says) in [
        (
            vec![1, 1 << 20, 2],
            "prompt token 1048576 at position 1 is outside the vocabulary",
        ),
        (vec![1; context], "tokens, the model's context is"),
    ] {
        let refused = p
            .prefill(PrefillRequest {
                request_id: "unrunnable".into(),
                prompt: prompt.clone(),
                decode_addr: c.decode.clone(),
                max_tokens: 2,
                kv_ticket: vec![7; 32],
                ..PrefillRequest::default()
            })
            .await;
        assert!(
            refused.as_ref().unwrap_err().message().contains(says),
            "{refused:?}"
        );
        refused_as_invalid(refused);
        let refused = d
            .generate(GenerateRequest {
                request_id: "unrunnable".into(),
                prompt,
                max_tokens: 2,
                prefill_here: true,
                ..GenerateRequest::default()
            })
            .await;
        let message = refused.as_ref().map(|_| "").unwrap_or_else(|e| e.message());
        assert!(message.contains(says), "{message}");
        refused_as_invalid(refused);
    }
}

/// A request with more sequences than a decode node runs in a step would run alone, over
/// the node's bound, while every other request waited for it: the router refuses it with a
/// 400 naming the parameter (from the width each node reports), and the decode node refuses
/// it from any peer; a request as wide as the batch is served.
#[tokio::test]
async fn a_request_wider_than_the_batch_is_refused() {
    use proto::v1::GenerateRequest;

    let c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--max-batch-size", "4"],
    )
    .await;
    let ask = |extra: serde_json::Value| {
        let mut body = json!({"model": c.model_name, "prompt": "Hello", "max_tokens": 2,
            "temperature": 1.0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, param) in [
        (json!({"n": 5}), "n"),
        (json!({"n": 2, "best_of": 6}), "best_of"),
    ] {
        let (status, v) = c.post("/v1/completions", &ask(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("at most 4"), "{message}");
    }
    let (status, v) = c.post("/v1/completions", &ask(json!({"n": 4}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 4);

    let (_, mut d) = node_clients(&c).await;
    refused_as_invalid(
        d.generate(GenerateRequest {
            request_id: "too-wide".into(),
            prompt: vec![1, 2, 3],
            n: 5,
            max_tokens: 2,
            prefill_here: true,
            ..GenerateRequest::default()
        })
        .await,
    );
}

/// gRPC clients of a PD cluster's prefill and decode nodes, speaking to them as any peer
/// could.
async fn node_clients(
    c: &Cluster,
) -> (
    proto::v1::prefill_client::PrefillClient<tonic::transport::Channel>,
    proto::v1::decode_client::DecodeClient<tonic::transport::Channel>,
) {
    let prefill = c.prefill.clone().expect("a PD cluster has a prefill node");
    let p = proto::v1::prefill_client::PrefillClient::connect(format!("http://{prefill}"))
        .await
        .expect("the prefill node accepts gRPC");
    let d = proto::v1::decode_client::DecodeClient::connect(format!("http://{}", c.decode))
        .await
        .expect("the decode node accepts gRPC");
    (p, d)
}

/// Asserts that a node refused a call as an invalid request: the status code and the
/// typed reason both say so.
fn refused_as_invalid<T: std::fmt::Debug>(answer: Result<T, tonic::Status>) {
    let refused = answer.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(
        proto::error_reason(&refused),
        proto::v1::ErrorReason::InvalidRequest
    );
}
