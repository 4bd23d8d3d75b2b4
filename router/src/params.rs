//! Request bodies to validated parameters. Each check names the parameter it rejects, as
//! the OpenAI error object's `param`.

use serde_json::{Map, Value};

use crate::error::RouterError;

/// A JSON object body.
pub type Obj = Map<String, Value>;

/// Most characters of message content (the seeds' 4 MB).
pub const MAX_CONTENT_CHARS: usize = 4 * 1024 * 1024;

/// Parameters both endpoints share.
#[derive(Debug, Clone)]
pub struct Common {
    pub model: String,
    pub stream: bool,
    pub sampling: proto::v1::SamplingParams,
    pub max_tokens: Option<u64>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// `stop_token_ids` that are int32 and inside the vocabulary.
    pub stop_token_ids: Vec<u32>,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// Choices returned.
    pub n: usize,
    /// Sequences generated, of which the n best (by cumulative logprob) are returned; with
    /// beam search, the beam width.
    pub best_of: usize,
    /// Beam search instead of sampling.
    pub beam: bool,
}

/// Content part types that carry media, by URL, path, file id or inline data: this is a
/// text model, and no request makes the router read a file or open a connection.
const MEDIA_PARTS: &[&str] = &[
    "image_url",
    "video_url",
    "audio_url",
    "input_audio",
    "image",
    "input_image",
    "video",
    "audio",
    "file",
    "input_file",
];

/// Keywords by which a JSON schema refers to another schema.
const REF_KEYWORDS: [&str; 3] = ["$ref", "$dynamicRef", "$recursiveRef"];

/// The first schema reference in `v` that points outside the document itself (a URL or a
/// path: anything but a `#` fragment). Nothing here resolves schemas, and a reference
/// that a later feature resolved must never become a fetch. The depth is bounded by
/// serde_json's recursion limit on the body.
fn external_ref(v: &Value) -> Option<&str> {
    match v {
        Value::Object(m) => m.iter().find_map(|(k, v)| match v {
            Value::String(r) if REF_KEYWORDS.contains(&k.as_str()) && !r.starts_with('#') => {
                Some(r.as_str())
            }
            _ => external_ref(v),
        }),
        Value::Array(items) => items.iter().find_map(external_ref),
        _ => None,
    }
}

/// Refuses the fields for which other servers read a file or fetch a URL (a template, a
/// web search, a schema): ignoring them would leave a client believing they were used.
fn no_fetching_fields(o: &Obj) -> Result<(), RouterError> {
    if get(o, "chat_template").is_some() {
        return Err(RouterError::param(
            "chat_template",
            "chat_template is not accepted: prompts are rendered with the model's own chat \
             template, never one from a request",
        ));
    }
    if get(o, "web_search_options").is_some() {
        return Err(RouterError::param(
            "web_search_options",
            "web search is not supported: the router opens no connection for a request",
        ));
    }
    response_format(o)
}

/// `response_format`: only `{"type": "text"}`. Output is not constrained to JSON, so
/// json_object and json_schema would be silently unmet.
fn response_format(o: &Obj) -> Result<(), RouterError> {
    let bad = |m: String| RouterError::param("response_format", m);
    let Some(format) = get(o, "response_format") else {
        return Ok(());
    };
    if let Some(r) = external_ref(format) {
        return Err(bad(format!(
            "response_format refers to {r:?}: only references inside the schema (\"#/...\") \
             are accepted, the router never fetches a schema"
        )));
    }
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(()),
        Some(kind @ ("json_object" | "json_schema")) => Err(bad(format!(
            "response_format {kind} is not supported: output is not constrained to a format"
        ))),
        _ => Err(bad("response_format must be {\"type\": \"text\"}".into())),
    }
}

/// Variables the router gives the chat template itself: a kwarg that replaced them would
/// slip messages and tools past their checks.
const TEMPLATE_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// Most stop strings, characters per stop string, and characters over all of them.
const MAX_STOPS: usize = 1024;
const MAX_STOP_CHARS: usize = 1024;
const MAX_STOP_TOTAL_CHARS: usize = 32768;

/// `stop`: a string or a list of strings; an empty list means none.
fn stop_strings(o: &Obj) -> Result<Vec<String>, RouterError> {
    let bad = |m: String| RouterError::param("stop", m);
    let stops: Vec<String> = match get(o, "stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad("stop must be a string or a list of strings".into()))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("stop must be a string or a list of strings".into())),
    };
    if stops.len() > MAX_STOPS {
        return Err(bad(format!(
            "stop has {} strings, the limit is {MAX_STOPS}",
            stops.len()
        )));
    }
    let mut total = 0;
    for s in &stops {
        let n = s.chars().count();
        if n == 0 || n > MAX_STOP_CHARS {
            return Err(bad(format!(
                "each stop string must have 1 to {MAX_STOP_CHARS} characters, got {n}"
            )));
        }
        total += n;
    }
    if total > MAX_STOP_TOTAL_CHARS {
        return Err(bad(format!(
            "stop strings hold {total} characters, the limit is {MAX_STOP_TOTAL_CHARS}"
        )));
    }
    Ok(stops)
}

