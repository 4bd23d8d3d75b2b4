//! The calls in each format's block of output. Arguments come out as the reference
//! parsers give them: re-serialised as Python's `json.dumps` writes them where the model
//! wrote them inside a JSON call (vLLM's Hermes, Llama 3 and Mistral parsers), as written
//! where they stand alone (DeepSeek's fences, Mistral's `[ARGS]`).

use serde_json::Value;

use super::{ToolCall, ARGS, CALL_ID, DS_CALL_CLOSE, DS_CALL_OPEN, DS_SEP, PYTHON_TAG, TOOL_CALLS};

/// `{"name": …, "arguments": {…}}`.
pub(super) fn hermes(block: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    json_call(&v, "arguments")
}

/// A call written as one JSON object: its name, and its arguments under `key` (or the
/// other of `arguments` and `parameters`, which models mix up), an object or absent.
fn json_call(v: &Value, key: &str) -> Option<ToolCall> {
    let name = v.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let other = if key == "arguments" {
        "parameters"
    } else {
        "arguments"
    };
    let args = v.get(key).or_else(|| v.get(other));
    let arguments = match args {
        None => "{}".to_string(),
        Some(a @ Value::Object(_)) => crate::py_json(a),
        // Mistral's models and clients also give the arguments as JSON text.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            a @ Value::Object(_) => crate::py_json(&a),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// DeepSeek's calls: an unfinished call inside an unclosed block is dropped only when
/// complete ones came before it.
pub(super) fn deepseek(block: &str, closed: bool) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = block;
    while let Some(start) = rest.find(DS_CALL_OPEN) {
        let after = &rest[start + DS_CALL_OPEN.len()..];
        let Some(end) = after.find(DS_CALL_CLOSE) else {
            if closed || calls.is_empty() {
                return None;
            }
            break;
        };
        calls.push(deepseek_call(&after[..end])?);
        rest = &after[end + DS_CALL_CLOSE.len()..];
    }
    (!calls.is_empty()).then_some(calls)
}

/// One DeepSeek call: `function<｜tool▁sep｜>name\n```json\n{…}\n```` (V3, R1) or
/// `name<｜tool▁sep｜>{…}` (V3.1).
fn deepseek_call(call: &str) -> Option<ToolCall> {
    let (left, right) = call.split_once(DS_SEP)?;
    let (name, args) = match right.split_once("```") {
        Some((name, fenced)) => {
            let body = fenced.strip_prefix("json").unwrap_or(fenced);
            let body = body.rsplit_once("```").map_or(body, |(b, _)| b);
            (name.trim(), body.trim())
        }
        None => (left.trim(), right.trim()),
    };
    standalone(name, args)
}

/// A call whose arguments stand alone: a name and a JSON object.
fn standalone(name: &str, args: &str) -> Option<ToolCall> {
    if name.is_empty() || !serde_json::from_str::<Value>(args).ok()?.is_object() {
        return None;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    })
}

/// Llama 3's reply: JSON calls joined by `;` (vLLM's `llama3_json` reads the same), after
/// a `<|python_tag|>` where the model wrote one. Anything else in the reply and it is not
/// a call: a model asked for JSON answers with an object too.
pub(super) fn llama3(block: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = block.trim_start().trim_start_matches(PYTHON_TAG);
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        if !calls.is_empty() {
            rest = rest.strip_prefix(';')?.trim_start();
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(json_call(&value, "parameters")?);
        rest = &rest[values.byte_offset()..];
    }
    (!calls.is_empty()).then_some(calls)
}

/// Mistral's reply from its first `[TOOL_CALLS]`: a JSON list of calls (v3 tokenizers), or
/// one `name[ARGS]{…}` (with `[CALL_ID]id` before `[ARGS]` in the v7 form) after each
/// `[TOOL_CALLS]` (v11 and later).
pub(super) fn mistral(block: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for part in block.split(TOOL_CALLS).skip(1) {
        let part = part.trim();
        match part.split_once(ARGS) {
            Some((name, args)) => {
                let name = name.split_once(CALL_ID).map_or(name, |(n, _)| n);
                calls.push(standalone(name.trim(), args.trim())?);
            }
            None => match serde_json::from_str::<Value>(part).ok()? {
                Value::Array(list) => {
                    for v in &list {
                        calls.push(json_call(v, "arguments")?);
                    }
                }
                v @ Value::Object(_) => calls.push(json_call(&v, "arguments")?),
                _ => return None,
            },
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// Phi-4-mini's block: a JSON list of calls, or the calls' objects joined by commas
/// without the list (which the model also writes).
pub(super) fn phi4_mini(block: &str) -> Option<Vec<ToolCall>> {
    let t = block.trim();
    let listed = if t.starts_with('[') {
        t.to_string()
    } else {
        format!("[{t}]")
    };
    let Value::Array(list) = serde_json::from_str::<Value>(&listed).ok()? else {
        return None;
    };
    let calls = list
        .iter()
        .map(|v| json_call(v, "arguments"))
        .collect::<Option<Vec<_>>>()?;
    (!calls.is_empty()).then_some(calls)
}
