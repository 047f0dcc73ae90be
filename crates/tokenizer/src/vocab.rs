//! The vocabulary read from GGUF metadata, with llama.cpp's token attributes and special ids.
//!
//! Follows `llama_vocab::impl::load` (llama.cpp src/llama-vocab.cpp): defaults per tokenizer model,
//! then the GGUF keys, then the text-based detection of end-of-generation and fill-in-the-middle
//! tokens that llama.cpp applies because converters do not record them.

use std::collections::BTreeSet;

use crate::fxhash::FxHashMap;

use crate::TokenizerError;

/// Token attributes (llama.cpp `llama_token_attr`), a bit set.
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;
}

/// Maps a GGUF `tokenizer.ggml.token_type` value to attributes.
fn attr_of_type(token_type: i64) -> u32 {
    match token_type {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// One vocabulary entry.
#[derive(Clone, Debug)]
pub(crate) struct TokenData {
    pub text: String,
    pub score: f32,
    pub attr: u32,
}

/// Which tokenizer algorithm the vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VocabType {
    /// SentencePiece-style BPE over ▁-escaped text with byte fallback (`tokenizer.ggml.model = llama`).
    Spm,
    /// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
    Bpe,
    /// BERT's WordPiece over ▁-prefixed words (`tokenizer.ggml.model = bert`).
    Wpm,
}

/// Ids with a role; `None` where the model has none.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

/// Selects one id slot of [`SpecialIds`].
type SlotOf = fn(&mut SpecialIds) -> &mut Option<u32>;

/// Everything read from the metadata.
pub(crate) struct Vocab {
    pub vocab_type: VocabType,
    pub pre: String,
    pub tokens: Vec<TokenData>,
    pub token_to_id: FxHashMap<String, u32>,
    pub special: SpecialIds,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// BertNormalizer options of a WordPiece vocabulary (false for other types).
    pub lowercase: bool,
    pub strip_accents: bool,
    pub eog: BTreeSet<u32>,
    /// BPE merges as given, `"left right"`.
    pub merges: Vec<String>,
}

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";

/// Reads an id key; negative or non-integer values count as absent, as no id can be negative.
fn id_key(md: &gguf::Metadata, key: &str) -> Option<i128> {
    md.get(key).and_then(|v| v.as_i128()).filter(|&v| v >= 0)
}

impl Vocab {
    /// Reads the vocabulary; `pre_add_bos` is the pre-tokenizer's default for `add_bos`.
    pub fn from_gguf(md: &gguf::Metadata, pre_add_bos: bool, pre_no_bos: bool) -> Result<Vocab, TokenizerError> {
        let model = md.str(KEY_MODEL)?;
        let pre = md.str_opt(KEY_PRE)?.unwrap_or("").to_string();
        let vocab_type = match model {
            "llama" => VocabType::Spm,
            "gpt2" => VocabType::Bpe,
            "bert" => VocabType::Wpm,
            other => return Err(TokenizerError::UnsupportedModel { model: other.to_string() }),
        };
        let texts =
            md.str_array_opt(KEY_TOKENS)?.ok_or_else(|| gguf::GgufError::MissingKey { key: KEY_TOKENS.to_string() })?;
        let n_vocab = texts.len();
        if n_vocab == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        let scores = md.f32_array_opt(KEY_SCORES)?;
        if let Some(s) = &scores {
            if s.len() < n_vocab {
                return Err(TokenizerError::ArrayTooShort { key: KEY_SCORES, got: s.len(), n_vocab });
            }
        }
        let types = md.i64_array_opt(KEY_TOKEN_TYPE)?;
        if let Some(t) = &types {
            if t.len() < n_vocab {
                return Err(TokenizerError::ArrayTooShort { key: KEY_TOKEN_TYPE, got: t.len(), n_vocab });
            }
        }
        let merges = match vocab_type {
            VocabType::Bpe => md
                .str_array_opt(KEY_MERGES)?
                .ok_or_else(|| gguf::GgufError::MissingKey { key: KEY_MERGES.to_string() })?
                .into_iter()
                .map(str::to_string)
                .collect(),
            VocabType::Spm | VocabType::Wpm => Vec::new(),
        };

        let mut tokens = Vec::with_capacity(n_vocab);
        let mut token_to_id = FxHashMap::with_capacity_and_hasher(n_vocab, Default::default());
        for (i, text) in texts.iter().enumerate() {
            let id = i as u32;
            // llama.cpp renames empty tokens so that every token has a distinct, non-empty text.
            let text = if text.is_empty() { format!("[EMPTY_{i}]") } else { (*text).to_string() };
            if let Some(&first) = token_to_id.get(&text) {
                return Err(TokenizerError::DuplicateToken { text, first, second: id });
            }
            token_to_id.insert(text.clone(), id);
            let score = scores.as_ref().map_or(0.0, |s| s[i]);
            let attr = types.as_ref().map_or(attr::NORMAL, |t| attr_of_type(t[i]));
            tokens.push(TokenData { text, score, attr });
        }

        // Defaults per tokenizer model, disabled where out of range.
        let in_range = |id: u32| ((id as usize) < n_vocab).then_some(id);
        let mut special = SpecialIds::default();
        let (mut add_bos, mut add_eos, mut add_space_prefix) = match vocab_type {
            VocabType::Spm => {
                special.bos = in_range(1);
                special.eos = in_range(2);
                special.unk = in_range(0);
                (true, false, true)
            }
            VocabType::Bpe => {
                special.bos = if pre_no_bos { None } else { in_range(11) };
                special.eos = in_range(11);
                (pre_add_bos, false, false)
            }
            // llama.cpp's BERT defaults; WordPiece always frames a text with CLS (the BOS id) and
            // SEP when special tokens are asked for, whatever add_bos/add_eos say.
            VocabType::Wpm => {
                special.bos = in_range(101);
                special.unk = in_range(100);
                special.sep = in_range(102);
                special.pad = in_range(0);
                special.mask = in_range(103);
                (true, false, false)
            }
        };
        if let Some(v) = md.bool_opt(KEY_ADD_PREFIX)? {
            add_space_prefix = v;
        }
        // A key overrides the default only with an id inside the vocabulary (llama.cpp warns and
        // keeps the default otherwise).
        let read = |key: &str, current: Option<u32>| match id_key(md, key) {
            Some(v) if v < n_vocab as i128 => Some(v as u32),
            _ => current,
        };
        special.bos = read(KEY_BOS, special.bos);
        special.eos = read(KEY_EOS, special.eos);
        special.eot = read("tokenizer.ggml.eot_token_id", special.eot);
        special.eom = read("tokenizer.ggml.eom_token_id", special.eom);
        special.unk = read("tokenizer.ggml.unknown_token_id", special.unk);
        special.sep = read("tokenizer.ggml.seperator_token_id", special.sep);
        special.pad = read("tokenizer.ggml.padding_token_id", special.pad);
        special.mask = read("tokenizer.ggml.mask_token_id", special.mask);
        special.fim_pre = read("tokenizer.ggml.fim_pre_token_id", special.fim_pre);
        special.fim_suf = read("tokenizer.ggml.fim_suf_token_id", special.fim_suf);
        special.fim_mid = read("tokenizer.ggml.fim_mid_token_id", special.fim_mid);
        special.fim_pad = read("tokenizer.ggml.fim_pad_token_id", special.fim_pad);
        special.fim_rep = read("tokenizer.ggml.fim_rep_token_id", special.fim_rep);
        special.fim_sep = read("tokenizer.ggml.fim_sep_token_id", special.fim_sep);
        // Deprecated spellings, read after the new ones as llama.cpp does.
        special.fim_pre = read("tokenizer.ggml.prefix_token_id", special.fim_pre);
        special.fim_suf = read("tokenizer.ggml.suffix_token_id", special.fim_suf);
        special.fim_mid = read("tokenizer.ggml.middle_token_id", special.fim_mid);

        if let Some(v) = md.bool_opt(KEY_ADD_BOS)? {
            add_bos = v;
        }
        if let Some(v) = md.bool_opt(KEY_ADD_EOS)? {
            add_eos = v;
        }
        if add_bos && special.bos.is_none() {
            return Err(TokenizerError::MissingSpecialToken { flag_key: KEY_ADD_BOS, id_key: KEY_BOS });
        }
        if add_eos && special.eos.is_none() {
            return Err(TokenizerError::MissingSpecialToken { flag_key: KEY_ADD_EOS, id_key: KEY_EOS });
        }

        // BertNormalizer: strip_accents defaults to lowercase, as in HF `tokenizers` and llama.cpp.
        let (lowercase, strip_accents) = if vocab_type == VocabType::Wpm {
            let lowercase = md.bool_opt("tokenizer.ggml.normalizer.lowercase")?.unwrap_or(false);
            (lowercase, md.bool_opt("tokenizer.ggml.normalizer.strip_accents")?.unwrap_or(lowercase))
        } else {
            (false, false)
        };
        if vocab_type == VocabType::Wpm && special.sep.is_none() {
            return Err(TokenizerError::MissingSeparator { n_vocab });
        }
        let mut vocab = Vocab {
            vocab_type,
            lowercase,
            strip_accents,
            pre,
            tokens,
            token_to_id,
            special,
            add_bos,
            add_eos,
            add_space_prefix,
            eog: BTreeSet::new(),
            merges,
        };
        vocab.detect_special_tokens();
        if let Some(name) = md.str_opt("general.name")? {
            vocab.apply_model_attrs(name);
        }
        Ok(vocab)
    }

    /// The id of a token text.
    pub fn id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Marks a token as control (llama.cpp overrides the type of control-looking tokens).
    fn make_control(&mut self, id: u32) {
        self.tokens[id as usize].attr |= attr::CONTROL;
    }

    /// The first id (lowest, for determinism) among `texts` that exists.
    fn first_of(&self, texts: &[&str]) -> Option<u32> {
        texts.iter().filter_map(|t| self.id(t)).min()
    }

    /// llama.cpp's text-based detection of EOT/EOM/FIM tokens and of end-of-generation tokens.
    ///
    /// llama.cpp walks an unordered map, so where several candidates exist which one becomes *the*
    /// EOT (or FIM) id is unspecified there; we take the lowest id. The set of end-of-generation
    /// tokens does not depend on that choice.
    fn detect_special_tokens(&mut self) {
        const EOT: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ];
        const EOM: &[&str] = &["<|eom_id|>"];
        const FIM_PRE: &[&str] = &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ];
        const FIM_SUF: &[&str] = &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ];
        const FIM_MID: &[&str] = &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ];
        const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
        const FIM_REP: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
        const FIM_SEP: &[&str] = &["<|file_sep|>"];
        const EOG: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|flush|>",
            "<|calls|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "</s>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "[EOS]",
            "<|end_of_text|>",
            "<end_of_utterance>",
            "<eos>",
            "<turn|>",
            "<|tool_response>",
            "<｜end▁of▁sentence｜>",
            "[e~[",
        ];

        let detections: [(&[&str], SlotOf); 8] = [
            (EOT, |s| &mut s.eot),
            (EOM, |s| &mut s.eom),
            (FIM_PRE, |s| &mut s.fim_pre),
            (FIM_SUF, |s| &mut s.fim_suf),
            (FIM_MID, |s| &mut s.fim_mid),
            (FIM_PAD, |s| &mut s.fim_pad),
            (FIM_REP, |s| &mut s.fim_rep),
            (FIM_SEP, |s| &mut s.fim_sep),
        ];
        for (texts, slot) in detections {
            if slot(&mut self.special).is_none() {
                if let Some(id) = self.first_of(texts) {
                    *slot(&mut self.special) = Some(id);
                    self.make_control(id);
                }
            }
        }

        // Control tokens whose text says "unused" are unused.
        for t in &mut self.tokens {
            if t.attr & attr::CONTROL != 0 && t.text.contains("unused") {
                t.attr |= attr::UNUSED;
            }
        }

        let mut eog = BTreeSet::new();
        for id in [self.special.fim_pad, self.special.fim_rep, self.special.fim_sep].into_iter().flatten() {
            eog.insert(id);
        }
        for text in EOG {
            if let Some(id) = self.id(text) {
                eog.insert(id);
                self.make_control(id);
            }
        }
        // gpt-oss: these are always rendered.
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = self.id(text) {
                self.tokens[id as usize].attr = attr::USER_DEFINED;
            }
        }
        for id in [self.special.eos, self.special.eot, self.special.eom].into_iter().flatten() {
            eog.insert(id);
        }
        // o200k_harmony and solar-open: "<|end|>" ends a message, not the generation.
        let eog_id = |text: &str| self.id(text).filter(|id| eog.contains(id));
        let has_return = eog_id("<|return|>").is_some();
        let has_call = eog_id("<|call|>").is_some() || eog_id("<|calls|>").is_some();
        let has_flush = eog_id("<|flush|>").is_some();
        let end_id = eog_id("<|end|>");
        // gemma4 and paddleocr: "</s>" is not end-of-generation next to "<|tool_response>".
        let has_tool_response = eog_id("<|tool_response>").is_some();
        let s_id = eog_id("</s>");
        if let Some(end_id) = end_id {
            if has_call && (has_return || has_flush) {
                eog.remove(&end_id);
                self.tokens[end_id as usize].attr = attr::USER_DEFINED;
            }
        }
        if let (true, Some(s_id)) = (has_tool_response, s_id) {
            eog.remove(&s_id);
            self.tokens[s_id as usize].attr = attr::NORMAL;
        }
        self.eog = eog;
    }

    /// Per-model attribute fixes llama.cpp applies by `general.name` (Phi-3 strips spaces right of
    /// special tokens).
    fn apply_model_attrs(&mut self, general_name: &str) {
        let name = general_name.to_ascii_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for t in &mut self.tokens {
                if t.attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0 {
                    t.attr |= attr::RSTRIP;
                }
            }
            if let Some(id) = self.id("</s>") {
                self.tokens[id as usize].attr |= attr::RSTRIP;
            }
            for text in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(id) = self.id(text) {
                    self.tokens[id as usize].attr &= !attr::RSTRIP;
                }
            }
        }
    }
}
