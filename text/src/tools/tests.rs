//! Each format's calls read out of streamed output, split at every token boundary.

use super::*;
use crate::structured::tests::{run, splits};
use crate::structured::{Delta, Parser};

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn parse_all(format: ToolFormat, text: &str) -> Delta {
    let mut last = None;
    for pieces in splits(text) {
        let d = run(Parser::new(false, Some(format), false), &pieces);
        if let Some(prev) = &last {
            assert_eq!(&d, prev, "{format:?} split as {pieces:?}");
        }
        last = Some(d);
    }
    last.unwrap()
}

#[test]
fn detects_the_format_a_template_teaches() {
    let cases = [
        (crate::CHATML_TEMPLATE, Some(ToolFormat::Hermes)),
        ("{{'<｜tool▁calls▁begin｜>'}}", Some(ToolFormat::DeepSeek)),
        ("{{- \"[TOOL_CALLS][\" }}", Some(ToolFormat::Mistral)),
        (
            "{{- '[TOOL_CALLS]' + name }}{{- '[ARGS]' }}",
            Some(ToolFormat::MistralArgs),
        ),
        (
            "Respond in the format {\"name\": function name, \"parameters\": dictionary of \
             argument name and its value}.",
            Some(ToolFormat::Llama3Json),
        ),
        (
            "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + \
             message['tools'] + '<|/tool|>' }}",
            Some(ToolFormat::Phi4Mini),
        ),
        ("{{ messages }}", None),
    ];
    for (template, format) in cases {
        assert_eq!(ToolFormat::detect(template), format, "{template}");
    }
}

#[test]
fn llama3_calls_are_the_whole_reply_with_or_without_the_python_tag() {
    let one = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\"}}";
    let d = parse_all(ToolFormat::Llama3Json, one);
    assert_eq!(
        d.calls,
        vec![call("get_weather", "{\"location\": \"Paris\"}")]
    );
    assert_eq!(d.content, "");
    let two = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \
        \"arguments\": {}}";
    let d = parse_all(ToolFormat::Llama3Json, two);
    assert_eq!(d.calls, vec![call("a", "{\"x\": 1}"), call("b", "{}")]);
    // A JSON answer that is not a call, and text before a brace, are content.
    for text in [
        "{\"answer\": 4}",
        "The object is {\"name\": \"x\"}.",
        "{\"name\": \"a\", \"parameters\": {}} and more",
    ] {
        let d = parse_all(ToolFormat::Llama3Json, text);
        assert_eq!((d.content.as_str(), d.calls.len()), (text, 0));
    }
}

#[test]
fn mistral_calls_in_the_list_and_args_forms() {
    let list = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"location\": \
        \"Paris\"}, \"id\": \"a1B2c3D4e\"}, {\"name\": \"get_time\", \"arguments\": \"{}\"}]";
    let args = "[TOOL_CALLS]get_weather[ARGS]{\"location\": \"Paris\"}[TOOL_CALLS]get_time\
        [CALL_ID]a1B2c3D4e[ARGS]{}";
    for format in [ToolFormat::Mistral, ToolFormat::MistralArgs] {
        for text in [list, args] {
            let d = parse_all(format, text);
            assert_eq!(
                d.calls,
                vec![
                    call("get_weather", "{\"location\": \"Paris\"}"),
                    call("get_time", "{}")
                ],
                "{format:?}: {text}"
            );
            assert_eq!(d.content, "");
        }
    }
    // Content before the calls is content; calls cut short stay text.
    let d = parse_all(
        ToolFormat::Mistral,
        "Sure. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]",
    );
    assert_eq!((d.content.as_str(), d.calls.len()), ("Sure. ", 1));
    let cut = "[TOOL_CALLS][{\"name\": \"f\", \"argu";
    let d = parse_all(ToolFormat::Mistral, cut);
    assert_eq!((d.content.as_str(), d.calls.len()), (cut, 0));
}

#[test]
fn phi4_mini_calls_closed_or_not_listed_or_not() {
    let want = vec![
        call("get_weather", "{\"location\": \"Paris\"}"),
        call("get_time", "{}"),
    ];
    for text in [
        "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}, \
         {\"name\": \"get_time\", \"arguments\": {}}]<|/tool_call|>",
        "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}, \
         {\"name\": \"get_time\", \"arguments\": {}}]",
        "<|tool_call|>{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}, \
         {\"name\": \"get_time\", \"parameters\": {}}<|/tool_call|>",
    ] {
        let d = parse_all(ToolFormat::Phi4Mini, text);
        assert_eq!((&d.calls, d.content.as_str()), (&want, ""), "{text}");
    }
    let d = parse_all(ToolFormat::Phi4Mini, "No call: {\"name\": 1}");
    assert_eq!(
        (d.content.as_str(), d.calls.len()),
        ("No call: {\"name\": 1}", 0)
    );
}

