//! Tools and tool calls through P and D: the request's tools reach the prompt (through the
//! template that teaches them, or written by the router in the generic format for SmolLM2's,
//! which teaches none), forced calls come back as `tool_calls`, and only a router told to
//! parse no format refuses tools rather than ignoring them.

use e2e::{smollm2, sse_chunks, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
            "required": ["location"]}}}])
}

/// A chat that asks for the weather in `city`, with a system prompt that shows a call, so
/// that the small model fills the arguments in from the question.
fn weather_chat(city: &str, tool_choice: Value) -> Value {
    let system = "You call tools. To call a tool, answer only with <tool_call> and a JSON \
        object.\nExample:\nUser: What is the weather in London?\nAssistant: <tool_call>\n\
        {\"name\": \"get_weather\", \"arguments\": {\"location\": \"London\"}}\n</tool_call>";
    json!({"model": "test", "temperature": 0, "max_tokens": 40,
        "messages": [{"role": "system", "content": system},
            {"role": "user", "content": format!("What is the weather in {city}?")}],
        "tools": weather_tool(), "tool_choice": tool_choice})
}

/// The one call in a response, as (name, parsed arguments).
fn only_call(v: &Value) -> (String, Value) {
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    // Seed 001's tool-call response: `"content": "", "tool_calls": [...]`.
    assert_eq!(
        choice["message"]["content"], "",
        "a message that only calls tools has empty content, as seed 001 shows: {v}"
    );
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    let call = &calls[0];
    assert_eq!(call["type"], "function");
    let id = call["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    let args = call["function"]["arguments"]
        .as_str()
        .expect("arguments as text");
    (
        call["function"]["name"].as_str().unwrap().to_string(),
        serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}")),
    )
}

#[tokio::test]
async fn required_and_named_tool_choice_return_parsed_calls_streamed_and_not() {
    // The generic format: SmolLM2's template teaches none.
    let c = Cluster::start(Mode::Pd, &smollm2(), &[]).await;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (city, choice) in [("Paris", json!("required")), ("Tokyo", named)] {
        let (status, v) = c
            .post("/v1/chat/completions", &weather_chat(city, choice))
            .await;
        assert_eq!(status, 200, "{v}");
        let (name, args) = only_call(&v);
        assert_eq!(name, "get_weather");
        assert_eq!(args, json!({"location": city}), "{v}");

        let mut body = weather_chat(city, json!("required"));
        body["stream"] = json!(true);
        let (status, data) = c.post_sse("/v1/chat/completions", &body).await;
        assert_eq!(status, 200);
        let chunks = sse_chunks(&data);
        let deltas: Vec<&Value> = chunks
            .iter()
            .filter_map(|ch| ch["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(deltas.len(), 1, "one whole call per delta: {data:?}");
        assert_eq!(deltas[0]["index"], 0);
        assert_eq!(deltas[0]["function"]["name"], "get_weather");
        let streamed_args: Value =
            serde_json::from_str(deltas[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(streamed_args, json!({"location": city}));
        let content = e2e::chat_stream_content(&chunks);
        assert_eq!(content, "", "the call is not also sent as content");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    }

    // tool_choice none: the tools are left out of the prompt and nothing is parsed.
    let none = weather_chat("Paris", json!("none"));
    let mut without = none.clone();
    without.as_object_mut().unwrap().remove("tools");
    without.as_object_mut().unwrap().remove("tool_choice");
    let (s1, a) = c.post("/v1/chat/completions", &none).await;
    let (s2, b) = c.post("/v1/chat/completions", &without).await;
    assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["choices"][0]["message"]["tool_calls"], json!([]));

    // The next turn: the call and its result go back in as history.
    let (_, first) = c
        .post(
            "/v1/chat/completions",
            &weather_chat("Paris", json!("required")),
        )
        .await;
    let call = first["choices"][0]["message"]["tool_calls"][0].clone();
    let mut next = weather_chat("Paris", json!("auto"));
    let messages = next["messages"].as_array_mut().unwrap();
    // Null content, as the openai SDK sends it: the router writes the call into the
    // content, and the result into a user turn, which SmolLM2's template renders.
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"}));
    let (status, v) = c.post("/v1/chat/completions", &next).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["usage"]["prompt_tokens"].as_u64() > first["usage"]["prompt_tokens"].as_u64(),
        "the history is in the prompt: {v}"
    );
}

#[tokio::test]
async fn tools_reach_the_prompt_and_are_refused_only_with_parser_none() {
    let ask = json!({"model": "test", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "weather?"}]});
    let mut with_tools = ask.clone();
    with_tools["tools"] = weather_tool();
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The tiny model's template renders tools (Hermes style); SmolLM2's does not, so the
    // router writes them in the same words. Either way they lengthen the prompt.
    for model in [tiny_model(), smollm2()] {
        let c = Cluster::start(Mode::Pd, &model, &[]).await;
        let (s1, plain) = c.post("/v1/chat/completions", &ask).await;
        let (s2, tooled) = c.post("/v1/chat/completions", &with_tools).await;
        assert_eq!((s1, s2), (200, 200), "{plain}\n{tooled}");
        assert!(
            tokens(&tooled) > tokens(&plain) + 20,
            "{} vs {}",
            tokens(&tooled),
            tokens(&plain)
        );
    }

    // Told to parse no format, the router refuses tools, since their calls could not be
    // returned, unless tool_choice is none.
    let none = Cluster::start(Mode::Pd, &tiny_model(), &["--tool-call-parser", "none"]).await;
    let (status, e) = none.post("/v1/chat/completions", &with_tools).await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("tools")),
        "{e}"
    );
    let mut unknown = with_tools.clone();
    unknown["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
    let (status, e) = none.post("/v1/chat/completions", &unknown).await;
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("tool_choice")),
        "{e}"
    );
    with_tools["tool_choice"] = json!("none");
    let (status, v) = none.post("/v1/chat/completions", &with_tools).await;
    assert_eq!(status, 200, "{v}");
}

