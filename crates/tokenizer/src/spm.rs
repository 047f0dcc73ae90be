//! SentencePiece-style BPE over scores (llama.cpp `llm_tokenizer_spm_session`).
//!
//! Symbols start as the code points of the (▁-escaped) text; the adjacent pair whose concatenation is a
//! token with the highest score is merged first (ties: leftmost). A final symbol that is not a token is
//! written as byte tokens `<0xXX>`.

use std::collections::BinaryHeap;

use crate::vocab::Vocab;

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge, ordered so that the heap's top is the highest score, then the leftmost pair.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // llama.cpp: `l.score < r.score || (l.score == r.score && l.left > r.left)` puts `r` first.
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes one fragment of (already escaped) text and appends its ids.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let index = symbols.len();
        symbols.push(Symbol { start, len: c.len_utf8(), prev: index.checked_sub(1), next: Some(index + 1) });
    }
    if let Some(last) = symbols.last_mut() {
        last.next = None;
    }
    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
        let (l, r) = (&symbols[left], &symbols[right]);
        let merged = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.id(merged) {
            queue.push(Bigram { score: vocab.tokens[id as usize].score, left, right, size: merged.len() });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, i - 1, i);
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        if let Some(p) = symbols[b.left].prev {
            try_add(&mut queue, &symbols, p, b.left);
        }
        if let Some(n) = symbols[b.left].next {
            try_add(&mut queue, &symbols, b.left, n);
        }
    }
    // Every merged symbol is a token by construction; only unmerged code points can be unknown.
    for s in symbols.iter().filter(|s| s.len > 0) {
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    if let Some(id) = byte_token(vocab, b) {
                        out.push(id);
                    }
                }
            }
        }
    }
}

/// The token of one byte: `<0xXX>`, else the one-byte text itself (llama.cpp `byte_to_token`).
/// llama.cpp aborts when neither exists; we fall back to the unknown token, else drop the byte.
pub(crate) fn byte_token(vocab: &Vocab, byte: u8) -> Option<u32> {
    let hex = format!("<0x{byte:02X}>");
    if let Some(id) = vocab.id(&hex) {
        return Some(id);
    }
    if byte.is_ascii() {
        if let Some(id) = vocab.id(&(byte as char).to_string()) {
            return Some(id);
        }
    }
    vocab.special.unk
}
