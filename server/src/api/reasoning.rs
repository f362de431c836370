//! Reasoning models' thinking on the chat route (Qwen3 style): a reply that opens with
//! `<think>` has its text up to `</think>` returned as `reasoning_content` and the rest as
//! `content`. The splitter works on streamed text, where a tag may arrive in pieces over several
//! chunks: text that may still turn out to be (part of) a tag is held back until it is known.
//!
//! The newlines around the parts are dropped the way Qwen3's own template drops them when it
//! renders an earlier reply: the reasoning loses its leading and trailing `\n`s, the content
//! after `</think>` its leading ones. Only a think block at the start of the reply counts
//! (after whitespace, which is dropped with it); a `<think>` later in the text is content. When
//! the prompt itself ends with an opened `<think>` (templates that start the thinking), the
//! reply starts inside the block.

pub(crate) const THINK_START: &str = "<think>";
pub(crate) const THINK_END: &str = "</think>";

/// Where the reply is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace so far: a `<think>` may still open the block.
    Start,
    /// Inside the think block.
    Thinking,
    /// After the block (or without one): everything is content.
    Answering,
}

/// Text of one piece of a reply, by part.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Split {
    pub reasoning: String,
    pub content: String,
}

impl Split {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

/// Splits a reply's text, pushed piece by piece, into reasoning and content.
#[derive(Debug, Clone)]
pub(crate) struct ThinkSplitter {
    phase: Phase,
    /// Text held back: what may be the start of the awaited tag, and (while thinking) the
    /// newlines before it.
    held: String,
    /// Leading newlines of the current part are still being dropped.
    part_start: bool,
    /// Whether a think block was seen (or the reply started inside one).
    thought: bool,
}

impl ThinkSplitter {
    /// `inside`: the prompt ended with an open `<think>`, so the reply starts in the block.
    pub fn new(inside: bool) -> Self {
        Self {
            phase: if inside {
                Phase::Thinking
            } else {
                Phase::Start
            },
            held: String::new(),
            part_start: inside,
            thought: inside,
        }
    }

    /// Whether the reply had a think block (its reasoning may still be empty).
    pub fn thought(&self) -> bool {
        self.thought
    }

    /// The next piece of the reply: what can be told apart so far.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        let mut rest = buf.as_str();
        loop {
            match self.phase {
                Phase::Start => {
                    let t = rest.trim_start();
                    if let Some(after) = t.strip_prefix(THINK_START) {
                        // The block opens; the whitespace before it goes.
                        self.phase = Phase::Thinking;
                        self.thought = true;
                        self.part_start = true;
                        rest = after;
                    } else if THINK_START.starts_with(t) {
                        // Only whitespace, or the start of a `<think>` not yet complete.
                        self.held = rest.to_string();
                        break;
                    } else {
                        self.phase = Phase::Answering;
                    }
                }
                Phase::Thinking => match rest.find(THINK_END) {
                    Some(i) => {
                        self.emit_reasoning(&mut out, rest[..i].trim_end_matches('\n'));
                        self.phase = Phase::Answering;
                        self.part_start = true;
                        rest = &rest[i + THINK_END.len()..];
                    }
                    None => {
                        // Hold back a possible start of `</think>` and the newlines before it.
                        let cut = rest.len() - partial_tag_len(rest, THINK_END);
                        let cut = rest[..cut].trim_end_matches('\n').len();
                        self.emit_reasoning(&mut out, &rest[..cut]);
                        self.held = rest[cut..].to_string();
                        break;
                    }
                },
                Phase::Answering => {
                    let text = if self.part_start {
                        rest.trim_start_matches('\n')
                    } else {
                        rest
                    };
                    if !text.is_empty() {
                        self.part_start = false;
                        out.content.push_str(text);
                    }
                    break;
                }
            }
        }
        out
    }

    /// The end of the reply: what was held back, in the part it belongs to.
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let held = std::mem::take(&mut self.held);
        match self.phase {
            // Whitespace or an incomplete `<think>`: plain content.
            Phase::Start => out.content = held,
            Phase::Thinking => self.emit_reasoning(&mut out, held.trim_end_matches('\n')),
            Phase::Answering => {}
        }
        out
    }

    fn emit_reasoning(&mut self, out: &mut Split, text: &str) {
        let text = if self.part_start {
            text.trim_start_matches('\n')
        } else {
            text
        };
        if !text.is_empty() {
            self.part_start = false;
            out.reasoning.push_str(text);
        }
    }
}

/// The length of the longest end of `s` that is a proper start of `tag` (0 if none). Tags begin
/// with the ASCII `<`, so the cut is on a character boundary.
pub(crate) fn partial_tag_len(s: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| s.as_bytes().ends_with(&tag.as_bytes()[..k]))
        .unwrap_or(0)
}

/// Whether a rendered chat prompt leaves a think block open for the reply (it ends with
/// `<think>` and perhaps whitespace).
pub(crate) fn prompt_opens_think(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_START)
}

