//! The generic tool format, for a chat template that teaches none (SmolLM2's): the router
//! writes the chat's tools and tool turns into plain messages, exactly as Qwen's templates
//! render them, so that any template renders the same prompt and the model answers in the
//! Hermes markup (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`) that
//! [`ToolFormat::Hermes`](super::ToolFormat::Hermes) parses. Qwen's wording is kept because
//! it is the most widely trained-on tool prompt, which is what a small model needs.

use serde_json::{json, Value};

use crate::{py_json, ChatInput, ChatTemplate};

const TOOLS_OPEN: &str = "# Tools\n\nYou may call one or more functions to assist with the \
    user query.\n\nYou are provided with function signatures within <tools></tools> XML \
    tags:\n<tools>";
const TOOLS_CLOSE: &str = "\n</tools>\n\nFor each function call, return a json object with \
    function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
    {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// `input` with its tools written into the system turn (after the request's own system
/// text), each assistant turn's calls into `<tool_call>` blocks of its content, and each
/// run of tool results into one user turn of `<tool_response>` blocks. The result has no
/// `tools` and only text content, which every chat template renders.
pub fn prompted(input: &ChatInput) -> ChatInput {
    let messages = input.messages.as_array().map_or(&[][..], Vec::as_slice);
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if let Some(tools) = input.tools.as_ref().and_then(Value::as_array) {
        let mut system = String::new();
        if let Some((first, after)) = messages.split_first() {
            if first["role"] == "system" {
                system = format!("{}\n\n", text(&first["content"]));
                rest = after;
            }
        }
        system.push_str(TOOLS_OPEN);
        for tool in tools {
            system.push('\n');
            system.push_str(&py_json(tool));
        }
        system.push_str(TOOLS_CLOSE);
        out.push(json!({"role": "system", "content": system}));
    }
    // The user turn of tool results being written, appended to in place: joining each
    // result to a copy of the ones before it made a run of results quadratic.
    let mut results: Option<String> = None;
    for m in rest {
        let role = m["role"].as_str().unwrap_or("");
        if role == "tool" {
            let turn = results.get_or_insert_with(String::new);
            if !turn.is_empty() {
                turn.push('\n');
            }
            turn.push_str("<tool_response>\n");
            turn.push_str(text(&m["content"]));
            turn.push_str("\n</tool_response>");
            continue;
        }
        if let Some(turn) = results.take() {
            out.push(json!({"role": "user", "content": turn}));
        }
        let mut m = m.clone();
        if let Some(turn) = m.as_object_mut() {
            let calls = turn.remove("tool_calls");
            if role == "assistant" {
                let content = with_calls(text(&turn["content"]), calls.as_ref());
                turn.insert("content".into(), Value::String(content));
            }
        }
        out.push(m);
    }
    if let Some(turn) = results {
        out.push(json!({"role": "user", "content": turn}));
    }
    ChatInput {
        messages: Value::Array(out),
        tools: None,
        add_generation_prompt: input.add_generation_prompt,
        kwargs: input.kwargs.clone(),
    }
}

/// Renders `input` in the generic format. A template that refuses a system turn (Gemma
/// 2's: "System role not supported") gets the system text at the head of the first user
/// turn, separated by a blank line, which is where Gemma 3's template puts it: the tools
/// must reach the prompt, and a request's own system text should too.
pub fn render_prompted(template: &ChatTemplate, input: &ChatInput) -> crate::Result<String> {
    let prompted = prompted(input);
    let refused = match template.render(&prompted) {
        Ok(text) => return Ok(text),
        Err(e) => e,
    };
    match system_in_first_user(&prompted) {
        Some(merged) => template.render(&merged).map_err(|_| refused),
        None => Err(refused),
    }
}

/// `input` with a leading system turn joined to the user turn after it, if there are both.
fn system_in_first_user(input: &ChatInput) -> Option<ChatInput> {
    let messages = input.messages.as_array()?;
    let (system, rest) = messages.split_first()?;
    let (user, rest) = rest.split_first()?;
    if system["role"] != "system" || user["role"] != "user" {
        return None;
    }
    let mut joined = user.clone();
    joined["content"] = Value::String(format!(
        "{}\n\n{}",
        text(&system["content"]),
        text(&user["content"])
    ));
    let messages = std::iter::once(joined)
        .chain(rest.iter().cloned())
        .collect();
    Some(ChatInput {
        messages: Value::Array(messages),
        ..input.clone()
    })
}

/// An assistant turn's text followed by its calls, each on its own line.
fn with_calls(content: &str, calls: Option<&Value>) -> String {
    let mut out = content.to_string();
    for (i, call) in calls
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        if i > 0 || !content.is_empty() {
            out.push('\n');
        }
        let call = call.get("function").unwrap_or(call);
        let arguments = match &call["arguments"] {
            Value::String(s) => s.clone(),
            other => py_json(other),
        };
        out.push_str(&format!(
            "<tool_call>\n{{\"name\": \"{}\", \"arguments\": {arguments}}}\n</tool_call>",
            text(&call["name"])
        ));
    }
    out
}