fn two_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string", "minLength": 1, "maxLength": 24},
                "unit": {"enum": ["c", "f"]}},
            "required": ["location", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {
                "zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// Checks a call against `two_tools`' schemas.
fn assert_fits(name: &str, args: &Value) {
    let o = args.as_object().unwrap_or_else(|| panic!("{name}: {args}"));
    match name {
        "get_weather" => {
            assert_eq!(o.len(), 2, "{args}");
            let location = o["location"].as_str().unwrap();
            assert!((1..=24).contains(&location.chars().count()), "{args}");
            assert!(["c", "f"].contains(&o["unit"].as_str().unwrap()), "{args}");
        }
        "get_time" => {
            assert_eq!(o.len(), 1, "{args}");
            assert!(["UTC", "CET", "PST"].contains(&o["zone"].as_str().unwrap()));
        }
        other => panic!("not a tool: {other} {args}"),
    }
}

/// A forced call (tool_choice required or named) is held to the tools' schemas by a
/// grammar: at temperature 1 every seeded run is a call of a given tool, with arguments its
/// schema accepts, and a named choice calls that tool.
#[tokio::test]
async fn forced_calls_at_temperature_1_always_fit_a_tool_s_schema() {
    let c = std::sync::Arc::new(Cluster::start(Mode::Pd, &smollm2(), &[]).await);
    let body = |seed: u64, choice: Value| {
        json!({"model": "test", "temperature": 1.0, "seed": seed, "max_tokens": 80,
            "messages": [{"role": "user", "content": "What is the weather, or the time?"}],
            "tools": two_tools(), "tool_choice": choice})
    };
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let mut runs = tokio::task::JoinSet::new();
    for seed in 0..30 {
        let choice = if seed % 3 == 2 {
            named.clone()
        } else {
            json!("required")
        };
        let (c, b) = (std::sync::Arc::clone(&c), body(seed, choice.clone()));
        runs.spawn(async move { (choice, c.post("/v1/chat/completions", &b).await) });
    }
    let mut names = std::collections::HashSet::new();
    for (choice, (status, v)) in runs.join_all().await {
        assert_eq!(status, 200, "{v}");
        let (name, args) = only_call(&v);
        assert_fits(&name, &args);
        if choice.is_object() {
            assert_eq!(name, "get_time", "{v}");
        }
        names.insert(name);
    }
    assert_eq!(names.len(), 2, "both tools get called: {names:?}");

    let mut both = body(1, json!("required"));
    both["response_format"] = json!({"type": "json_object"});
    let (status, v) = c.post("/v1/chat/completions", &both).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tool_choice", "{v}");
}

/// The generated tiny model with the chat template of a fixture in
/// `engine/tests/fixtures/templates/` (a real model's), written once per call.
fn tiny_model_with_template(name: &str) -> std::path::PathBuf {
    let root = e2e::root();
    let fixture = root.join(format!("engine/tests/fixtures/templates/{name}.json"));
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let dir = e2e::scratch().join(format!("tiny-template-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(tiny_model()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let _ = std::fs::remove_file(dir.join("chat_template.jinja"));
    let config_path = dir.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = fixture["template"].clone();
    std::fs::write(&config_path, config.to_string()).unwrap();
    dir
}

/// Llama 3.2's and Mistral Nemo's templates teach their own formats: a forced call comes
/// back as `tool_calls` (the grammar writes Llama's `parameters` and Mistral's list, the
/// parser reads them), with ids Mistral's template takes back (nine letters and digits),
/// and a next turn whose history holds OpenAI-style ids renders, which Mistral's template
/// alone would refuse.
#[tokio::test]
async fn llama3_mistral_and_phi4_templates_force_and_take_back_calls_in_their_formats() {
    let cases = [
        ("llama3_2", 29, "Llama3Json"),
        ("mistral_nemo", 9, "Mistral"),
        ("phi4_mini", 29, "Phi4Mini"),
    ];
    for (name, id_len, format) in cases {
        let c = Cluster::start(Mode::Pd, &tiny_model_with_template(name), &[]).await;
        // The router found the template's own format (not the generic one, which would
        // force and parse calls too).
        let found = format!("Some({format})");
        assert!(c.logs().contains(&found), "{name}: {}", c.logs());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        for choice in [json!("required"), named] {
            // The random model's strings run on: a city from a list keeps the call short.
            let tools = json!([{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"location":
                    {"enum": ["Paris", "Nice"]}}, "required": ["location"]}}}]);
            let body = json!({"model": "test", "temperature": 0, "max_tokens": 40,
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": tools, "tool_choice": choice});
            let (status, v) = c.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{name}: {v}");
            let call = &v["choices"][0]["message"]["tool_calls"][0];
            assert_eq!(
                v["choices"][0]["finish_reason"], "tool_calls",
                "{name}: {v}"
            );
            assert_eq!(call["function"]["name"], "get_weather", "{name}: {v}");
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(
                ["Paris", "Nice"].contains(&args["location"].as_str().unwrap()),
                "{v}"
            );
            assert_eq!(call["id"].as_str().unwrap().len(), id_len, "{name}: {v}");

            let mut next = body.clone();
            let openai_call = json!({"id": "call_0123456789abcdef01234567", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"location\": \"Nice\"}"}});
            for given in [call.clone(), openai_call] {
                next["messages"] = json!([
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": null, "tool_calls": [given]},
                    {"role": "tool", "tool_call_id": given["id"], "content": "22 C"},
                ]);
                next["tool_choice"] = json!("auto");
                let (status, v) = c.post("/v1/chat/completions", &next).await;
                assert_eq!(status, 200, "{name}: {v}");
            }
        }
    }
}
