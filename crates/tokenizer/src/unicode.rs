//! Code point classes and the GPT-2 byte-to-unicode map, as llama.cpp's `unicode.cpp` uses them.
//!
//! llama.cpp classifies every code point into exactly one regex category (`\p{L}`, `\p{N}`, `\p{P}`,
//! `\p{S}`, `\p{M}`, `\p{Z}`, `\p{C}`; unassigned code points count as `\p{C}`) plus a separate
//! whitespace bit (Python `regex`'s `\s`, i.e. the Unicode `White_Space` property). The categories come
//! from `unicode-general-category`; its Unicode version can differ from llama.cpp's generated table for
//! code points assigned in the newest Unicode releases only.

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// The one regex category of a code point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Category {
    Letter,
    Number,
    Punctuation,
    Symbol,
    AccentMark,
    Separator,
    Control,
}

/// What the pre-tokenizers need to know about one code point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CptClass {
    pub category: Category,
    pub is_whitespace: bool,
}

impl CptClass {
    pub fn is_letter(self) -> bool {
        self.category == Category::Letter
    }
    pub fn is_number(self) -> bool {
        self.category == Category::Number
    }
}

/// Classifies one code point.
pub(crate) fn classify(c: char) -> CptClass {
    if c.is_ascii() {
        return classify_ascii(c as u8);
    }
    classify_table(c)
}

/// The Unicode classes of ASCII, without a table lookup (most text is ASCII).
fn classify_ascii(b: u8) -> CptClass {
    let category = match b {
        b'A'..=b'Z' | b'a'..=b'z' => Category::Letter,
        b'0'..=b'9' => Category::Number,
        b' ' => Category::Separator,
        b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'`' | b'|' | b'~' => Category::Symbol,
        0x21..=0x7E => Category::Punctuation,
        _ => Category::Control,
    };
    CptClass { category, is_whitespace: matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r') }
}

fn classify_table(c: char) -> CptClass {
    let category = match get_general_category(c) {
        G::UppercaseLetter | G::LowercaseLetter | G::TitlecaseLetter | G::ModifierLetter | G::OtherLetter => {
            Category::Letter
        }
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Category::Number,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation => Category::Punctuation,
        G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol => Category::Symbol,
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark => Category::AccentMark,
        G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => Category::Separator,
        // Control, format, surrogate, private use, unassigned: `\p{C}`.
        _ => Category::Control,
    };
    // Rust's `char::is_whitespace` is the Unicode White_Space property, which is what Python's
    // `regex` module matches with `\s` and hence what llama.cpp's table holds.
    CptClass { category, is_whitespace: c.is_whitespace() }
}

/// The printable code point GPT-2's byte-level BPE uses for each byte (`bytes_to_unicode`).
pub(crate) fn byte_to_char(byte: u8) -> char {
    BYTE_TO_CHAR[byte as usize]
}

/// The byte a GPT-2 byte-level code point stands for, if it is one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 0x100 {
        let b = cp as u8;
        if is_printable_latin1(b) {
            return Some(b);
        }
        return None;
    }
    if cp < 0x100 + 68 {
        return Some(NON_PRINTABLE[(cp - 0x100) as usize]);
    }
    None
}

/// Bytes that GPT-2 keeps as their own code point: `!`..`~`, `¡`..`¬`, `®`..`ÿ`.
const fn is_printable_latin1(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The 68 bytes that GPT-2 moves to U+0100.., in byte order.
const NON_PRINTABLE: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !is_printable_latin1(b as u8) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

const BYTE_TO_CHAR: [char; 256] = {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        out[b] = if is_printable_latin1(b as u8) {
            match char::from_u32(b as u32) {
                Some(c) => c,
                None => '\0',
            }
        } else {
            let c = match char::from_u32(0x100 + n) {
                Some(c) => c,
                None => '\0',
            };
            n += 1;
            c
        };
        b += 1;
    }
    out
};

/// Byte-encodes a word: each UTF-8 byte becomes its GPT-2 code point.
pub(crate) fn byte_encode(word: &str, out: &mut String) {
    for &b in word.as_bytes() {
        out.push(byte_to_char(b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_matches_gpt2_bytes_to_unicode() {
        // Values from GPT-2's encoder.py `bytes_to_unicode()`.
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(0), 'Ā');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        assert_eq!(byte_to_char(0x7F), 'ġ');
        assert_eq!(byte_to_char(b'a'), 'a');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b), "byte {b}");
        }
        assert_eq!(char_to_byte('ŉ'), None);
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn ascii_fast_path_agrees_with_the_table() {
        for b in 0..128u8 {
            assert_eq!(classify_ascii(b), classify_table(b as char), "byte {b}");
        }
    }

    #[test]
    fn classes() {
        assert!(classify('a').is_letter());
        assert!(classify('é').is_letter());
        assert!(classify('٣').is_number());
        assert_eq!(classify('\u{301}').category, Category::AccentMark);
        assert!(classify('\u{a0}').is_whitespace);
        assert!(!classify('\u{200b}').is_whitespace);
        assert_eq!(classify('\u{200b}').category, Category::Control);
        assert_eq!(classify('$').category, Category::Symbol);
        assert_eq!(classify('!').category, Category::Punctuation);
    }
}
