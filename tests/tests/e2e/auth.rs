//! API keys (Bearer, from flags and a file) and seed 003's error body.

use e2e::{scratch, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

async fn ask(c: &Cluster, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}{path}", c.url))
        .json(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn hello() -> Value {
    json!({"model": "test", "prompt": "hello", "max_tokens": 2})
}

#[tokio::test]
async fn api_keys_guard_the_api_but_not_health_or_metrics() {
    let file = scratch().join("keys.txt");
    std::fs::write(
        &file,
        "# one key per line, with an optional token quota\n\nfile-key\nsmall-key 10\nburst-key 40\n",
    )
    .unwrap();
    let file = file.display().to_string();
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &["--api-keys", "k1,k2", "--api-key-file", &file],
    )
    .await;
    let (status, v) = ask(&c, "/v1/completions", None, &hello()).await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(v["error"]["type"], "authentication_error");
    let (status, _) = ask(&c, "/v1/completions", Some("k3"), &hello()).await;
    assert_eq!(status, 401);
    for key in ["k1", "k2", "file-key"] {
        let (status, v) = ask(&c, "/v1/completions", Some(key), &hello()).await;
        assert_eq!(status, 200, "{key}: {v}");
    }
    // small-key may use 10 tokens: a request passes while the rest of the quota covers its
    // worst case (prompt and max_tokens), then gets 429; the key never uses more than 10.
    let mut used = 0;
    let mut refused = false;
    for _ in 0..10 {
        let (status, v) = ask(&c, "/v1/completions", Some("small-key"), &hello()).await;
        if status == 429 {
            assert_eq!(v["error"]["code"], "insufficient_quota", "{v}");
            refused = true;
            break;
        }
        assert_eq!(status, 200, "{used} tokens used: {v}");
        used += v["usage"]["total_tokens"].as_u64().unwrap();
    }
    assert!(
        refused && used <= 10,
        "{used} tokens used, refused: {refused}"
    );

    // Sixteen requests at once, each certain to use its prompt and 8 tokens: they all pass
    // the check at the door together, but only as many as the quota covers are served.
    let burst = json!({"model": "test", "prompt": "hello", "max_tokens": 8, "ignore_eos": true});
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (url, burst) = (c.url.clone(), burst.clone());
        tasks.spawn(async move {
            let resp = reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .bearer_auth("burst-key")
                .json(&burst)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        });
    }
    let answers = tasks.join_all().await;
    let served: u64 = answers
        .iter()
        .filter(|(status, _)| *status == 200)
        .map(|(_, v)| v["usage"]["total_tokens"].as_u64().unwrap())
        .sum();
    let too_big = answers.iter().filter(|(status, v)| {
        *status == 429
            && v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("lower max_tokens")
    });
    assert!(served <= 40, "the burst used {served} of a 40-token quota");
    assert!(too_big.count() >= 12, "{answers:?}");
    let (status, _) = ask(&c, "/v1/completions", Some("file-key"), &hello()).await;
    assert_eq!(status, 200, "other keys keep their own account");

    let models = reqwest::get(format!("{}/v1/models", c.url)).await.unwrap();
    assert_eq!(models.status(), 401);
    let r = reqwest::get(format!("{}/health", c.url)).await.unwrap();
    assert_eq!(r.status(), 200, "/health needs no key");
    for open in ["/health", "/health/ready", "/metrics"] {
        let r = reqwest::get(format!("http://{}{open}", c.ops))
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            200,
            "{open} on the operations listener needs no key"
        );
    }
}