/// An integer in `lo..=hi`, or `None` when absent or null.
fn int_in(o: &Obj, key: &'static str, lo: i128, hi: i128) -> Result<Option<usize>, RouterError> {
    match integer(o, key)? {
        None => Ok(None),
        Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as usize)),
        Some(x) => Err(RouterError::param(
            key,
            format!("{key} must be in [{lo}, {hi}], got {x}"),
        )),
    }
}

/// Parses a body into an object; anything else is a 400.
pub fn object(body: &[u8]) -> Result<Obj, RouterError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(RouterError::InvalidJson("expected a JSON object".into())),
        Err(e) => Err(RouterError::InvalidJson(e.to_string())),
    }
}

/// The value of `key`, treating null as absent.
fn get<'a>(o: &'a Obj, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn number(o: &Obj, key: &'static str) -> Result<Option<f64>, RouterError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| RouterError::param(key, format!("{key} must be a number"))),
    }
}

fn integer(o: &Obj, key: &'static str) -> Result<Option<i128>, RouterError> {
    match get(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(i128::from)
            .or_else(|| v.as_u64().map(i128::from))
            .map(Some)
            .ok_or_else(|| RouterError::param(key, format!("{key} must be an integer"))),
    }
}

/// A boolean parameter with its default.
pub fn boolean(o: &Obj, key: &'static str, default: bool) -> Result<bool, RouterError> {
    match get(o, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RouterError::param(key, format!("{key} must be a boolean"))),
    }
}

/// A float in a range; `lo_open`/`hi_open` exclude that end.
fn ranged(
    o: &Obj,
    key: &'static str,
    default: f64,
    (lo, lo_open): (f64, bool),
    (hi, hi_open): (f64, bool),
) -> Result<f64, RouterError> {
    let Some(sent) = number(o, key)? else {
        return Ok(default);
    };
    // The engine samples in f32: the range holds for the value it will use, or 1e-310
    // would pass an open 0 and reach it as 0 (a repetition penalty dividing by 0, or a
    // temperature of 0 that makes n samples one greedy answer).
    let x = f64::from(sent as f32);
    let above = if lo_open { x > lo } else { x >= lo };
    let below = if hi_open { x < hi } else { x <= hi };
    if above && below {
        Ok(x)
    } else {
        let (l, r) = (
            if lo_open { "(" } else { "[" },
            if hi_open { ")" } else { "]" },
        );
        Err(RouterError::param(
            key,
            format!("{key} must be in {l}{lo}, {hi}{r}, got {sent}"),
        ))
    }
}

