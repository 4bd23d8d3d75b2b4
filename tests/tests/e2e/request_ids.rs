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

/// The router's log lines that `poll_until` finds, once `n` access lines are in.
async fn access_lines(c: &Cluster, n: usize) -> Vec<Value> {
    let router = c
        .procs
        .iter()
        .find(|p| p.log.display().to_string().contains("router"))
        .expect("the router's log");
    let lines = e2e::poll_until(std::time::Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&router.log).ok()?;
        let access: Vec<Value> = json_lines(&text)
            .into_iter()
            .filter(|l| l["target"] == "tandem::access")
            .collect();
        (access.len() >= n).then_some(access)
    })
    .await;
    lines.unwrap_or_else(|| panic!("fewer than {n} access lines"))
}

#[tokio::test]
async fn every_request_ends_with_one_access_line() {
    let router = ["--log-format", "json", "--api-keys", "key-a"];
    let c = Cluster::start(Mode::Pd, &tiny_model(), &router).await;
    let send = |id: &str, body: Value| {
        c.client
            .post(format!("{}/v1/completions", c.url))
            .bearer_auth("key-a")
            .header("x-request-id", id)
            .json(&body)
            .send()
    };
    let ask = |stream: bool| {
        json!({"model": c.model_name, "prompt": "hello there", "max_tokens": 3,
            "ignore_eos": true, "stream": stream})
    };
    let whole = send("whole-1", ask(false)).await.unwrap();
    assert_eq!(whole.status(), 200);
    let usage = whole.json::<Value>().await.unwrap()["usage"].clone();
    let streamed = send("stream-1", ask(true)).await.unwrap();
    assert_eq!(streamed.status(), 200);
    assert!(streamed.text().await.unwrap().contains("[DONE]"));
    let bad = json!({"model": c.model_name, "prompt": "hello", "max_tokens": -1});
    assert_eq!(send("bad-1", bad).await.unwrap().status(), 400);

    let lines = access_lines(&c, 3).await;
    let line = |id: &str| {
        let of: Vec<&Value> = lines.iter().filter(|l| l["span"]["req_id"] == id).collect();
        assert_eq!(of.len(), 1, "one line for {id}: {lines:#?}");
        of[0].clone()
    };
    for (id, streamed) in [("whole-1", false), ("stream-1", true)] {
        let l = line(id);
        assert_eq!(l["status"], 200, "{l}");
        assert_eq!(l["streamed"], streamed, "{l}");
        assert_eq!(l["prompt_tokens"], usage["prompt_tokens"], "{l}");
        assert_eq!(l["completion_tokens"], 3, "{l}");
        let (ttft, latency) = (l["ttft_ms"].as_f64(), l["latency_ms"].as_f64());
        assert!(
            ttft.is_some_and(|t| t > 0.0 && t <= latency.unwrap()),
            "{l}"
        );
        assert_eq!(l["span"]["endpoint"], "completions", "{l}");
        assert_eq!(l["span"]["placement"], "prefill_node", "{l}");
        for worker in ["prefill", "decode"] {
            let name = l["span"][worker].as_str().unwrap_or_default();
            assert!(name.starts_with(worker), "{worker}: {l}");
        }
        let key = l["key"].as_str().expect("the key's id");
        assert!(key.len() == 8 && !key.contains("key-a"), "{l}");
    }
    let l = line("bad-1");
    assert_eq!(l["status"], 400, "{l}");
    assert_eq!(l["completion_tokens"], 0, "{l}");
    assert!(
        l["ttft_ms"].is_null() && l["span"]["placement"].is_null(),
        "{l}"
    );
}