#[test]
fn markers_are_the_special_tokens_each_format_opens_calls_with() {
    for format in [
        ToolFormat::Hermes,
        ToolFormat::DeepSeek,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
        ToolFormat::MistralArgs,
        ToolFormat::Phi4Mini,
    ] {
        let openers: Vec<&str> = format.openers(true).iter().map(|o| o.tag).collect();
        for marker in format.markers() {
            let in_markup = openers.contains(marker)
                || [ARGS, CALL_ID].contains(marker)
                || format.close() == Some(*marker);
            assert!(in_markup, "{format:?}: {marker}");
        }
        assert_eq!(
            format.call_json().is_some(),
            !matches!(format, ToolFormat::DeepSeek | ToolFormat::MistralArgs)
        );
    }
}

/// The real template of a fixture under `engine/tests/fixtures/templates/`, with its
/// BOS and EOS.
pub(super) fn fixture_template(name: &str) -> crate::ChatTemplate {
    let path = format!(
        "{}/../engine/tests/fixtures/templates/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap();
    crate::ChatTemplate::new(
        v["template"].as_str().unwrap(),
        v["bos_token"].as_str().unwrap_or(""),
        v["eos_token"].as_str().unwrap_or(""),
    )
    .unwrap()
}

/// What the real templates write for an assistant turn with calls, between `open` and
/// `close`, parses back into those calls: the parser reads the markup the templates teach.
/// Llama 3's templates take one call a turn; Mistral's take ids of nine characters.
#[test]
fn calls_rendered_by_the_real_templates_parse_back() {
    let header = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    let cases = [
        (
            "qwen3",
            ToolFormat::Hermes,
            2,
            "<|im_start|>assistant\n",
            "<|im_end|>",
        ),
        (
            "deepseek_v3",
            ToolFormat::DeepSeek,
            2,
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
        ),
        ("llama3_1", ToolFormat::Llama3Json, 1, header, "<|eot_id|>"),
        ("llama3_2", ToolFormat::Llama3Json, 1, header, "<|eot_id|>"),
        ("llama3_3", ToolFormat::Llama3Json, 1, header, "<|eot_id|>"),
        ("mistral_nemo", ToolFormat::Mistral, 2, "[/INST]", "</s>"),
        (
            "mistral_small_3_2",
            ToolFormat::MistralArgs,
            2,
            "[/INST]",
            "</s>",
        ),
    ];
    let cities = ["Paris", "Nice"];
    for (name, format, calls, open, close) in cases {
        let t = fixture_template(name);
        assert_eq!(ToolFormat::detect(t.source()), Some(format), "{name}");
        let think = t.source().contains("</think>");
        let call = |city: &str| {
            serde_json::json!({"id": format!("call_{city}"), "type": "function", "function": {
                "name": "get_weather", "arguments": {"location": city}}})
        };
        let messages = serde_json::json!([
            {"role": "user", "content": "Weather in Paris and Nice?"},
            {"role": "assistant", "content": null,
                "tool_calls": cities[..calls].iter().map(|c| call(c)).collect::<Vec<_>>()},
        ]);
        let input = crate::ChatInput {
            messages: mistral_ids(&messages),
            tools: None,
            add_generation_prompt: false,
            kwargs: Default::default(),
        };
        let rendered = render(&t, &input).unwrap_or_else(|e| panic!("{name}: {e}"));
        let turn = &rendered[rendered.rfind(open).unwrap() + open.len()..];
        let turn = &turn[..turn.find(close).unwrap()];
        let d = run(Parser::new(think, Some(format), false), &[turn]);
        let got: Vec<Value> = d
            .calls
            .iter()
            .map(|c| {
                assert_eq!(c.name, "get_weather");
                serde_json::from_str::<Value>(&c.arguments).unwrap()["location"].clone()
            })
            .collect();
        assert_eq!(got, cities[..calls], "{name}: {turn:?}");
        assert_eq!(d.content.trim(), "", "{name}: {turn:?}");
    }
}
