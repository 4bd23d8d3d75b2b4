//! Text ↔ token ids: Hugging Face `tokenizer.json` files, tokenizers rebuilt from GGUF
//! metadata, and incremental detokenization for streaming.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::alphabet::{byte_of_char, char_of_byte};
use crate::encode::FastEncoder;
use crate::error::{Result, TextError};
use crate::gguf::{Metadata, Value as GgufValue};

/// A loaded tokenizer plus the special tokens the server needs to know about.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Every token's bytes, when the decoder is byte-level alone; `decode` then needs no
    /// `tokenizers` call.
    byte_level: Option<Arc<TokenBytes>>,
    /// `encode` without the `tokenizers` crate's offsets bookkeeping, for the byte-level
    /// BPE tokenizers whose steps it reproduces.
    fast: Option<Arc<FastEncoder>>,
}

/// Per token id, what a byte-level decoder turns it into, and whether it is special: one
/// buffer for the whole vocabulary.
struct TokenBytes {
    bytes: Vec<u8>,
    /// Token `id`'s bytes end at `ends[id]` and start where the previous ones end.
    ends: Vec<usize>,
    kinds: Vec<Kind>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// An id the vocabulary lacks: decoding leaves it out.
    Unknown,
    Normal,
    Special,
}

impl TokenBytes {
    /// The table for `inner` if its decoder is `ByteLevel` and nothing else.
    fn of(inner: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        ) {
            return None;
        }
        let to_byte: std::collections::HashMap<char, u8> =
            (0..=255u8).map(|b| (char_of_byte(b), b)).collect();
        let last = inner.get_vocab(true).into_values().max()?;
        let added = inner.get_added_vocabulary();
        let mut table = Self {
            bytes: Vec::new(),
            ends: Vec::with_capacity(last as usize + 1),
            kinds: Vec::with_capacity(last as usize + 1),
        };
        for id in 0..=last {
            let kind = match inner.id_to_token(id) {
                None => Kind::Unknown,
                Some(token) => {
                    // As `ByteLevel::decode_chain`: a token with a character outside the
                    // alphabet keeps its UTF-8 bytes.
                    let mapped: Option<Vec<u8>> =
                        token.chars().map(|c| to_byte.get(&c).copied()).collect();
                    table
                        .bytes
                        .extend(mapped.unwrap_or_else(|| token.as_bytes().to_vec()));
                    if added.is_special_token(&token) {
                        Kind::Special
                    } else {
                        Kind::Normal
                    }
                }
            };
            table.ends.push(table.bytes.len());
            table.kinds.push(kind);
        }
        Some(table)
    }

    /// `tokenizers::Tokenizer::decode` for a byte-level decoder: the tokens' bytes in
    /// order (unknown ids and, with `skip_special`, special tokens left out), as text
    /// with invalid sequences replaced.
    fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let id = id as usize;
            let Some(&kind) = self.kinds.get(id) else {
                continue;
            };
            if kind == Kind::Unknown || (skip_special && kind == Kind::Special) {
                continue;
            }
            let start = if id == 0 { 0 } else { self.ends[id - 1] };
            out.extend_from_slice(&self.bytes[start..self.ends[id]]);
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

fn tok_err(e: impl std::fmt::Display) -> TextError {
    TextError::Tokenizer(e.to_string())
}

