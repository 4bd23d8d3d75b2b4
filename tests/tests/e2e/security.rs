//! What a request may not do: make the router read a local file or open a connection on
//! its behalf, or leave its API key or prompt in the logs (unless `--log-prompts` asks for
//! the prompt, and then never the key).

use std::io::ErrorKind;
use std::net::TcpListener;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use e2e::{poll_until, scratch, sse_chunks, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

/// A string that appears nowhere unless this test put it there.
fn canary(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{what}{nanos:08x}p{}", std::process::id())
}

/// A chat body asking `text`.
fn chat_body(text: &str) -> Value {
    json!({"model": "test", "max_tokens": 4,
        "messages": [{"role": "user", "content": text}]})
}

/// The request each field would carry `target` in, the endpoint, and the parameter the
/// refusal must name.
fn carriers(target: &str) -> Vec<(&'static str, Value, &'static str)> {
    let chat = "/v1/chat/completions";
    let with_part = |part: Value| {
        json!({"model": "test", "max_tokens": 4, "messages": [{"role": "user",
            "content": [{"type": "text", "text": "what is this?"}, part]}]})
    };
    let patched = |patch: Value| {
        let mut body = chat_body("hello");
        if let (Some(b), Some(p)) = (body.as_object_mut(), patch.as_object()) {
            b.extend(p.clone());
        }
        body
    };
    let schema = json!({"type": "object", "properties": {"city": {"$ref": target}}});
    vec![
        (
            chat,
            with_part(json!({"type": "image_url", "image_url": {"url": target}})),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "image_url", "image_url": target})),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "video_url", "video_url": {"url": target}})),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "audio_url", "audio_url": {"url": target}})),
            "messages",
        ),
        (
            chat,
            with_part(
                json!({"type": "input_audio", "input_audio": {"data": target, "format": "wav"}}),
            ),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "file", "file": {"file_id": target, "filename": target}})),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "image", "image": target})),
            "messages",
        ),
        (
            chat,
            with_part(json!({"type": "input_file", "file_url": target})),
            "messages",
        ),
        (chat, patched(json!({"model": target})), "model"),
        (
            "/v1/completions",
            json!({"model": target, "prompt": "hello", "max_tokens": 4}),
            "model",
        ),
        (
            chat,
            patched(json!({"chat_template": target})),
            "chat_template",
        ),
        (
            "/v1/completions",
            json!({"model": "test", "prompt": "hello", "chat_template": target}),
            "chat_template",
        ),
        (
            chat,
            patched(
                json!({"chat_template_kwargs": {"messages": [{"role": "user",
                "content": [{"type": "image_url", "image_url": {"url": target}}]}]}}),
            ),
            "chat_template_kwargs",
        ),
        (
            chat,
            patched(
                json!({"tools": [{"type": "function", "function": {"name": "weather",
                "parameters": schema}}]}),
            ),
            "tools",
        ),
        (
            chat,
            patched(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema}}})),
            "response_format",
        ),
        (chat, patched(json!({"guided_json": schema})), "guided_json"),
        (
            chat,
            patched(
                json!({"web_search_options": {"user_location": {"type": "approximate",
                "approximate": {"city": target}}}}),
            ),
            "web_search_options",
        ),
    ]
}

/// Panics if anything connected to `listener` (set non-blocking) since it was bound.
fn assert_untouched(listener: &TcpListener, what: &str) {
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("{peer} connected to the test's {what} listener"),
        Err(e) => panic!("accept on the {what} listener: {e}"),
    }
}

