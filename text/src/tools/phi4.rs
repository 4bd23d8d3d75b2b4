//! Phi-4-mini's tool turns. Its template renders the tools only from a system message's
//! `tools` text (`<|system|>…<|tool|>[…]<|/tool|><|end|>`, as its model card writes them)
//! and every other message as `<|role|>content<|end|>`. So the request's tools go into the
//! system message (one is added, in the card's words, where the chat has none), an
//! assistant turn's calls into its content as the model writes them, and a tool's result
//! into a `tool_response` turn: the tokenizer has a `<|tool_response|>` token, and the card
//! does not say how results go back.

use serde_json::{json, Value};

use super::{PHI_CALL_CLOSE, PHI_CALL_OPEN};
use crate::ChatInput;

/// The system text of the card's tool-calling example, for a chat without a system turn.
const SYSTEM_WITH_TOOLS: &str = "You are a helpful assistant with some tools.";

/// `input` with its tools and tool turns where Phi-4-mini's template renders them.
pub fn phi4_mini_messages(input: &ChatInput) -> ChatInput {
    let mut messages: Vec<Value> = input.messages.as_array().cloned().unwrap_or_default();
    for m in &mut messages {
        match m.get("role").and_then(Value::as_str) {
            Some("assistant") => written_calls(m),
            Some("tool") => m["role"] = Value::from("tool_response"),
            _ => {}
        }
    }
    let tools = input.tools.as_ref().and_then(Value::as_array);
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let functions: Vec<Value> = tools
            .iter()
            .map(|t| t.get("function").unwrap_or(t).clone())
            .collect();
        let text = Value::from(crate::py_json(&Value::Array(functions)));
        match messages.first_mut().filter(|m| m["role"] == "system") {
            Some(system) => system["tools"] = text,
            None => messages.insert(
                0,
                json!({"role": "system", "content": SYSTEM_WITH_TOOLS, "tools": text}),
            ),
        }
    }
    ChatInput {
        messages: Value::Array(messages),
        tools: None,
        ..input.clone()
    }
}

/// An assistant turn's `tool_calls` written after its content, as the model writes calls.
fn written_calls(m: &mut Value) {
    let Some(calls) = m
        .as_object_mut()
        .and_then(|o| o.remove("tool_calls"))
        .and_then(|c| c.as_array().cloned())
    else {
        return;
    };
    let written: Vec<Value> = calls
        .iter()
        .map(|c| {
            let args = c.pointer("/function/arguments").cloned().unwrap_or(json!({}));
            let args = match &args {
                Value::String(s) => serde_json::from_str(s).unwrap_or(args),
                _ => args,
            };
            json!({"name": c.pointer("/function/name").cloned().unwrap_or_default(), "arguments": args})
        })
        .collect();
    let content = m.get("content").and_then(Value::as_str).unwrap_or("");
    m["content"] = Value::from(format!(
        "{content}{PHI_CALL_OPEN}{}{PHI_CALL_CLOSE}",
        crate::py_json(&Value::Array(written))
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(messages: Value, tools: Option<Value>) -> ChatInput {
        ChatInput {
            messages,
            tools,
            add_generation_prompt: true,
            kwargs: Default::default(),
        }
    }

    /// The model card's tool-calling example, rendered by the model's own template from an
    /// OpenAI request: the same prompt, to the byte.
    #[test]
    fn tools_render_as_the_model_card_writes_them() {
        let template = super::super::tests::fixture_template("phi4_mini");
        let tool = json!({"type": "function", "function": {
            "name": "get_weather_updates",
            "description": "Fetches weather updates for a given city using the RapidAPI Weather API.",
            "parameters": {"city": {"description": "The name of the city for which to retrieve weather information.", "type": "str", "default": "London"}}}});
        let asked =
            json!([{"role": "user", "content": "What is the weather like in Paris today?"}]);
        let prompt = template
            .render(&phi4_mini_messages(&input(asked, Some(json!([tool])))))
            .unwrap();
        assert_eq!(
            prompt,
            "<|system|>You are a helpful assistant with some tools.<|tool|>[{\"name\": \
             \"get_weather_updates\", \"description\": \"Fetches weather updates for a given \
             city using the RapidAPI Weather API.\", \"parameters\": {\"city\": \
             {\"description\": \"The name of the city for which to retrieve weather \
             information.\", \"type\": \"str\", \"default\": \"London\"}}}]<|/tool|><|end|>\
             <|user|>What is the weather like in Paris today?<|end|><|assistant|>"
        );
    }

    #[test]
    fn calls_and_results_become_the_models_own_markup() {
        let chat = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
        ]);
        let tools =
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]);
        let template = super::super::tests::fixture_template("phi4_mini");
        let prompt = template
            .render(&phi4_mini_messages(&input(chat, Some(tools))))
            .unwrap();
        assert_eq!(
            prompt,
            "<|system|>Be brief.<|tool|>[{\"name\": \"get_weather\", \"parameters\": {}}]\
             <|/tool|><|end|><|user|>Weather in Paris?<|end|><|assistant|><|tool_call|>\
             [{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}]\
             <|/tool_call|><|end|><|tool_response|>18 C<|end|><|assistant|>"
        );
        // The calls written into the history parse back with the format's own parser.
        let (_, after) = prompt.split_once(PHI_CALL_OPEN).unwrap();
        let (block, _) = after.split_once(PHI_CALL_CLOSE).unwrap();
        let calls = super::super::ToolFormat::Phi4Mini
            .parse(block, true)
            .unwrap();
        assert_eq!(calls[0].arguments, "{\"location\": \"Paris\"}");
    }
}
