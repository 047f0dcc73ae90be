//! [`StreamDecoder`]: token-by-token text for streaming output.

use crate::Tokenizer;

/// Turns generated ids into text deltas that are always valid UTF-8.
///
/// A token can end inside a UTF-8 sequence (byte tokens, byte-level BPE pieces of an emoji); the
/// decoder holds such an incomplete tail back until the next tokens complete it. Bytes that can never
/// become valid UTF-8 come out as U+FFFD. Pieces are llama.cpp's `token_to_piece`, concatenated
/// without `detokenize`'s space clean-up, as llama.cpp's server streams them.
///
/// # Examples
/// ```no_run
/// # fn demo(tokenizer: &tokenizer::Tokenizer, ids: &[u32]) {
/// let mut stream = tokenizer::StreamDecoder::new(tokenizer, false);
/// let mut text = String::new();
/// for &id in ids {
///     text.push_str(&stream.push(id));
/// }
/// text.push_str(&stream.finish());
/// # }
/// ```
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder; `special` prints control tokens (`<|im_end|>`) too.
    pub fn new(tokenizer: &'a Tokenizer, special: bool) -> StreamDecoder<'a> {
        StreamDecoder { tokenizer, special, pending: Vec::new() }
    }

    /// Adds one token and returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend_from_slice(self.tokenizer.token_to_piece(id, self.special));
        self.take_complete(false)
    }

    /// Returns what is still held back, with an incomplete UTF-8 tail as U+FFFD, and resets.
    pub fn finish(&mut self) -> String {
        self.take_complete(true)
    }

    /// Whether bytes are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take_complete(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[valid + bad..];
                        }
                        None if flush => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let kept = rest.to_vec();
        self.pending = kept;
        out
    }
}