#[tokio::test]
async fn no_request_makes_the_router_read_a_file_or_open_a_connection() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let trap = TcpListener::bind("127.0.0.1:0").expect("binding the trap listener");
    trap.set_nonblocking(true).unwrap();
    let port = trap.local_addr().unwrap().port();
    // The same port on IPv6 loopback, where the machine has one.
    let trap6 = TcpListener::bind(("::1", port)).ok();
    if let Some(l) = &trap6 {
        l.set_nonblocking(true).unwrap();
    }
    let targets = [
        "/etc/passwd".to_string(),
        "../../etc/passwd".into(),
        "file:///etc/passwd".into(),
        "http://169.254.169.254/latest/meta-data/".into(),
        format!("http://127.0.0.1:{port}/"),
        format!("http://[::1]:{port}/"),
        format!("http://localhost:{port}/x.png"),
        // The decode node's own port.
        format!("http://{}/metrics", c.decode),
        // Redirect-looking: an open redirect, and userinfo that hides the real host.
        format!("http://127.0.0.1:{port}/redirect?to=file:///etc/passwd"),
        format!("http://example.com/redirect?url=http://127.0.0.1:{port}/"),
        format!("http://example.com@127.0.0.1:{port}/"),
    ];
    for target in &targets {
        for (path, body, param) in carriers(target) {
            let (status, v) = c.post(path, &body).await;
            let expected = if param == "model" { 404 } else { 400 };
            assert_eq!(status, expected, "{param} = {target}: {v}");
            let error = &v["error"];
            assert_eq!(error["param"], param, "{target}: {v}");
            assert_eq!(error["type"], "invalid_request_error", "{target}: {v}");
            assert!(error["message"].is_string(), "{target}: {v}");
        }
    }
    // The same strings as plain text are just a prompt.
    let (status, v) = c
        .post(
            "/v1/chat/completions",
            &chat_body(&format!("fetch http://127.0.0.1:{port}/ and /etc/passwd")),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_untouched(&trap, "127.0.0.1");
    if let Some(l) = &trap6 {
        assert_untouched(l, "[::1]");
    }
}

/// Sends `body` to `path` with `authorization` as the header; the status and the body
/// (JSON, or the SSE `data:` payloads as a JSON list of strings when streamed).
async fn send(c: &Cluster, path: &str, authorization: &str, body: String) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", c.url))
        .header("authorization", authorization)
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let status = resp.status().as_u16();
    let sse = resp
        .headers()
        .get("content-type")
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    let text = resp.text().await.expect("reading the body");
    if sse {
        let data: Vec<Value> = text
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(|d| Value::from(d.to_string()))
            .collect();
        (status, Value::Array(data))
    } else {
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

/// The response id of a completion, streamed or not; panics unless it succeeded whole.
fn response_id(v: &Value) -> String {
    let first = match v {
        Value::Array(data) => {
            let data: Vec<String> = data
                .iter()
                .map(|d| d.as_str().unwrap_or_default().to_string())
                .collect();
            sse_chunks(&data).remove(0)
        }
        whole => whole.clone(),
    };
    first["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {first}"))
        .to_string()
}

/// Writes a key file holding `key`; its name carries no canary.
fn key_file(key: &str) -> String {
    let file = scratch().join(format!("security-keys-{}.txt", e2e::free_port()));
    std::fs::write(&file, format!("{key}\n")).expect("writing the key file");
    file.display().to_string()
}

/// The log of the process whose log file name ends with `suffix` (`-router.log`, ...).
fn log_of(c: &Cluster, suffix: &str) -> String {
    let proc = c
        .procs
        .iter()
        .find(|p| p.log.to_string_lossy().ends_with(suffix))
        .unwrap_or_else(|| panic!("no process logs to *{suffix}"));
    std::fs::read_to_string(&proc.log).unwrap_or_default()
}

/// Panics with the offending line if any process's log holds one of `secrets`.
fn assert_absent_from_logs(c: &Cluster, secrets: &[(&str, &str)]) {
    for p in &c.procs {
        let log = std::fs::read_to_string(&p.log)
            .unwrap_or_else(|e| panic!("reading {}: {e}", p.log.display()));
        for (what, secret) in secrets {
            if let Some(line) = log.lines().find(|l| l.contains(secret)) {
                panic!("{} logs the {what}: {line}", p.log.display());
            }
        }
    }
}

