//! [`Tokenizer`]: encode and decode with llama.cpp's `llama_tokenize` / `llama_token_to_piece`
//! semantics.

use std::collections::{BTreeMap, HashMap};

use aho_corasick::AhoCorasick;

use crate::bpe::{self, BpeRanks};
use crate::pretok::{PreSettings, PreTokenizer};
use crate::spm;
use crate::unicode;
use crate::vocab::{attr, Vocab, VocabType};
use crate::wpm;
use crate::TokenizerError;

/// The algorithm-specific part of a tokenizer.
enum Model {
    Spm,
    Bpe {
        ranks: BpeRanks,
        pre: PreTokenizer,
    },
    /// WordPiece; candidates longer than the longest token (in bytes) are never looked up.
    Wpm {
        max_token_len: usize,
    },
}

/// A tokenizer built from GGUF metadata (`tokenizer.ggml.*`).
///
/// Thread-safe and immutable; encoding keeps its word cache per call.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    settings: Option<PreSettings>,
    /// Control, user-defined and unknown tokens, longest text first (llama.cpp
    /// `cache_special_tokens`); the order decides which of two overlapping specials wins.
    special_order: Vec<u32>,
    /// Finds every occurrence of every token in `special_order` (pattern index = position there).
    special_matcher: Option<AhoCorasick>,
    /// `token_to_piece(id, special = true)` for every id.
    pieces: Vec<Vec<u8>>,
}

/// A piece of the input after special tokens were cut out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fragment {
    Token(u32),
    /// A byte range of the input.
    Text(usize, usize),
}

