//! SentencePiece-style ("llama") vocabularies as a `tokenizers` BPE model: llama.cpp merges the
//! adjacent pair whose joined text is the highest-scoring vocabulary entry, so every split of an
//! entry into two entries becomes a merge ranked by that entry's score; unknown characters fall
//! back to `<0xNN>` byte tokens.

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};

use super::pieces::TokenKind;
use super::TokenizerError;

/// Entries that can take part in merges (as either half or as the result).
fn mergeable(kind: TokenKind) -> bool {
    matches!(kind, TokenKind::Normal | TokenKind::UserDefined)
}

/// All (left, right) pairs whose concatenation is a vocabulary entry, best score first.
///
/// Ties in score are ordered by the merged entry's id, then by the split position; llama.cpp
/// breaks ties by position in the text instead, which only matters when two different pairs with
/// exactly equal scores compete at once.
pub(crate) fn merges_from_scores(
    tokens: &[String],
    kinds: &[TokenKind],
    scores: &[f32],
) -> Vec<(String, String)> {
    let mut index: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
    for (id, text) in tokens.iter().enumerate() {
        if mergeable(kinds[id]) {
            // A repeated text maps to its last id, as in llama.cpp's lookup.
            index.insert(text.as_str(), id as u32);
        }
    }
    let mut candidates: Vec<(f32, u32, usize)> = Vec::new();
    for (id, text) in tokens.iter().enumerate() {
        if !mergeable(kinds[id]) || index.get(text.as_str()) != Some(&(id as u32)) {
            continue;
        }
        for (split, _) in text.char_indices().skip(1) {
            let (left, right) = text.split_at(split);
            if index.contains_key(left) && index.contains_key(right) {
                candidates.push((scores[id], id as u32, split));
            }
        }
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    candidates
        .into_iter()
        .map(|(_, id, split)| {
            let (l, r) = tokens[id as usize].split_at(split);
            (l.to_string(), r.to_string())
        })
        .collect()
}

/// The BPE model of a SentencePiece vocabulary.
pub(crate) fn build_model(
    tokens: &[String],
    kinds: &[TokenKind],
    scores: &[f32],
    unk: Option<u32>,
) -> Result<BPE, TokenizerError> {
    let mut vocab = Vocab::default();
    for (id, text) in tokens.iter().enumerate() {
        vocab.insert(text.clone(), id as u32);
    }
    let merges = merges_from_scores(tokens, kinds, scores);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(tokens[unk as usize].clone());
    }
    builder
        .build()
        .map_err(|e| TokenizerError::Build(format!("SentencePiece vocabulary: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_ranked_by_the_score_of_the_joined_entry() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let kinds = vec![TokenKind::Normal; tokens.len()];
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let m = merges_from_scores(&tokens, &kinds, &scores);
        let m: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(
            m,
            vec![("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")],
            "bc (-1) before ab (-2) before abc (-3)"
        );
    }

    #[test]
    fn control_entries_never_merge() {
        let tokens: Vec<String> = ["<", "s", ">", "<s>", "<s"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let kinds = vec![
            TokenKind::Normal,
            TokenKind::Normal,
            TokenKind::Normal,
            TokenKind::Control,
            TokenKind::Normal,
        ];
        let m = merges_from_scores(&tokens, &kinds, &[0.0; 5]);
        assert_eq!(m, vec![("<".to_string(), "s".to_string())]);
    }
}
