//! Conformance: every example request in the API documents, sent as written but for the
//! model name, through P and D, and its response checked against the documents' output
//! tables. A multimodal example gets a 400 naming its media part: this is a text model.

use e2e::{seed_requests, sse_chunks, tiny_model, Cluster, Mode};
use serde_json::Value;

use crate::api::check_usage;

fn has_media(body: &Value) -> bool {
    body["messages"].as_array().is_some_and(|ms| {
        ms.iter().any(|m| {
            m["content"].as_array().is_some_and(|parts| {
                parts
                    .iter()
                    .any(|p| p["type"].as_str().is_some_and(|t| t != "text"))
            })
        })
    })
}

/// Checks one choice of a response or of a chunk.
fn check_choice(c: &Value, chat: bool, chunk: bool, ctx: &str) {
    assert!(c["index"].is_u64(), "{ctx}: {c}");
    if chat {
        let m = if chunk { &c["delta"] } else { &c["message"] };
        assert_eq!(m["role"], "assistant", "{ctx}: {c}");
        assert!(
            m["content"].is_string() || m["content"].is_null(),
            "{ctx}: {c}"
        );
        if !chunk {
            assert!(m["tool_calls"].is_array(), "{ctx}: {c}");
        }
    } else {
        assert!(c["text"].is_string(), "{ctx}: {c}");
        assert!(c.get("stop_reason").is_some(), "{ctx}: {c}");
    }
    assert!(c.get("logprobs").is_some(), "{ctx}: {c}");
    let finish = &c["finish_reason"];
    assert!(
        finish.is_null() || ["stop", "length", "tool_calls"].contains(&finish.as_str().unwrap()),
        "{ctx}: {c}"
    );
}

#[tokio::test]
async fn every_seed_example_request_is_accepted_as_written() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let requests = seed_requests();
    assert_eq!(requests.len(), 19, "the documents show 19 example requests");
    let mut media = 0;
    for (i, (doc, mut body)) in requests.into_iter().enumerate() {
        let ctx = format!("example {i} of {doc}");
        body["model"] = Value::from(c.model_name.as_str());
        let chat = body.get("messages").is_some();
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        if has_media(&body) {
            let (status, v) = c.post(path, &body).await;
            assert_eq!(status, 400, "{ctx}: {v}");
            assert_eq!(v["error"]["param"], "messages", "{ctx}: {v}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.contains("image_url"), "{ctx}: {message}");
            media += 1;
            continue;
        }
        let choices = body["n"].as_u64().unwrap_or(1) as usize;
        if body["stream"] == Value::Bool(true) {
            let (status, data) = c.post_sse(path, &body).await;
            assert_eq!(status, 200, "{ctx}: {data:?}");
            let chunks = sse_chunks(&data);
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let mut finished = 0;
            for ch in &chunks {
                assert_eq!(ch["object"], object, "{ctx}");
                assert_eq!(ch["id"], chunks[0]["id"], "{ctx}");
                for choice in ch["choices"].as_array().unwrap() {
                    check_choice(choice, chat, true, &ctx);
                    finished += usize::from(!choice["finish_reason"].is_null());
                }
            }
            assert_eq!(finished, choices, "{ctx}: each choice ends once");
            check_usage(&chunks.last().unwrap()["usage"]);
        } else {
            let (status, v) = c.post(path, &body).await;
            assert_eq!(status, 200, "{ctx}: {v}");
            let object = if chat {
                "chat.completion"
            } else {
                "text_completion"
            };
            assert_eq!(v["object"], object, "{ctx}");
            assert_eq!(v["model"], c.model_name.as_str(), "{ctx}");
            let list = v["choices"].as_array().unwrap();
            assert_eq!(list.len(), choices, "{ctx}: {v}");
            for choice in list {
                check_choice(choice, chat, false, &ctx);
                assert!(!choice["finish_reason"].is_null(), "{ctx}");
            }
            let completion = check_usage(&v["usage"]);
            if let Some(max) = body["max_tokens"].as_u64() {
                assert!(completion as u64 <= max * choices as u64, "{ctx}: {v}");
            }
            assert!(v["prefill_time"].as_f64().is_some_and(|t| t > 0.0), "{ctx}");
            let decode = v["decode_time_arr"].as_array().unwrap();
            assert_eq!(decode.len(), completion - choices, "{ctx}: {v}");
        }
    }
    // 000, 001, 003 and 004 each show one "Multimodal model" request with an image_url part.
    assert_eq!(media, 4, "the documents show four multimodal requests");
}
