//! Tool calls: the markup each chat template teaches (Hermes', DeepSeek's, Llama 3's JSON,
//! Mistral's `[TOOL_CALLS]`, Phi-4-mini's `<|tool_call|>`), the calls parsed out of it, and rendering a chat whose
//! assistant turns hold calls, which templates disagree on; and the generic format, for
//! templates that teach none.

use serde_json::Value;

mod calls;
mod ids;
mod phi4;
mod prompted;
pub use ids::{base62_id, mistral_ids, nine_char_id};
pub use phi4::phi4_mini_messages;
pub use prompted::{prompted, render_prompted};

pub(crate) const DS_CALLS_OPEN: &str = "<｜tool▁calls▁begin｜>";
pub(crate) const DS_CALL_OPEN: &str = "<｜tool▁call▁begin｜>";
pub(crate) const DS_CALL_CLOSE: &str = "<｜tool▁call▁end｜>";
pub(crate) const DS_SEP: &str = "<｜tool▁sep｜>";
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
pub(crate) const TOOL_CALLS: &str = "[TOOL_CALLS]";
pub(crate) const ARGS: &str = "[ARGS]";
pub(crate) const CALL_ID: &str = "[CALL_ID]";
pub(crate) const PHI_CALL_OPEN: &str = "<|tool_call|>";
pub(crate) const PHI_CALL_CLOSE: &str = "<|/tool_call|>";
/// The tool-call markup a model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen2.5 and Qwen3 (Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
    /// DeepSeek-V3 and R1: calls inside `<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>`, each
    /// `function<｜tool▁sep｜>name` and its arguments in a json fence (V3.1 writes
    /// `name<｜tool▁sep｜>{…}`; both parse).
    DeepSeek,
    /// Llama 3.1 to 3.3: the whole reply is `{"name": …, "parameters": {…}}` (after
    /// `<|python_tag|>` where the model writes one), several calls joined by `;`.
    Llama3Json,
    /// Mistral with v3 tokenizers (Mistral-7B-v0.3, Nemo, Mixtral-8x22B):
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` to the end of the reply.
    Mistral,
    /// Mistral with v11 and later tokenizers (Mistral Small 3.2, Devstral, Ministral 3):
    /// `[TOOL_CALLS]name[ARGS]{…}` per call. Both Mistral forms parse in either variant;
    /// they differ in how a forced call is opened.
    MistralArgs,
    /// Phi-4-mini: `<|tool_call|>[{"name": …, "arguments": {…}}, …]<|/tool_call|>`, the
    /// closing often left out. Its template renders tools only from the system message's
    /// `tools` text ([`phi4_mini_messages`] puts them there).
    Phi4Mini,
}

/// Where a call starts in the output: `tag`, which is part of the call's text when
/// `in_block` (Llama 3's `{`, Mistral's `[TOOL_CALLS]`, which the calls after it repeat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Opener {
    pub(crate) tag: &'static str,
    pub(crate) in_block: bool,
}

/// The JSON a forced call is written as after the prompt's opening, which a grammar can
/// hold to the tools' schemas: the key the arguments go under, and whether the calls are a
/// list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallJson {
    pub arguments_key: &'static str,
    pub list: bool,
}

impl ToolFormat {
    /// The format a chat template teaches, found by the markup it renders.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if template.contains("tool▁calls▁begin") {
            Some(Self::DeepSeek)
        } else if template.contains(TOOL_CALLS) {
            Some(if template.contains(ARGS) {
                Self::MistralArgs
            } else {
                Self::Mistral
            })
        } else if template.contains("\"parameters\": dictionary of argument name") {
            Some(Self::Llama3Json)
        } else if template.contains("<|tool|>") && template.contains("message['tools']") {
            Some(Self::Phi4Mini)
        } else {
            None
        }
    }

    /// The markup that opens calls; Llama 3's bare `{` only where the reply starts.
    pub(crate) fn openers(self, at_start: bool) -> Vec<Opener> {
        let tag = |tag, in_block| Opener { tag, in_block };
        match self {
            Self::Hermes => vec![tag("<tool_call>", false)],
            Self::DeepSeek => vec![tag(DS_CALLS_OPEN, false)],
            Self::Llama3Json if at_start => vec![tag(PYTHON_TAG, false), tag("{", true)],
            Self::Llama3Json => vec![tag(PYTHON_TAG, false)],
            Self::Mistral | Self::MistralArgs => vec![tag(TOOL_CALLS, true)],
            Self::Phi4Mini => vec![tag(PHI_CALL_OPEN, false)],
        }
    }

    /// The markup that closes calls; `None` where they run to the end of the reply.
    pub(crate) fn close(self) -> Option<&'static str> {
        match self {
            Self::Hermes => Some("</tool_call>"),
            Self::DeepSeek => Some("<｜tool▁calls▁end｜>"),
            Self::Phi4Mini => Some(PHI_CALL_CLOSE),
            Self::Llama3Json | Self::Mistral | Self::MistralArgs => None,
        }
    }

    /// The special tokens the format marks calls with. Decoding drops special tokens
    /// (`skip_special_tokens`), so these must be kept in the text the parser reads.
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            Self::Hermes | Self::DeepSeek => &[],
            Self::Llama3Json => &[PYTHON_TAG],
            Self::Mistral | Self::MistralArgs => &[TOOL_CALLS, ARGS, CALL_ID],
            Self::Phi4Mini => &[PHI_CALL_OPEN, PHI_CALL_CLOSE],
        }
    }

    /// The JSON a forced call is written as, where a grammar holds it (`None` where the
    /// call is in markup a JSON grammar cannot write, and the prompt alone forces it).
    pub fn call_json(self) -> Option<CallJson> {
        let json = |arguments_key, list| {
            Some(CallJson {
                arguments_key,
                list,
            })
        };
        match self {
            Self::Hermes => json("arguments", false),
            Self::Llama3Json => json("parameters", false),
            Self::Mistral | Self::Phi4Mini => json("arguments", true),
            Self::DeepSeek | Self::MistralArgs => None,
        }
    }

    /// The chat as this format's template takes it, where that differs from the request:
    /// Mistral's templates refuse call ids that are not nine letters and digits, and
    /// Phi-4-mini's renders tools and tool turns only in places of its own.
    pub fn adapt(self, input: &crate::ChatInput) -> Option<crate::ChatInput> {
        match self {
            Self::Mistral | Self::MistralArgs => Some(crate::ChatInput {
                messages: mistral_ids(&input.messages),
                ..input.clone()
            }),
            Self::Phi4Mini => Some(phi4_mini_messages(input)),
            Self::Hermes | Self::DeepSeek | Self::Llama3Json => None,
        }
    }

    /// Whether the model's template asks for call ids of nine letters and digits.
    pub fn nine_char_ids(self) -> bool {
        matches!(self, Self::Mistral | Self::MistralArgs)
    }

    /// What forces a tool call when the request requires one (`name` for a named
    /// function): the text appended to the prompt, and the part of it the parser reads as
    /// the start of the call.
    pub fn forced(self, name: Option<&str>) -> (String, String) {
        let quoted = |n: &str| crate::py_json(&Value::from(n));
        match (self, name) {
            (Self::Hermes, None) => ("<tool_call>\n".into(), "\n".into()),
            (Self::Hermes, Some(n)) => {
                let body = format!("\n{{\"name\": {}, \"arguments\": ", quoted(n));
                (format!("<tool_call>{body}"), body)
            }
            (Self::DeepSeek, None) => (
                format!("{DS_CALLS_OPEN}{DS_CALL_OPEN}"),
                DS_CALL_OPEN.to_string(),
            ),
            (Self::DeepSeek, Some(n)) => {
                let body = format!("{DS_CALL_OPEN}function{DS_SEP}{n}\n```json\n");
                (format!("{DS_CALLS_OPEN}{body}"), body)
            }
            (Self::Llama3Json, None) => (String::new(), String::new()),
            (Self::Llama3Json, Some(n)) => {
                both(format!("{{\"name\": {}, \"parameters\": ", quoted(n)))
            }
            (Self::Mistral | Self::MistralArgs, None) => both(TOOL_CALLS.to_string()),
            (Self::Mistral, Some(n)) => both(format!(
                "{TOOL_CALLS}[{{\"name\": {}, \"arguments\": ",
                quoted(n)
            )),
            (Self::MistralArgs, Some(n)) => both(format!("{TOOL_CALLS}{n}{ARGS}")),
            (Self::Phi4Mini, None) => (PHI_CALL_OPEN.into(), String::new()),
            (Self::Phi4Mini, Some(n)) => {
                let body = format!("[{{\"name\": {}, \"arguments\": ", quoted(n));
                (format!("{PHI_CALL_OPEN}{body}"), body)
            }
        }
    }

    /// The calls in a block of output (from its opening, kept where it is part of the
    /// block, to the closing tag or the end: `closed` false when the output ended before a
    /// closing tag), or `None` when it does not parse.
    pub(crate) fn parse(self, block: &str, closed: bool) -> Option<Vec<ToolCall>> {
        match self {
            Self::Hermes => calls::hermes(block).map(|c| vec![c]),
            Self::DeepSeek => calls::deepseek(block, closed),
            Self::Llama3Json => calls::llama3(block),
            Self::Mistral | Self::MistralArgs => calls::mistral(block),
            Self::Phi4Mini => calls::phi4_mini(block),
        }
    }
}

/// A forced opening that the prompt ends with and the parser starts from alike.
fn both(body: String) -> (String, String) {
    (body.clone(), body)
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
mod tests;
