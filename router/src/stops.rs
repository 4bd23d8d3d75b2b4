//! Stop strings matched on the decoded text across token boundaries. Text that could still
//! turn into a stop string is held back, so a client never sees part of one.

/// What the text so far allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// No stop string yet: the text up to this byte can be released.
    Release(usize),
    /// Stop string `which` was found: the output ends at this byte.
    Stop { end: usize, which: usize },
}

/// A request's stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    include: bool,
    max_len: usize,
    min_tokens: usize,
}

impl StopStrings {
    /// `include` keeps the matched stop string in the output. No stop string ends a choice
    /// within its first `min_tokens` tokens (vLLM checks none there either).
    pub fn new(stops: Vec<String>, include: bool, min_tokens: usize) -> Self {
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            include,
            max_len,
            min_tokens,
        }
    }

    /// Whether what stopped the output (a stop string, or one of the request's own stop
    /// tokens) is kept in it.
    pub fn include(&self) -> bool {
        self.include
    }

    /// Tokens of a choice that no stop string ends.
    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// The stop string at `i`.
    pub fn get(&self, i: usize) -> &str {
        &self.stops[i]
    }

    /// Scans `text`, whose first `old_len` bytes were scanned before without a match. Only
    /// a match that ends after byte `floor` counts: the text before it is that of the tokens
    /// `min_tokens` exempts from stopping.
    pub fn scan(&self, text: &str, old_len: usize, floor: usize) -> Scan {
        if self.stops.is_empty() {
            return Scan::Release(text.len());
        }
        // A new match must end in the new text, so it starts at most max_len - 1 bytes back.
        let mut start = old_len.saturating_sub(self.max_len.saturating_sub(1));
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                text[start..]
                    .match_indices(s.as_str())
                    .map(|(p, _)| start + p)
                    .find(|&p| p + s.len() > floor)
                    .map(|p| (p, i))
            })
            .min_by_key(|&(p, i)| (p, std::cmp::Reverse(self.stops[i].len())));
        if let Some((pos, which)) = found {
            let end = if self.include {
                pos + self.stops[which].len()
            } else {
                pos
            };
            return Scan::Stop { end, which };
        }
        // Hold back the longest tail that is the start of some stop string.
        let hold = (1..self.max_len.min(text.len() + 1))
            .rev()
            .filter(|&k| text.is_char_boundary(text.len() - k))
            .find(|&k| {
                let tail = &text[text.len() - k..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0);
        Scan::Release(text.len() - hold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_split_across_tokens_is_found_and_never_released() {
        let s = StopStrings::new(vec!["stop1".into(), "的首都".into()], false, 0);
        let mut text = String::from("abc st");
        assert_eq!(
            s.scan(&text, 0, 0),
            Scan::Release(4),
            "\"st\" may start stop1"
        );
        let old = text.len();
        text.push_str("op");
        assert_eq!(s.scan(&text, old, 0), Scan::Release(4));
        let old = text.len();
        text.push_str("1 more");
        assert_eq!(s.scan(&text, old, 0), Scan::Stop { end: 4, which: 0 });
    }

    #[test]
    fn multibyte_stops_and_include() {
        let s = StopStrings::new(vec!["的首都".into()], true, 0);
        let text = "北京是中国的首";
        assert_eq!(s.scan(text, 0, 0), Scan::Release(text.len() - "的首".len()));
        let full = "北京是中国的首都，";
        assert_eq!(
            s.scan(full, text.len(), 0),
            Scan::Stop {
                end: "北京是中国的首都".len(),
                which: 0
            }
        );
    }

    #[test]
    fn the_earliest_match_wins() {
        let s = StopStrings::new(vec!["cd".into(), "b".into()], false, 0);
        assert_eq!(s.scan("abcd", 0, 0), Scan::Stop { end: 1, which: 1 });
        assert_eq!(StopStrings::default().scan("abc", 0, 0), Scan::Release(3));
    }

    #[test]
    fn a_match_must_end_past_the_floor() {
        let s = StopStrings::new(vec!["ab".into()], false, 0);
        assert_eq!(
            s.scan("xab ab", 0, 3),
            Scan::Stop { end: 4, which: 0 },
            "the first \"ab\" ends at the floor and does not count"
        );
        assert_eq!(
            s.scan("xab", 0, 3),
            Scan::Release(3),
            "no match past the floor"
        );
        assert_eq!(s.scan("xab", 0, 2), Scan::Stop { end: 1, which: 0 });
    }
}
