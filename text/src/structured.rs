//! Reasoning and tool calls out of generated text. Chat models mark them with the tags their
//! template teaches: `<think>…</think>`, Qwen's `<tool_call>…</tool_call>`, DeepSeek's
//! `<｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>`, Mistral's `[TOOL_CALLS]`, or a reply that
//! is one JSON call (Llama 3). A [`Parser`] splits a choice's text as it streams into
//! reasoning, content and whole tool calls; markup that does not parse stays content, so
//! nothing the model wrote is lost.

use crate::tools::{Opener, ToolCall, ToolFormat};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// What a stretch of output turned into.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    Tool,
}

/// Splits one choice's streamed text into reasoning, content and tool calls. Text that may
/// still turn out to be markup is held back until it is known not to be.
#[derive(Debug, Clone)]
pub struct Parser {
    think: bool,
    tools: Option<ToolFormat>,
    mode: Mode,
    buf: String,
    /// Only whitespace so far: a `<think>` block may still open.
    at_start: bool,
    /// Newlines after `</think>` are dropped, as the templates drop them from history.
    trim_newlines: bool,
    calls: usize,
    /// The opening tag of the block being read, where it is not part of the block: put
    /// back if the block does not parse.
    opened: &'static str,
    /// The opening of a forced call that the prompt, not the model, wrote: if the call
    /// does not parse, it is not shown as the model's content.
    injected: Option<String>,
}

impl Parser {
    /// A parser for `<think>` blocks when `think`, tool calls in `tools`' markup, starting
    /// inside a reasoning block when the prompt opened one.
    pub fn new(think: bool, tools: Option<ToolFormat>, in_reasoning: bool) -> Self {
        Self {
            think,
            tools,
            mode: if think && in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            at_start: true,
            trim_newlines: false,
            calls: 0,
            opened: "",
            injected: None,
        }
    }

    /// Starts inside a tool call whose opening (`body`, from [`ToolFormat::forced`]) the
    /// prompt already holds.
    pub fn forced(mut self, body: String) -> Self {
        self.mode = Mode::Tool;
        self.buf.clone_from(&body);
        self.injected = Some(body);
        self.at_start = false;
        self
    }

    /// Takes the next piece of text.
    pub fn feed(&mut self, text: &str) -> Delta {
        self.buf.push_str(text);
        self.drain(false)
    }

    /// Ends the output: whatever is held back is settled.
    pub fn finish(&mut self) -> Delta {
        self.drain(true)
    }

    /// The tool-call format the parser reads, if any.
    pub fn format(&self) -> Option<ToolFormat> {
        self.tools
    }

    /// Markup that may open in content, and the mode it starts.
    fn openers(&self) -> Vec<(Opener, Mode)> {
        let mut m = Vec::with_capacity(3);
        if self.think && self.at_start {
            let think = Opener {
                tag: THINK_OPEN,
                in_block: false,
            };
            m.push((think, Mode::Reasoning));
        }
        if let Some(f) = self.tools {
            m.extend(
                f.openers(self.at_start)
                    .into_iter()
                    .map(|o| (o, Mode::Tool)),
            );
        }
        m
    }

