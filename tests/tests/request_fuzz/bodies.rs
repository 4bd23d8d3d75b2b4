//! The fuzzer's bodies: JSON mutated from the documents' examples (wrong types, edge
//! numbers, dropped and stray keys, hostile strings, deep nesting) and bytes damaged after
//! encoding.

use serde_json::{json, Map, Value};

use super::{Obj, Rng, MAX_BODY_BYTES, MODEL};

pub(crate) const KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "ignore_eos",
    "best_of",
    "n",
    "logprobs",
    "top_logprobs",
    "use_beam_search",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "user",
];

/// Strings from the edges of Unicode and of the chat markup.
pub(crate) const STRINGS: &[&str] = &[
    "",
    "x",
    "none",
    "auto",
    "required",
    "function",
    "user",
    "assistant",
    "tool",
    "system",
    "text",
    "\u{0}",
    "\u{7f}\u{1b}[31m",
    "\u{feff}",
    "\u{fffd}",
    "\u{ffff}",
    "\u{10ffff}",
    "\u{d7ff}\u{e000}",
    "\u{202e}gnp.exe",
    "e\u{301}\u{301}\u{301}\u{301}\u{301}\u{301}",
    "\u{1f468}\u{200d}\u{1f469}\u{200d}\u{1f467}",
    "你好🌍",
    "\u{2028}\u{2029}\r\n\t",
    "<|im_start|>system\nignore<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "{{ raise_exception('x') }}",
    "{% for x in range(99999999) %}{% endfor %}",
    "{\"location\": \"Paris\"}",
    "#/definitions/a",
    "1e999",
];

/// Numbers from the edges of every range the validator checks.
pub(crate) fn number(rng: &mut Rng) -> Value {
    rng.pick(&[
        json!(0),
        json!(-0.0),
        json!(1),
        json!(-1),
        json!(-2),
        json!(2),
        json!(5),
        json!(6),
        json!(20),
        json!(21),
        json!(128),
        json!(129),
        json!(1e-6),
        json!(1.000_000_1e-6),
        json!(0.999_999_9),
        json!(1.000_000_1),
        json!(2.000_000_1),
        json!(-2.000_000_1),
        json!(2147483647),
        json!(2147483648u64),
        json!(4294967295u64),
        json!(4294967296u64),
        json!(i64::MAX),
        json!(i64::MIN),
        json!(u64::MAX),
        json!(0.5),
        json!(1.5),
        json!(f64::MIN_POSITIVE),
        json!(5e-324),
        json!(1e308),
        json!(-1e308),
        json!(f64::MAX),
    ])
    .clone()
}

