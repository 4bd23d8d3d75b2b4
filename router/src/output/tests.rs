//! An output on its own, fed tokens of the bundled model's real tokenizer as a worker
//! would send them: stop strings across token boundaries, text offsets, fullText, best_of
//! ranking, logprobs and echo, read back from the JSON a client gets.

use std::sync::Arc;

use serde_json::{json, Value};

use super::*;
use crate::placement::LocalReason;

/// The bundled tokenizer's ids for `s`.
fn ids(s: &str) -> Vec<u32> {
    crate::testing::bundled().tokenizer.encode(s).unwrap()
}

fn render(full_text: bool) -> Render {
    Render {
        text: crate::testing::bundled(),
        model: "m".into(),
        full_text,
        metrics: Arc::default(),
    }
}

/// One plain sequence: no stops, logprobs, parser or echo.
fn spec(kind: Kind) -> OutputSpec {
    OutputSpec {
        kind,
        id: "cmpl-1".into(),
        created: 1,
        prompt_tokens: 3,
        stopping: Stopping {
            ids: Vec::new(),
            user_ids: Vec::new(),
            strings: StopStrings::default(),
        },
        logprobs: false,
        n: 1,
        sequences: 1,
        skip_special_tokens: true,
        kept_specials: Default::default(),
        parser: None,
        include_usage: false,
        echo: None,
        ended: None,
    }
}

fn stop_at(strings: &[&str], include: bool) -> Stopping {
    Stopping {
        ids: Vec::new(),
        user_ids: Vec::new(),
        strings: StopStrings::new(strings.iter().map(|s| s.to_string()).collect(), include, 0),
    }
}

fn token(choice: u32, id: u32, logprob: f32) -> TokenStat {
    TokenStat {
        choice,
        id,
        logprob,
        top: Vec::new(),
        step_ms: 1.0,
        batch_size: 1,
        queue_wait_us: 0,
        from_prefill: false,
        cached_tokens: 0,
        placement: Placement::DecodeNode(LocalReason::Colocated),
    }
}

/// Feeds `tokens` to `choice` as a worker sends them, each with `logprob`, then its finish
/// (`Length`) unless a stop string ended it first; returns the content each token let out.
fn generate(out: &mut Output, choice: u32, tokens: &[u32], logprob: f32) -> Vec<String> {
    let mut released = Vec::new();
    for &id in tokens {
        let piece = Piece::Token(token(choice, id, logprob));
        let Piece::Token(t) = &piece else {
            unreachable!()
        };
        if let Some(part) = out.push(t).unwrap() {
            released.push(part.content);
        }
        if let Some((c, reason)) = out.ending(&piece).unwrap() {
            released.push(out.finish(c, reason).unwrap().content);
        }
    }
    let end = Piece::Finish {
        choice,
        reason: FinishReason::Length,
    };
    if let Some((c, reason)) = out.ending(&end).unwrap() {
        released.push(out.finish(c, reason).unwrap().content);
    }
    released
}

fn whole(out: &Output) -> Value {
    serde_json::to_value(out.response()).unwrap()
}

#[test]
fn a_stop_string_across_tokens_is_held_back_and_cut() {
    let tokens = ids("Hello world, and more");
    assert!(tokens.len() >= 3, "{tokens:?}");
    for (include, shown) in [(false, "Hell"), (true, "Hello wo")] {
        let mut s = spec(Kind::Completion);
        s.stopping = stop_at(&["o wo"], include);
        let mut out = Output::new(s, render(false), None);
        let released = generate(&mut out, 0, &tokens, -0.5);
        // "Hello" ends with the start of the stop string, so its "o" is held back.
        assert_eq!(released[0], "Hell", "{released:?}");
        assert_eq!(released.concat(), shown);
        let body = whole(&out);
        let choice = &body["choices"][0];
        assert_eq!(choice["text"], shown);
        assert_eq!(choice["finish_reason"], "stop");
        assert_eq!(choice["stop_reason"], "o wo");
        // Every token counts, the one after the stop string's end too.
        assert_eq!(body["usage"]["completion_tokens"], 2);
    }
}

