//! Byte-level BPE merging within one pre-tokenized word (llama.cpp `llm_tokenizer_bpe_session`).
//!
//! Symbols start as the code points of the byte-encoded word; the adjacent pair with the lowest merge
//! rank is merged first (ties: leftmost), until no pair has a rank. A final symbol that is not a token
//! falls back to the tokens of its single bytes, where those exist.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::fxhash::FxHashMap;

/// Merge ranks, keyed by interned symbol texts so that lookups need no allocation.
pub(crate) struct BpeRanks {
    part_ids: FxHashMap<String, u32>,
    ranks: FxHashMap<(u32, u32), u32>,
}

impl BpeRanks {
    /// Parses `tokenizer.ggml.merges` (`"left right"`, split at the first space after the first
    /// byte, as llama.cpp does; a line without one merges two empty strings and never applies).
    pub fn new(merges: &[String]) -> BpeRanks {
        let mut part_ids: FxHashMap<String, u32> = FxHashMap::default();
        let mut ranks = FxHashMap::default();
        let intern = |s: &str, part_ids: &mut FxHashMap<String, u32>| -> u32 {
            if let Some(&id) = part_ids.get(s) {
                return id;
            }
            let id = part_ids.len() as u32;
            part_ids.insert(s.to_string(), id);
            id
        };
        for (rank, merge) in merges.iter().enumerate() {
            let split = merge.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1);
            let Some(pos) = split else { continue };
            let left = intern(&merge[..pos], &mut part_ids);
            let right = intern(&merge[pos + 1..], &mut part_ids);
            // The first occurrence of a pair keeps its rank (llama.cpp uses `emplace`).
            ranks.entry((left, right)).or_insert(rank as u32);
        }
        BpeRanks { part_ids, ranks }
    }

    /// The interned id of a symbol text, if any merge uses it.
    fn part(&self, text: &str) -> Option<u32> {
        self.part_ids.get(text).copied()
    }

    fn rank(&self, left: Option<u32>, right: Option<u32>) -> Option<u32> {
        self.ranks.get(&(left?, right?)).copied()
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    /// [`BpeRanks::part`] of the symbol's text.
    part: Option<u32>,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Merges one byte-encoded word and appends its ids. `token_id` looks a text up in the vocabulary.
pub(crate) fn merge_word(ranks: &BpeRanks, word: &str, token_id: &dyn Fn(&str) -> Option<u32>, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for (start, c) in word.char_indices() {
        let index = symbols.len();
        let len = c.len_utf8();
        let part = ranks.part(&word[start..start + len]);
        symbols.push(Symbol { start, len, part, prev: index.checked_sub(1), next: Some(index + 1) });
    }
    if let Some(last) = symbols.last_mut() {
        last.next = None;
    }
    // (rank, left index, right index, merged length in bytes); min-heap on rank then left index.
    let mut queue: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let text = |s: &Symbol| &word[s.start..s.start + s.len];
    let push = |queue: &mut BinaryHeap<Reverse<(u32, usize, usize, usize)>>, symbols: &[Symbol], l: usize, r: usize| {
        let (ls, rs) = (&symbols[l], &symbols[r]);
        if let Some(rank) = ranks.rank(ls.part, rs.part) {
            queue.push(Reverse((rank, l, r, ls.len + rs.len)));
        }
    };
    for i in 1..symbols.len() {
        push(&mut queue, &symbols, i - 1, i);
    }
    while let Some(Reverse((_, l, r, size))) = queue.pop() {
        let (left, right) = (symbols[l], symbols[r]);
        // A pair is stale once either side changed; sides only grow, so the length tells.
        if left.len == 0 || right.len == 0 || left.len + right.len != size {
            continue;
        }
        symbols[l].len += right.len;
        symbols[l].part = ranks.part(text(&symbols[l]));
        symbols[r].len = 0;
        symbols[l].next = right.next;
        if let Some(n) = right.next {
            symbols[n].prev = Some(l);
        }
        if let Some(p) = symbols[l].prev {
            push(&mut queue, &symbols, p, l);
        }
        if let Some(n) = symbols[l].next {
            push(&mut queue, &symbols, l, n);
        }
    }
    for s in symbols.iter().filter(|s| s.len > 0) {
        let piece = text(s);
        match token_id(piece) {
            Some(id) => out.push(id),
            None => {
                // llama.cpp looks up each byte of the (byte-encoded) text as a one-byte token.
                for &b in piece.as_bytes() {
                    if b.is_ascii() {
                        let one = [b];
                        if let Some(id) = std::str::from_utf8(&one).ok().and_then(token_id) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_lowest_rank_first() {
        let merges: Vec<String> = ["a b", "b c", "ab c"].iter().map(|s| s.to_string()).collect();
        let ranks = BpeRanks::new(&merges);
        let vocab: std::collections::HashMap<&str, u32> =
            [("a", 0), ("b", 1), ("c", 2), ("ab", 3), ("bc", 4), ("abc", 5)].into();
        let lookup = |s: &str| vocab.get(s).copied();
        let mut out = Vec::new();
        merge_word(&ranks, "abc", &lookup, &mut out);
        assert_eq!(out, [5]);
        out.clear();
        merge_word(&ranks, "bca", &lookup, &mut out);
        assert_eq!(out, [4, 0]);
        out.clear();
        // "d" is not a token and has no one-byte token: dropped, as llama.cpp does.
        merge_word(&ranks, "adb", &lookup, &mut out);
        assert_eq!(out, [0, 1]);
    }
}