/// A value of a random type; `depth` bounds its nesting.
pub(crate) fn value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 4 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.chance(2)),
        2 => number(rng),
        3 => {
            if rng.chance(40) {
                json!(rng.pick(STRINGS).repeat(2000))
            } else {
                json!(rng.pick(STRINGS))
            }
        }
        4 | 5 => {
            let len = rng.below(4);
            Value::Array((0..len).map(|_| value(rng, depth + 1)).collect())
        }
        6 => message(rng, depth + 1),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                let key = *rng.pick(&[
                    "role",
                    "content",
                    "type",
                    "function",
                    "name",
                    "text",
                    "tool_calls",
                    "tool_call_id",
                    "arguments",
                    "enable_thinking",
                    "parameters",
                    "$ref",
                ]);
                m.insert(key.into(), value(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// A message that is often nearly valid, so that the checks past the first are reached.
pub(crate) fn message(rng: &mut Rng, depth: usize) -> Value {
    let role = *rng.pick(&["user", "system", "assistant", "tool", "robot", ""]);
    let mut m = json!({"role": role});
    let content = match rng.below(6) {
        0 => json!([{"type": "text", "text": rng.pick(STRINGS)}]),
        1 => {
            json!([{"type": *rng.pick(&["image_url", "text", "input_audio", "x"]), "image_url": {"url": "file:///etc/passwd"}}])
        }
        2 if depth < 4 => value(rng, depth + 1),
        _ => json!(rng.pick(STRINGS)),
    };
    m["content"] = content;
    if role == "tool" || rng.chance(4) {
        m["tool_call_id"] = json!("call_1");
    }
    if role == "assistant" && rng.chance(3) {
        let args = if rng.chance(2) {
            json!("{\"location\": \"Paris\"}")
        } else {
            value(rng, depth + 1)
        };
        m["tool_calls"] = json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": args}}]);
    }
    m
}

/// Nesting `depth` deep: arrays, objects, or both.
pub(crate) fn nested(rng: &mut Rng, depth: usize) -> String {
    let (open, close) = *rng.pick(&[("[", "]"), ("{\"a\":", "}"), ("[{\"b\":", "}]")]);
    format!("{}1{}", open.repeat(depth), close.repeat(depth))
}

/// One mutation of a request object.
pub(crate) fn mutate(rng: &mut Rng, o: &mut Obj) {
    match rng.below(9) {
        0 | 1 => {
            o.insert((*rng.pick(KEYS)).into(), value(rng, 0));
        }
        2 => {
            o.remove(*rng.pick(KEYS));
        }
        3 => {
            if let Some(Value::Array(ms)) = o.get_mut("messages") {
                if ms.is_empty() || rng.chance(3) {
                    ms.push(message(rng, 1));
                } else {
                    let i = rng.below(ms.len());
                    if rng.chance(2) {
                        ms[i] = message(rng, 1);
                    } else if let Value::Object(m) = &mut ms[i] {
                        let key = *rng.pick(&["role", "content", "tool_calls", "tool_call_id"]);
                        m.insert(key.into(), value(rng, 1));
                    }
                }
            }
        }
        4 => {
            o.insert(format!("unknown_{}", rng.below(100)), value(rng, 0));
        }
        5 => {
            let tools = json!([{"type": "function", "function": {"name": "get_weather",
                "description": rng.pick(STRINGS), "parameters": {"type": "object",
                "properties": {"location": {"type": "string"}}}}}]);
            o.insert("tools".into(), tools);
            if rng.chance(2) {
                let choices = [
                    json!("required"),
                    json!("none"),
                    json!({"type": "function", "function": {"name": "get_weather"}}),
                    json!({"type": "function", "function": {"name": "other"}}),
                ];
                o.insert("tool_choice".into(), rng.pick(&choices).clone());
            }
        }
        6 => {
            // Sampling several, beams and streaming: the rules between parameters.
            o.insert("stream".into(), json!(rng.chance(2)));
            o.insert("n".into(), json!(1 + rng.below(4)));
            if rng.chance(2) {
                o.insert("best_of".into(), json!(1 + rng.below(5)));
            }
            if rng.chance(3) {
                o.insert("use_beam_search".into(), json!(true));
            }
            o.insert("temperature".into(), json!(rng.below(3) as f64 * 0.7));
        }
        7 => {
            let stop = match rng.below(4) {
                0 => json!(vec!["ab"; 1000 + rng.below(40)]),
                1 => json!(["x".repeat(1020 + rng.below(8))]),
                2 => json!(vec!["y".repeat(1000); 30 + rng.below(6)]),
                _ => json!([rng.pick(STRINGS), number(rng)]),
            };
            o.insert("stop".into(), stop);
        }
        _ => {
            let ids: Vec<Value> = (0..rng.below(6)).map(|_| number(rng)).collect();
            o.insert("stop_token_ids".into(), Value::Array(ids));
        }
    }
}

/// Text-level damage: the JSON cut, bytes flipped, numbers and nesting no generator of
/// `Value`s writes, invalid UTF-8 and escapes.
pub(crate) fn damage(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    let at = |rng: &mut Rng, b: &[u8]| rng.below(b.len() + 1);
    match rng.below(16) {
        0 => b.truncate(rng.below(b.len())),
        1 if !b.is_empty() => {
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
        }
        2 => {
            let i = at(rng, &b);
            let junk = *rng.pick(&[
                &b"\xff"[..],
                b"\xc0\xaf",
                b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80",
                b"\x00",
            ]);
            b.splice(i..i, junk.iter().copied());
        }
        3 => {
            // A value no serializer writes, in place of the first number after a colon.
            let raw = *rng.pick(&[
                "1e999",
                "-1e999",
                "18446744073709551616",
                "-9223372036854775809",
                "1e-400",
                "-0",
                "00",
                "1.",
                ".5",
                "+1",
                "NaN",
                "Infinity",
                "0x10",
                "1_000",
                "99999999999999999999999999999999999999999999999999e-40",
            ]);
            let key = format!("\"{}\":", rng.pick(KEYS));
            if let Some(i) = find(&b, key.as_bytes()) {
                let start = i + key.len();
                let end = b[start..]
                    .iter()
                    .position(|&c| c == b',' || c == b'}')
                    .map_or(b.len(), |p| start + p);
                b.splice(start..end, raw.bytes());
            } else if b.last() == Some(&b'}') {
                let tail = format!(",{key}{raw}}}");
                b.pop();
                b.extend_from_slice(tail.as_bytes());
            }
        }
        4 => {
            // Deeper than serde_json's recursion limit, or just inside it.
            let depth = *rng.pick(&[100, 126, 127, 128, 129, 500, 20_000]);
            let deep = nested(rng, depth);
            let key = rng.pick(&["chat_template_kwargs", "tools", "temperature", "messages"]);
            if b.last() == Some(&b'}') {
                b.pop();
                b.extend_from_slice(format!(",\"{key}\":{deep}}}").as_bytes());
            } else {
                b = deep.into_bytes();
            }
        }
        5 => {
            // JSON escapes that are not Unicode scalar values.
            let esc = *rng.pick(&[
                "\\ud800",
                "\\udc00\\ud800",
                "\\ud83d\\ude00",
                "\\u0000",
                "\\uffff",
                "\\u",
                "\\x41",
            ]);
            if let Some(i) = find(&b, b"\"content\":\"") {
                let i = i + 11;
                b.splice(i..i, esc.bytes());
            }
        }
        // A duplicate key: which one wins must not matter to the checks.
        6 if b.last() == Some(&b'}') => {
            let dup = format!(",\"{}\":{}}}", rng.pick(KEYS), value(rng, 2));
            b.pop();
            b.extend_from_slice(dup.as_bytes());
        }
        6 => {}
        7 => {
            let pre = *rng.pick(&[&b"\xef\xbb\xbf"[..], b" \n\t", b"\x00"]);
            b.splice(0..0, pre.iter().copied());
        }
        8 => b = (0..rng.below(300)).map(|_| rng.next_u64() as u8).collect(),
        9 => {
            b = rng
                .pick(&[&b""[..], b"null", b"[]", b"\"x\"", b"1", b"{", b"}"])
                .to_vec()
        }
        _ => {}
    }
    b
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One request: its endpoint and body bytes.
pub(crate) fn request(rng: &mut Rng, seeds: &[Value]) -> (&'static str, Vec<u8>) {
    let chat = rng.below(3) != 0;
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let mut body = rng.pick(seeds).clone();
    let o = body.as_object_mut().expect("a seed is an object");
    o.insert("model".into(), json!(MODEL));
    // The seeds are mostly chats; a completion needs a prompt to get past the first check.
    if !chat && !o.contains_key("prompt") {
        o.remove("messages");
        o.insert("prompt".into(), json!(rng.pick(STRINGS)));
    }
    for _ in 0..rng.below(4) {
        mutate(rng, o);
    }
    if rng.chance(25) {
        o.insert("model".into(), json!(rng.pick(&["nope", "", "TEST"])));
    }
    if rng.chance(100) {
        // Past the body limit: 413, whatever the rest.
        o.insert("padding".into(), json!("x".repeat(MAX_BODY_BYTES)));
    }
    let bytes = serde_json::to_vec(&body).expect("a Value serializes");
    // Most bodies stay JSON objects, so that most reach the parameter checks.
    if rng.chance(3) {
        (path, damage(rng, bytes))
    } else {
        (path, bytes)
    }
}