#[tokio::test]
async fn provider_error_format_uses_the_003_codes() {
    let file = scratch().join("spent-keys.txt");
    std::fs::write(&file, "spent 0\n").unwrap();
    let file = file.display().to_string();
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &[
            "--api-keys",
            "k",
            "--api-key-file",
            &file,
            "--error-format",
            "provider",
            "--request-timeout-ms",
            "1",
        ],
    )
    .await;
    let cases = [
        (None, hello(), 401, 702),
        (Some("wrong"), hello(), 401, 801),
        (Some("spent"), hello(), 429, 701),
        (
            Some("k"),
            json!({"model": "test", "prompt": "hello", "temperature": 9}),
            400,
            9999,
        ),
        // A request cannot finish within 1 ms: 504, 802.
        (
            Some("k"),
            json!({"model": "test", "prompt": "hello", "max_tokens": 50}),
            504,
            802,
        ),
    ];
    for (key, body, status, code) in cases {
        let (got, v) = ask(&c, "/v1/completions", key, &body).await;
        assert_eq!(got, status, "{v}");
        assert_eq!(v["code"], code, "{v}");
        assert!(v["result"].is_null() && v["message"].is_string(), "{v}");
        assert!(v.get("error").is_none());
    }
    // An unknown route is answered in the provider's shape too (003 lists no code for it).
    let (got, v) = ask(&c, "/v2/nothing", Some("k"), &hello()).await;
    assert_eq!(got, 404, "{v}");
    assert_eq!(v["code"], 9999, "{v}");
    assert!(v["result"].is_null() && v["message"].is_string(), "{v}");
}

/// The tokens an API key may still hold, as a request too large for it is told: 128
/// sequences of the router's most tokens (513) need more than the key's 50,000.
async fn quota_left(c: &Cluster, key: &str) -> u64 {
    let body = json!({"model": "test", "prompt": "hi", "max_tokens": 2000, "n": 128,
        "temperature": 1.0});
    let (status, v) = ask(c, "/v1/completions", Some(key), &body).await;
    assert_eq!(status, 429, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    let left = message
        .split(" the API key has ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok());
    left.unwrap_or_else(|| panic!("no tokens left in {message:?}"))
}

/// A client that leaves after a prefill node took its prompt, before its first token,
/// still pays for the prompt: the prefill was computed for it. It used to pay nothing, so
/// a key could buy prefills without end by leaving early.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_abandoned_before_its_first_token_pays_for_its_prompt() {
    use tokio::io::AsyncWriteExt;
    let file = scratch().join("abandon-keys.txt");
    std::fs::write(&file, "open-key\nmetered 50000\n").unwrap();
    let file = file.display().to_string();
    let c = Cluster::start(Mode::Pd, &e2e::smollm2(), &["--api-key-file", &file]).await;
    let prefill = c.prefill.clone().expect("a prefill node");
    let quota = quota_left(&c, "metered").await;
    // A long prompt keeps the prefill node's compute thread busy...
    let long =
        json!({"model": "test", "prompt": "river stone lantern ".repeat(600), "max_tokens": 1});
    let busy = {
        let url = format!("{}/v1/completions", c.url);
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth("open-key")
                .json(&long)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    e2e::wait_metric(
        &prefill,
        "prefill_running_prompts",
        "",
        1.0,
        std::time::Duration::from_secs(30),
    )
    .await;
    // ...so the metered request's prompt waits in its queue when its client leaves.
    let prompt = "Summarise the harbour's history in one line.";
    let body = json!({"model": "test", "prompt": prompt, "max_tokens": 8}).to_string();
    let host = c.url.trim_start_matches("http://");
    let mut sock = tokio::net::TcpStream::connect(host).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer metered\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body.as_bytes()).await.unwrap();
    e2e::wait_metric(
        &prefill,
        "prefill_queue_depth",
        "",
        1.0,
        std::time::Duration::from_secs(30),
    )
    .await;
    drop(sock);
    let (_, tokenized) = ask(
        &c,
        "/tokenize",
        Some("open-key"),
        &json!({"model": "test", "prompt": prompt}),
    )
    .await;
    let prompt_tokens = tokenized["count"].as_u64().expect("a count");
    let charged = e2e::poll_until(std::time::Duration::from_secs(30), || async {
        (quota_left(&c, "metered").await == quota - prompt_tokens).then_some(())
    })
    .await;
    assert!(
        charged.is_some(),
        "the key was not charged the {prompt_tokens} prompt tokens of the abandoned request: \
         {} of {quota} left",
        quota_left(&c, "metered").await
    );
    assert_eq!(busy.await.unwrap().expect("an answer"), 200);
}
