//! BERT's WordPiece, as llama.cpp's `llm_tokenizer_wpm_session` applies it to a GGUF vocabulary.
//!
//! The converter stores word-initial pieces with a `▁` prefix and continuation pieces (`##ing` in
//! the Hugging Face vocabulary) bare, so one vocabulary lookup per candidate substring of
//! `▁word` does what WordPiece's two vocabularies do. Normalization is the BertNormalizer's:
//! optional NFD plus removal of combining marks, optional lowercasing, control characters
//! dropped, and every punctuation mark, ASCII symbol and CJK ideograph a word of its own.

use unicode_normalization::UnicodeNormalization;

use crate::unicode::{classify, Category};
use crate::vocab::Vocab;

/// The words of `text` after BERT's normalization and pre-tokenization.
pub(crate) fn words(text: &str, lowercase: bool, strip_accents: bool) -> Vec<String> {
    let decomposed: String;
    let text = if strip_accents {
        decomposed = text.nfd().collect();
        &decomposed
    } else {
        text
    };
    let mut words = vec![String::new()];
    for c in text.chars() {
        let class = classify(c);
        if class.is_whitespace {
            if !words.last().is_some_and(String::is_empty) {
                words.push(String::new());
            }
            continue;
        }
        if c == '\0' || c == '\u{FFFD}' || class.category == Category::Control {
            continue;
        }
        if strip_accents && class.category == Category::AccentMark {
            continue;
        }
        // llama.cpp maps each code point to one code point; Rust's full mapping can give several
        // (U+0130 -> "i\u{307}"), of which the first is llama.cpp's.
        let c = if lowercase { c.to_lowercase().next().unwrap_or(c) } else { c };
        let single = class.category == Category::Punctuation
            || (c.is_ascii() && class.category == Category::Symbol)
            || is_cjk_ideograph(c);
        if single {
            if !words.last().is_some_and(String::is_empty) {
                words.push(String::new());
            }
            if let Some(w) = words.last_mut() {
                w.push(c);
            }
            words.push(String::new());
        } else if let Some(w) = words.last_mut() {
            w.push(c);
        }
    }
    words.retain(|w| !w.is_empty());
    words
}

/// The CJK ideograph blocks BERT splits character by character (`_is_chinese_char`).
fn is_cjk_ideograph(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B920..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

/// Appends the ids of `text` (no CLS/SEP) to `out`: each word is cut greedily into the longest
/// pieces the vocabulary has; a word with any uncovered part becomes the unknown token.
pub(crate) fn tokenize(vocab: &Vocab, max_token_len: usize, text: &str, out: &mut Vec<u32>) {
    let mut word = String::new();
    for w in words(text, vocab.lowercase, vocab.strip_accents) {
        word.clear();
        word.push('▁');
        word.push_str(&w);
        let bytes = word.as_bytes();
        let n = bytes.len();
        let start = out.len();
        let mut i = 0;
        while i < n {
            // Longest match first; a byte range that cuts a character is no token.
            let found = (i + 1..=n.min(i + max_token_len + 1))
                .rev()
                .find_map(|j| word.get(i..j).and_then(|piece| vocab.id(piece)).map(|id| (id, j)));
            match found {
                Some((id, j)) => {
                    out.push(id);
                    i = j;
                }
                None => {
                    out.truncate(start);
                    break;
                }
            }
        }
        if out.len() == start {
            out.extend(vocab.special.unk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::words;

    #[test]
    fn punctuation_cjk_and_accents_split_like_bert() {
        // Expected words from HF `tokenizers`' BertNormalizer + BertPreTokenizer (lowercase,
        // strip_accents), run on these strings.
        assert_eq!(words("Héllo, WORLD!", true, true), ["hello", ",", "world", "!"]);
        assert_eq!(words("東京は", true, true), ["東", "京", "は"]);
        assert_eq!(words("a\tb\u{0}c  $5", true, true), ["a", "bc", "$", "5"]);
        assert_eq!(words("Café", false, false), ["Café"]);
    }
}
