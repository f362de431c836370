//! The tokenizers of both vocabulary kinds (SmolLM2's byte-level BPE, Gemma 3's SentencePiece
//! with byte fallback): encode of arbitrary text, with and without special-token parsing; decode
//! of arbitrary id sequences (ids outside the vocabulary included); streaming decode, which must
//! give exactly the text of the whole decode. Where the vocabulary guarantees a round trip (every
//! byte has a token), decode(encode(text)) is the text.
//!
//! Input: a mode byte (bit 0: the vocabulary; bits 1-2: encode, encode with specials, decode,
//! streaming decode), then the text (UTF-8, lossy) or the ids (little-endian u32s).

use npu_tokenizer::Tokenizer;

use crate::fixtures;

pub fn run(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (tok, byte_level) = if mode & 1 == 0 {
        (fixtures::smollm2(), true)
    } else {
        (fixtures::gemma3(), false)
    };
    match (mode >> 1) & 3 {
        0 => encode(tok, &String::from_utf8_lossy(rest), false, byte_level),
        1 => encode(tok, &String::from_utf8_lossy(rest), true, false),
        2 => decode(tok, &ids(rest, tok)),
        _ => stream(tok, &ids(rest, tok)),
    }
}

/// Little-endian u32 ids; the high bit of each byte pair chooses whether an id is folded into
/// the vocabulary, so most ids are real tokens and some are far outside.
fn ids(bytes: &[u8], tok: &Tokenizer) -> Vec<u32> {
    let n = tok.vocab_size().max(1) as u32;
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            let v = u32::from_le_bytes(b);
            if v & 0x8000_0000 == 0 {
                v % n
            } else {
                v
            }
        })
        .collect()
}

fn encode(tok: &Tokenizer, text: &str, special: bool, round_trip: bool) {
    let ids = match tok.encode_with(text, false, special) {
        Ok(ids) => ids,
        Err(_) => return,
    };
    let n = tok.vocab_size() as u32;
    for &id in &ids {
        assert!(
            id < n,
            "encode produced id {id} outside a vocabulary of {n}"
        );
    }
    let back = tok.decode(&ids, false);
    // A byte-level vocabulary gives every text back whose bytes all have tokens (SmolLM2's lacks
    // a few, such as 0x04, which llama.cpp drops as this tokenizer does).
    if round_trip
        && text
            .bytes()
            .all(|b| tok.token_id(&byte_char(b).to_string()).is_some())
    {
        assert_eq!(
            back, text,
            "byte-level round trip of {text:?} through {ids:?}"
        );
    }
}

/// The character GPT-2's byte-level alphabet writes byte `b` as: printable Latin-1 bytes stand
/// for themselves, the others for U+0100 onwards in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("a valid code point")
}

fn decode(tok: &Tokenizer, ids: &[u32]) {
    for skip in [false, true] {
        let _ = tok.decode(ids, skip);
        let _ = tok.decode_continuation(ids, skip);
    }
}

fn stream(tok: &Tokenizer, ids: &[u32]) {
    for skip in [false, true] {
        let mut s = tok.decode_stream_continuation(skip);
        let mut text = String::new();
        for &id in ids {
            text.push_str(&s.push(id));
        }
        text.push_str(&s.flush());
        assert_eq!(
            text,
            tok.decode_continuation(ids, skip),
            "streamed and whole decodes of {ids:?} differ"
        );
    }
}
