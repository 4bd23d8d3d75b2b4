//! Encoding without the `tokenizers` crate's bookkeeping, for the usual byte-level BPE
//! tokenizer (GPT-2, Qwen, Llama 3, DeepSeek): the same steps in the same order (added tokens
//! split out, the pre-tokenizer's regex splits, the byte-to-character map, the model's own
//! BPE with its cache), without the per-byte alignment tables `tokenizers` keeps for
//! offsets the server never asks for. That bookkeeping was most of a short prompt's
//! encoding time, which the router spends on every request's path.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value;
use tokenizers::{Model, ModelWrapper};

/// A tokenizer's encoding, when its shape is one this module reproduces exactly.
pub(crate) struct FastEncoder {
    /// Added tokens matched in the text as written, then those matched after normalizing.
    raw: Added,
    normalized: Added,
    /// The pre-tokenizer's splits, in order; every one isolates its matches.
    splits: Vec<fancy_regex::Regex>,
    /// The normalizer is NFC: ASCII text is its own NFC form, other text goes the long way.
    ascii_only: bool,
    byte_chars: [char; 256],
}

/// Added tokens and their ids, matched leftmost-longest as `tokenizers` does.
struct Added(Option<(AhoCorasick, Vec<u32>)>);

impl FastEncoder {
    /// The encoder for `tok`, if nothing in it needs the general path: no truncation or
    /// padding, no normalizer but NFC, splits then a plain byte-level step, a BPE model
    /// without dropout, and added tokens without stripping or whole-word rules.
    pub(crate) fn of(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if tok.get_truncation().is_some()
            || tok.get_padding().is_some()
            || tok.get_encode_special_tokens()
        {
            return None;
        }
        match tok.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none() => {}
            _ => return None,
        }
        let ascii_only = match tok.get_normalizer() {
            None => false,
            Some(n) => match serde_json::to_value(n).ok()? {
                v if v["type"] == "NFC" => true,
                v if v["type"] == "Sequence" && v["normalizers"].as_array()?.is_empty() => false,
                _ => return None,
            },
        };
        if let Some(p) = tok.get_post_processor() {
            // With no special tokens asked for, these leave the ids as they are.
            let p = serde_json::to_value(p).ok()?;
            if !["ByteLevel", "TemplateProcessing"].contains(&p["type"].as_str()?) {
                return None;
            }
        }
        let splits = splits(&serde_json::to_value(tok.get_pre_tokenizer()?).ok()?)?;
        let mut raw = (Vec::new(), Vec::new());
        let mut normalized = (Vec::new(), Vec::new());
        for token in tok.get_added_tokens_decoder().into_values() {
            if token.lstrip || token.rstrip || token.single_word || token.content.is_empty() {
                return None;
            }
            // Normalized tokens would be matched on NFC text, which is the text itself
            // for the ASCII text this path takes under NFC.
            if token.normalized && ascii_only && !token.content.is_ascii() {
                return None;
            }
            let id = tok.token_to_id(&token.content)?;
            let side = if token.normalized {
                &mut normalized
            } else {
                &mut raw
            };
            side.0.push(token.content);
            side.1.push(id);
        }
        Some(Self {
            raw: Added::new(raw)?,
            normalized: Added::new(normalized)?,
            splits,
            ascii_only,
            byte_chars: std::array::from_fn(|b| crate::alphabet::char_of_byte(b as u8)),
        })
    }

    /// The ids `tokenizers` gives `text` without special tokens added, or `None` where
    /// this text needs the general path (non-ASCII text under NFC, a regex that gave up).
    pub(crate) fn encode(&self, model: &ModelWrapper, text: &str) -> Option<Vec<u32>> {
        if self.ascii_only && !text.is_ascii() {
            return None;
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut word = String::new();
        for (part, id) in self.raw.split(text) {
            if let Some(id) = id {
                ids.push(id);
                continue;
            }
            for (part, id) in self.normalized.split(part) {
                if let Some(id) = id {
                    ids.push(id);
                    continue;
                }
                let mut pieces = vec![part];
                for regex in &self.splits {
                    pieces = isolate(regex, &pieces)?;
                }
                for piece in pieces {
                    word.clear();
                    word.extend(piece.bytes().map(|b| self.byte_chars[b as usize]));
                    ids.extend(model.tokenize(&word).ok()?.into_iter().map(|t| t.id));
                }
            }
        }
        Some(ids)
    }
}

impl Added {
    fn new((contents, ids): (Vec<String>, Vec<u32>)) -> Option<Self> {
        if contents.is_empty() {
            return Some(Self(None));
        }
        let trie = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&contents)
            .ok()?;
        Some(Self(Some((trie, ids))))
    }

    /// `text` cut around the added tokens in it, each with its id, the rest without.
    fn split<'a>(&self, text: &'a str) -> Vec<(&'a str, Option<u32>)> {
        let Some((trie, ids)) = &self.0 else {
            return vec![(text, None)];
        };
        let mut parts = Vec::new();
        let mut at = 0;
        for m in trie.find_iter(text) {
            if m.start() > at {
                parts.push((&text[at..m.start()], None));
            }
            parts.push((&text[m.start()..m.end()], Some(ids[m.pattern().as_usize()])));
            at = m.end();
        }
        if at < text.len() {
            parts.push((&text[at..], None));
        }
        parts
    }
}

/// The regexes of a pre-tokenizer made of `Split`s that isolate their matches, then a
/// byte-level step that only maps bytes to characters; `None` for any other shape.
fn splits(pre: &Value) -> Option<Vec<fancy_regex::Regex>> {
    let steps = match pre["type"].as_str()? {
        "Sequence" => pre["pretokenizers"].as_array()?.as_slice(),
        _ => std::slice::from_ref(pre),
    };
    let (last, splits) = steps.split_last()?;
    let plain_byte_level = last["type"] == "ByteLevel"
        && last["add_prefix_space"] == false
        && last["use_regex"] == false;
    if !plain_byte_level {
        return None;
    }
    splits
        .iter()
        .map(|s| {
            let isolated =
                s["type"] == "Split" && s["behavior"] == "Isolated" && s["invert"] == false;
            let pattern = s["pattern"]["Regex"].as_str().filter(|_| isolated)?;
            fancy_regex::Regex::new(pattern).ok()
        })
        .collect()
}

/// Each of `pieces` cut at `regex`'s matches, the matches and the text between them each a
/// piece of their own; `None` if the regex gave up (its backtracking limit).
fn isolate<'a>(regex: &fancy_regex::Regex, pieces: &[&'a str]) -> Option<Vec<&'a str>> {
    let mut out = Vec::with_capacity(pieces.len() * 2);
    for &piece in pieces {
        let mut at = 0;
        for m in regex.find_iter(piece) {
            let m = m.ok()?;
            if m.start() > at {
                out.push(&piece[at..m.start()]);
            }
            if m.end() > m.start() {
                out.push(m.as_str());
            }
            at = m.end();
        }
        if at < piece.len() {
            out.push(&piece[at..]);
        }
    }
    Some(out)
}
