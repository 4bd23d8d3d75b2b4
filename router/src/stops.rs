//! Stop strings matched on the decoded text across token boundaries. Text that could still
//! turn into a stop string is held back, so a client never sees part of one.
//!
//! Each choice keeps, per stop string, how much of it the text ends with (a KMP automaton
//! state), and feeds only the bytes each token adds. A token therefore costs the stop
//! strings' count times its own bytes, whatever the strings' lengths: the seeds allow one
//! stop string of 32768 characters (001, 002), or 1024 strings of up to 1024 (003), and a
//! scan of the text's tail per string would cost their lengths squared.

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
    /// Per stop string, KMP's failure function: `fail[i]` is the length of the longest
    /// proper prefix of `stop[..=i]` that is also a suffix of it.
    fail: Vec<Vec<u32>>,
    include: bool,
    min_tokens: usize,
}

/// One choice's progress through the stop strings: for each, the length of its longest
/// prefix that the text so far ends with (always shorter than the string).
#[derive(Debug, Clone, Default)]
pub struct Progress(Vec<u32>);

impl StopStrings {
    /// `include` keeps the matched stop string in the output. No stop string ends a choice
    /// within its first `min_tokens` tokens (vLLM checks none there either).
    pub fn new(stops: Vec<String>, include: bool, min_tokens: usize) -> Self {
        let fail = stops.iter().map(|s| failure(s.as_bytes())).collect();
        Self {
            stops,
            fail,
            include,
            min_tokens,
        }
    }

    /// Whether the request gave no stop string.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The stop string at `i`.
    pub fn get(&self, i: usize) -> &str {
        &self.stops[i]
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

    /// Feeds `text[old_len..]`, the bytes added since the last call, into `progress`. With
    /// `counts` false (within `min_tokens`) a completed stop string does not end the
    /// output. The first stop string to complete wins; of two completing at the same byte,
    /// the longer one (it starts earlier).
    pub fn scan(&self, progress: &mut Progress, text: &str, old_len: usize, counts: bool) -> Scan {
        if self.stops.is_empty() {
            return Scan::Release(text.len());
        }
        progress.0.resize(self.stops.len(), 0);
        let bytes = text.as_bytes();
        for (at, &b) in bytes.iter().enumerate().skip(old_len) {
            let mut found: Option<usize> = None;
            for (i, stop) in self.stops.iter().enumerate() {
                let stop = stop.as_bytes();
                let fail = &self.fail[i];
                let mut k = progress.0[i] as usize;
                while k > 0 && stop[k] != b {
                    k = fail[k - 1] as usize;
                }
                if stop[k] == b {
                    k += 1;
                }
                if k == stop.len() {
                    if counts && found.is_none_or(|f| self.stops[f].len() < stop.len()) {
                        found = Some(i);
                    }
                    k = fail[k - 1] as usize;
                }
                progress.0[i] = k as u32;
            }
            if let Some(which) = found {
                let end = at + 1;
                let start = end - self.stops[which].len();
                let end = if self.include { end } else { start };
                return Scan::Stop { end, which };
            }
        }
        Scan::Release(text.len() - self.held(progress))
    }

    /// Bytes at the end of the text that may still begin a stop string. They start on a
    /// character boundary: they equal the start of a stop string, which is UTF-8.
    pub fn held(&self, progress: &Progress) -> usize {
        progress.0.iter().copied().max().unwrap_or(0) as usize
    }
}

/// KMP's failure function of `s`.
fn failure(s: &[u8]) -> Vec<u32> {
    let mut fail = vec![0u32; s.len()];
    let mut k = 0usize;
    for i in 1..s.len() {
        while k > 0 && s[i] != s[k] {
            k = fail[k - 1] as usize;
        }
        if s[i] == s[k] {
            k += 1;
        }
        fail[i] = k as u32;
    }
    fail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` one by one; the scan after the last.
    fn feed(s: &StopStrings, pieces: &[&str]) -> (String, Scan) {
        let mut p = Progress::default();
        let mut text = String::new();
        let mut last = Scan::Release(0);
        for piece in pieces {
            let old = text.len();
            text.push_str(piece);
            last = s.scan(&mut p, &text, old, true);
            if let Scan::Stop { .. } = last {
                break;
            }
        }
        (text, last)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_found_and_never_released() {
        let s = StopStrings::new(vec!["stop1".into(), "的首都".into()], false, 0);
        assert_eq!(
            feed(&s, &["abc st"]).1,
            Scan::Release(4),
            "\"st\" may start stop1"
        );
        assert_eq!(feed(&s, &["abc st", "op"]).1, Scan::Release(4));
        assert_eq!(
            feed(&s, &["abc st", "op", "1 more"]).1,
            Scan::Stop { end: 4, which: 0 }
        );
    }

    #[test]
    fn multibyte_stops_and_include() {
        let s = StopStrings::new(vec!["的首都".into()], true, 0);
        let text = "北京是中国的首";
        assert_eq!(
            feed(&s, &[text]).1,
            Scan::Release(text.len() - "的首".len())
        );
        assert_eq!(
            feed(&s, &[text, "都，"]).1,
            Scan::Stop {
                end: "北京是中国的首都".len(),
                which: 0
            }
        );
    }

    #[test]
    fn the_first_to_complete_wins_and_of_two_the_longer() {
        let s = StopStrings::new(vec!["cd".into(), "b".into()], false, 0);
        assert_eq!(feed(&s, &["abcd"]).1, Scan::Stop { end: 1, which: 1 });
        let s = StopStrings::new(vec!["c".into(), "bc".into()], false, 0);
        assert_eq!(feed(&s, &["abcd"]).1, Scan::Stop { end: 1, which: 1 });
        assert_eq!(feed(&StopStrings::default(), &["abc"]).1, Scan::Release(3));
    }

    #[test]
    fn overlapping_prefixes_are_followed() {
        // "aab" inside "aaab": the automaton falls back instead of restarting.
        let s = StopStrings::new(vec!["aab".into()], false, 0);
        assert_eq!(feed(&s, &["a", "a", "a"]).1, Scan::Release(1));
        assert_eq!(
            feed(&s, &["a", "a", "a", "b"]).1,
            Scan::Stop { end: 1, which: 0 }
        );
    }

    #[test]
    fn a_match_that_does_not_count_is_passed_over() {
        let s = StopStrings::new(vec!["ab".into()], false, 0);
        let mut p = Progress::default();
        let mut text = String::from("xab");
        assert_eq!(s.scan(&mut p, &text, 0, false), Scan::Release(3));
        text.push_str(" ab");
        assert_eq!(
            s.scan(&mut p, &text, 3, true),
            Scan::Stop { end: 4, which: 0 }
        );
    }

    #[test]
    fn a_long_stop_string_costs_its_bytes_once() {
        // One stop string of 32768 characters, fed a character at a time: each token only
        // advances the automaton, and the text it may still become is held back.
        let stop = "ab".repeat(16384);
        let s = StopStrings::new(vec![stop.clone()], false, 0);
        let mut p = Progress::default();
        let mut text = String::new();
        for (i, c) in stop.chars().enumerate().take(stop.len() - 1) {
            let old = text.len();
            text.push(c);
            assert_eq!(s.scan(&mut p, &text, old, true), Scan::Release(0), "at {i}");
        }
        text.push('b');
        assert_eq!(
            s.scan(&mut p, &text, text.len() - 1, true),
            Scan::Stop { end: 0, which: 0 }
        );
    }
}
