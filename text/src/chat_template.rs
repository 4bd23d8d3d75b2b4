//! Chat templates rendered the way Hugging Face `transformers` renders them.
//!
//! transformers runs Jinja2 with `trim_blocks`, `lstrip_blocks`, a `tojson` that is Python's
//! `json.dumps(ensure_ascii=False)`, `raise_exception` and `strftime_now`. minijinja plus
//! Python-style string methods covers the same ground.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde_json::Map;

use crate::error::{Result, TextError};

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

/// What a chat turn renders from: the request's messages and options.
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    /// OpenAI-style messages.
    pub messages: serde_json::Value,
    /// OpenAI-style tool definitions, if any.
    pub tools: Option<serde_json::Value>,
    pub add_generation_prompt: bool,
    /// Extra variables, such as `enable_thinking`.
    pub kwargs: Map<String, serde_json::Value>,
}

fn template_err(e: minijinja::Error) -> TextError {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    TextError::Template(msg)
}

/// The text of a special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Compiles a template with the given special tokens.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(template_err)?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Reads the template of a Hugging Face folder: `chat_template.jinja`, or the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list whose `default` entry
    /// is used). `None` when the folder has no template.
    pub fn from_hf_folder(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| TextError::invalid_model(&cfg_path, e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(TextError::io(&cfg_path, e)),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| TextError::io(&jinja, e))?)
        } else {
            match cfg.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(String::from),
                _ => None,
            }
        };
        source
            .map(|s| {
                Self::new(
                    &s,
                    &token_text(cfg.get("bos_token")),
                    &token_text(cfg.get("eos_token")),
                )
            })
            .transpose()
    }

    /// The template's Jinja source: what tells a server which tool-call and reasoning
    /// markup the model was trained on.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation to the prompt text.
    pub fn render(&self, input: &ChatInput) -> Result<String> {
        let mut ctx = Map::new();
        ctx.insert("messages".into(), input.messages.clone());
        if let Some(tools) = &input.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            input.add_generation_prompt.into(),
        );
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        for (k, v) in &input.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self.env.get_template("chat").map_err(template_err)?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(template_err)
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `time.strftime` for the directives templates use, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    format_time(secs, &fmt)
}

fn format_time(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(i64::try_from(v)?.max(0) as usize),
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => (
            s.get_item_by_index(0)?.to_string(),
            s.get_item_by_index(1)?.to_string(),
        ),
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(x, ensure_ascii=False)`: JSON as Python writes it, which is what models
/// trained on Python-rendered prompts expect to see (", " and ": " separators).
pub fn py_json(x: &serde_json::Value) -> String {
    let style = JsonStyle {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        ensure_ascii: false,
        sort_keys: false,
    };
    let mut out = String::new();
    style
        .write(&Value::from_serialize(x), 0, &mut out)
        .expect("a serde_json value always writes");
    out
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonStyle {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(
        &self,
        v: &Value,
        depth: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&python_number(v)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', depth, out, &items, |item, d, o| {
                    self.write(item, d, o)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.container('{', '}', depth, out, &keys, |key, d, o| {
                    self.string(&key.to_string(), o);
                    o.push_str(&self.key_sep);
                    self.write(&v.get_item(key)?, d, o)
                })?;
            }
            _ => self.string(&v.to_string(), out),
        }
        Ok(())
    }

    fn container(
        &self,
        open: char,
        close: char,
        depth: usize,
        out: &mut String,
        items: &[Value],
        mut each: impl FnMut(&Value, usize, &mut String) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(depth + 1, out);
            each(item, depth + 1, out)?;
        }
        self.newline(depth, out);
        out.push(close);
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `repr` writes it: floats keep a `.0`, exponents get a sign.
fn python_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let s = format!("{f:?}");
    match s.split_once('e') {
        Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e:0>2}"),
        Some((m, e)) => format!("{m}e-{:0>2}", &e[1..]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: serde_json::Value) -> String {
        ChatTemplate::new(src, "<s>", "</s>")
            .unwrap()
            .render(&ChatInput {
                messages,
                ..Default::default()
            })
            .unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            json!([{"b": [1, 2.0, 1e20], "a": "é\"\n", "c": {}, "d": null, "e": true}]),
        );
        assert_eq!(
            out,
            "{\"b\": [1, 2.0, 1e+20], \"a\": \"é\\\"\\n\", \"c\": {}, \"d\": null, \"e\": true}|{\n  \"b\": [\n    1,\n    2.0,\n    1e+20\n  ],\n  \"a\": \"é\\\"\\n\",\n  \"c\": {},\n  \"d\": null,\n  \"e\": true\n}"
        );
    }

    #[test]
    fn py_json_is_python_json_dumps() {
        assert_eq!(
            py_json(&json!({"city": "Zürich", "days": [1, 2.5], "x": {"y": null}})),
            "{\"city\": \"Zürich\", \"days\": [1, 2.5], \"x\": {\"y\": null}}"
        );
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let err = t.render(&ChatInput::default()).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    #[test]
    fn python_string_methods_and_block_trimming_work() {
        let out = render(
            "{% for m in messages %}\n  {{ m.content.strip().upper() }}{% if m.content.startswith(' a') %}!{% endif %}\n    {% if m %}|{% endif %}\n{% endfor %}",
            json!([{"content": " a b "}, {"content": "c"}]),
        );
        // What Jinja2 renders with trim_blocks and lstrip_blocks.
        assert_eq!(out, "  A B!|  C|");
    }

    #[test]
    fn time_formatting_follows_strftime() {
        assert_eq!(
            format_time(0, "%d %b %Y %H:%M:%S %A"),
            "01 Jan 1970 00:00:00 Thursday"
        );
        assert_eq!(
            format_time(1_709_251_199, "%Y-%m-%d %B %a"),
            "2024-02-29 February Thu"
        );
    }
}