/// A whole reply split at once: (reasoning when there was a think block, content).
#[cfg(test)]
pub(crate) fn split_whole(text: &str, inside: bool) -> (Option<String>, String) {
    let mut s = ThinkSplitter::new(inside);
    let mut a = s.push(text);
    let b = s.finish();
    a.reasoning.push_str(&b.reasoning);
    a.content.push_str(&b.content);
    (s.thought().then_some(a.reasoning), a.content)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes the pieces and finishes: (reasoning when there was a think block, content).
    fn streamed(pieces: &[&str], inside: bool) -> (Option<String>, String) {
        let mut s = ThinkSplitter::new(inside);
        let mut all = Split::default();
        for p in pieces {
            let x = s.push(p);
            all.reasoning.push_str(&x.reasoning);
            all.content.push_str(&x.content);
        }
        let x = s.finish();
        all.reasoning.push_str(&x.reasoning);
        all.content.push_str(&x.content);
        (s.thought().then_some(all.reasoning), all.content)
    }

    #[test]
    fn a_qwen3_reply_splits_into_reasoning_and_content() {
        let reply = "<think>\nThe user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is 4.";
        let want = (
            Some("The user asks 2+2.\nThat is 4.".to_string()),
            "The answer is 4.".to_string(),
        );
        assert_eq!(split_whole(reply, false), want);
        // However the text is cut into chunks (here: every place, and one character at a time),
        // the parts are the same: tags split over chunks are recognised.
        for i in 0..=reply.len() {
            assert_eq!(
                streamed(&[&reply[..i], &reply[i..]], false),
                want,
                "cut at {i}"
            );
        }
        let chars: Vec<String> = reply.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(streamed(&pieces, false), want);
        // Tokens the way a tokenizer without think tokens cuts the tags.
        assert_eq!(
            streamed(
                &[
                    "<",
                    "think",
                    ">\n",
                    "The user asks 2+2.\nThat is 4.\n</",
                    "think",
                    ">\n\n",
                    "The answer is 4."
                ],
                false
            ),
            want
        );
    }

    #[test]
    fn a_tag_split_across_chunks_is_held_back_until_known() {
        let mut s = ThinkSplitter::new(false);
        assert!(s.push("<thi").is_empty(), "may still be <think>");
        assert!(s.push("nk>Hmm, ").reasoning == "Hmm, ");
        // "</th" may start the closing tag: not given out yet.
        let x = s.push("so 4</th");
        assert_eq!((x.reasoning.as_str(), x.content.as_str()), ("so 4", ""));
        let x = s.push("ink>\n\nFour");
        assert_eq!((x.reasoning.as_str(), x.content.as_str()), ("", "Four"));
        assert_eq!(s.push(".").content, ".");
        assert!(s.finish().is_empty());
        // Something that only looked like a tag is given back to its part.
        let mut s = ThinkSplitter::new(false);
        assert!(s.push("<think>a </t").reasoning == "a ");
        assert_eq!(s.push("able>").reasoning, "</table>");
    }

    #[test]
    fn replies_without_a_think_block_are_all_content() {
        for text in [
            "Just an answer.",
            "  leading spaces kept",
            "An answer that mentions <think> later and </think> too.",
            "<thin",
            "",
            "\n\n",
        ] {
            assert_eq!(
                split_whole(text, false),
                (None, text.to_string()),
                "{text:?}"
            );
            let one_by_one: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = one_by_one.iter().map(String::as_str).collect();
            assert_eq!(
                streamed(&pieces, false),
                (None, text.to_string()),
                "{text:?}"
            );
        }
        // Disabled thinking (the template writes an empty block into the prompt): the reply
        // has no tags at all.
        assert_eq!(
            split_whole("The answer is 4.", false),
            (None, "The answer is 4.".to_string())
        );
    }

    #[test]
    fn unfinished_and_empty_blocks_and_prompts_that_open_the_block() {
        // Cut off while thinking (max_tokens): everything is reasoning, no content.
        assert_eq!(
            split_whole("<think>\nstill thinking\n", false),
            (Some("still thinking".to_string()), String::new())
        );
        // An empty block.
        assert_eq!(
            split_whole("<think>\n\n</think>\n\nHi!", false),
            (Some(String::new()), "Hi!".to_string())
        );
        // Whitespace before <think> goes with it; only the first block counts.
        assert_eq!(
            split_whole("\n <think>a</think>b<think>c</think>", false),
            (Some("a".to_string()), "b<think>c</think>".to_string())
        );
        // The prompt opened the block: the reply starts inside it.
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think("<|im_start|>assistant\n"));
        assert!(!prompt_opens_think("<think>\n\n</think>\n\n"));
        assert_eq!(
            split_whole("\nreasoning here\n</think>\n\nanswer", true),
            (Some("reasoning here".to_string()), "answer".to_string())
        );
        assert_eq!(
            streamed(&["reason", "ing</", "think>", "answer"], true),
            (Some("reasoning".to_string()), "answer".to_string())
        );
        // Newlines inside the parts stay; multi-byte text is cut on character boundaries.
        assert_eq!(
            streamed(&["<think>汉", "字\n\n", "🙂</thi", "nk>\n答\n\n案"], false),
            (Some("汉字\n\n🙂".to_string()), "答\n\n案".to_string())
        );
    }
}