    fn drain(&mut self, last: bool) -> Delta {
        let mut d = Delta::default();
        loop {
            match self.mode {
                Mode::Content => {
                    let openers = self.openers();
                    let found = openers
                        .iter()
                        .filter_map(|&(o, mode)| self.buf.find(o.tag).map(|at| (at, o, mode)))
                        .min_by_key(|&(at, ..)| at);
                    if let Some((at, opener, mode)) = found {
                        let taken = if opener.in_block {
                            at
                        } else {
                            at + opener.tag.len()
                        };
                        self.opened = if opener.in_block { "" } else { opener.tag };
                        let before: String = self.buf.drain(..taken).collect();
                        let before = &before[..at];
                        // Whitespace before markup that opens the output or follows a
                        // call is layout, not content (and was held back for that reason).
                        if !(before.trim().is_empty() && (self.at_start || self.calls > 0)) {
                            self.content(before, &mut d);
                        }
                        self.mode = mode;
                        continue;
                    }
                    let keep = if last {
                        0
                    } else {
                        held(&self.buf, openers.iter().map(|(o, _)| o.tag))
                    };
                    let upto = self.buf.len() - keep;
                    let blank = self.buf[..upto].trim().is_empty();
                    if blank && (self.calls > 0 || (self.at_start && !last)) {
                        if last {
                            self.buf.clear();
                        }
                        break;
                    }
                    let text: String = self.buf.drain(..upto).collect();
                    self.content(&text, &mut d);
                    break;
                }
                Mode::Reasoning => {
                    if let Some(at) = self.buf.find(THINK_CLOSE) {
                        d.reasoning.extend(self.buf.drain(..at));
                        self.buf.drain(..THINK_CLOSE.len());
                        self.mode = Mode::Content;
                        self.at_start = false;
                        self.trim_newlines = true;
                        continue;
                    }
                    let keep = if last {
                        0
                    } else {
                        held(&self.buf, [THINK_CLOSE])
                    };
                    d.reasoning.extend(self.buf.drain(..self.buf.len() - keep));
                    break;
                }
                Mode::Tool => {
                    let Some(format) = self.tools else {
                        self.mode = Mode::Content;
                        continue;
                    };
                    let close = format.close();
                    let (block, closed) = match close.and_then(|c| Some((self.buf.find(c)?, c))) {
                        Some((at, close)) => {
                            let block: String = self.buf.drain(..at).collect();
                            self.buf.drain(..close.len());
                            (block, true)
                        }
                        // A block without a closing tag runs to the end of the output.
                        None if last => (std::mem::take(&mut self.buf), close.is_none()),
                        None => break,
                    };
                    self.mode = Mode::Content;
                    let injected = self.injected.take();
                    match format.parse(&block, closed) {
                        Some(calls) => {
                            self.calls += calls.len();
                            self.at_start = false;
                            d.calls.extend(calls);
                        }
                        None => {
                            let close = close.filter(|_| closed).unwrap_or("");
                            let raw = match injected {
                                Some(body) => {
                                    format!(
                                        "{}{close}",
                                        block.strip_prefix(&body).unwrap_or(&block)
                                    )
                                }
                                None => format!("{}{block}{close}", self.opened),
                            };
                            self.content(&raw, &mut d);
                        }
                    }
                    if last && self.buf.is_empty() {
                        break;
                    }
                }
            }
        }
        d
    }

    fn content(&mut self, text: &str, d: &mut Delta) {
        let text = if self.trim_newlines {
            let t = text.trim_start_matches('\n');
            self.trim_newlines = t.is_empty();
            t
        } else {
            text
        };
        if !text.trim().is_empty() {
            self.at_start = false;
        }
        d.content.push_str(text);
    }
}

/// Bytes at the end of `buf` that could be the start of one of `tags`.
fn held<'a>(buf: &str, tags: impl IntoIterator<Item = &'a str>) -> usize {
    tags.into_iter()
        .filter_map(|tag| {
            (1..tag.len())
                .rev()
                .filter(|&k| tag.is_char_boundary(k))
                .find(|&k| buf.ends_with(&tag[..k]))
        })
        .max()
        .unwrap_or(0)
}

