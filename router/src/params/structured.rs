//! Structured outputs: `response_format` (OpenAI's `json_object` and `json_schema`) and
//! vLLM's `guided_json`, `guided_regex` and `guided_choice`, read into the one grammar a
//! request's output must match. Whether the grammar compiles is checked against the
//! model's vocabulary by the caller (`openai::prepare`), which has it.

use proto::v1;
use proto::v1::grammar::Kind;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Value};
use text::grammar::{Grammar, Vocab};
use text::tools::CallJson;

use crate::api::json::JsonBudget;
use crate::api::{Param, Sampling};
use crate::error::RouterError;

/// A request's grammar and the parameter it came from, which its errors name.
#[derive(Debug, Clone, PartialEq)]
pub struct Constrained {
    pub grammar: Grammar,
    pub param: &'static str,
}

impl Constrained {
    /// The grammar in its wire form, once it compiles against the model's vocabulary
    /// (`vocab`, or why there is none); else a 400 naming the parameter it came from and
    /// what is wrong with it. (Whether it compiles does not depend on the stop tokens.)
    pub fn checked(&self, vocab: &Result<Vocab, String>) -> Result<v1::Grammar, RouterError> {
        let param = self.param;
        let vocab = vocab.as_ref().map_err(|e| {
            RouterError::param(
                param,
                format!("{param} is not supported for this model: {e}"),
            )
        })?;
        let wire = self.wire()?;
        vocab
            .compile(&self.grammar, &[])
            .map_err(|e| RouterError::param(param, format!("{param}: {e}")))?;
        Ok(wire)
    }

    /// The grammar in its wire form, within the grammar limits (checked before it
    /// compiles: the limits bound what a compile costs); else a 400 naming the parameter.
    pub fn wire(&self) -> Result<v1::Grammar, RouterError> {
        let kind = match &self.grammar {
            Grammar::JsonSchema { schema, strict } => Kind::JsonSchema(v1::JsonSchema {
                schema: schema.to_string(),
                strict: *strict,
            }),
            Grammar::Regex(rx) => Kind::Regex(rx.clone()),
            Grammar::Choice(c) => Kind::Choice(v1::Choices { choices: c.clone() }),
        };
        let wire = v1::Grammar { kind: Some(kind) };
        proto::limits::check_grammar(&wire)
            .map_err(|e| RouterError::param(self.param, format!("{}: {e}", self.param)))?;
        Ok(wire)
    }
}

/// `response_format`, as OpenAI defines it.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSchemaFormat {
    name: String,
    /// Accepted and unused: the grammar, not the model's reading of it, holds the output
    /// to the schema.
    #[serde(default, rename = "description")]
    _description: Option<IgnoredAny>,
    /// Absent: any JSON value, as OpenAI reads it.
    #[serde(default)]
    schema: Option<Value>,
    /// Absent or null: false.
    #[serde(default)]
    strict: Option<bool>,
}

/// Keywords by which a JSON schema refers to another schema.
pub(super) const REF_KEYWORDS: [&str; 3] = ["$ref", "$dynamicRef", "$recursiveRef"];

/// The first schema reference in `v` that points outside the document itself (a URL or a
/// path: anything but a `#` fragment). Nothing here resolves schemas, and a reference
/// that a later feature resolved must never become a fetch. The depth is bounded by
/// serde_json's recursion limit on the body.
pub(super) fn external_ref(v: &Value) -> Option<&str> {
    match v {
        Value::Object(m) => m.iter().find_map(|(k, v)| match v {
            Value::String(r) if REF_KEYWORDS.contains(&k.as_str()) && !r.starts_with('#') => {
                Some(r.as_str())
            }
            _ => external_ref(v),
        }),
        Value::Array(items) => items.iter().find_map(external_ref),
        _ => None,
    }
}

/// A schema that refers only inside itself, as a grammar; else a 400 naming `param`.
fn schema_grammar(
    schema: Value,
    strict: bool,
    param: &'static str,
) -> Result<Constrained, RouterError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(RouterError::param(
            param,
            format!(
                "{param}'s schema must be a JSON object or a boolean, got {}",
                match schema {
                    Value::Array(_) => "an array",
                    Value::String(_) => "a string",
                    Value::Number(_) => "a number",
                    _ => "null",
                }
            ),
        ));
    }
    if let Some(r) = external_ref(&schema) {
        return Err(RouterError::param(
            param,
            format!(
                "{param} refers to {r:?}: only references inside the schema (\"#/...\") are \
                 accepted, the router never fetches a schema"
            ),
        ));
    }
    Ok(Constrained {
        grammar: Grammar::JsonSchema { schema, strict },
        param,
    })
}