#[test]
fn a_stop_token_ends_the_text_and_is_kept_only_when_asked() {
    let tokens = ids("one two three");
    let stop = tokens[1];
    for (include, shown) in [(false, "one"), (true, "one two")] {
        let mut s = spec(Kind::Completion);
        s.stopping = Stopping {
            ids: vec![stop, 2],
            user_ids: vec![stop],
            strings: StopStrings::new(Vec::new(), include, 0),
        };
        let mut out = Output::new(s, render(false), None);
        // The worker ends the sequence on its stop token.
        for &id in &tokens[..2] {
            out.push(&token(0, id, -0.1)).unwrap();
        }
        out.finish(0, FinishReason::Stop).unwrap();
        let choice = &whole(&out)["choices"][0];
        assert_eq!(choice["text"], shown);
        assert_eq!(choice["stop_reason"], stop);
    }
}

/// Characters of text released before each of `tokens`: a token's text goes out once the
/// bytes so far are whole characters, so a token that ends inside a character releases
/// nothing, the text before that character included, until a later one completes it. What
/// offsets must say.
fn char_offsets(tokens: &[u32]) -> Vec<usize> {
    let tokenizer = &crate::testing::bundled().tokenizer;
    let mut bytes = Vec::new();
    let mut released = 0;
    tokens
        .iter()
        .map(|&id| {
            let before = released;
            bytes.extend(tokenizer.token_bytes(id).unwrap());
            if let Ok(s) = std::str::from_utf8(&bytes) {
                released = s.chars().count();
            }
            before
        })
        .collect()
}

#[test]
fn offsets_count_characters_before_each_token_past_the_echo() {
    let tokens = ids("Grüße aus Köln ꙮ🦀 und so");
    let expected = char_offsets(&tokens);
    // A character split across tokens: the token after its first part starts where it did.
    assert!(
        expected.windows(2).any(|w| w[0] == w[1]),
        "{tokens:?} {expected:?}"
    );
    let prompt = "Sagé:";
    let mut s = spec(Kind::Completion);
    s.logprobs = true;
    s.echo = Some(Echo::new(prompt.into(), ids(prompt)));
    let mut out = Output::new(s, render(false), None);
    generate(&mut out, 0, &tokens, -1.0);
    let choice = &whole(&out)["choices"][0];
    assert_eq!(choice["text"], format!("{prompt}Grüße aus Köln ꙮ🦀 und so"));
    let echoed = prompt.chars().count();
    let offsets: Vec<usize> = expected.iter().map(|o| o + echoed).collect();
    assert_eq!(choice["logprobs"]["text_offset"], json!(offsets));
}

#[test]
fn echo_with_logprobs_scores_the_prompt_first_token_unscored() {
    let prompt = "Say hi to me";
    let prompt_ids = ids(prompt);
    let mut s = spec(Kind::Completion);
    s.logprobs = true;
    s.echo = Some(Echo::new(prompt.into(), prompt_ids.clone()));
    let mut out = Output::new(s, render(false), None);
    let scored: Vec<proto::v1::Token> = prompt_ids[1..]
        .iter()
        .map(|&id| proto::v1::Token {
            id,
            logprob: -2.0,
            top: Vec::new(),
        })
        .collect();
    out.scored_prompt(&scored).unwrap();
    let output = ids(" hello");
    let released = generate(&mut out, 0, &output, -0.25);
    // A stream shows the prompt with the first token.
    assert!(released[0].starts_with(prompt), "{released:?}");
    let lp = &whole(&out)["choices"][0]["logprobs"];
    let n = prompt_ids.len() + output.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["token_logprobs"][1], -2.0);
    assert_eq!(lp["token_logprobs"][n - 1], -0.25);
    let mut offsets = char_offsets(&prompt_ids);
    let echoed = prompt.chars().count();
    offsets.extend(char_offsets(&output).iter().map(|o| o + echoed));
    assert_eq!(lp["text_offset"], json!(offsets));
    // Scores that do not follow the prompt are the worker's fault.
    assert!(out.scored_prompt(&scored[1..]).is_err());
}

