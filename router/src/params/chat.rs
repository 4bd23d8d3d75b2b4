//! A chat request's own parameters: messages (checked, list content joined to text, media
//! refused), tools and tool_choice, logprobs, and the template's kwargs.

use proto::limits::MAX_TOP_LOGPROBS;
use serde_json::{Map, Value};

use super::{external_ref, int_in, MAX_CONTENT_CHARS, MAX_MESSAGES, MAX_TOOLS};
use crate::api::chat::ChatRequest;
use crate::api::json::JsonBudget;
use crate::api::Param;
use crate::error::RouterError;

/// Content part types that carry media, by URL, path, file id or inline data: this is a
/// text model, and no request makes the router read a file or open a connection.
pub(super) const MEDIA_PARTS: &[&str] = &[
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

/// Variables the router gives the chat template itself: a kwarg that replaced them would
/// slip messages and tools past their checks.
pub(super) const TEMPLATE_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

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

impl ToolChoice {
    /// How the request wrote it, for errors.
    pub fn name(&self) -> &str {
        match self {
            ToolChoice::None => "none",
            ToolChoice::Auto => "auto",
            ToolChoice::Required => "required",
            ToolChoice::Named(n) => n,
        }
    }
}

/// `tools`: a list of `{"type": "function", "function": {"name", ...}}`; an empty list
/// means none.
fn tools(tools: &Param<Vec<Value>>) -> Result<Option<Vec<Value>>, RouterError> {
    let bad = |m: String| RouterError::param("tools", m);
    let list = match tools {
        Param::Absent | Param::Null => return Ok(None),
        Param::Valid(l) if l.is_empty() => return Ok(None),
        Param::Valid(l) if l.len() > MAX_TOOLS => {
            return Err(bad(format!(
                "tools has {} entries, the limit is {MAX_TOOLS}",
                l.len()
            )))
        }
        Param::Valid(l) => l,
        Param::Invalid => return Err(bad("tools must be a list".into())),
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
            if f.get(key).is_some_and(|v| !v.is_null() && !ok(v)) {
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
fn tool_choice(choice: &Param<Value>, tools: Option<&[Value]>) -> Result<ToolChoice, RouterError> {
    let bad = |m: String| RouterError::param("tool_choice", m);
    let choice = match choice {
        Param::Absent | Param::Null => ToolChoice::Auto,
        Param::Valid(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"
                )))
            }
        },
        Param::Valid(Value::Object(c)) => {
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
        Param::Valid(_) | Param::Invalid => {
            return Err(bad("tool_choice must be a string or an object".into()))
        }
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

/// Checks `messages` and the chat-only parameters; JSON text inside them (tool calls'
/// arguments) is parsed within what is left of `json`.
pub fn chat(o: ChatRequest, json: &JsonBudget) -> Result<Chat, RouterError> {
    let messages = match o.messages {
        Param::Valid(m) if m.len() > MAX_MESSAGES => {
            return Err(RouterError::param(
                "messages",
                format!(
                    "messages has {} entries, the limit is {MAX_MESSAGES}",
                    m.len()
                ),
            ))
        }
        Param::Valid(m) if !m.is_empty() => m,
        Param::Valid(_) => {
            return Err(RouterError::param("messages", "messages must not be empty"))
        }
        Param::Null | Param::Invalid => {
            return Err(RouterError::param("messages", "messages must be a list"))
        }
        Param::Absent => return Err(RouterError::param("messages", "messages is required")),
    };
    let mut chars = 0;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        out.push(message(i, m, &mut chars, json)?);
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
    let tools = tools(&o.tools)?;
    let tool_choice = tool_choice(&o.tool_choice, tools.as_deref())?;
    let top = int_in(&o.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS as i128)?;
    // The seeds: a valid top_logprobs without logprobs turns logprobs on.
    let logprobs = match (o.logprobs.value("logprobs")?, top) {
        (None, top) => top,
        (Some(true), top) => Some(top.unwrap_or(0)),
        (Some(false), Some(k)) if k > 0 => {
            return Err(RouterError::param(
                "top_logprobs",
                "top_logprobs needs logprobs to be true",
            ))
        }
        _ => None,
    };
    let kwargs = match &o.chat_template_kwargs {
        Param::Absent | Param::Null => Map::new(),
        Param::Valid(k) => k.clone(),
        Param::Invalid => {
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
    // OpenAI's default (true) is what the parsers do: every call in the reply is returned.
    if let Some(false) = o.parallel_tool_calls.value("parallel_tool_calls")? {
        return Err(RouterError::param(
            "parallel_tool_calls",
            "parallel_tool_calls false is not supported: every call the model writes is returned",
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

/// One message checked, with list content joined to text for the template. The message
/// is taken, not copied: its strings may be most of a 20 MiB body.
fn message(i: usize, m: Value, chars: &mut usize, json: &JsonBudget) -> Result<Value, RouterError> {
    let bad = |msg: String| RouterError::param("messages", format!("messages[{i}]: {msg}"));
    let Value::Object(mut m) = m else {
        return Err(bad("a message must be an object".into()));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) => r.clone(),
        _ => return Err(bad("role is required and must be a string".into())),
    };
    if !matches!(role.as_str(), "system" | "user" | "assistant" | "tool") {
        return Err(bad(format!(
            "role must be system, user, assistant or tool, got {role:?}"
        )));
    }
    if role == "tool" && !matches!(m.get("tool_call_id"), Some(Value::String(_))) {
        return Err(bad("a tool message needs a tool_call_id string".into()));
    }
    let has_tool_calls = matches!(m.get("tool_calls"), Some(Value::Array(a)) if !a.is_empty());
    let content = match m.remove("content").filter(|c| !c.is_null()) {
        None if role == "assistant" && has_tool_calls => Value::Null,
        None => return Err(bad("content is required".into())),
        Some(Value::String(s)) => {
            *chars += s.chars().count();
            Value::String(s)
        }
        Some(Value::Array(parts)) => Value::String(joined(&parts, chars, &bad)?),
        Some(_) => return Err(bad("content must be a string or a list of parts".into())),
    };
    m.insert("content".into(), content);
    if let Some(calls) = m.remove("tool_calls").filter(|c| !c.is_null()) {
        if role != "assistant" {
            return Err(bad("only an assistant message has tool_calls".into()));
        }
        m.insert("tool_calls".into(), tool_calls(calls, json, bad)?);
    }
    Ok(Value::Object(m))
}

/// List content's text parts joined, counted into `chars`; media and unknown parts are
/// refused.
fn joined(
    parts: &[Value],
    chars: &mut usize,
    bad: &impl Fn(String) -> RouterError,
) -> Result<String, RouterError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "text" => match p.get("text") {
                Some(Value::String(t)) if !t.is_empty() => {
                    *chars += t.chars().count();
                    text.push_str(t);
                }
                _ => return Err(bad(format!("content[{j}].text must be a non-empty string"))),
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
    Ok(text)
}

/// An assistant message's `tool_calls`, checked, with each call's arguments as an object:
/// clients send them as JSON text, and templates such as Qwen2.5's write them with
/// `tojson`, which would quote that text a second time.
fn tool_calls(
    calls: Value,
    json: &JsonBudget,
    bad: impl Fn(String) -> RouterError,
) -> Result<Value, RouterError> {
    let Value::Array(mut list) = calls else {
        return Err(bad("tool_calls must be a list".into()));
    };
    for (j, call) in list.iter_mut().enumerate() {
        let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return Err(bad(format!("tool_calls[{j}].function must be an object")));
        };
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(bad(format!(
                "tool_calls[{j}].function.name must be a string"
            )));
        }
        let not_object = || {
            bad(format!(
                "tool_calls[{j}].function.arguments must be a JSON object or text holding one"
            ))
        };
        if let Some(Value::String(text)) = f.get("arguments") {
            match json.text(text).map_err(|e| e.or_syntax(|_| not_object()))? {
                args @ Value::Object(_) => {
                    f.insert("arguments".into(), args);
                }
                _ => return Err(not_object()),
            }
        }
    }
    Ok(Value::Array(list))
}