#[tokio::test]
async fn api_keys_and_prompts_stay_out_of_the_logs() {
    let key = canary("sk-key");
    let wrong_key = canary("sk-wrong");
    let prompt = canary("secretprompt");
    let file = key_file(&key);
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--api-key-file", &file]).await;
    let bearer = format!("Bearer {key}");
    let completion = |stream: bool| {
        json!({"model": "test", "prompt": format!("Tell me about {prompt}"),
            "max_tokens": 4, "stream": stream})
        .to_string()
    };
    let chat = |stream: bool| {
        let mut body = chat_body(&format!("Tell me about {prompt}"));
        body["stream"] = json!(stream);
        body["messages"].as_array_mut().unwrap().insert(
            0,
            json!({"role": "system", "content": format!("Keep {prompt} safe")}),
        );
        body.to_string()
    };
    let mut served = Vec::new();
    for stream in [false, true] {
        for (path, body) in [
            ("/v1/chat/completions", chat(stream)),
            ("/v1/completions", completion(stream)),
        ] {
            let (status, v) = send(&c, path, &bearer, body).await;
            assert_eq!(status, 200, "{path} stream={stream}: {v}");
            served.push(response_id(&v));
        }
    }
    let tools = json!([{"type": "function", "function": {"name": "weather"}}]);
    let mut bad_param = serde_json::from_str::<Value>(&chat(false)).unwrap();
    bad_param["tools"] = tools;
    bad_param["tool_choice"] = json!(prompt);
    let mut bad_model = serde_json::from_str::<Value>(&completion(false)).unwrap();
    bad_model["model"] = json!(prompt);
    let (chat_path, completions_path) = ("/v1/chat/completions", "/v1/completions");
    let refused = [
        // Cut JSON that carries the prompt.
        (
            completions_path,
            bearer.clone(),
            format!("{{\"model\": \"test\", \"prompt\": \"{prompt}"),
            400,
            false,
        ),
        (
            chat_path,
            format!("Bearer {wrong_key}"),
            chat(false),
            401,
            false,
        ),
        // No `Bearer `: the whole header is what a careless log line would print.
        (
            completions_path,
            wrong_key.clone(),
            completion(true),
            401,
            false,
        ),
        // Both echo the prompt in their error message.
        (chat_path, bearer.clone(), bad_param.to_string(), 400, true),
        (
            completions_path,
            bearer.clone(),
            bad_model.to_string(),
            404,
            true,
        ),
    ];
    for (path, authorization, body, want, echoes) in refused {
        let (status, v) = send(&c, path, &authorization, body).await;
        assert_eq!(status, want, "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(message.contains(&prompt), echoes, "{v}");
    }
    // The logs are written and read: the prefill node logs every request it served.
    let logged = poll_until(Duration::from_secs(10), || {
        let log = log_of(&c, "-prefill.log");
        std::future::ready(
            served
                .iter()
                .all(|id| log.contains(id.as_str()))
                .then_some(()),
        )
    })
    .await;
    assert!(
        logged.is_some(),
        "the prefill log lacks the served requests {served:?}:\n{}",
        c.logs()
    );
    assert_absent_from_logs(
        &c,
        &[
            ("prompt", &prompt),
            ("API key", &key),
            ("wrong API key", &wrong_key),
        ],
    );
}

#[tokio::test]
async fn log_prompts_logs_prompts_under_their_request_but_never_keys() {
    let key = canary("sk-key");
    let wrong_key = canary("sk-wrong");
    let chat_prompt = canary("chatprompt");
    let completion_prompt = canary("completionprompt");
    let file = key_file(&key);
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &["--api-key-file", &file, "--log-prompts"],
    )
    .await;
    let bearer = format!("Bearer {key}");
    let (status, v) = send(
        &c,
        "/v1/chat/completions",
        &bearer,
        chat_body(&chat_prompt).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let chat_id = response_id(&v);
    let body = json!({"model": "test", "prompt": completion_prompt, "max_tokens": 4,
        "stream": true});
    let (status, v) = send(&c, "/v1/completions", &bearer, body.to_string()).await;
    assert_eq!(status, 200, "{v}");
    let completion_id = response_id(&v);
    let (status, _) = send(
        &c,
        "/v1/completions",
        &format!("Bearer {wrong_key}"),
        body.to_string(),
    )
    .await;
    assert_eq!(status, 401);

    let lines = poll_until(Duration::from_secs(10), || {
        let log = log_of(&c, "-router.log");
        let line = |canary: &str| log.lines().find(|l| l.contains(canary)).map(String::from);
        std::future::ready(line(&chat_prompt).zip(line(&completion_prompt)))
    })
    .await;
    let Some((chat_line, completion_line)) = lines else {
        panic!(
            "the router did not log both prompts:\n{}",
            log_of(&c, "-router.log")
        );
    };
    assert!(
        chat_line.contains(&chat_id),
        "the prompt is not logged under its request's span: {chat_line}"
    );
    assert!(
        chat_line.contains("<|im_start|>"),
        "the rendered prompt is logged: {chat_line}"
    );
    assert!(
        completion_line.contains(&completion_id),
        "the prompt is not logged under its request's span: {completion_line}"
    );
    let router_log = log_of(&c, "-router.log");
    assert!(
        router_log
            .lines()
            .any(|l| l.contains("WARN") && l.contains("--log-prompts is on")),
        "no startup warning:\n{router_log}"
    );
    assert_absent_from_logs(&c, &[("API key", &key), ("wrong API key", &wrong_key)]);
}