/// GPT-2's split, used when a GGUF names no pre-tokenizer we know.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's split: case-insensitive contractions, single digits, newline runs.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TextError::invalid_model(path, format!("tokenizer.json: {e}")))?;
        Ok(Self::new(inner))
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_str(json).map_err(tok_err)?;
        Ok(Self::new(inner))
    }

    fn new(inner: tokenizers::Tokenizer) -> Self {
        let byte_level = TokenBytes::of(&inner).map(Arc::new);
        let fast = FastEncoder::of(&inner).map(Arc::new);
        Self {
            inner,
            byte_level,
            fast,
        }
    }

    /// Rebuilds a byte-level BPE tokenizer from a GGUF file's vocabulary and merges.
    pub fn from_gguf(meta: &Metadata, path: &Path) -> Result<Self> {
        let md = |k: &str| meta.get(k);
        let bad = |r: &str| TextError::invalid_model(path, r.to_string());
        let model = md("tokenizer.ggml.model")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| bad("no tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(bad(&format!(
                "GGUF tokenizer model {model:?} is not supported; expected gpt2 (byte-level BPE)"
            )));
        }
        let strings = |k: &str| -> Result<Vec<String>> {
            md(k)
                .and_then(GgufValue::as_array)
                .ok_or_else(|| bad(&format!("no {k}")))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad(&format!("{k}: not strings")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match md("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(v) => v.iter().map(|x| x.to_i32().map_or(1, i64::from)).collect(),
            None => vec![1; tokens.len()],
        };
        let pre = md("tokenizer.ggml.pre")
            .and_then(GgufValue::as_str)
            .unwrap_or("default");
        let vocab: serde_json::Map<String, Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        // Control (3) and user-defined (4) tokens are matched whole before BPE runs.
        let added: Vec<Value> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
            .map(|(i, (t, &ty))| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": ty == 4, "special": ty == 3})
            })
            .collect();
        let byte_level = |use_regex: bool| {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": use_regex})
        };
        let split = |pattern: &str| {
            json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                   "invert": false})
        };
        let pre_tokenizer = match pre {
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            "qwen2" => json!({"type": "Sequence", "pretokenizers": [
                split(QWEN2_SPLIT), byte_level(false)]}),
            "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
                split(LLAMA3_SPLIT), byte_level(false)]}),
            _ => json!({"type": "Sequence", "pretokenizers": [
                split(GPT2_SPLIT), byte_level(false)]}),
        };
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": byte_level(false),
            "decoder": byte_level(true),
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        Self::from_json(&doc.to_string())
    }

    /// Token ids for `text`; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let model = self.inner.get_model();
        if let Some(ids) = self.fast.as_ref().and_then(|f| f.encode(model, text)) {
            return Ok(ids);
        }
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether `encode` can skip the `tokenizers` crate's bookkeeping for this tokenizer
    /// (for ASCII text at least).
    pub fn encodes_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// Text for `ids`; `skip_special` drops special tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.byte_level {
            Some(t) => Ok(t.decode(ids, skip_special)),
            None => self.inner.decode(ids, skip_special).map_err(tok_err),
        }
    }

    /// The id of a token given as text, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of one token id, as stored in the vocabulary.
    pub fn id_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for: byte-level BPE pieces mapped back through GPT-2's
    /// byte-to-character table, so a piece of a multi-byte character keeps its own bytes.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let is_special = self
            .inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special);
        let mapped: Option<Vec<u8>> = piece.chars().map(byte_of_char).collect();
        Some(match mapped {
            Some(bytes) if !is_special => bytes,
            _ => piece.into_bytes(),
        })
    }

    /// Size of the vocabulary including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers` object.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns a growing list of ids into text pieces that never split a UTF-8 character.
///
/// It decodes a short window behind the newest token, because byte-level and SentencePiece
/// decoders only produce the right text for a token with its neighbours in view.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
    /// Special tokens shown even when `skip_special`: the markers of a tool-call format,
    /// which the output's parser must see.
    kept: std::sync::Arc<[u32]>,
}

impl IncrementalDecoder {
    /// Starts a stream; `skip_special` drops special tokens from the text.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            ..Default::default()
        }
    }

    /// Shows the special tokens `ids` even when special tokens are skipped (shared: every
    /// request of a server keeps the same few).
    pub fn keeping(mut self, ids: std::sync::Arc<[u32]>) -> Self {
        self.kept = ids;
        self
    }

    /// The text already emitted from the window, and the window's text with the new ids.
    fn window(&self, tok: &Tokenizer) -> Result<(String, String)> {
        let ids = &self.ids[self.prefix_offset..];
        let emitted = self.read_offset - self.prefix_offset;
        Ok((
            tok.decode(&ids[..emitted], self.skip_special)?,
            tok.decode(ids, self.skip_special)?,
        ))
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        if self.skip_special && self.kept.contains(&id) {
            // A special token decodes on its own: the text held before it is complete.
            let mut text = self.flush(tok)?.unwrap_or_default();
            text.push_str(&tok.decode(&[id], false)?);
            return Ok(Some(text));
        }
        self.ids.push(id);
        let (prefix, text) = self.window(tok)?;
        if text.len() > prefix.len() && !text.ends_with('\u{FFFD}') && text.starts_with(&prefix) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(text[prefix.len()..].to_string()))
        } else {
            Ok(None)
        }
    }

    /// Text still held back at the end of the stream (an incomplete character shows as
    /// U+FFFD, as a full decode would show it).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let (prefix, text) = self.window(tok)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        match text.strip_prefix(&prefix) {
            Some(rest) if !rest.is_empty() => Ok(Some(rest.to_string())),
            _ => Ok(None),
        }
    }
}