/// Checks and reads the parameters both endpoints share. `vocab_size` caps top_k.
pub fn common(o: &Obj, vocab_size: usize) -> Result<Common, RouterError> {
    let model = match o.get("model") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(RouterError::param("model", "model must be a string")),
        None => return Err(RouterError::param("model", "model is required")),
    };
    no_fetching_fields(o)?;
    let temperature = ranged(o, "temperature", 1.0, (0.0, false), (2.0, false))?;
    let top_p = ranged(o, "top_p", 1.0, (1e-6, true), (1.0, false))?;
    let top_k = match integer(o, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && k <= i32::MAX as i128 => (k as usize).min(vocab_size) as u32,
        Some(k) => {
            return Err(RouterError::param(
                "top_k",
                format!("top_k must be -1, 0 or in (0, 2147483647], got {k}"),
            ))
        }
    };
    let presence = ranged(o, "presence_penalty", 0.0, (-2.0, false), (2.0, false))?;
    let frequency = ranged(o, "frequency_penalty", 0.0, (-2.0, false), (2.0, false))?;
    let repetition = ranged(o, "repetition_penalty", 1.0, (0.0, true), (2.0, false))?;
    let seed = match integer(o, "seed")? {
        None => random_u64(),
        Some(s) if (0..=u64::MAX as i128).contains(&s) => s as u64,
        Some(s) => {
            return Err(RouterError::param(
                "seed",
                format!("seed must be in [0, 18446744073709551615], got {s}"),
            ))
        }
    };
    let max_tokens = match integer(o, "max_tokens")? {
        None => None,
        Some(m) if m > 0 && m <= i32::MAX as i128 => Some(m as u64),
        Some(m) => {
            return Err(RouterError::param(
                "max_tokens",
                format!("max_tokens must be in (0, 2147483647], got {m}"),
            ))
        }
    };
    let stop_token_ids = match get(o, "stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            // The seeds: elements that are not int32 are ignored.
            .filter_map(|v| v.as_i64().filter(|&i| i32::try_from(i).is_ok()))
            .filter(|&i| i >= 0 && (i as usize) < vocab_size)
            .map(|i| i as u32)
            .collect(),
        Some(_) => {
            return Err(RouterError::param(
                "stop_token_ids",
                "stop_token_ids must be a list of integers",
            ))
        }
    };
    let stream = boolean(o, "stream", false)?;
    let n_given = int_in(o, "n", 1, 128)?;
    let best_of_given = int_in(o, "best_of", 1, 128)?;
    let n = n_given.unwrap_or(1);
    let beam = boolean(o, "use_beam_search", false)?;
    let best_of = if beam {
        // The seeds: with beam search best_of is not checked; the beam is as wide as the
        // larger of the two.
        best_of_given.unwrap_or(n).max(n)
    } else {
        best_of_given.unwrap_or(n)
    };
    if !beam && best_of < n {
        return Err(RouterError::param(
            "best_of",
            format!("best_of ({best_of}) must be at least n ({n})"),
        ));
    }
    let sampled_several = if beam { n > 1 } else { best_of > 1 };
    if sampled_several && temperature <= 0.0 {
        let param = if n > 1 { "n" } else { "best_of" };
        return Err(RouterError::param(
            param,
            "n or best_of above 1 needs a temperature above 0",
        ));
    }
    // The seeds: streaming needs best_of = n, so best_of alone (above 1) is refused too.
    if !beam && stream && best_of != n {
        return Err(RouterError::param(
            "best_of",
            "when streaming, best_of must equal n (and cannot be set without it)",
        ));
    }
    let stop = stop_strings(o)?;
    let include_stop_str_in_output = boolean(o, "include_stop_str_in_output", false)?;
    if beam && (!stop.is_empty() || !stop_token_ids.is_empty()) {
        return Err(RouterError::param(
            "use_beam_search",
            "use_beam_search cannot be combined with stop or stop_token_ids",
        ));
    }
    Ok(Common {
        model,
        stream,
        sampling: proto::v1::SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            repetition_penalty: repetition as f32,
            presence_penalty: presence as f32,
            frequency_penalty: frequency as f32,
            seed,
        },
        max_tokens,
        ignore_eos: boolean(o, "ignore_eos", false)?,
        skip_special_tokens: boolean(o, "skip_special_tokens", true)?,
        stop_token_ids,
        stop,
        include_stop_str_in_output,
        n,
        best_of,
        beam,
    })
}

/// A fresh random u64, for seeds and ids: fastrand's per-thread generator, seeded once per
/// thread. Ids and seeds must differ, not stay secret, and a getrandom call per value cost the
/// router a system call three times per request.
pub fn random_u64() -> u64 {
    fastrand::u64(..)
}

/// What a chat request renders its prompt from.
#[derive(Debug, Clone)]
pub struct Chat {
    pub input: text::ChatInput,
    /// `Some(k)`: report each token's logprob and its k best alternatives.
    pub logprobs: Option<usize>,
    pub tool_choice: ToolChoice,
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tools given, or `"none"`: the output is plain content.
    None,
    /// The model may call a tool.
    Auto,
    /// The model must call at least one tool.
    Required,
    /// The model must call this function.
    Named(String),
}

/// `tools`: a list of `{"type": "function", "function": {"name", ...}}`; an empty list
/// means none.
fn tools(o: &Obj) -> Result<Option<Vec<Value>>, RouterError> {
    let bad = |m: String| RouterError::param("tools", m);
    let list = match get(o, "tools") {
        None => return Ok(None),
        Some(Value::Array(l)) if l.is_empty() => return Ok(None),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(bad("tools must be a list".into())),
    };
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!("tools[{i}].type must be \"function\"")));
        }
        let Some(Value::Object(f)) = t.get("function") else {
            return Err(bad(format!("tools[{i}].function must be an object")));
        };
        match f.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            _ => {
                return Err(bad(format!(
                    "tools[{i}].function.name must be a non-empty string"
                )))
            }
        }
        let typed = [
            (
                "description",
                Value::is_string as fn(&Value) -> bool,
                "a string",
            ),
            ("parameters", Value::is_object, "an object (a JSON schema)"),
            ("strict", Value::is_boolean, "a boolean"),
        ];
        for (key, ok, what) in typed {
            if get(f, key).is_some_and(|v| !ok(v)) {
                return Err(bad(format!("tools[{i}].function.{key} must be {what}")));
            }
        }
        if let Some(r) = external_ref(t) {
            return Err(bad(format!(
                "tools[{i}] refers to {r:?}: only references inside the schema (\"#/...\") \
                 are accepted, the router never fetches a schema"
            )));
        }
    }
    Ok(Some(list.clone()))
}

