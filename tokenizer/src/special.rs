//! Splitting raw text around special tokens before the vocabulary model sees it: control and
//! unknown tokens only when special-token parsing is on, user-defined tokens always, longest
//! token text first (the order llama.cpp uses), with optional whitespace stripping beside a match.

/// A token whose text is matched literally in the input instead of going through the model.
#[derive(Clone, Debug)]
pub(crate) struct SpecialToken {
    pub text: String,
    pub id: u32,
    /// User-defined tokens are matched even when special-token parsing is off.
    pub always: bool,
    /// Remove whitespace just before a match.
    pub lstrip: bool,
    /// Remove whitespace just after a match.
    pub rstrip: bool,
}

/// One piece of the partitioned input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialMatcher {
    /// Sorted by text length (bytes), longest first; ties keep id order.
    tokens: Vec<SpecialToken>,
}

/// The whitespace set of C's `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

impl SpecialMatcher {
    pub fn new(mut tokens: Vec<SpecialToken>) -> Self {
        tokens.retain(|t| !t.text.is_empty());
        tokens.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        Self { tokens }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Splits `text` into raw-text fragments and matched special tokens, in order.
    pub fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(text));
        for tok in &self.tokens {
            if !parse_special && !tok.always {
                continue;
            }
            // Fast path: most special tokens never occur in a given input.
            let occurs = fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(tok.text.as_str())));
            if !occurs {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for frag in fragments {
                match frag {
                    Fragment::Token(_) => next.push(frag),
                    Fragment::Text(t) => split_on(t, tok, &mut next),
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// Appends the pieces of `text` split on every occurrence of `tok`.
fn split_on<'a>(text: &'a str, tok: &SpecialToken, out: &mut Vec<Fragment<'a>>) {
    let mut rest = text;
    while let Some(pos) = rest.find(tok.text.as_str()) {
        let mut left = &rest[..pos];
        if tok.lstrip {
            left = left.trim_end_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
        }
        if !left.is_empty() {
            out.push(Fragment::Text(left));
        }
        out.push(Fragment::Token(tok.id));
        rest = &rest[pos + tok.text.len()..];
        if tok.rstrip {
            rest = rest.trim_start_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
        }
    }
    if !rest.is_empty() {
        out.push(Fragment::Text(rest));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(text: &str, id: u32, always: bool) -> SpecialToken {
        SpecialToken {
            text: text.into(),
            id,
            always,
            lstrip: false,
            rstrip: false,
        }
    }

    #[test]
    fn splits_on_every_occurrence_and_keeps_text_between() {
        let m = SpecialMatcher::new(vec![tok("<a>", 1, false)]);
        assert_eq!(
            m.partition("x<a>y<a><a>", true),
            vec![
                Fragment::Text("x"),
                Fragment::Token(1),
                Fragment::Text("y"),
                Fragment::Token(1),
                Fragment::Token(1)
            ]
        );
    }

    #[test]
    fn control_tokens_need_parse_special_user_defined_do_not() {
        let m = SpecialMatcher::new(vec![tok("<c>", 1, false), tok("<u>", 2, true)]);
        assert_eq!(
            m.partition("<c><u>", false),
            vec![Fragment::Text("<c>"), Fragment::Token(2)]
        );
        assert_eq!(
            m.partition("<c><u>", true),
            vec![Fragment::Token(1), Fragment::Token(2)]
        );
    }

    #[test]
    fn longest_token_wins_over_its_prefix() {
        let m = SpecialMatcher::new(vec![tok("<|end|>", 1, false), tok("<|end|>x", 2, false)]);
        assert_eq!(
            m.partition("a<|end|>xb<|end|>", true),
            vec![
                Fragment::Text("a"),
                Fragment::Token(2),
                Fragment::Text("b"),
                Fragment::Token(1)
            ]
        );
    }

    #[test]
    fn strips_whitespace_beside_tokens_that_ask_for_it() {
        let mut t = tok("<m>", 7, false);
        t.lstrip = true;
        t.rstrip = true;
        let m = SpecialMatcher::new(vec![t]);
        assert_eq!(
            m.partition("a \t<m>\n b", true),
            vec![Fragment::Text("a"), Fragment::Token(7), Fragment::Text("b")]
        );
        assert_eq!(m.partition("  <m>  ", true), vec![Fragment::Token(7)]);
    }

    #[test]
    fn empty_input_and_empty_token_text() {
        let m = SpecialMatcher::new(vec![tok("", 1, true)]);
        assert_eq!(m.len(), 0);
        assert!(m.partition("", true).is_empty());
        assert_eq!(m.partition("abc", true), vec![Fragment::Text("abc")]);
    }
}