/// A message's text: the router has joined list content into a string, and null (an
/// assistant turn that only calls tools) is empty.
fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatTemplate;

    /// SmolLM2-135M-Instruct's own template, which knows nothing of tools.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and \
        messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI \
        assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' \
        + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if \
        add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn weather(city: &str, arguments_as_text: bool) -> Value {
        let args = json!({"location": city});
        let args = if arguments_as_text {
            Value::String(py_json(&args))
        } else {
            args
        };
        json!({"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": args}})
    }

    fn chat(system: bool, with_tools: bool) -> ChatInput {
        let mut messages = vec![
            json!({"role": "user", "content": "Weather in Paris and Nice?"}),
            json!({"role": "assistant", "content": null,
                "tool_calls": [weather("Paris", true), weather("Nice", false)]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "22 C"}),
            json!({"role": "tool", "tool_call_id": "call_2", "content": "25 C"}),
            json!({"role": "assistant", "content": "Warm in both.",
                "tool_calls": [weather("Lyon", false)]}),
            json!({"role": "tool", "tool_call_id": "call_3", "content": "19 C"}),
            json!({"role": "user", "content": "Thanks"}),
        ];
        if system {
            messages.insert(0, json!({"role": "system", "content": "Be brief."}));
        }
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city", "parameters": {"type": "object",
            "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]);
        ChatInput {
            messages: Value::Array(messages),
            tools: with_tools.then_some(tools),
            add_generation_prompt: true,
            kwargs: Default::default(),
        }
    }

    /// Written out and rendered by SmolLM2's template, a tool chat is exactly the prompt a
    /// template that teaches tools (ours, written as Qwen's) renders from the original.
    #[test]
    fn a_template_without_tools_renders_what_a_tool_template_does() {
        let plain = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        let teaching = ChatTemplate::new(crate::CHATML_TEMPLATE, "", "").unwrap();
        for (system, tools) in [(true, true), (false, true), (true, false)] {
            let input = chat(system, tools);
            let expected = teaching.render(&input).unwrap();
            let got = plain.render(&prompted(&input)).unwrap();
            assert_eq!(got, expected, "system {system}, tools {tools}");
            assert_eq!(
                got.contains("# Tools"),
                tools,
                "the tools are written only when there are some"
            );
        }
        // Without a system turn or tools the template's own system text stays.
        let bare = plain.render(&prompted(&chat(false, false))).unwrap();
        assert!(bare.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(bare.contains(
            "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\n25 C\n\
             </tool_response><|im_end|>"
        ));
    }

    /// Gemma 2's template refuses a system turn, so the tools go at the head of the first
    /// user turn: the prompt Gemma 3's template, the same but for taking a system turn
    /// there, renders.
    #[test]
    fn a_template_without_a_system_turn_gets_the_tools_in_the_first_user_turn() {
        let gemma2 = super::super::tests::fixture_template("gemma2");
        let gemma3 = super::super::tests::fixture_template("gemma3");
        for (system, tools) in [(true, true), (false, true), (true, false)] {
            let mut input = chat(system, tools);
            // Gemma's roles alternate: the last tool result gets its answer.
            let messages = input.messages.as_array_mut().unwrap();
            let at = messages.len() - 1;
            messages.insert(at, json!({"role": "assistant", "content": "19 C in Lyon."}));
            assert!(
                gemma2.render(&prompted(&input)).is_err(),
                "Gemma 2 refuses it"
            );
            let got = render_prompted(&gemma2, &input).unwrap();
            assert_eq!(got, gemma3.render(&prompted(&input)).unwrap());
            assert_eq!(got.contains("# Tools"), tools);
        }
        // A chat the template refuses for another reason is still refused.
        let mut twice = chat(false, true);
        twice.messages[0]["role"] = json!("assistant");
        assert!(render_prompted(&gemma2, &twice).is_err());
    }
}
