//! What each token decodes to, as raw bytes: GPT-2 byte-level characters mapped back to bytes,
//! SentencePiece "▁" turned into spaces and `<0xNN>` byte tokens, special tokens as their text.
//! Decoding is concatenating these pieces, which makes streaming exact and O(1) per token.

/// The kind of a vocabulary entry (GGUF `tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// Ordinary text token (type 1).
    Normal,
    /// The unknown token (type 2); special.
    Unknown,
    /// Control token such as BOS, EOS, `<|im_start|>` (type 3); special.
    Control,
    /// Added token matched literally in input and shown literally in output (type 4).
    UserDefined,
    /// Unused or undefined slot (type 5 or 0); decodes to nothing.
    Unused,
    /// SentencePiece byte-fallback token `<0xNN>` (type 6).
    Byte,
}

impl TokenKind {
    /// Maps a GGUF token type; unknown codes count as unused (as llama.cpp does).
    pub fn from_gguf_type(t: i64) -> Self {
        match t {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            6 => Self::Byte,
            _ => Self::Unused,
        }
    }

    /// Special tokens are hidden when decoding with `skip_special`.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// How normal token texts turn into bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte-level BPE: every character stands for one byte.
    ByteLevel,
    /// SentencePiece: "▁" is a space, `<0xNN>` tokens are single bytes.
    SentencePiece,
    /// The token text is the output text.
    Plain,
}

const SPM_SPACE: char = '\u{2581}';

/// Is `b` one of the bytes GPT-2's byte-level alphabet keeps as the same code point?
const fn byte_is_printable(b: u32) -> bool {
    (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)
}

/// The 68 bytes without a printable code point, in order; byte `SHIFTED[n]` is written as
/// U+0100 + n in byte-level text.
const SHIFTED: [u8; 68] = {
    let mut table = [0u8; 68];
    let mut n = 0;
    let mut b = 0u32;
    while b < 0x100 {
        if !byte_is_printable(b) {
            table[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    table
};

/// Inverse of GPT-2's byte-to-character table.
pub(crate) fn byte_level_char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 0x100 {
        return byte_is_printable(cp).then_some(cp as u8);
    }
    SHIFTED.get((cp - 0x100) as usize).copied()
}

/// The byte-level character that stands for byte `b`.
pub(crate) fn byte_to_byte_level_char(b: u8) -> char {
    if byte_is_printable(b as u32) {
        return b as char;
    }
    let n = SHIFTED.iter().position(|&x| x == b).unwrap_or(0) as u32;
    char::from_u32(0x100 + n).unwrap_or('\u{fffd}')
}

/// Parses a SentencePiece byte token text `<0xNN>`.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Decoded bytes of one token.
pub(crate) fn token_piece(text: &str, kind: TokenKind, style: PieceStyle) -> Vec<u8> {
    match kind {
        TokenKind::Unused => Vec::new(),
        TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => {
            text.as_bytes().to_vec()
        }
        TokenKind::Byte => match parse_byte_token(text) {
            Some(b) => vec![b],
            None => text.as_bytes().to_vec(),
        },
        TokenKind::Normal => match style {
            PieceStyle::Plain => text.as_bytes().to_vec(),
            PieceStyle::SentencePiece => text.replace(SPM_SPACE, " ").into_bytes(),
            PieceStyle::ByteLevel => {
                let mut out = Vec::with_capacity(text.len());
                for c in text.chars() {
                    match byte_level_char_to_byte(c) {
                        Some(b) => out.push(b),
                        // Not a byte-level character: keep it as its own UTF-8.
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                out
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_over_all_bytes() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_byte_level_char(b);
            assert!(seen.insert(c), "char {c:?} used twice");
            assert_eq!(byte_level_char_to_byte(c), Some(b));
        }
        assert_eq!(byte_to_byte_level_char(b' '), '\u{120}'); // 'Ġ'
        assert_eq!(byte_to_byte_level_char(b'\n'), '\u{10a}'); // 'Ċ'
        assert_eq!(byte_to_byte_level_char(b'A'), 'A');
        assert_eq!(byte_level_char_to_byte('\u{144}'), None);
        assert_eq!(byte_level_char_to_byte('\u{a0}'), None);
    }

    #[test]
    fn pieces_per_style_and_kind() {
        assert_eq!(
            token_piece("\u{120}the", TokenKind::Normal, PieceStyle::ByteLevel),
            b" the"
        );
        // "ðŁĺ" is the first three bytes of an emoji in byte-level form.
        assert_eq!(
            token_piece("ðŁĺ", TokenKind::Normal, PieceStyle::ByteLevel),
            vec![0xf0, 0x9f, 0x98]
        );
        assert_eq!(
            token_piece(
                "\u{2581}Hello",
                TokenKind::Normal,
                PieceStyle::SentencePiece
            ),
            b" Hello"
        );
        assert_eq!(
            token_piece("<0x0A>", TokenKind::Byte, PieceStyle::SentencePiece),
            b"\n"
        );
        assert_eq!(
            token_piece("<|im_end|>", TokenKind::Control, PieceStyle::ByteLevel),
            b"<|im_end|>"
        );
        assert!(token_piece("[PAD]", TokenKind::Unused, PieceStyle::Plain).is_empty());
    }

    #[test]
    fn byte_token_parsing() {
        assert_eq!(parse_byte_token("<0xFF>"), Some(0xff));
        assert_eq!(parse_byte_token("<0x0a>"), Some(0x0a));
        assert_eq!(parse_byte_token("<0x100>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
    }
}
