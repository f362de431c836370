//! Incremental detokenization for streaming: each pushed token appends its bytes, and only
//! complete UTF-8 characters are handed out; bytes of a character split over tokens wait for the
//! rest. Everything pushed plus `flush` equals `Tokenizer::decode` of the same ids.

use super::{take_leading_space, Tokenizer};

/// Streaming detokenizer of one sequence (see `Tokenizer::decode_stream`).
pub struct DecodeStream {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Still to drop one leading space from the first non-empty piece.
    strip_leading_space: bool,
    /// Bytes of an incomplete UTF-8 character at the end of the text so far (at most 3).
    pending: Vec<u8>,
}

impl DecodeStream {
    pub(crate) fn new(tokenizer: Tokenizer, skip_special: bool, strip_leading_space: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            strip_leading_space,
            pending: Vec::with_capacity(8),
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.tokenizer.output_piece(id, self.skip_special);
        if piece.is_empty() {
            return String::new();
        }
        let piece = take_leading_space(piece, &mut self.strip_leading_space);
        self.pending.extend_from_slice(piece);
        self.take_complete()
    }

    /// Returns whatever is held back (an incomplete character becomes U+FFFD) and resets.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Moves every complete character (and every definitely invalid sequence, as U+FFFD) out of
    /// `pending`, keeping only an incomplete character at the end.
    fn take_complete(&mut self) -> String {
        let mut out = String::with_capacity(self.pending.len());
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(valid) => {
                    out.push_str(valid);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid_end = start + e.valid_up_to();
                    // The prefix up to `valid_up_to` is valid UTF-8 by definition.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid_end]));
                    start = valid_end;
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{fffd}');
                            start += bad;
                        }
                        None => break, // incomplete character at the end: wait for more bytes
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

impl std::fmt::Debug for DecodeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStream")
            .field("skip_special", &self.skip_special)
            .field("pending", &self.pending)
            .finish()
    }
}
