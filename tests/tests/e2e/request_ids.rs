//! A client's X-Request-Id: bounded and sanitized, echoed on the response, and the id under
//! which the prefill and decode nodes log the request; with `--log-format json` every log
//! line of all three processes is one JSON object.

use e2e::{tiny_model, Cluster, Mode};
use serde_json::{json, Value};

/// Every line of `log` as JSON; panics on a line that is not one object.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v.is_object(), "{l}");
            v
        })
        .collect()
}

#[tokio::test]
async fn a_client_request_id_is_echoed_and_logged_by_both_nodes() {
    let json_logs = ["--log-format", "json"];
    let c = Cluster::start_full(Mode::Pd, &tiny_model(), &json_logs, &json_logs, &json_logs).await;
    let body = json!({"model": c.model_name, "prompt": "hello", "max_tokens": 3});
    let send = |id: Option<&str>| {
        let mut r = c
            .client
            .post(format!("{}/v1/completions", c.url))
            .json(&body);
        if let Some(id) = id {
            r = r.header("x-request-id", id);
        }
        r.send()
    };

    // Characters outside [A-Za-z0-9._:-] are dropped, and the id is cut at 128.
    let resp = send(Some("tenant-7:abc 123/x")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "tenant-7:abc123x");
    let long = "a".repeat(300);
    let resp = send(Some(&long)).await.unwrap();
    assert_eq!(resp.headers()["x-request-id"], "a".repeat(128).as_str());
    // Without one, the response's own id is the request id.
    let resp = send(None).await.unwrap();
    let made = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["id"], made.as_str());
    // An error is answered under the id too.
    let resp = c
        .client
        .post(format!("{}/v1/completions", c.url))
        .header("x-request-id", "bad-one")
        .json(&json!({"model": c.model_name, "prompt": "hello", "max_tokens": -1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["x-request-id"], "bad-one");

    let logs: Vec<(String, Vec<Value>)> = c
        .procs
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p.log).unwrap();
            (p.log.display().to_string(), json_lines(&text))
        })
        .collect();
    for (name, wanted) in [("prefill", "prefilled"), ("decode", "finished")] {
        let (_, lines) = logs
            .iter()
            .find(|(path, _)| path.contains(name))
            .unwrap_or_else(|| panic!("no {name} log"));
        let logged: Vec<&Value> = lines
            .iter()
            .filter(|l| l["message"] == wanted)
            .filter(|l| l["span"]["req_id"] == "tenant-7:abc123x")
            .collect();
        assert_eq!(logged.len(), 1, "{name}: {lines:#?}");
    }
}
