//! Stop strings over streamed text: text that could be the start of a stop string is held back
//! until it is clear, a matched stop string ends the request and is never sent, and what comes
//! before it is.

/// What one piece of new text leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that can be sent now (possibly empty while a possible stop string is held back).
    Emit(String),
    /// A stop string matched: the text before it (not yet sent) is the last to send.
    Stopped(String),
}

/// Finds a request's stop strings in its generated text as it streams.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet sent: the longest end of the text so far that begins some stop string.
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Emit(text.to_string());
        }
        self.held.push_str(text);
        // Every match not found before starts in the held text (it is the longest end that
        // could begin one), so searching held + new text finds the earliest new match.
        let first_match = self.stops.iter().filter_map(|s| self.held.find(s)).min();
        if let Some(at) = first_match {
            let before = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped(before);
        }
        let keep = self.longest_stop_prefix_suffix();
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopOutcome::Emit(emit)
    }

    /// The request ended for another reason: whatever is held back is sent after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes at the end of `held` that are a proper prefix of some stop string (on a character
    /// boundary).
    fn longest_stop_prefix_suffix(&self) -> usize {
        let h = &self.held;
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let start_min = h.len().saturating_sub(longest_stop.saturating_sub(1));
        (start_min..h.len())
            .filter(|&i| h.is_char_boundary(i))
            .find(|&i| {
                let tail = &h[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .map_or(0, |i| h.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Feeds pieces; returns the text sent and whether (and where) a stop matched.
    fn run(m: &mut StopMatcher, pieces: &[&str]) -> (String, Option<usize>) {
        let mut sent = String::new();
        for (i, p) in pieces.iter().enumerate() {
            match m.push(p) {
                StopOutcome::Emit(t) => sent.push_str(&t),
                StopOutcome::Stopped(t) => {
                    sent.push_str(&t);
                    return (sent, Some(i));
                }
            }
        }
        sent.push_str(&m.finish());
        (sent, None)
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_found_and_not_sent() {
        let mut m = matcher(&["END"]);
        assert_eq!(m.push("abc E"), StopOutcome::Emit("abc ".into()));
        assert_eq!(m.push("N"), StopOutcome::Emit(String::new()));
        assert_eq!(m.push("Dxyz"), StopOutcome::Stopped(String::new()));
        let mut m = matcher(&["END"]);
        assert_eq!(run(&mut m, &["a", "bE", "NDc"]), ("ab".into(), Some(2)));
    }

    #[test]
    fn held_text_that_turns_out_harmless_is_sent() {
        let mut m = matcher(&["END"]);
        assert_eq!(m.push("E"), StopOutcome::Emit(String::new()));
        assert_eq!(m.push("Nx"), StopOutcome::Emit("ENx".into()));
        let mut m = matcher(&["\n\n"]);
        assert_eq!(run(&mut m, &["a\n", "b\n"]), ("a\nb\n".into(), None));
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let mut m = matcher(&["world", "lo w"]);
        assert_eq!(m.push("hello world"), StopOutcome::Stopped("hel".into()));
        let mut m = matcher(&["bb", "abbc"]);
        assert_eq!(run(&mut m, &["xa", "b", "bc"]), ("x".into(), Some(2)));
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("café"), StopOutcome::Emit("caf".into()));
        assert_eq!(m.push("?"), StopOutcome::Emit("é?".into()));
        assert_eq!(m.push("é"), StopOutcome::Emit(String::new()));
        assert_eq!(m.push("!"), StopOutcome::Stopped(String::new()));
    }

    #[test]
    fn no_stop_strings_pass_everything_through() {
        let mut m = matcher(&["", ""]);
        assert!(m.is_empty());
        assert_eq!(m.push("abc"), StopOutcome::Emit("abc".into()));
        assert_eq!(m.finish(), "");
    }
}
