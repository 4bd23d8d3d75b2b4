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
}

impl StopStrings {
    /// `include` keeps the matched stop string in the output.
    pub fn new(stops: Vec<String>, include: bool) -> Self {
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            include,
            max_len,
        }
    }

    /// The stop string at `i`.
    pub fn get(&self, i: usize) -> &str {
        &self.stops[i]
    }

    /// Scans `text`, whose first `old_len` bytes were scanned before without a match.
    pub fn scan(&self, text: &str, old_len: usize) -> Scan {
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
            .filter_map(|(i, s)| text[start..].find(s.as_str()).map(|p| (start + p, i)))
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
        let s = StopStrings::new(vec!["stop1".into(), "的首都".into()], false);
        let mut text = String::from("abc st");
        assert_eq!(s.scan(&text, 0), Scan::Release(4), "\"st\" may start stop1");
        let old = text.len();
        text.push_str("op");
        assert_eq!(s.scan(&text, old), Scan::Release(4));
        let old = text.len();
        text.push_str("1 more");
        assert_eq!(s.scan(&text, old), Scan::Stop { end: 4, which: 0 });
    }

    #[test]
    fn multibyte_stops_and_include() {
        let s = StopStrings::new(vec!["的首都".into()], true);
        let text = "北京是中国的首";
        assert_eq!(s.scan(text, 0), Scan::Release(text.len() - "的首".len()));
        let full = "北京是中国的首都，";
        assert_eq!(
            s.scan(full, text.len()),
            Scan::Stop {
                end: "北京是中国的首都".len(),
                which: 0
            }
        );
    }

    #[test]
    fn the_earliest_match_wins() {
        let s = StopStrings::new(vec!["cd".into(), "b".into()], false);
        assert_eq!(s.scan("abcd", 0), Scan::Stop { end: 1, which: 1 });
        assert_eq!(StopStrings::default().scan("abc", 0), Scan::Release(3));
    }
}
