//! A chat's prompt and how its output is read: the template renders the messages (after
//! the router writes tools and tool turns into them, for a template that teaches no tool
//! format), a forced tool call ends the prompt with the call's opening and a grammar holds
//! it to the tools' schemas, and a parser splits reasoning and calls out of the output.

use text::structured::{prompt_opens_reasoning, Parser};

use crate::error::RouterError;
use crate::params::{self, Chat, Common, ToolChoice};
use crate::state::AppState;

/// The prompt's text and the parser for the output, if it needs one. A forced tool call
/// puts its grammar in `common`.
pub(crate) fn prompt(
    state: &AppState,
    chat: &Chat,
    common: &mut Common,
) -> Result<(String, Option<Parser>), RouterError> {
    let mut text = render(state, &chat.input)?;
    let grammar = forced_call_grammar(state, chat);
    let parser = parser(state, &chat.tool_choice, grammar.is_some(), &mut text)?;
    if let Some(g) = grammar {
        if let Some(other) = &common.grammar {
            return Err(RouterError::param(
                "tool_choice",
                format!(
                    "tool_choice {} forces a tool call, which {} would constrain too; send \
                     one of them",
                    chat.tool_choice.name(),
                    other.param
                ),
            ));
        }
        common.grammar = Some(g);
    }
    Ok((text, parser))
}

/// A chat rendered by the model's template: with the tools and tool turns written into
/// the messages for a template that teaches no tool format, and the special tokens' texts
/// in the client's strings escaped (`text::specials`; undone by [`encode`] and [`shown`]).
/// `/tokenize` counts the same prompt.
pub(crate) fn render(state: &AppState, input: &text::ChatInput) -> Result<String, RouterError> {
    let template = state
        .text
        .template
        .as_ref()
        .ok_or(RouterError::NoChatTemplate)?;
    let escaped;
    let input = match &state.specials {
        Some(s) => {
            escaped = text::ChatInput {
                messages: s.escape(&input.messages),
                tools: input.tools.as_ref().map(|t| s.escape(t)),
                add_generation_prompt: input.add_generation_prompt,
                kwargs: input
                    .kwargs
                    .iter()
                    .map(|(k, v)| (k.clone(), s.escape(v)))
                    .collect(),
            };
            &escaped
        }
        None => input,
    };
    let adapted = state.tool_format.and_then(|f| f.adapt(input));
    let input = adapted.as_ref().unwrap_or(input);
    let rendered = if state.tools_in_prompt {
        text::tools::render_prompted(template, input)
    } else {
        text::tools::render(template, input)
    };
    rendered.map_err(|e| RouterError::Template(e.to_string()))
}

/// The ids of a prompt [`render`] made.
pub(crate) fn encode(state: &AppState, prompt: &str) -> Result<Vec<u32>, RouterError> {
    let tokenizer = &state.text.tokenizer;
    match &state.specials {
        Some(s) => s.encode(tokenizer, prompt),
        None => tokenizer.encode(prompt),
    }
    .map_err(|e| RouterError::param("messages", e.to_string()))
}

/// A prompt [`render`] made, as the model reads it: for logs.
pub(crate) fn shown(state: &AppState, prompt: &str) -> String {
    match &state.specials {
        Some(s) => s.unescape(prompt),
        None => prompt.to_string(),
    }
}

/// The grammar that holds a forced tool call (`tool_choice` required or named) to the
/// tools' schemas: in the formats whose call is JSON after the prompt's opening (Hermes,
/// Llama 3, Mistral's list). DeepSeek's calls and Mistral's `[ARGS]`, in their own markup,
/// are forced by the prompt alone.
fn forced_call_grammar(state: &AppState, chat: &Chat) -> Option<params::Constrained> {
    let name = match &chat.tool_choice {
        ToolChoice::Required => None,
        ToolChoice::Named(n) => Some(n.as_str()),
        ToolChoice::None | ToolChoice::Auto => return None,
    };
    let tools = chat.input.tools.as_ref()?.as_array()?;
    let shape = state.tool_format?.call_json()?;
    Some(params::forced_call(tools, name, shape))
}

/// The parser for a chat's output, if it needs one, with the prompt extended by what
/// forces a required or named tool call (`by_grammar`: a grammar holds the call, and names
/// the function where there is one).
fn parser(
    state: &AppState,
    choice: &ToolChoice,
    by_grammar: bool,
    prompt: &mut String,
) -> Result<Option<Parser>, RouterError> {
    let tools = match (choice, state.tool_format) {
        (ToolChoice::None, _) => None,
        (_, Some(f)) => Some(f),
        (_, None) => {
            return Err(RouterError::param(
                "tools",
                "tool calls cannot be returned: the router runs with --tool-call-parser none",
            ))
        }
    };
    if tools.is_none() && !state.think {
        return Ok(None);
    }
    let parser = Parser::new(state.think, tools, prompt_opens_reasoning(prompt));
    let forced = match (choice, tools) {
        (ToolChoice::Required, Some(f)) => Some(f.forced(None)),
        (ToolChoice::Named(_), Some(f)) if by_grammar => Some(f.forced(None)),
        (ToolChoice::Named(name), Some(f)) => Some(f.forced(Some(name))),
        _ => None,
    };
    Ok(Some(match forced {
        Some((suffix, body)) => {
            prompt.push_str(&suffix);
            parser.forced(body)
        }
        None => parser,
    }))
}