/// Whether a rendered prompt ends inside an open `<think>` block, as DeepSeek-R1's
/// template leaves it: the output then starts as reasoning.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Feeds `pieces` one at a time and merges what comes out, checking that no piece
    /// releases text a later piece shows to be markup.
    pub(crate) fn run(mut p: Parser, pieces: &[&str]) -> Delta {
        let mut all = Delta::default();
        for piece in pieces {
            let d = p.feed(piece);
            all.reasoning.push_str(&d.reasoning);
            all.content.push_str(&d.content);
            all.calls.extend(d.calls);
        }
        let d = p.finish();
        all.reasoning.push_str(&d.reasoning);
        all.content.push_str(&d.content);
        all.calls.extend(d.calls);
        all
    }

    /// Every split of `text` into two pieces, and one piece per character.
    pub(crate) fn splits(text: &str) -> Vec<Vec<&str>> {
        let mut out: Vec<Vec<&str>> = text
            .char_indices()
            .map(|(i, _)| vec![&text[..i], &text[i..]])
            .collect();
        out.push(
            text.char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect(),
        );
        out
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn hermes() -> Parser {
        Parser::new(true, Some(ToolFormat::Hermes), false)
    }

    // Recorded Qwen3 output (thinking on, one tool call), as the model writes it.
    const QWEN3_THINK_AND_CALL: &str = "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

    #[test]
    fn qwen3_reasoning_and_tool_call_split_the_same_at_every_token_boundary() {
        for pieces in splits(QWEN3_THINK_AND_CALL) {
            let d = run(hermes(), &pieces);
            assert_eq!(
                d.reasoning, "\nThe user wants the weather in Paris. I should call get_weather.\n",
                "{pieces:?}"
            );
            assert_eq!(d.content, "", "{pieces:?}");
            assert_eq!(
                d.calls,
                vec![call(
                    "get_weather",
                    "{\"location\": \"Paris\", \"unit\": \"celsius\"}"
                )],
                "{pieces:?}"
            );
        }
    }

    #[test]
    fn qwen25_content_then_two_calls() {
        // Recorded Qwen2.5-7B-Instruct output for two cities.
        let out = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Nice\"}}\n</tool_call>";
        for pieces in splits(out) {
            let d = run(Parser::new(false, Some(ToolFormat::Hermes), false), &pieces);
            assert_eq!(d.content, "Let me check both.\n", "{pieces:?}");
            assert_eq!(
                d.calls,
                vec![
                    call("get_weather", "{\"location\": \"Paris\"}"),
                    call("get_weather", "{\"location\": \"Nice\"}"),
                ]
            );
        }
    }

    #[test]
    fn markup_that_does_not_parse_stays_content() {
        let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"loc\n</tool_call> ok";
        let d = run(hermes(), &[bad]);
        assert!(d.calls.is_empty());
        assert_eq!(d.content, bad);
        // A call the output cut short (max_tokens) is content too.
        let cut = "<tool_call>\n{\"name\": \"get_weather\", \"argu";
        let d = run(hermes(), &[cut]);
        assert_eq!((d.content.as_str(), d.calls.len()), (cut, 0));
        // A call missing only its closing tag still parses, as vLLM's parser allows.
        let open = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n";
        assert_eq!(run(hermes(), &[open]).calls, vec![call("f", "{}")]);
    }

    #[test]
    fn text_is_held_only_while_it_could_be_markup() {
        let mut p = hermes();
        assert_eq!(p.feed("Hello <to").content, "Hello ");
        assert_eq!(p.feed("day").content, "<today");
        // `<think>` opens reasoning only before any content.
        assert_eq!(p.feed(" <think>x").content, " <think>x");
        assert_eq!(p.finish(), Delta::default());
    }

    #[test]
    fn thinking_off_template_output_is_plain_content_and_r1_starts_in_reasoning() {
        let qwen3_no_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        assert!(!prompt_opens_reasoning(qwen3_no_think));
        let r1 = "<｜User｜>2+2?<｜Assistant｜><think>\n";
        assert!(prompt_opens_reasoning(r1));
        // Recorded DeepSeek-R1 output: its template already wrote `<think>`.
        let d = run(
            Parser::new(true, None, true),
            &["Simple", " sum.\n</think>\n\n", "4"],
        );
        assert_eq!(
            (d.reasoning.as_str(), d.content.as_str()),
            ("Simple sum.\n", "4")
        );
        // A reasoning block the output never closes is all reasoning.
        let d = run(Parser::new(true, None, false), &["<think>\nhmm"]);
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("\nhmm", ""));
    }

    #[test]
    fn deepseek_calls_in_the_v3_and_v31_forms() {
        // Recorded DeepSeek-V3-0324 output for two cities.
        let v3 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Nice\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        for pieces in splits(v3) {
            let d = run(
                Parser::new(false, Some(ToolFormat::DeepSeek), false),
                &pieces,
            );
            assert_eq!(
                d.calls,
                vec![
                    call("get_weather", "{\"location\": \"Paris\"}"),
                    call("get_weather", "{\"location\": \"Nice\"}"),
                ],
                "{pieces:?}"
            );
            assert_eq!(d.content, "");
        }
        let v31 = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\":\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let d = run(
            Parser::new(false, Some(ToolFormat::DeepSeek), false),
            &[v31],
        );
        assert_eq!(d.content, "Sure.");
        assert_eq!(
            d.calls,
            vec![call("get_weather", "{\"location\":\"Paris\"}")]
        );
    }

    #[test]
    fn forced_calls_read_the_opening_the_prompt_holds() {
        let cases = [
            (
                ToolFormat::Hermes,
                "{\"location\": \"Paris\"}}\n</tool_call>",
            ),
            (
                ToolFormat::DeepSeek,
                "{\"location\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            ),
            (ToolFormat::Llama3Json, "{\"location\": \"Paris\"}}"),
            (ToolFormat::Mistral, "{\"location\": \"Paris\"}}]"),
            (ToolFormat::MistralArgs, "{\"location\": \"Paris\"}"),
            (
                ToolFormat::Phi4Mini,
                "{\"location\": \"Paris\"}}]<|/tool_call|>",
            ),
        ];
        for (format, rest) in cases {
            let (suffix, body) = format.forced(Some("get_weather"));
            assert!(suffix.ends_with(&body));
            let d = run(
                Parser::new(false, Some(format), false).forced(body),
                &[rest],
            );
            assert_eq!(
                d.calls,
                vec![call("get_weather", "{\"location\": \"Paris\"}")],
                "{format:?}"
            );
        }
        // A forced call the model does not complete shows only what the model wrote.
        let (_, body) = ToolFormat::Hermes.forced(Some("get_weather"));
        let p = Parser::new(false, Some(ToolFormat::Hermes), false).forced(body);
        let d = run(p, &["1}\n\nThe weather", " is fine."]);
        assert_eq!(
            (d.content.as_str(), d.calls.len()),
            ("1}\n\nThe weather is fine.", 0)
        );
    }
}
