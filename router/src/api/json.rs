//! A request body parsed into JSON within limits on what it means, not only on its bytes:
//! every value is counted while it is parsed, and the parse stops at the first one past
//! the limit. An element of an array costs 2 bytes of body (`0,`) and about 80 bytes parsed,
//! so a body within `--max-body-bytes` could otherwise take forty times its size.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::error::RouterError;

/// The most JSON values (every object, array, string, number, boolean and null) a body may
/// hold besides a prompt's token ids: room for 128 tools with large schemas, and a long
/// conversation. About 6 MiB parsed.
pub const MAX_JSON_VALUES: usize = 65_536;

/// The deepest a body's values may nest (a JSON schema nests its properties; nothing a
/// request holds needs more).
pub const MAX_JSON_DEPTH: usize = 64;

/// What a body may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonLimits {
    /// Values in all.
    pub values: usize,
    /// Nesting of arrays and objects.
    pub depth: usize,
}

impl JsonLimits {
    /// The limits for a router whose prompts hold at most `prompt_tokens` tokens: a prompt
    /// sent as token ids is one value a token, on top of [`MAX_JSON_VALUES`].
    pub fn for_prompts(prompt_tokens: usize) -> Self {
        Self {
            values: MAX_JSON_VALUES.saturating_add(prompt_tokens),
            depth: MAX_JSON_DEPTH,
        }
    }
}

/// Which limit stopped a parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Past {
    Values,
    Depth,
}

/// JSON text inside a request (a tool call's arguments, a schema sent as a string) that
/// could not be used.
#[derive(Debug)]
pub enum TextError {
    /// It is not JSON: serde_json's words.
    Syntax(serde_json::Error),
    /// It goes past what is left of the request's limits: a 413.
    Limit(RouterError),
}

impl TextError {
    /// The request's error: `syntax` for text that is not JSON.
    pub fn or_syntax(self, syntax: impl FnOnce(serde_json::Error) -> RouterError) -> RouterError {
        match self {
            TextError::Syntax(e) => syntax(e),
            TextError::Limit(e) => e,
        }
    }
}

/// What one request's JSON may still hold: its body, and then the JSON texts inside it,
/// parsed against one count.
pub struct JsonBudget {
    left: Cell<usize>,
    limits: JsonLimits,
    past: Cell<Option<Past>>,
}

impl JsonBudget {
    pub fn new(limits: JsonLimits) -> Self {
        Self {
            left: Cell::new(limits.values),
            limits,
            past: Cell::new(None),
        }
    }

    /// Parses a body as one JSON object: a 413 past the limits, a 400 for anything that is
    /// not a JSON object.
    pub fn object(&self, body: &[u8]) -> Result<Map<String, Value>, RouterError> {
        match self.parse(body) {
            Ok(Value::Object(o)) => Ok(o),
            Ok(_) => Err(RouterError::InvalidJson("expected a JSON object".into())),
            Err(TextError::Syntax(e)) => Err(RouterError::InvalidJson(e.to_string())),
            Err(TextError::Limit(e)) => Err(e),
        }
    }

    /// Parses JSON text found inside the request.
    pub fn text(&self, text: &str) -> Result<Value, TextError> {
        self.parse(text.as_bytes())
    }

    fn parse(&self, bytes: &[u8]) -> Result<Value, TextError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let parsed = Bounded {
            count: self,
            depth: 0,
        }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
        match (parsed, self.past.get()) {
            (_, Some(past)) => Err(TextError::Limit(RouterError::BodyTooComplex(match past {
                Past::Values => format!("it holds more than {} JSON values", self.limits.values),
                Past::Depth => format!("its values nest more than {} deep", self.limits.depth),
            }))),
            (Ok(v), None) => Ok(v),
            (Err(e), None) => Err(TextError::Syntax(e)),
        }
    }

    /// Takes one value from the count; an error once none is left.
    fn take<E: de::Error>(&self) -> Result<(), E> {
        match self.left.get() {
            0 => self.stop(Past::Values),
            n => {
                self.left.set(n - 1);
                Ok(())
            }
        }
    }

    fn stop<T, E: de::Error>(&self, past: Past) -> Result<T, E> {
        self.past.set(Some(past));
        Err(E::custom("a limit of the request body"))
    }
}

/// One value at `depth`, built as `serde_json::Value` builds it, counted as it goes.
#[derive(Clone, Copy)]
struct Bounded<'a> {
    count: &'a JsonBudget,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.count.take()?;
        d.deserialize_any(self)
    }
}

impl Bounded<'_> {
    /// The seed for the values inside an array or object at this depth.
    fn inner<E: de::Error>(self) -> Result<Self, E> {
        if self.depth >= self.count.limits.depth {
            return self.count.stop(Past::Depth);
        }
        Ok(Self {
            count: self.count,
            depth: self.depth + 1,
        })
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(inner)? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let inner = self.inner()?;
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(inner)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: JsonLimits = JsonLimits {
        values: 8,
        depth: 3,
    };

    fn parse(body: &str) -> Result<Map<String, Value>, RouterError> {
        JsonBudget::new(SMALL).object(body.as_bytes())
    }

    #[test]
    fn a_body_within_its_limits_parses_as_serde_json_parses_it() {
        let body = r#"{"a": [1, -2, 3.5], "b": {"c": null}, "d": "\u00e9"}"#;
        let want: Value = serde_json::from_str(body).unwrap();
        assert_eq!(Value::Object(parse(body).unwrap()), want);
        let keys: Vec<_> = parse(r#"{"z": 1, "a": 2}"#).unwrap().into_iter().collect();
        assert_eq!(keys[0].0, "z", "the client's order is kept");
    }

    #[test]
    fn a_body_past_a_limit_is_refused_as_too_complex() {
        // The object, the array and seven numbers: nine values.
        let many = parse(r#"{"a": [0, 0, 0, 0, 0, 0, 0]}"#).unwrap_err();
        assert!(
            matches!(&many, RouterError::BodyTooComplex(m) if m.contains("8 JSON values")),
            "{many:?}"
        );
        assert_eq!(many.http_status(), 413);
        assert!(parse(r#"{"a": [0, 0, 0, 0, 0, 0]}"#).is_ok());
        let deep = parse(r#"{"a": [[[0]]]}"#).unwrap_err();
        assert!(
            matches!(&deep, RouterError::BodyTooComplex(m) if m.contains("3 deep")),
            "{deep:?}"
        );
        assert!(parse(r#"{"a": [[0]]}"#).is_ok());
    }

    #[test]
    fn json_texts_inside_a_request_share_its_count() {
        let budget = JsonBudget::new(SMALL);
        budget.object(br#"{"a": [0]}"#).unwrap();
        assert_eq!(budget.text("[1, 2]").unwrap(), serde_json::json!([1, 2]));
        assert!(matches!(budget.text("{"), Err(TextError::Syntax(_))));
        // Three values, then three, then the one the bad text began: one is left.
        assert!(matches!(
            budget.text("[1]"),
            Err(TextError::Limit(RouterError::BodyTooComplex(_)))
        ));
    }

    #[test]
    fn what_is_not_one_json_object_is_a_bad_request() {
        for body in ["[1]", "{\"a\": 1} 2", "{\"a\":", "", "\"x\""] {
            let e = parse(body).unwrap_err();
            assert!(matches!(e, RouterError::InvalidJson(_)), "{body}: {e:?}");
        }
    }
}
