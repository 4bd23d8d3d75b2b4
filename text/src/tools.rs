//! Tool calls: the markup each chat template teaches (Hermes', DeepSeek's), the calls
//! parsed out of it, and rendering a chat whose assistant turns hold calls, which templates
//! disagree on; and the generic format, for templates that teach none.

use serde_json::Value;

mod prompted;
pub use prompted::prompted;

pub(crate) const DS_CALL_OPEN: &str = "<｜tool▁call▁begin｜>";
pub(crate) const DS_CALL_CLOSE: &str = "<｜tool▁call▁end｜>";
pub(crate) const DS_SEP: &str = "<｜tool▁sep｜>";

/// The tool-call markup a model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen2.5 and Qwen3 (Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
    /// DeepSeek-V3 and R1: calls inside `<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>`, each
    /// `function<｜tool▁sep｜>name` and its arguments in a json fence (V3.1 writes
    /// `name<｜tool▁sep｜>{…}`; both parse).
    DeepSeek,
}

impl ToolFormat {
    /// The format a chat template teaches, found by the markup it renders.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if template.contains("tool▁calls▁begin") {
            Some(Self::DeepSeek)
        } else {
            None
        }
    }

    pub(crate) fn open(self) -> &'static str {
        match self {
            Self::Hermes => "<tool_call>",
            Self::DeepSeek => "<｜tool▁calls▁begin｜>",
        }
    }

    pub(crate) fn close(self) -> &'static str {
        match self {
            Self::Hermes => "</tool_call>",
            Self::DeepSeek => "<｜tool▁calls▁end｜>",
        }
    }

    /// What forces a tool call when the request requires one (`name` for a named
    /// function): the text appended to the prompt, and the part of it after the opening
    /// tag, which the parser reads as the start of the call.
    pub fn forced(self, name: Option<&str>) -> (String, String) {
        let body = match (self, name) {
            (Self::Hermes, None) => "\n".to_string(),
            (Self::Hermes, Some(n)) => format!(
                "\n{{\"name\": {}, \"arguments\": ",
                crate::py_json(&Value::from(n))
            ),
            (Self::DeepSeek, None) => DS_CALL_OPEN.to_string(),
            (Self::DeepSeek, Some(n)) => format!("{DS_CALL_OPEN}function{DS_SEP}{n}\n```json\n"),
        };
        (format!("{}{body}", self.open()), body)
    }

    /// The calls in the text between an opening and a closing tag (`closed` false when the
    /// output ended first), or `None` when it does not parse.
    pub(crate) fn parse(self, block: &str, closed: bool) -> Option<Vec<ToolCall>> {
        match self {
            Self::Hermes => hermes_call(block).map(|c| vec![c]),
            Self::DeepSeek => {
                let mut calls = Vec::new();
                let mut rest = block;
                while let Some(start) = rest.find(DS_CALL_OPEN) {
                    let after = &rest[start + DS_CALL_OPEN.len()..];
                    let Some(end) = after.find(DS_CALL_CLOSE) else {
                        // An unfinished call inside an unclosed block is dropped only
                        // when complete ones came before it.
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
        }
    }
}

/// `{"name": …, "arguments": {…}}`; arguments come out as Python's `json.dumps` writes
/// them, as vLLM's parser gives them.
fn hermes_call(block: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let name = v.get("name")?.as_str().filter(|n| !n.is_empty())?;
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.map_or_else(|| "{}".to_string(), crate::py_json),
    })
}

/// One DeepSeek call: `function<｜tool▁sep｜>name\n```json\n{…}\n```` (V3, R1) or
/// `name<｜tool▁sep｜>{…}` (V3.1); arguments are kept as the model wrote them.
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
    if name.is_empty() {
        return None;
    }
    serde_json::from_str::<Value>(args).ok()?;
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    })
}

/// A function call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// Renders a chat. Templates disagree on the assistant turns that call tools: Hugging
/// Face's convention, arguments as objects and content null, is tried first (Qwen2.5 writes
/// arguments with `tojson`, DeepSeek-V3 renders calls only when content is null); a template
/// that fails on it gets the arguments as JSON text (DeepSeek-V3 joins them as text), then
/// empty content instead of null (Qwen3 searches the content for `</think>`), then both.
pub fn render(template: &crate::ChatTemplate, input: &crate::ChatInput) -> crate::Result<String> {
    let first = match template.render(input) {
        Ok(text) => return Ok(text),
        Err(e) => e,
    };
    for (text_args, empty_content) in [(true, false), (false, true), (true, true)] {
        let mut messages = input.messages.clone();
        let mut changed = false;
        for m in messages.as_array_mut().into_iter().flatten() {
            let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else {
                continue;
            };
            for args in calls
                .iter_mut()
                .filter_map(|c| c.pointer_mut("/function/arguments"))
            {
                if text_args && !args.is_string() {
                    *args = Value::String(crate::py_json(args));
                    changed = true;
                }
            }
            if empty_content && m.get("content").is_none_or(Value::is_null) {
                m["content"] = Value::String(String::new());
                changed = true;
            }
        }
        if !changed {
            continue;
        }
        let retry = crate::ChatInput {
            messages,
            ..input.clone()
        };
        if let Ok(text) = template.render(&retry) {
            return Ok(text);
        }
    }
    Err(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_the_format_a_template_teaches() {
        assert_eq!(
            ToolFormat::detect(crate::CHATML_TEMPLATE),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect("{{'<｜tool▁calls▁begin｜>'}}"),
            Some(ToolFormat::DeepSeek)
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), None);
    }
}