/// `tool_choice`: `"none"`, `"auto"` (the default with tools), `"required"`, or
/// `{"type": "function", "function": {"name"}}` naming one of `tools`.
fn tool_choice(o: &Obj, tools: Option<&[Value]>) -> Result<ToolChoice, RouterError> {
    let bad = |m: String| RouterError::param("tool_choice", m);
    let choice = match get(o, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"
                )))
            }
        },
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (c.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(bad(
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                    ))
                }
            }
        }
        Some(_) => return Err(bad("tool_choice must be a string or an object".into())),
    };
    let Some(tools) = tools else {
        return match choice {
            ToolChoice::Required | ToolChoice::Named(_) => {
                Err(bad("tool_choice requires tools, and none were given".into()))
            }
            _ => Ok(ToolChoice::None),
        };
    };
    if let ToolChoice::Named(n) = &choice {
        let known = tools
            .iter()
            .any(|t| t["function"]["name"].as_str() == Some(n.as_str()));
        if !known {
            return Err(bad(format!(
                "tool_choice names {n:?}, which is not in tools"
            )));
        }
    }
    Ok(choice)
}

/// Checks `messages` and the chat-only parameters.
pub fn chat(o: &Obj) -> Result<Chat, RouterError> {
    let messages = match o.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(RouterError::param("messages", "messages must not be empty"))
        }
        Some(_) => return Err(RouterError::param("messages", "messages must be a list")),
        None => return Err(RouterError::param("messages", "messages is required")),
    };
    let mut chars = 0;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        out.push(message(i, m, &mut chars)?);
    }
    if chars > MAX_CONTENT_CHARS {
        return Err(RouterError::param(
            "messages",
            format!("messages hold {chars} characters, the limit is {MAX_CONTENT_CHARS}"),
        ));
    }
    if chars == 0 && out.iter().all(|m| m.get("tool_calls").is_none()) {
        return Err(RouterError::param("messages", "messages have no content"));
    }
    let tools = tools(o)?;
    let tool_choice = tool_choice(o, tools.as_deref())?;
    let top = int_in(o, "top_logprobs", 0, 20)?;
    // The seeds: a valid top_logprobs without logprobs turns logprobs on.
    let logprobs = match (get(o, "logprobs"), top) {
        (None, top) => top,
        (Some(_), top) if boolean(o, "logprobs", false)? => Some(top.unwrap_or(0)),
        (Some(_), Some(k)) if k > 0 => {
            return Err(RouterError::param(
                "top_logprobs",
                "top_logprobs needs logprobs to be true",
            ))
        }
        _ => None,
    };
    let kwargs = match get(o, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(k)) => k.clone(),
        Some(_) => {
            return Err(RouterError::param(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object",
            ))
        }
    };
    if let Some(k) = kwargs
        .keys()
        .find(|k| TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        return Err(RouterError::param(
            "chat_template_kwargs",
            format!("chat_template_kwargs.{k} is not accepted: the router sets {k} itself"),
        ));
    }
    if let Some(t) = kwargs
        .get("enable_thinking")
        .filter(|v| !v.is_null() && !v.is_boolean())
    {
        return Err(RouterError::param(
            "chat_template_kwargs",
            format!("chat_template_kwargs.enable_thinking must be a boolean, got {t}"),
        ));
    }
    // tool_choice none keeps the tools out of the prompt, so the model is not invited to
    // write calls that nobody will parse.
    let tools = match tool_choice {
        ToolChoice::None => None,
        _ => tools.map(Value::Array),
    };
    Ok(Chat {
        input: text::ChatInput {
            messages: Value::Array(out),
            tools,
            add_generation_prompt: true,
            kwargs,
        },
        logprobs,
        tool_choice,
    })
}

/// One message checked, with list content joined to text for the template.
fn message(i: usize, m: &Value, chars: &mut usize) -> Result<Value, RouterError> {
    let bad = |msg: String| RouterError::param("messages", format!("messages[{i}]: {msg}"));
    let Value::Object(m) = m else {
        return Err(bad("a message must be an object".into()));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) => r.as_str(),
        _ => return Err(bad("role is required and must be a string".into())),
    };
    if !matches!(role, "system" | "user" | "assistant" | "tool") {
        return Err(bad(format!(
            "role must be system, user, assistant or tool, got {role:?}"
        )));
    }
    if role == "tool" && !matches!(m.get("tool_call_id"), Some(Value::String(_))) {
        return Err(bad("a tool message needs a tool_call_id string".into()));
    }
    let has_tool_calls = matches!(m.get("tool_calls"), Some(Value::Array(a)) if !a.is_empty());
    let content = match get(m, "content") {
        None if role == "assistant" && has_tool_calls => Value::Null,
        None => return Err(bad("content is required".into())),
        Some(Value::String(s)) => {
            *chars += s.chars().count();
            Value::String(s.clone())
        }
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match kind {
                    "text" => match p.get("text") {
                        Some(Value::String(t)) if !t.is_empty() => {
                            *chars += t.chars().count();
                            text.push_str(t);
                        }
                        _ => {
                            return Err(bad(format!(
                                "content[{j}].text must be a non-empty string"
                            )))
                        }
                    },
                    kind if MEDIA_PARTS.contains(&kind) => {
                        return Err(bad(format!(
                            "content[{j}] is {kind}: this is a text model, media is not accepted \
                             (the router never reads a file or fetches a URL for a request)"
                        )))
                    }
                    other => return Err(bad(format!("content[{j}] has unknown type {other:?}"))),
                }
            }
            Value::String(text)
        }
        Some(_) => return Err(bad("content must be a string or a list of parts".into())),
    };
    let mut out = m.clone();
    out.insert("content".into(), content);
    if let Some(calls) = get(m, "tool_calls") {
        if role != "assistant" {
            return Err(bad("only an assistant message has tool_calls".into()));
        }
        out.insert("tool_calls".into(), tool_calls(calls).map_err(bad)?);
    }
    Ok(Value::Object(out))
}