/// The grammar of a tool call that the request forces (`tool_choice` required, or `name`
/// for a named function), written after the prompt's opening in the format's JSON
/// (`shape`): `{"name": …, "arguments": {…}}` for one of `tools` (the chat's `tools` list),
/// the arguments under Llama 3's `parameters`, or a list of one such call for Mistral. A tool
/// without `parameters` takes any object. Its errors name `tools`: a parameters schema that
/// does not compile.
pub fn forced_call(tools: &[Value], name: Option<&str>, shape: CallJson) -> Constrained {
    let calls: Vec<Value> = tools
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            let n = f.get("name")?.as_str()?;
            if name.is_some_and(|wanted| wanted != n) {
                return None;
            }
            let arguments = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            let key = shape.arguments_key;
            Some(json!({
                "type": "object",
                "properties": {"name": {"const": n}, key: arguments},
                "required": ["name", key],
                "additionalProperties": false
            }))
        })
        .collect();
    let call = json!({"anyOf": calls});
    let schema = if shape.list {
        // One call, as in the other formats.
        json!({"type": "array", "items": call, "minItems": 1, "maxItems": 1})
    } else {
        call
    };
    Constrained {
        grammar: Grammar::JsonSchema {
            schema,
            strict: false,
        },
        param: "tools",
    }
}

/// The names OpenAI allows a schema: letters, digits, `_` and `-`, at most 64.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn response_format(p: &Param<Value>) -> Result<Option<Constrained>, RouterError> {
    const PARAM: &str = "response_format";
    let bad = |m: String| RouterError::param(PARAM, m);
    let Param::Valid(v) = p else {
        return match p {
            Param::Invalid => Err(bad("response_format must be an object".into())),
            _ => Ok(None),
        };
    };
    let format = ResponseFormat::deserialize(v).map_err(|e| {
        bad(format!(
            "response_format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or \
             {{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}, \
             \"strict\": ...}}}}: {e}"
        ))
    })?;
    match format {
        ResponseFormat::Text => Ok(None),
        ResponseFormat::JsonObject => Ok(Some(Constrained {
            grammar: Grammar::JsonSchema {
                schema: json!({"type": "object"}),
                strict: true,
            },
            param: PARAM,
        })),
        ResponseFormat::JsonSchema { json_schema: f } => {
            if !valid_name(&f.name) {
                return Err(bad(format!(
                    "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or \
                     '-', got {:?}",
                    f.name
                )));
            }
            let schema = f.schema.unwrap_or_else(|| json!({}));
            schema_grammar(schema, f.strict.unwrap_or(false), PARAM).map(Some)
        }
    }
}

/// The grammar a request's output must match, from whichever one parameter gives it.
pub fn grammar(s: &Sampling, json: &JsonBudget) -> Result<Option<Constrained>, RouterError> {
    let mut found = Vec::new();
    if let Some(c) = response_format(&s.response_format)? {
        found.push(c);
    }
    match &s.guided_json {
        Param::Absent | Param::Null => {}
        Param::Valid(Value::String(text)) => {
            let schema = json.text(text).map_err(|e| {
                e.or_syntax(|e| {
                    RouterError::param("guided_json", format!("guided_json is not JSON: {e}"))
                })
            })?;
            found.push(schema_grammar(schema, false, "guided_json")?);
        }
        Param::Valid(schema) => found.push(schema_grammar(schema.clone(), false, "guided_json")?),
        Param::Invalid => {
            return Err(RouterError::param(
                "guided_json",
                "guided_json must be a JSON schema",
            ))
        }
    }
    if let Some(rx) = s.guided_regex.value("guided_regex")? {
        found.push(Constrained {
            grammar: Grammar::Regex(rx.clone()),
            param: "guided_regex",
        });
    }
    match &s.guided_choice {
        Param::Absent | Param::Null => {}
        Param::Valid(c) if !c.is_empty() => found.push(Constrained {
            grammar: Grammar::Choice(c.clone()),
            param: "guided_choice",
        }),
        _ => {
            return Err(RouterError::param(
                "guided_choice",
                "guided_choice must be a non-empty list of strings",
            ))
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(RouterError::param(
            found[1].param,
            format!(
                "{} and {} both constrain the output; send one of them",
                found[0].param, found[1].param
            ),
        )),
    }
}