/// C `isspace` in the "C" locale, which llama.cpp uses for LSTRIP/RSTRIP.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's metadata.
    ///
    /// # Errors
    /// Missing or mistyped `tokenizer.ggml.*` keys, an unsupported `tokenizer.ggml.model` (we implement
    /// `gpt2`, `llama` and `bert`), an unknown `tokenizer.ggml.pre`, duplicate tokens, or `add_bos_token` set
    /// without a BOS id.
    pub fn from_gguf(md: &gguf::Metadata) -> Result<Tokenizer, TokenizerError> {
        let is_bpe = md.str_opt("tokenizer.ggml.model")? == Some("gpt2");
        let settings =
            if is_bpe { Some(PreSettings::from_name(md.str_opt("tokenizer.ggml.pre")?.unwrap_or(""))?) } else { None };
        let vocab = Vocab::from_gguf(md, settings.is_some_and(|s| s.add_bos), settings.is_some_and(|s| s.no_bos))?;
        let model = match (vocab.vocab_type, settings) {
            (VocabType::Bpe, Some(s)) => {
                Model::Bpe { ranks: BpeRanks::new(&vocab.merges), pre: PreTokenizer::new(s.pre_type)? }
            }
            (VocabType::Wpm, _) => {
                Model::Wpm { max_token_len: vocab.tokens.iter().map(|t| t.text.len()).max().unwrap_or(0) }
            }
            _ => Model::Spm,
        };
        let mut special_order: Vec<u32> = (0..vocab.tokens.len() as u32)
            .filter(|&id| vocab.tokens[id as usize].attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .collect();
        // llama.cpp sorts by length only (unstable); ties between equal-length texts can only matter
        // when they overlap, and we break them by id.
        special_order.sort_by_key(|&id| std::cmp::Reverse(vocab.tokens[id as usize].text.len()));
        let special_matcher = if special_order.is_empty() {
            None
        } else {
            let patterns = special_order.iter().map(|&id| vocab.tokens[id as usize].text.as_bytes());
            Some(AhoCorasick::new(patterns).map_err(|e| TokenizerError::BadRegex {
                regex: "<special tokens>".to_string(),
                reason: e.to_string(),
            })?)
        };
        let mut tokenizer = Tokenizer { vocab, model, settings, special_order, special_matcher, pieces: Vec::new() };
        tokenizer.pieces = (0..tokenizer.vocab.tokens.len() as u32).map(|id| tokenizer.make_piece(id)).collect();
        Ok(tokenizer)
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.vocab.special.bos
    }

    /// The end-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<u32> {
        self.vocab.special.eos
    }

    /// The end-of-turn token (`<|im_end|>`, `<end_of_turn>`, ...), if the model has one.
    pub fn eot(&self) -> Option<u32> {
        self.vocab.special.eot
    }

    /// The padding token, if the model has one.
    pub fn pad(&self) -> Option<u32> {
        self.vocab.special.pad
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// Whether the token ends generation (EOS, EOT and the tokens llama.cpp recognises by text).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// Every end-of-generation token, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// Whether the token is a control token (not printed unless asked for).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.tokens.get(id as usize).is_some_and(|t| t.attr & attr::CONTROL != 0)
    }

    /// The id of a token by its exact vocabulary text (`"<|im_end|>"`, `"Ġthe"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// The vocabulary text of a token (byte-level BPE tokens are in GPT-2's byte encoding).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(|t| t.text.as_str())
    }

    /// `tokenizer.ggml.pre` (empty when absent).
    pub fn pre(&self) -> &str {
        &self.vocab.pre
    }

    /// Tokenizes `text` exactly as llama.cpp's `llama_tokenize(vocab, text, .., add_special,
    /// parse_special)`.
    ///
    /// `add_special` adds BOS/EOS where the model's `add_bos_token`/`add_eos_token` ask for them.
    /// `parse_special` lets control tokens written in the text (`<|im_start|>`) become their ids;
    /// user-defined tokens are always matched, as in llama.cpp and HF `tokenizers`.
    ///
    /// # Errors
    /// Only if a pre-tokenizer regex gives up (fancy-regex's backtracking limit).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let fragments = if text.is_empty() { Vec::new() } else { self.partition(text, parse_special) };
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let wordpiece = matches!(self.model, Model::Wpm { .. });
        // WordPiece frames every text with CLS (the BOS id) and SEP, whatever add_bos/add_eos say
        // (llama.cpp's `LLAMA_VOCAB_TYPE_WPM` branch).
        if add_special && (self.vocab.add_bos || wordpiece) {
            out.extend(self.vocab.special.bos);
        }
        match &self.model {
            Model::Spm => {
                let mut is_prev_special = true;
                let mut buf = String::new();
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => {
                            buf.clear();
                            if self.vocab.add_space_prefix && is_prev_special {
                                buf.push('▁');
                            }
                            for c in text[start..end].chars() {
                                if c == ' ' {
                                    buf.push('▁');
                                } else {
                                    buf.push(c);
                                }
                            }
                            spm::tokenize(&self.vocab, &buf, &mut out);
                            is_prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            is_prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe { ranks, pre } => {
                let ignore_merges = self.settings.is_some_and(|s| s.ignore_merges);
                let mut cache = WordCache::default();
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => {
                            let fragment_text = &text[start..end];
                            for range in pre.split(fragment_text)? {
                                let word = &fragment_text[range];
                                self.encode_word(ranks, ignore_merges, word, &mut cache, &mut out);
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::Wpm { max_token_len } => {
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => {
                            wpm::tokenize(&self.vocab, *max_token_len, &text[start..end], &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if wordpiece {
            if add_special {
                out.extend(self.vocab.special.sep);
            }
        } else if add_special && self.vocab.add_eos {
            out.extend(self.vocab.special.eos);
        }
        Ok(out)
    }

    fn encode_word<'t>(
        &self,
        ranks: &BpeRanks,
        ignore_merges: bool,
        word: &'t str,
        cache: &mut WordCache<'t>,
        out: &mut Vec<u32>,
    ) {
        if let Some(&(a, b)) = cache.words.get(word) {
            out.extend_from_slice(&cache.ids[a..b]);
            return;
        }
        let start = cache.ids.len();
        cache.encoded.clear();
        unicode::byte_encode(word, &mut cache.encoded);
        let lookup = |s: &str| self.vocab.id(s);
        match ignore_merges.then(|| self.vocab.id(&cache.encoded)).flatten() {
            Some(id) => cache.ids.push(id),
            None => bpe::merge_word(ranks, &cache.encoded, &lookup, &mut cache.ids),
        }
        let end = cache.ids.len();
        out.extend_from_slice(&cache.ids[start..end]);
        cache.words.insert(word, (start, end));
    }

    /// Cuts special tokens out of the text (llama.cpp `tokenizer_st_partition`).
    ///
    /// llama.cpp takes the special tokens longest first and, for each, claims its occurrences left
    /// to right in the text not yet claimed. We find all occurrences of all of them in one pass
    /// and replay that order, which gives the same fragments in linear time.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let Some(matcher) = &self.special_matcher else { return vec![Fragment::Text(0, text.len())] };
        let mut occurrences: Vec<(usize, usize, usize)> = matcher
            .find_overlapping_iter(text)
            .filter(|m| {
                let id = self.special_order[m.pattern().as_usize()];
                parse_special || self.vocab.tokens[id as usize].attr & (attr::CONTROL | attr::UNKNOWN) == 0
            })
            .map(|m| (m.pattern().as_usize(), m.start(), m.end()))
            .collect();
        if occurrences.is_empty() {
            return vec![Fragment::Text(0, text.len())];
        }
        occurrences.sort_unstable();
        let bytes = text.as_bytes();
        // Claimed byte ranges (start -> end), tokens and stripped whitespace alike, disjoint.
        let mut claimed: BTreeMap<usize, (usize, Option<u32>)> = BTreeMap::new();
        let overlaps = |claimed: &BTreeMap<usize, (usize, Option<u32>)>, start: usize, end: usize| {
            claimed.range(..end).next_back().is_some_and(|(_, &(e, _))| e > start)
        };
        for (order, start, end) in occurrences {
            if overlaps(&claimed, start, end) {
                continue;
            }
            let id = self.special_order[order];
            let token_attr = self.vocab.tokens[id as usize].attr;
            claimed.insert(start, (end, Some(id)));
            if token_attr & attr::LSTRIP != 0 {
                let mut s = start;
                while s > 0 && is_c_space(bytes[s - 1]) && !overlaps(&claimed, s - 1, s) {
                    s -= 1;
                }
                if s < start {
                    claimed.insert(s, (start, None));
                }
            }
            if token_attr & attr::RSTRIP != 0 {
                let mut e = end;
                while e < bytes.len() && is_c_space(bytes[e]) && !overlaps(&claimed, e, e + 1) {
                    e += 1;
                }
                if e > end {
                    claimed.insert(end, (e, None));
                }
            }
        }
        let mut fragments = Vec::with_capacity(claimed.len() * 2 + 1);
        let mut pos = 0;
        for (&start, &(end, id)) in &claimed {
            if start > pos {
                fragments.push(Fragment::Text(pos, start));
            }
            if let Some(id) = id {
                fragments.push(Fragment::Token(id));
            }
            pos = end;
        }
        if pos < text.len() {
            fragments.push(Fragment::Text(pos, text.len()));
        }
        fragments
    }

    /// llama.cpp `token_to_piece` without a cache, special = true.
    fn make_piece(&self, id: u32) -> Vec<u8> {
        let token = &self.vocab.tokens[id as usize];
        let a = token.attr;
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return token.text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match self.vocab.vocab_type {
                VocabType::Spm | VocabType::Wpm => token.text.replace('▁', " ").into_bytes(),
                VocabType::Bpe => decode_byte_level(&token.text),
            };
        }
        if a & attr::BYTE != 0 {
            // `<0xXX>`: llama.cpp parses the two characters after "<0x" with strtol.
            let hex = token.text.get(3..5).unwrap_or("");
            let byte = u8::from_str_radix(hex, 16).unwrap_or(0);
            return vec![byte];
        }
        Vec::new()
    }

    /// The bytes a token stands for (llama.cpp `llama_token_to_piece(.., lstrip = 0, special)`).
    ///
    /// With `special = false`, control and unknown tokens give nothing. Pieces are bytes: a byte
    /// token or a byte-level BPE token can hold part of a UTF-8 sequence. An id outside the
    /// vocabulary gives nothing.
    pub fn token_to_piece(&self, id: u32, special: bool) -> &[u8] {
        let Some(token) = self.vocab.tokens.get(id as usize) else { return &[] };
        if !special && token.attr & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return &[];
        }
        &self.pieces[id as usize]
    }

    /// llama.cpp `llama_detokenize(tokens, remove_special, unparse_special)`: the pieces, the first
    /// one without its leading space where the model adds a space prefix, and for models with
    /// `clean_spaces` (GPT-2 style) the clean-up of " ," " 's" etc.
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.vocab.add_space_prefix;
        if remove_special && self.vocab.add_bos && ids.first().is_some_and(|&id| Some(id) == self.vocab.special.bos) {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.vocab.add_eos && ids.last().is_some_and(|&id| Some(id) == self.vocab.special.eos) {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::new();
        for &id in ids {
            let mut piece = self.token_to_piece(id, unparse_special);
            if remove_space && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            remove_space = false;
            text.extend_from_slice(piece);
        }
        if self.settings.is_some_and(|s| s.clean_spaces) {
            text = clean_spaces(&text);
        }
        text
    }

    /// The text of a sequence of ids, as llama.cpp's `common_detokenize(.., special = false)`:
    /// control tokens are left out; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.detokenize(ids, false, false)).into_owned()
    }
}

/// Per-call memo of BPE words: input word -> range in `ids`.
#[derive(Default)]
struct WordCache<'t> {
    words: HashMap<&'t str, (usize, usize)>,
    ids: Vec<u32>,
    encoded: String,
}

/// Maps GPT-2 byte-level text back to bytes (llama.cpp `llama_decode_text`), marking code points
/// outside the byte map as llama.cpp does.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match unicode::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).as_bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// llama.cpp's three clean-up passes of `detokenize` for `clean_spaces` vocabularies.
fn clean_spaces(text: &[u8]) -> Vec<u8> {
    // Pass 1: " ?" " !" " ." " ," lose the space.
    let mut t: Vec<u8> = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            t.pop();
        }
        t.push(x);
    }
    // Pass 2: " ' " becomes "'".
    // llama.cpp overwrites the skipped space with NUL in place, which later comparisons see.
    let mut u: Vec<u8> = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        let x = t[i];
        if i > 0 && x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            u.pop();
            u.push(x);
            t[i + 1] = 0;
            i += 2;
            continue;
        }
        u.push(x);
        i += 1;
    }
    // Pass 3: " 's" " 'm" " 're" " 've" lose the space.
    let mut v: Vec<u8> = Vec::with_capacity(u.len());
    for i in 0..u.len() {
        let x = u[i];
        if i > 0 && u[i - 1] == b' ' && x == b'\'' && i + 1 < u.len() {
            let x1 = u[i + 1];
            let remove = match x1 {
                b's' | b'm' => true,
                b't' | b'd' => false,
                _ => i + 2 < u.len() && matches!((x1, u[i + 2]), (b'r', b'e') | (b'v', b'e')),
            };
            if remove {
                v.pop();
            }
        }
        v.push(x);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::clean_spaces;

    #[test]
    fn clean_spaces_follows_llama_cpp() {
        assert_eq!(clean_spaces(b"Hi , you ! ok ."), b"Hi, you! ok.");
        assert_eq!(clean_spaces(b"a ' b"), b"a'b");
        assert_eq!(clean_spaces(b"it 's we 're I 'd"), b"it's we're I 'd");
    }
}