/// An assistant message's `tool_calls`, checked, with each call's arguments as an object:
/// clients send them as JSON text, and templates such as Qwen2.5's write them with
/// `tojson`, which would quote that text a second time.
fn tool_calls(calls: &Value) -> Result<Value, String> {
    let Value::Array(list) = calls else {
        return Err("tool_calls must be a list".into());
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let mut call = call.clone();
        let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return Err(format!("tool_calls[{j}].function must be an object"));
        };
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(format!("tool_calls[{j}].function.name must be a string"));
        }
        if let Some(Value::String(text)) = f.get("arguments") {
            match serde_json::from_str::<Value>(text) {
                Ok(args @ Value::Object(_)) => {
                    f.insert("arguments".into(), args);
                }
                _ => {
                    return Err(format!(
                    "tool_calls[{j}].function.arguments must be a JSON object or text holding one"
                ))
                }
            }
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

/// A text completion's own parameters.
#[derive(Debug, Clone)]
pub struct Completion {
    pub prompt: String,
    /// `Some(k)`: report each token's logprob and its k best alternatives.
    pub logprobs: Option<usize>,
}

/// Checks `prompt` and the completions-only parameters.
pub fn completion(o: &Obj) -> Result<Completion, RouterError> {
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => {
            return Err(RouterError::param("prompt", "prompt must not be empty"))
        }
        Some(_) => return Err(RouterError::param("prompt", "prompt must be a string")),
        None => return Err(RouterError::param("prompt", "prompt is required")),
    };
    if prompt.chars().count() > MAX_CONTENT_CHARS {
        return Err(RouterError::param(
            "prompt",
            format!("prompt is longer than {MAX_CONTENT_CHARS} characters"),
        ));
    }
    Ok(Completion {
        prompt,
        logprobs: int_in(o, "logprobs", 0, 5)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn random_values_differ_within_and_across_threads() {
        let mine: std::collections::HashSet<u64> = (0..10_000).map(|_| random_u64()).collect();
        assert_eq!(mine.len(), 10_000, "a thread repeated a value");
        let theirs: Vec<u64> = std::thread::spawn(|| (0..100).map(|_| random_u64()).collect())
            .join()
            .unwrap();
        assert!(
            theirs.iter().all(|v| !mine.contains(v)),
            "two threads' generators overlap: seeded alike"
        );
    }

    fn rejected_param(v: Value) -> &'static str {
        match common(&obj(v), 1000) {
            Err(RouterError::InvalidParam { param, .. }) => param,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    #[test]
    fn ranges_are_the_seeds_ranges() {
        assert_eq!(
            rejected_param(json!({"model": "m", "temperature": 2.01})),
            "temperature"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "temperature": -0.1})),
            "temperature"
        );
        assert_eq!(rejected_param(json!({"model": "m", "top_p": 0.0})), "top_p");
        assert_eq!(rejected_param(json!({"model": "m", "top_p": 1.5})), "top_p");
        assert_eq!(rejected_param(json!({"model": "m", "top_k": -2})), "top_k");
        assert_eq!(
            rejected_param(json!({"model": "m", "repetition_penalty": 0})),
            "repetition_penalty"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "presence_penalty": 2.5})),
            "presence_penalty"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "max_tokens": 0})),
            "max_tokens"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "max_tokens": 2147483648u64})),
            "max_tokens"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "max_tokens": 1.5})),
            "max_tokens"
        );
        assert_eq!(rejected_param(json!({"model": "m", "seed": -1})), "seed");
        assert_eq!(
            rejected_param(json!({"model": "m", "stream": "yes"})),
            "stream"
        );
        assert_eq!(rejected_param(json!({"temperature": 1})), "model");
    }

    /// Every numeric parameter: values just inside its range pass, just outside get a 400
    /// that names it.
    #[test]
    fn boundary_table() {
        let table: &[(&str, &[Value], &[Value])] = &[
            (
                "temperature",
                &[json!(0), json!(2.0), json!(null)],
                &[json!(-1e-9), json!(2.000001)],
            ),
            (
                "top_p",
                &[json!(1e-6 + 1e-12), json!(1)],
                &[json!(1e-6), json!(1.0000001)],
            ),
            (
                "top_k",
                &[json!(-1), json!(0), json!(1), json!(2147483647)],
                &[json!(-2), json!(2147483648u64)],
            ),
            (
                "seed",
                &[json!(0), json!(u64::MAX)],
                &[json!(-1), json!(1.5)],
            ),
            (
                "presence_penalty",
                &[json!(-2), json!(2)],
                &[json!(-2.0001), json!(2.0001)],
            ),
            (
                "frequency_penalty",
                &[json!(-2), json!(2)],
                &[json!(-2.0001), json!(2.0001)],
            ),
            (
                "repetition_penalty",
                &[json!(1e-9), json!(2)],
                &[json!(0), json!(2.0001)],
            ),
            (
                "max_tokens",
                &[json!(1), json!(2147483647)],
                &[json!(0), json!(2147483648u64)],
            ),
            (
                "stream",
                &[json!(true), json!(false)],
                &[json!(1), json!("true")],
            ),
            ("ignore_eos", &[json!(true)], &[json!("no")]),
            ("skip_special_tokens", &[json!(false)], &[json!(0)]),
            ("include_stop_str_in_output", &[json!(true)], &[json!([])]),
        ];
        for (param, inside, outside) in table {
            let with = |v: &Value| {
                let mut body = obj(json!({"model": "m"}));
                body.insert(param.to_string(), v.clone());
                body
            };
            for v in *inside {
                assert!(common(&with(v), 1000).is_ok(), "{param} = {v} must pass");
            }
            for v in *outside {
                assert_eq!(
                    rejected_param(Value::Object(with(v))),
                    *param,
                    "{param} = {v}"
                );
            }
        }
        let chat_lp = |v: Value| {
            chat(&obj(
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": v}),
            ))
        };
        assert!(chat_lp(json!(0)).is_ok() && chat_lp(json!(20)).is_ok());
        assert!(chat_lp(json!(-1)).is_err() && chat_lp(json!(21)).is_err());
        let cmpl_lp = |v: Value| completion(&obj(json!({"prompt": "x", "logprobs": v})));
        assert!(cmpl_lp(json!(0)).is_ok() && cmpl_lp(json!(5)).is_ok());
        assert!(cmpl_lp(json!(-1)).is_err() && cmpl_lp(json!(6)).is_err());
    }

    #[test]
    fn edges_and_nulls_are_accepted() {
        let c = common(
            &obj(
                json!({"model": "m", "temperature": 2, "top_p": 1, "top_k": 5000,
                "seed": u64::MAX, "max_tokens": 2147483647, "presence_penalty": -2,
                "repetition_penalty": 2, "n": null, "best_of": 1, "stop": [],
                "top_logprobs": null, "stop_token_ids": [2, 13, 4294967296u64, "x"]}),
            ),
            1000,
        )
        .unwrap();
        assert_eq!(
            c.sampling.top_k, 1000,
            "top_k at or above the vocabulary is the vocabulary"
        );
        assert_eq!(c.sampling.seed, u64::MAX);
        assert_eq!(c.stop_token_ids, vec![2, 13], "non-int32 ids are ignored");
        assert_eq!(c.max_tokens, Some(2147483647));
    }

    #[test]
    fn n_best_of_and_beam_search_rules() {
        assert_eq!(
            rejected_param(json!({"model": "m", "n": 2, "temperature": 0})),
            "n"
        );
        assert_eq!(rejected_param(json!({"model": "m", "n": 129})), "n");
        assert_eq!(
            rejected_param(json!({"model": "m", "n": 3, "best_of": 2})),
            "best_of"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "stream": true, "n": 2, "best_of": 3})),
            "best_of"
        );
        assert_eq!(
            rejected_param(json!({"model": "m", "stream": true, "best_of": 2})),
            "best_of"
        );
        let ok = common(&obj(json!({"model": "m", "n": 2, "best_of": 4})), 1000).unwrap();
        assert_eq!((ok.n, ok.best_of), (2, 4));
        let ok = common(&obj(json!({"model": "m", "stream": true, "n": 3})), 1000).unwrap();
        assert_eq!((ok.n, ok.best_of), (3, 3));
        // Beam search: 002's example as written; best_of is not checked against n, and
        // the beam is as wide as the larger.
        let ok = common(
            &obj(
                json!({"model": "m", "prompt": "who are you", "temperature": 1,
                "max_tokens": 5, "use_beam_search": true, "ignore_eos": true, "n": 2,
                "best_of": 2, "stream": true, "logprobs": 2}),
            ),
            1000,
        )
        .unwrap();
        assert!(ok.beam);
        assert_eq!((ok.n, ok.best_of), (2, 2));
        let ok = common(
            &obj(json!({"model": "m", "use_beam_search": true, "n": 3, "best_of": 1, "stream": true})),
            1000,
        )
        .unwrap();
        assert_eq!((ok.n, ok.best_of), (3, 3));
        let ok = common(
            &obj(json!({"model": "m", "use_beam_search": true, "best_of": 4, "temperature": 0})),
            1000,
        )
        .unwrap();
        assert_eq!((ok.n, ok.best_of), (1, 4));
        for with in [json!({"stop": "x"}), json!({"stop_token_ids": [2]})] {
            let mut body = obj(json!({"model": "m", "use_beam_search": true}));
            body.extend(obj(with));
            assert_eq!(rejected_param(Value::Object(body)), "use_beam_search");
        }
        assert_eq!(
            rejected_param(json!({"model": "m", "use_beam_search": "yes"})),
            "use_beam_search"
        );
    }

    #[test]
    fn stop_strings_have_the_seeds_limits() {
        let stops = |v: Value| common(&obj(json!({"model": "m", "stop": v})), 1000);
        assert_eq!(stops(json!("x")).unwrap().stop, vec!["x"]);
        assert!(
            stops(json!([])).unwrap().stop.is_empty(),
            "an empty list means null"
        );
        assert!(stops(json!(vec!["a"; 1024])).is_ok());
        assert!(stops(json!(vec!["a"; 1025])).is_err());
        assert!(stops(json!(["x".repeat(1024)])).is_ok());
        assert!(stops(json!(["x".repeat(1025)])).is_err());
        assert!(stops(json!([""])).is_err());
        assert!(
            stops(json!(vec!["x".repeat(1000); 33])).is_err(),
            "32768 characters in all"
        );
        assert!(stops(json!([1])).is_err());
    }

    #[test]
    fn top_logprobs_turns_logprobs_on() {
        let lp = |v: Value| {
            let mut o = obj(json!({"messages": [{"role": "user", "content": "hi"}]}));
            o.extend(obj(v));
            chat(&o).map(|c| c.logprobs)
        };
        assert_eq!(lp(json!({})).unwrap(), None);
        assert_eq!(lp(json!({"top_logprobs": 3})).unwrap(), Some(3));
        assert_eq!(lp(json!({"logprobs": true})).unwrap(), Some(0));
        assert_eq!(
            lp(json!({"logprobs": false, "top_logprobs": null})).unwrap(),
            None
        );
        assert!(lp(json!({"top_logprobs": 21})).is_err());
        assert!(lp(json!({"logprobs": false, "top_logprobs": 2})).is_err());
        let c =
            |v: Value| completion(&obj(json!({"prompt": "p", "logprobs": v}))).map(|c| c.logprobs);
        assert_eq!(c(json!(5)).unwrap(), Some(5));
        assert!(c(json!(6)).is_err());
    }

    #[test]
    fn media_parts_and_bad_roles_are_named() {
        let bad = |m: Value| match chat(&obj(json!({"messages": m}))) {
            Err(RouterError::InvalidParam { message, .. }) => message,
            other => panic!("expected a rejection, got {other:?}"),
        };
        assert!(bad(json!([{"role": "user", "content": [{"type": "image_url", "image_url": "/etc/passwd"}]}]))
            .contains("image_url"));
        assert!(bad(json!([{"role": "robot", "content": "hi"}])).contains("role"));
        assert!(bad(json!([{"role": "tool", "content": "42"}])).contains("tool_call_id"));
        let ok = chat(&obj(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]}))).unwrap();
        assert_eq!(ok.input.messages[0]["content"], "ab");
    }

    /// Every field through which a request could name a file or a URL is refused with a
    /// 400 naming it; the router reads and fetches nothing for a request.
    #[test]
    fn nothing_in_a_request_names_a_file_or_url() {
        let url = "http://169.254.169.254/latest/meta-data/";
        for kind in MEDIA_PARTS {
            let part = json!({"type": kind, *kind: {"url": url}});
            match chat(&obj(
                json!({"messages": [{"role": "user", "content": [part]}]}),
            )) {
                Err(RouterError::InvalidParam { param, message }) => {
                    assert_eq!(param, "messages");
                    assert!(message.contains(kind), "{kind}: {message}");
                }
                other => panic!("{kind}: expected a rejection, got {other:?}"),
            }
        }
        for (extra, param) in [
            (json!({"chat_template": "/etc/passwd"}), "chat_template"),
            (
                json!({"web_search_options": {"search_context_size": "low"}}),
                "web_search_options",
            ),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema":
                    {"name": "x", "schema": {"$ref": "file:///etc/passwd"}}}}),
                "response_format",
            ),
            (json!({"response_format": "text"}), "response_format"),
        ] {
            let mut body = obj(json!({"model": "m"}));
            body.extend(obj(extra.clone()));
            assert_eq!(rejected_param(Value::Object(body)), param, "{extra}");
        }
        let text = obj(json!({"model": "m", "response_format": {"type": "text"}}));
        assert!(
            common(&text, 1000).is_ok(),
            "text is what is produced anyway"
        );

        let with_tool = |schema: Value| {
            chat(&obj(
                json!({"messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
            ))
        };
        for r in [url, "../../etc/passwd", "defs.json#/a", "/etc/passwd"] {
            for keyword in REF_KEYWORDS {
                let schema = json!({"type": "object",
                    "properties": {"a": {"items": [{keyword: r}]}}});
                match with_tool(schema) {
                    Err(RouterError::InvalidParam { param, message }) => {
                        assert_eq!(param, "tools");
                        assert!(message.contains(r), "{message}");
                    }
                    other => panic!("{keyword} {r}: expected a rejection, got {other:?}"),
                }
            }
        }
        let local = json!({"type": "object", "$defs": {"p": {"type": "string"}},
            "properties": {"$ref": {"$ref": "#/$defs/p"}}});
        assert!(
            with_tool(local).is_ok(),
            "references inside the schema, and a property named $ref, are fine"
        );

        for var in TEMPLATE_VARIABLES {
            let body = json!({"messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {var: [{"role": "user", "content":
                    [{"type": "image_url", "image_url": {"url": url}}]}]}});
            match chat(&obj(body)) {
                Err(RouterError::InvalidParam { param, message }) => {
                    assert_eq!(param, "chat_template_kwargs");
                    assert!(message.contains(var), "{message}");
                }
                other => panic!("{var}: expected a rejection, got {other:?}"),
            }
        }
    }

    #[test]
    fn tools_and_tool_choice_are_checked() {
        let weather = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object"}}}]);
        let ask = |extra: Value| {
            let mut o = obj(json!({"messages": [{"role": "user", "content": "hi"}]}));
            o.extend(obj(extra));
            chat(&o)
        };
        let param = |extra: Value| match ask(extra) {
            Err(RouterError::InvalidParam { param, message }) => (param, message),
            other => panic!("expected a rejection, got {other:?}"),
        };
        let ok = ask(json!({"tools": weather})).unwrap();
        assert_eq!(
            ok.tool_choice,
            ToolChoice::Auto,
            "auto is the default with tools"
        );
        assert_eq!(ok.input.tools, Some(weather.clone()));
        let none = ask(json!({"tools": weather, "tool_choice": "none"})).unwrap();
        assert_eq!(
            (none.tool_choice, none.input.tools),
            (ToolChoice::None, None)
        );
        let empty = ask(json!({"tools": [], "tool_choice": "auto"})).unwrap();
        assert_eq!(
            (empty.tool_choice, empty.input.tools),
            (ToolChoice::None, None)
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            ask(json!({"tools": weather, "tool_choice": named}))
                .unwrap()
                .tool_choice,
            ToolChoice::Named("get_weather".into())
        );
        assert_eq!(
            ask(json!({"tools": weather, "tool_choice": "required"}))
                .unwrap()
                .tool_choice,
            ToolChoice::Required
        );
        for (bad, param_name, says) in [
            (json!({"tools": {}}), "tools", "list"),
            (
                json!({"tools": [{"type": "retrieval"}]}),
                "tools",
                "tools[0].type",
            ),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools",
                "tools[0].function",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
                "tools",
                "name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools",
                "parameters",
            ),
            (
                json!({"tool_choice": "required"}),
                "tool_choice",
                "requires tools",
            ),
            (
                json!({"tool_choice": named}),
                "tool_choice",
                "requires tools",
            ),
            (
                json!({"tools": weather, "tool_choice": "always"}),
                "tool_choice",
                "always",
            ),
            (
                json!({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice",
                "not in tools",
            ),
            (
                json!({"chat_template_kwargs": {"enable_thinking": "yes"}}),
                "chat_template_kwargs",
                "enable_thinking",
            ),
        ] {
            let (p, m) = param(bad.clone());
            assert_eq!(p, param_name, "{bad}");
            assert!(m.contains(says), "{bad}: {m}");
        }
    }

    #[test]
    fn assistant_tool_calls_reach_the_template_as_objects() {
        let history = |args: Value| {
            chat(&obj(json!({"messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]})))
        };
        let c = history(json!("{\"location\": \"Paris\"}")).unwrap();
        assert_eq!(
            c.input.messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({"location": "Paris"})
        );
        assert!(history(json!({"location": "Paris"})).is_ok());
        assert!(history(json!("not json")).is_err());
        let on_user = chat(&obj(json!({"messages": [
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}
        ]})));
        assert!(on_user.is_err());
    }
}
