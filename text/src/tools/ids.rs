//! Tool-call ids for Mistral's templates, which refuse any id that is not nine letters and
//! digits ("Tool call IDs should be alphanumeric strings with length 9!"), while OpenAI
//! clients send back the ids they were given, such as `call_` and 24 hex digits.

use serde_json::Value;

const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Nine letters and digits for `id`: the id itself where it already is such, else a hash
/// of it, so that a call and its result, which carry the same id, still match.
pub fn nine_char_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    // FNV-1a: a fixed function, so the same id maps the same in every process.
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    base62_id(hash)
}

/// Nine letters and digits from `n`: its base-62 digits (62^9 > 2^53, so most of its bits).
pub fn base62_id(mut n: u64) -> String {
    (0..9)
        .map(|_| {
            let c = ALPHABET[(n % 62) as usize] as char;
            n /= 62;
            c
        })
        .collect()
}

/// `messages` with every call id (`tool_calls[].id`) and tool result id (`tool_call_id`)
/// made nine letters and digits.
pub fn mistral_ids(messages: &Value) -> Value {
    let mut out = messages.clone();
    for m in out.as_array_mut().into_iter().flatten() {
        if let Some(Value::String(id)) = m.get_mut("tool_call_id") {
            *id = nine_char_id(id);
        }
        let calls = m.get_mut("tool_calls").and_then(Value::as_array_mut);
        for call in calls.into_iter().flatten() {
            if let Some(Value::String(id)) = call.get_mut("id") {
                *id = nine_char_id(id);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ids_become_nine_letters_and_digits_and_calls_keep_matching_results() {
        assert_eq!(nine_char_id("a1B2c3D4e"), "a1B2c3D4e");
        for id in ["call_1", "call_0123456789abcdef01234567", "a1B2c3D4_", ""] {
            let nine = nine_char_id(id);
            assert_eq!(nine.len(), 9, "{id}");
            assert!(nine.bytes().all(|b| b.is_ascii_alphanumeric()), "{nine}");
            assert_eq!(nine, nine_char_id(id), "a fixed function");
        }
        assert_ne!(nine_char_id("call_1"), nine_char_id("call_2"));
        let chat = json!([
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]);
        let out = mistral_ids(&chat);
        let call = out[0]["tool_calls"][0]["id"].as_str().unwrap();
        assert_eq!(call, out[1]["tool_call_id"]);
        assert_eq!(call, nine_char_id("call_1"));
    }
}