#[test]
fn full_text_repeats_the_whole_text_in_each_chunk() {
    let tokens = ids("The quick brown fox");
    for full_text in [false, true] {
        let mut out = Output::new(spec(Kind::Chat), render(full_text), None);
        let head = out.chunk_head();
        let mut contents = Vec::new();
        for &id in &tokens {
            let part = out.push(&token(0, id, -0.1)).unwrap().unwrap();
            let chunk: Value = serde_json::from_str(&out.token_chunk(&head, 0, &part)).unwrap();
            contents.push(chunk["choices"][0]["delta"]["content"].clone());
        }
        let rest = out.finish(0, FinishReason::Length).unwrap();
        let last: Value = serde_json::from_str(&out.finish_chunk(0, &rest)).unwrap();
        let tokenizer = &crate::testing::bundled().tokenizer;
        let deltas: Vec<String> = tokens
            .iter()
            .map(|&id| tokenizer.decode(&[id], true).unwrap())
            .collect();
        assert_eq!(deltas.concat(), "The quick brown fox");
        let expected: Vec<String> = if full_text {
            (1..=deltas.len()).map(|i| deltas[..i].concat()).collect()
        } else {
            deltas.clone()
        };
        assert_eq!(contents, expected);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["completion_tokens"], tokens.len());
        let shown = last.get("full_text").cloned();
        assert_eq!(shown, full_text.then(|| json!("The quick brown fox")));
    }
}

#[test]
fn best_of_returns_the_n_likeliest_with_offsets_continued() {
    let mut s = spec(Kind::Completion);
    s.sequences = 3;
    s.n = 2;
    s.logprobs = true;
    let mut out = Output::new(s, render(false), None);
    let texts = ["first one", "second", "third text"];
    for (choice, (text, logprob)) in texts.iter().zip([-3.0, -0.5, -1.0]).enumerate() {
        generate(&mut out, choice as u32, &ids(text), logprob);
    }
    let body = whole(&out);
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[0]["text"], "second");
    assert_eq!(choices[1]["text"], "third text");
    assert_eq!(choices[1]["index"], 1);
    // Seed 002: the second choice's offsets start after the first one's text.
    assert_eq!(choices[1]["logprobs"]["text_offset"][0], "second".len());
    // Every sequence's tokens are counted, the dropped one's too.
    let all: usize = texts.iter().map(|t| ids(t).len()).sum();
    assert_eq!(body["usage"]["completion_tokens"], all);
}

#[test]
fn a_stop_string_ending_one_of_several_choices_tells_the_workers() {
    let (tx, rx) = watch::channel(EndedChoices::default());
    let mut s = spec(Kind::Completion);
    s.sequences = 2;
    s.n = 2;
    s.stopping = stop_at(&["b"], false);
    s.ended = Some(Arc::new(tx));
    let mut out = Output::new(s, render(false), None);
    generate(&mut out, 1, &ids("a b c"), -1.0);
    assert_eq!(*rx.borrow(), EndedChoices::default().with(1));
    assert!(!out.all_finished());
    // A new attempt starts every choice again.
    out.restart();
    assert_eq!(*rx.borrow(), EndedChoices::default());
    assert_eq!(out.tally.completion_tokens, 0);
    assert!(out.choices.iter().all(|c| c.finish.is_none()));
}

/// A token of the bundled vocabulary whose bytes are only part of a character.
fn part_of_a_character() -> (u32, Vec<u8>) {
    let tokenizer = &crate::testing::bundled().tokenizer;
    (0..tokenizer.vocab_size() as u32)
        .find_map(|id| {
            let bytes = tokenizer.token_bytes(id)?;
            std::str::from_utf8(&bytes).is_err().then_some((id, bytes))
        })
        .expect("a byte-level vocabulary has partial characters")
}

#[test]
fn chat_logprobs_show_each_token_and_a_split_character_as_bytes() {
    let (partial, bytes) = part_of_a_character();
    let word = ids("Hi")[0];
    let mut s = spec(Kind::Chat);
    s.logprobs = true;
    let mut out = Output::new(s, render(false), None);
    let mut t = token(0, word, -0.75);
    t.top = vec![(word, -0.75), (partial, -1.5)];
    out.push(&t).unwrap();
    out.push(&token(0, partial, -2.5)).unwrap();
    out.finish(0, FinishReason::Length).unwrap();
    let content = &whole(&out)["choices"][0]["logprobs"]["content"];
    assert_eq!(content[0]["token"], "Hi");
    assert_eq!(content[0]["logprob"], -0.75);
    assert_eq!(content[0]["bytes"], json!(b"Hi"));
    let hex: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
    assert_eq!(
        content[0]["top_logprobs"][1]["token"],
        format!("bytes:{hex}")
    );
    assert_eq!(content[1]["token"], format!("bytes:{hex}"));
    assert_eq!(content[1]["bytes"], json!(bytes));
}
