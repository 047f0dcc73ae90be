//! Synthetic models: GGUF files of any size and architecture with random weights, for
//! benchmarks and tests that need the shape of a real model but not its knowledge.
//!
//! A [`SynthShape`] holds the hyper-parameters (named shapes of real models come from
//! [`SynthShape::named`], anything else from [`SynthShape::minimal`] plus [`SynthShape::set`]);
//! [`SynthPlan::new`] turns it into metadata and a tensor list in the exact names and shapes
//! llama.cpp and this crate load; [`SynthPlan::write`] streams the tensor data.
//!
//! # Design: every row is a pure function of (seed, tensor name, row index)
//! Each row of each tensor draws from its own counter-seeded generator, so rows can be made in
//! any order, on any number of threads, in chunks of any size, and a test can regenerate any row
//! to check the file. Writing therefore never holds more than one chunk of rows (a few MiB,
//! [`SynthOptions::chunk_bytes`]) whatever the model size: a 400 GB DeepSeek-V3 is written with
//! the memory of a 1 B model.
//!
//! # Weights
//! Matrices are N(0, 1/fan_in) (standard deviation `1/sqrt(fan_in)`, fan_in the row length
//! unless stated), so every projection keeps unit-RMS activations at unit RMS. In models with an
//! untied output, those that write into the residual stream (attention output, FFN, shared and
//! expert down) are N(0, 1/(2 n_layer fan_in)) and the embedding N(0, 1) (unit RMS per token), so
//! each token's own row stays a large part of every layer's input and the routers of a MoE see
//! inputs that differ from token to token (`residual_out` says what happened without it); with a
//! tied output the embedding is N(0, 1/n_embd) and every matrix follows the plain law;
//! norm gains are 1 + N(0, 0.02²); biases N(0, 0.02²); attention sinks N(0, 0.1²). A forward pass then yields logits of standard
//! deviation about 1 and greedy decoding never meets a NaN. (Gemma 3 alone: embedding N(0,
//! 1/n_embd²) and final gain sqrt(n_embd), see `embeddings`.)
//! Routers (`ffn_gate_inp.weight`) stay F32, as llama-quantize keeps them.
//!
//! # Direct blocks
//! Drawing Gaussians and running the reference quantizer costs 30 (Q8_0) to 140 (Q4_K) ns per
//! value, hours for a 30 B model on two cores. Zero-mean Q8_0, Q4_0 and Q4_K matrices are
//! therefore drawn as blocks (unless [`SynthOptions::exact_quantization`]): one f16 scale per
//! block chosen so the dequantized values have the law's standard deviation, and symmetric
//! bounded codes (Q8_0: the sum of four uniform bytes over 8, an Irwin-Hall approximation
//! of a Gaussian cut at 3.5 sigma; Q4_0/Q4_K: the difference of two uniforms on
//! 0..=7, a triangular law on -7..=7; Q4_K sub-block scales uniform on 32..=63 with mins equal
//! to the scales and `dmin = 7 d`, so each value is `d * sc * (q - 7)`, zero mean). About 1 ns
//! per value: writing is then bound by the disk. Other types, and the gains (mean 1), go
//! through the quantizer.
//!
//! # Routing skew
//! With i.i.d. router rows every expert is equally likely. `routing_skew = S > 0` ranks the
//! experts of each layer by a random permutation (rank 1 = most popular, a different permutation
//! per layer, derived from the seed) and multiplies the router row of the expert of rank `r` by
//! `r^-S`. The logit of that expert for a unit-RMS input is then N(0, r^-2S): experts with a wider
//! logit distribution win top-k more often, so popularity falls with rank. Measured on
//! isotropic Gaussian inputs (20 000 tokens), share of tokens that use the most popular /
//! the median / the least popular expert, against uniform k/n:
//!
//! | experts, top-k | S = 0 | S = 0.1 | S = 0.25 | S = 0.5 | uniform |
//! |---|---|---|---|---|---|
//! | 128, 8 (Qwen3-MoE) | .06/.06/.06 | .15/.056/.043 | .27/.045/.022 | .39/.026/.004 | .0625 |
//! | 32, 4 (gpt-oss-20b) | .12/.13/.12 | .18/.12/.11 | .26/.11/.075 | .38/.093/.037 | .125 |
//! | 8, 2 (Mixtral) | .25/.25/.24 | .28/.25/.24 | .31/.24/.21 | .37/.23/.18 | .25 |
//!
//! The top expert saturates near one half (it wins only when its logit is positive), so the
//! knob gives heavy-tailed, not exactly Zipf, popularity; S between 0.1 and 0.5 covers what
//! real routers show.
//!
//! # Tokenizer
//! A byte-level `gpt2` vocabulary without merges: ids 0..=255 are the 256 bytes (GPT-2's
//! byte-to-unicode spelling, id = byte value), 256 is BOS `<|begin_of_text|>`, 257 is EOS
//! `<|end_of_text|>` (both control tokens), and ids from 258 up to the vocabulary size are
//! normal tokens `[t258]`, `[t259]`, ... that no text encodes to but that generation can pick
//! (so a random model prints visible output). Pre-tokenizer `default`.

use crate::error::ModelError;
use compute::quant::{self, QuantError};
use gguf::names::{blk, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};
use gguf::{GgmlType, GgufError, GgufWriter, TensorDataSink, Value, ValueType};
use rayon::prelude::*;
use std::cell::RefCell;
use std::io::Write;
use std::path::Path;

/// Why a synthetic model could not be described or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    /// A shape name that is not in [`SHAPES`].
    #[error("unknown shape {name:?}; known shapes: {known}")]
    UnknownShape {
        /// The name given.
        name: String,
        /// The names there are.
        known: String,
    },
    /// An architecture this generator has no tensor list for.
    #[error("architecture {arch:?} has no synthetic tensor list; known: {known}")]
    UnknownArch {
        /// The architecture given.
        arch: String,
        /// The architectures there are.
        known: String,
    },
    /// A `key=value` parameter with an unknown key.
    #[error("unknown parameter {key:?}; known: {known}")]
    UnknownParam {
        /// The key given.
        key: String,
        /// The keys there are.
        known: String,
    },
    /// A parameter whose value does not parse or is out of range.
    #[error("parameter {key}={value:?}: {why}")]
    BadParam {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// Hyper-parameters that do not make a model.
    #[error("bad shape for {arch}: {why}")]
    BadShape {
        /// The architecture.
        arch: String,
        /// What is wrong.
        why: String,
    },
    /// A tensor type there is no quantizer for.
    #[error("cannot write tensors of type {dtype}: no quantizer (types with one: {supported})")]
    Type {
        /// The type asked for.
        dtype: GgmlType,
        /// Types that can be written.
        supported: String,
    },
    /// Writing the file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Quantizing a row failed.
    #[error("quantizing {tensor:?}: {source}")]
    Quant {
        /// The tensor.
        tensor: String,
        /// The cause.
        source: QuantError,
    },
}

impl From<SynthError> for ModelError {
    fn from(e: SynthError) -> Self {
        ModelError::Hparams { why: e.to_string() }
    }
}

/// Shorthand for results of this module.
pub type Result<T, E = SynthError> = std::result::Result<T, E>;

/// Architectures (`general.architecture`) this generator has tensor lists for.
pub const SYNTH_ARCHITECTURES: &[&str] =
    &["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "olmoe", "gpt-oss", "deepseek2"];

/// Token id of BOS in the synthetic vocabulary.
pub const BOS_ID: u32 = 256;
/// Token id of EOS in the synthetic vocabulary.
pub const EOS_ID: u32 = 257;

/// Hyper-parameters of a synthetic model. Fields that an architecture does not use are ignored
/// (zero by convention). Names follow the `--params` keys (see [`PARAM_KEYS`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SynthShape {
    /// `general.architecture`.
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (for deepseek2: ignored, MLA has one latent head).
    pub n_head_kv: usize,
    /// Head width of q, k and v.
    pub head_dim: usize,
    /// Dense FFN width (also the leading dense layers of deepseek2).
    pub n_ff: usize,
    /// Vocabulary size (at least 258: bytes, BOS, EOS).
    pub n_vocab: usize,
    /// Trained context length written to the metadata.
    pub n_ctx: usize,
    /// Rope base.
    pub rope_base: f32,
    /// RMS norm epsilon.
    pub rms_eps: f32,
    /// Output projection tied to the embedding (no `output.weight`).
    pub tied: bool,
    /// Routed experts per MoE layer (0: dense).
    pub n_expert: usize,
    /// Experts used per token.
    pub n_expert_used: usize,
    /// Width of one expert's FFN.
    pub n_ff_exp: usize,
    /// Shared experts (deepseek2), each of width `n_ff_exp`.
    pub n_expert_shared: usize,
    /// Leading layers with a dense FFN (deepseek2).
    pub n_dense_lead: usize,
    /// Sliding-window length (gemma3, gpt-oss; 0: none).
    pub sliding_window: usize,
    /// MLA query low-rank width (deepseek2).
    pub q_lora_rank: usize,
    /// MLA key/value latent width (deepseek2).
    pub kv_lora_rank: usize,
    /// MLA rotary part of the q/k head (deepseek2).
    pub qk_rope_dim: usize,
    /// MLA non-rotary part of the q/k head (deepseek2).
    pub qk_nope_dim: usize,
    /// MLA value head width (deepseek2).
    pub v_head_dim: usize,
    /// Expert groups (deepseek2 group-limited routing; 1: none).
    pub n_group: usize,
    /// Groups a token may use.
    pub n_group_used: usize,
    /// Scale of the routed experts' sum (deepseek2).
    pub routed_scale: f32,
    /// YaRN context-extension factor (0: no rope scaling).
    pub yarn_factor: f32,
    /// YaRN original context.
    pub yarn_orig_ctx: usize,
}

/// The `--params` keys, in [`SynthShape`] field order.
pub const PARAM_KEYS: &[&str] = &[
    "n_layer",
    "n_embd",
    "n_head",
    "n_head_kv",
    "head_dim",
    "n_ff",
    "n_vocab",
    "n_ctx",
    "rope_base",
    "rms_eps",
    "tied",
    "n_expert",
    "n_expert_used",
    "n_ff_exp",
    "n_expert_shared",
    "n_dense_lead",
    "sliding_window",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_dim",
    "qk_nope_dim",
    "v_head_dim",
    "n_group",
    "n_group_used",
    "routed_scale",
    "yarn_factor",
    "yarn_orig_ctx",
];

/// Named shapes: name, architecture, what it mimics (from the model's `config.json`).
pub const SHAPES: &[(&str, &str, &str)] = &[
    ("dense-1b", "llama", "Llama-3.2-1B: 16 layers, 2048 wide, 32:8 heads of 64, FFN 8192, vocab 128256, tied"),
    ("dense-8b", "llama", "Llama-3.1-8B: 32 layers, 4096 wide, 32:8 heads of 128, FFN 14336, vocab 128256"),
    ("qwen3-30b-a3b", "qwen3moe", "Qwen3-30B-A3B: 48 layers, 2048 wide, 32:4 heads of 128, 128 experts top-8 of 768, vocab 151936"),
    ("qwen3-235b-a22b", "qwen3moe", "Qwen3-235B-A22B: 94 layers, 4096 wide, 64:4 heads of 128, 128 experts top-8 of 1536, vocab 151936"),
    ("gpt-oss-20b", "gpt-oss", "gpt-oss-20b: 24 layers, 2880 wide, 64:8 heads of 64, 32 experts top-4 of 2880, window 128, vocab 201088"),
    ("gpt-oss-120b", "gpt-oss", "gpt-oss-120b: 36 layers, 2880 wide, 64:8 heads of 64, 128 experts top-4 of 2880, window 128, vocab 201088"),
    ("mixtral-8x7b", "llama", "Mixtral-8x7B: 32 layers, 4096 wide, 32:8 heads of 128, 8 experts top-2 of 14336, vocab 32000"),
    ("olmoe-1b-7b", "olmoe", "OLMoE-1B-7B: 16 layers, 2048 wide, 16:16 heads of 128, 64 experts top-8 of 1024, vocab 50304"),
    (
        "deepseek-v3",
        "deepseek2",
        "DeepSeek-V3: 61 layers (3 dense), 7168 wide, 128 MLA heads, 256 experts top-8 of 2048 + 1 shared, vocab 129280",
    ),
];

impl SynthShape {
    /// A small model of `arch` (2 layers, 256 wide, vocabulary 512, rows multiples of 256 so
    /// every quantized type applies), the starting point for `--params`.
    ///
    /// # Errors
    /// [`SynthError::UnknownArch`].
    pub fn minimal(arch: &str) -> Result<SynthShape> {
        let base = SynthShape {
            arch: arch.to_string(),
            n_layer: 2,
            n_embd: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            n_ff: 512,
            n_vocab: 512,
            n_ctx: 4096,
            rope_base: 10000.0,
            rms_eps: 1e-5,
            tied: false,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            n_expert_shared: 0,
            n_dense_lead: 0,
            sliding_window: 0,
            q_lora_rank: 0,
            kv_lora_rank: 0,
            qk_rope_dim: 0,
            qk_nope_dim: 0,
            v_head_dim: 0,
            n_group: 1,
            n_group_used: 1,
            routed_scale: 1.0,
            yarn_factor: 0.0,
            yarn_orig_ctx: 0,
        };
        let moe = SynthShape { n_expert: 8, n_expert_used: 2, n_ff_exp: 256, ..base.clone() };
        Ok(match arch {
            "llama" | "qwen2" => base,
            "qwen3" => SynthShape { tied: true, ..base },
            "gemma3" => SynthShape { n_layer: 6, sliding_window: 8, tied: true, rms_eps: 1e-6, ..base },
            "qwen3moe" => moe,
            // llama.cpp's OLMoE has as many kv heads as heads, n_embd wide.
            "olmoe" => SynthShape { n_head_kv: 4, ..moe },
            "gpt-oss" => {
                SynthShape { sliding_window: 8, yarn_factor: 32.0, yarn_orig_ctx: 4096, rope_base: 150000.0, ..moe }
            }
            "deepseek2" => SynthShape {
                n_head_kv: 1,
                n_dense_lead: 1,
                n_expert_shared: 1,
                q_lora_rank: 256,
                kv_lora_rank: 256,
                qk_rope_dim: 64,
                qk_nope_dim: 64,
                v_head_dim: 64,
                n_group: 2,
                n_group_used: 1,
                routed_scale: 2.5,
                rms_eps: 1e-6,
                ..moe
            },
            _ => return Err(SynthError::UnknownArch { arch: arch.to_string(), known: SYNTH_ARCHITECTURES.join(", ") }),
        })
    }

    /// The shape of a real model by its [`SHAPES`] name, hyper-parameters from its config.json.
    ///
    /// # Errors
    /// [`SynthError::UnknownShape`].
    pub fn named(name: &str) -> Result<SynthShape> {
        let Some(&(_, arch, _)) = SHAPES.iter().find(|s| s.0 == name) else {
            return Err(SynthError::UnknownShape {
                name: name.to_string(),
                known: SHAPES.iter().map(|s| s.0).collect::<Vec<_>>().join(", "),
            });
        };
        let m = SynthShape::minimal(arch)?;
        let llama3 =
            SynthShape { rope_base: 500000.0, n_vocab: 128256, n_ctx: 131072, n_head: 32, n_head_kv: 8, ..m.clone() };
        let qwen3moe = SynthShape {
            head_dim: 128,
            n_vocab: 151936,
            n_ctx: 40960,
            rope_base: 1e6,
            rms_eps: 1e-6,
            n_expert: 128,
            n_expert_used: 8,
            ..m.clone()
        };
        let gpt_oss = SynthShape {
            n_embd: 2880,
            n_head: 64,
            n_head_kv: 8,
            head_dim: 64,
            n_ff: 2880,
            n_ff_exp: 2880,
            n_expert_used: 4,
            n_vocab: 201088,
            n_ctx: 131072,
            sliding_window: 128,
            ..m.clone()
        };
        Ok(match name {
            "dense-1b" => SynthShape { n_layer: 16, n_embd: 2048, head_dim: 64, n_ff: 8192, tied: true, ..llama3 },
            "dense-8b" => SynthShape { n_layer: 32, n_embd: 4096, head_dim: 128, n_ff: 14336, ..llama3 },
            "qwen3-30b-a3b" => SynthShape {
                n_layer: 48,
                n_embd: 2048,
                n_head: 32,
                n_head_kv: 4,
                n_ff: 6144,
                n_ff_exp: 768,
                ..qwen3moe
            },
            "qwen3-235b-a22b" => SynthShape {
                n_layer: 94,
                n_embd: 4096,
                n_head: 64,
                n_head_kv: 4,
                n_ff: 12288,
                n_ff_exp: 1536,
                ..qwen3moe
            },
            "gpt-oss-20b" => SynthShape { n_layer: 24, n_expert: 32, ..gpt_oss },
            "gpt-oss-120b" => SynthShape { n_layer: 36, n_expert: 128, ..gpt_oss },
            "mixtral-8x7b" => SynthShape {
                n_layer: 32,
                n_embd: 4096,
                n_head: 32,
                n_head_kv: 8,
                head_dim: 128,
                n_ff: 14336,
                n_expert: 8,
                n_expert_used: 2,
                n_ff_exp: 14336,
                n_vocab: 32000,
                n_ctx: 32768,
                rope_base: 1e6,
                ..m
            },
            "olmoe-1b-7b" => SynthShape {
                n_layer: 16,
                n_embd: 2048,
                n_head: 16,
                n_head_kv: 16,
                head_dim: 128,
                n_ff: 1024,
                n_expert: 64,
                n_expert_used: 8,
                n_ff_exp: 1024,
                n_vocab: 50304,
                n_ctx: 4096,
                ..m
            },
            "deepseek-v3" => SynthShape {
                n_layer: 61,
                n_embd: 7168,
                n_head: 128,
                n_ff: 18432,
                n_expert: 256,
                n_expert_used: 8,
                n_ff_exp: 2048,
                n_expert_shared: 1,
                n_dense_lead: 3,
                q_lora_rank: 1536,
                kv_lora_rank: 512,
                qk_rope_dim: 64,
                qk_nope_dim: 128,
                v_head_dim: 128,
                n_group: 8,
                n_group_used: 4,
                routed_scale: 2.5,
                n_vocab: 129280,
                n_ctx: 163840,
                yarn_factor: 40.0,
                yarn_orig_ctx: 4096,
                ..m
            },
            _ => unreachable!("every SHAPES entry has a table row"),
        })
    }

    /// Sets one hyper-parameter by its [`PARAM_KEYS`] name.
    ///
    /// # Errors
    /// [`SynthError::UnknownParam`], or [`SynthError::BadParam`] for a value that does not parse.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad =
            |why: &str| SynthError::BadParam { key: key.to_string(), value: value.to_string(), why: why.to_string() };
        let int = || value.trim().parse::<usize>().map_err(|_| bad("expected a non-negative integer"));
        let float = || {
            value.trim().parse::<f32>().ok().filter(|v| v.is_finite()).ok_or_else(|| bad("expected a finite number"))
        };
        match key {
            "n_layer" => self.n_layer = int()?,
            "n_embd" => self.n_embd = int()?,
            "n_head" => self.n_head = int()?,
            "n_head_kv" => self.n_head_kv = int()?,
            "head_dim" => self.head_dim = int()?,
            "n_ff" => self.n_ff = int()?,
            "n_vocab" => self.n_vocab = int()?,
            "n_ctx" => self.n_ctx = int()?,
            "rope_base" => self.rope_base = float()?,
            "rms_eps" => self.rms_eps = float()?,
            "tied" => {
                self.tied = match value.trim() {
                    "1" | "true" | "yes" => true,
                    "0" | "false" | "no" => false,
                    _ => return Err(bad("expected true or false")),
                }
            }
            "n_expert" => self.n_expert = int()?,
            "n_expert_used" => self.n_expert_used = int()?,
            "n_ff_exp" => self.n_ff_exp = int()?,
            "n_expert_shared" => self.n_expert_shared = int()?,
            "n_dense_lead" => self.n_dense_lead = int()?,
            "sliding_window" => self.sliding_window = int()?,
            "q_lora_rank" => self.q_lora_rank = int()?,
            "kv_lora_rank" => self.kv_lora_rank = int()?,
            "qk_rope_dim" => self.qk_rope_dim = int()?,
            "qk_nope_dim" => self.qk_nope_dim = int()?,
            "v_head_dim" => self.v_head_dim = int()?,
            "n_group" => self.n_group = int()?,
            "n_group_used" => self.n_group_used = int()?,
            "routed_scale" => self.routed_scale = float()?,
            "yarn_factor" => self.yarn_factor = float()?,
            "yarn_orig_ctx" => self.yarn_orig_ctx = int()?,
            _ => return Err(SynthError::UnknownParam { key: key.to_string(), known: PARAM_KEYS.join(", ") }),
        }
        Ok(())
    }

    /// Applies `k=v,k=v,...` (whitespace around items allowed; an empty string changes nothing).
    ///
    /// # Errors
    /// As [`SynthShape::set`]; an item without `=` is [`SynthError::BadParam`].
    pub fn apply_params(&mut self, params: &str) -> Result<()> {
        for item in params.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((k, v)) = item.split_once('=') else {
                return Err(SynthError::BadParam {
                    key: item.to_string(),
                    value: String::new(),
                    why: "expected key=value".into(),
                });
            };
            self.set(k.trim(), v)?;
        }
        Ok(())
    }

    fn is_moe(&self) -> bool {
        self.n_expert > 0
    }

    /// Checks that the numbers make a model of this architecture.
    ///
    /// # Errors
    /// [`SynthError::BadShape`] naming the first problem, [`SynthError::UnknownArch`].
    pub fn validate(&self) -> Result<()> {
        if !SYNTH_ARCHITECTURES.contains(&self.arch.as_str()) {
            return Err(SynthError::UnknownArch { arch: self.arch.clone(), known: SYNTH_ARCHITECTURES.join(", ") });
        }
        let bad = |why: String| Err(SynthError::BadShape { arch: self.arch.clone(), why });
        for (name, v) in [("n_layer", self.n_layer), ("n_embd", self.n_embd), ("n_head", self.n_head)] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if self.n_vocab < 258 {
            return bad(format!("n_vocab {} < 258 (256 byte tokens, BOS, EOS)", self.n_vocab));
        }
        if self.n_vocab > u32::MAX as usize {
            return bad(format!("n_vocab {} does not fit token ids", self.n_vocab));
        }
        let moe_arch = matches!(self.arch.as_str(), "qwen3moe" | "olmoe" | "gpt-oss" | "deepseek2");
        let dense_only = matches!(self.arch.as_str(), "qwen2" | "qwen3" | "gemma3");
        if moe_arch && !self.is_moe() {
            return bad("n_expert is 0 but the architecture is mixture-of-experts".into());
        }
        if dense_only && self.is_moe() {
            return bad(format!("n_expert {} but the architecture is dense", self.n_expert));
        }
        if self.is_moe() {
            if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
                return bad(format!("n_expert_used {} must be in 1..={}", self.n_expert_used, self.n_expert));
            }
            if self.n_ff_exp == 0 {
                return bad("n_ff_exp is 0".into());
            }
        }
        if self.arch == "deepseek2" {
            for (name, v) in [
                ("kv_lora_rank", self.kv_lora_rank),
                ("qk_rope_dim", self.qk_rope_dim),
                ("qk_nope_dim", self.qk_nope_dim),
                ("v_head_dim", self.v_head_dim),
                ("n_group", self.n_group),
                ("n_group_used", self.n_group_used),
            ] {
                if v == 0 {
                    return bad(format!("{name} is 0"));
                }
            }
            if !self.n_expert.is_multiple_of(self.n_group) || self.n_group_used > self.n_group {
                return bad(format!(
                    "{} experts in {} groups, {} used",
                    self.n_expert, self.n_group, self.n_group_used
                ));
            }
            if self.n_dense_lead > self.n_layer {
                return bad(format!("n_dense_lead {} > n_layer {}", self.n_dense_lead, self.n_layer));
            }
            if self.n_dense_lead > 0 && self.n_ff == 0 {
                return bad("n_ff is 0 but there are leading dense layers".into());
            }
        } else {
            if self.head_dim == 0 || self.n_head_kv == 0 {
                return bad("head_dim and n_head_kv must be positive".into());
            }
            if !self.n_head.is_multiple_of(self.n_head_kv) {
                return bad(format!("n_head {} is not a multiple of n_head_kv {}", self.n_head, self.n_head_kv));
            }
            if !self.head_dim.is_multiple_of(2) {
                return bad(format!("head_dim {} is odd (rope rotates pairs)", self.head_dim));
            }
            if self.arch == "olmoe" && (self.n_head_kv != self.n_head || self.n_head * self.head_dim != self.n_embd) {
                return bad(format!(
                    "OLMoE needs n_head_kv = n_head and n_head * head_dim = n_embd (llama.cpp sizes its q/k norms n_embd); \
                     got {}:{} heads of {} for {}",
                    self.n_head, self.n_head_kv, self.head_dim, self.n_embd
                ));
            }
            if !self.is_moe() && self.n_ff == 0 {
                return bad("n_ff is 0".into());
            }
        }
        Ok(())
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// `mean + std * N(0, 1)` for every value.
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
    },
    /// Router rows: `N(0, std²)` scaled by `rank^-skew`, the expert's popularity rank in this
    /// layer (see the module docs).
    Router {
        /// Standard deviation before scaling.
        std: f32,
        /// The block index (the permutation differs per layer).
        layer: usize,
        /// Routing skew `S`.
        skew: f32,
    },
}

/// One tensor of a synthetic model: its name, ggml shape, stored type and value law.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    /// GGUF name.
    pub name: String,
    /// ggml order (row length first).
    pub shape: Vec<u64>,
    /// Stored type.
    pub dtype: GgmlType,
    /// Value law.
    pub init: Init,
    key: u64,
    /// Blocks drawn directly ([`direct_blocks`]) rather than quantized from `row_values`.
    direct: bool,
}

impl SynthTensor {
    /// Values per row (`shape[0]`).
    pub fn row_len(&self) -> usize {
        self.shape[0] as usize
    }

    /// Rows (product of every dimension but the first).
    pub fn n_rows(&self) -> u64 {
        self.shape[1..].iter().product()
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.dtype.block_elems() * self.dtype.block_bytes()
    }

    /// Bytes of the stored tensor.
    pub fn size_bytes(&self) -> u64 {
        self.row_bytes() as u64 * self.n_rows()
    }

    /// The f32 values of row `row` (before quantization); `out` has [`SynthTensor::row_len`]
    /// values. A pure function of the seed, the name and `row`.
    pub fn row_values(&self, row: u64, out: &mut [f32]) {
        let mut rng = self.row_rng(row);
        let (mean, std) = match self.init {
            Init::Normal { mean, std } => (mean, std),
            Init::Router { std, layer, skew } => {
                let ranks = popularity_ranks(self.key, layer, self.n_rows() as usize);
                (0.0, std * (ranks[row as usize] as f32).powf(-skew))
            }
        };
        let mut pairs = out.chunks_exact_mut(2);
        for p in &mut pairs {
            let (a, b) = rng.normal_pair();
            p[0] = mean + std * a as f32;
            p[1] = mean + std * b as f32;
        }
        if let [last] = pairs.into_remainder() {
            *last = mean + std * rng.normal_pair().0 as f32;
        }
    }

    /// True when this tensor's blocks are drawn directly (see "Direct blocks" in the module
    /// docs), false when its rows are [`SynthTensor::row_values`] through the reference quantizer.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Encodes row `row` into `dst` ([`SynthTensor::row_bytes`] bytes): a pure function of the
    /// seed, the name and `row`, like [`SynthTensor::row_values`].
    ///
    /// # Errors
    /// [`SynthError::Quant`] (only for a plan built around an impossible type).
    pub fn encode_row(&self, row: u64, dst: &mut [u8]) -> Result<()> {
        thread_local! {
            static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        if self.direct {
            let Init::Normal { std, .. } = self.init else { unreachable!("direct tensors have a Normal law") };
            direct_blocks(self.dtype, std, &mut self.row_rng(row), dst);
            return Ok(());
        }
        ROW.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            scratch.resize(self.row_len(), 0.0);
            self.row_values(row, &mut scratch);
            quant::quantize(self.dtype, &scratch, dst)
                .map_err(|source| SynthError::Quant { tensor: self.name.clone(), source })
        })
    }

    /// Encodes rows `first_row..first_row + out.len() / row_bytes` into `out`, in parallel.
    ///
    /// # Errors
    /// [`SynthError::Quant`] (only for a plan built around an impossible type).
    pub fn encode_rows(&self, first_row: u64, out: &mut [u8]) -> Result<()> {
        out.par_chunks_mut(self.row_bytes())
            .enumerate()
            .try_for_each(|(i, dst)| self.encode_row(first_row + i as u64, dst))
    }

    fn row_rng(&self, row: u64) -> SplitMix64 {
        SplitMix64(mix64(self.key ^ mix64(row.wrapping_add(0x5851_F42D_4C95_7F2D))))
    }
}

/// Types whose blocks [`direct_blocks`] can draw.
fn has_direct_blocks(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_K)
}

/// Standard deviation of the Q8_0 code: the sum of four uniform odd numbers in -255..=255
/// (`2 b + 1`, b a uniform i8), divided by 8 rounding toward zero (symmetric, so zero mean; the
/// code stays in -127..=127). Computed exactly by convolving the four distributions.
const Q8_CODE_STD: f32 = 36.6487;
/// Variance of the signed nibble `(b & 7) - (b >> 3 & 7)`: two uniforms on 0..=7, 2 * 63 / 12.
const NIBBLE_VAR: f32 = 10.5;
/// Mean square of the Q4_K sub-block scale, uniform on 32..=63: (sum of k^2) / 32.
const Q4K_SCALE_MEAN_SQUARE: f32 = 2341.5;

/// Fills `dst` (whole blocks of `dtype`, one of [`has_direct_blocks`]) with random blocks whose
/// values have mean 0 and standard deviation `std`: symmetric, bounded codes (about 3.5 `std`
/// at most) under one scale per block, so no value is NaN or infinite and activations stay
/// bounded as with Gaussian weights.
fn direct_blocks(dtype: GgmlType, std: f32, rng: &mut SplitMix64, dst: &mut [u8]) {
    let f16_bytes = |v: f32| half::f16::from_f32(v).to_le_bytes();
    // A signed nibble in -7..=7 from 6 random bits: the difference of two uniforms on 0..=7
    // (triangular, symmetric), stored with `offset` added.
    let nibble = |byte: u64, offset: i32| ((byte & 7) as i32 - (byte >> 3 & 7) as i32 + offset) as u8;
    // 8 stored nibbles (offset 8 or 7) from one u64, packed two per byte.
    let nibbles = |rng: &mut SplitMix64, out: &mut [u8], offset: i32| {
        for chunk in out.chunks_mut(4) {
            let bits = rng.next_u64();
            for (i, b) in chunk.iter_mut().enumerate() {
                let lo = nibble(bits >> (16 * i), offset);
                let hi = nibble(bits >> (16 * i + 8), offset);
                *b = lo | hi << 4;
            }
        }
    };
    match dtype {
        GgmlType::Q8_0 => {
            let d = f16_bytes(std / Q8_CODE_STD);
            for block in dst.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                for pair in block[2..].chunks_exact_mut(2) {
                    let b = rng.next_u64().to_le_bytes().map(|x| x as i8 as i32);
                    // 2 (b0 + b1 + b2 + b3) + 4: four odd numbers 2 b + 1.
                    pair[0] = ((2 * (b[0] + b[1] + b[2] + b[3]) + 4) / 8) as i8 as u8;
                    pair[1] = ((2 * (b[4] + b[5] + b[6] + b[7]) + 4) / 8) as i8 as u8;
                }
            }
        }
        GgmlType::Q4_0 => {
            // value = (q - 8) * d
            let d = f16_bytes(std / NIBBLE_VAR.sqrt());
            for block in dst.chunks_exact_mut(18) {
                block[..2].copy_from_slice(&d);
                nibbles(rng, &mut block[2..], 8);
            }
        }
        GgmlType::Q4_K => {
            // value = d * sc * q - dmin * m with m = sc and dmin = 7 d: d * sc * (q - 7), zero
            // mean whatever the sub-block's scale sc (uniform on 32..=63).
            let d = std / (NIBBLE_VAR * Q4K_SCALE_MEAN_SQUARE).sqrt();
            for block in dst.chunks_exact_mut(144) {
                block[..2].copy_from_slice(&f16_bytes(d));
                block[2..4].copy_from_slice(&f16_bytes(7.0 * d));
                let bits = rng.next_u64();
                let scales: [u8; 8] = std::array::from_fn(|j| 32 + (bits >> (5 * j) & 31) as u8);
                block[4..16].copy_from_slice(&pack_q4k_scales(&scales, &scales));
                nibbles(rng, &mut block[16..], 7);
            }
        }
        other => unreachable!("no direct blocks for {other}: has_direct_blocks guards every call"),
    }
}

/// Packs eight 6-bit sub-block scales and mins the way ggml's `get_scale_min_k4` unpacks them.
fn pack_q4k_scales(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = scales[j] & 63 | (scales[j + 4] >> 4) << 6;
        q[j + 4] = mins[j] & 63 | (mins[j + 4] >> 4) << 6;
        q[j + 8] = scales[j + 4] & 15 | (mins[j + 4] & 15) << 4;
    }
    q
}

/// Popularity rank (1 = most popular) of each of `n` experts of `layer`: a permutation drawn
/// from the router's key.
fn popularity_ranks(key: u64, layer: usize, n: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&e| mix64(key ^ mix64((layer as u64) << 32 | e as u64)));
    let mut rank = vec![0u32; n];
    for (pos, &e) in order.iter().enumerate() {
        rank[e] = pos as u32 + 1;
    }
    rank
}

/// Options of [`SynthPlan::new`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Type of the weight matrices (norms, biases and routers stay F32; a matrix whose rows do
    /// not fill whole blocks gets llama-quantize's fallback type).
    pub dtype: GgmlType,
    /// Seed of every value.
    pub seed: u64,
    /// Routing skew `S` (0: uniform).
    pub routing_skew: f32,
    /// Target bytes per chunk handed to the writer (at least one row).
    pub chunk_bytes: usize,
    /// Quantize every row's f32 values with the reference quantizer instead of drawing the
    /// blocks of Q8_0, Q4_0 and Q4_K directly (see "Direct blocks" in the module docs). Exact
    /// but slow: 30 to 140 ns per value, hours for a 30 B model on two cores.
    pub exact_quantization: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            dtype: GgmlType::Q8_0,
            seed: 0,
            routing_skew: 0.0,
            chunk_bytes: 8 << 20,
            exact_quantization: false,
        }
    }
}

/// A synthetic model ready to write: metadata and tensors.
#[derive(Clone, Debug)]
pub struct SynthPlan {
    /// The hyper-parameters.
    pub shape: SynthShape,
    /// The options.
    pub options: SynthOptions,
    /// Metadata keys in writing order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors in writing order.
    pub tensors: Vec<SynthTensor>,
}

/// llama-quantize's substitute for a type whose blocks do not divide a row (`tensor_type_fallback`
/// in llama.cpp's src/llama-quant.cpp), then F16.
fn fallback_type(dtype: GgmlType, row_len: usize) -> GgmlType {
    use GgmlType::*;
    let fits = |t: GgmlType| row_len.is_multiple_of(t.block_elems());
    if fits(dtype) {
        return dtype;
    }
    let alt = match dtype {
        Q2_K | Q3_K | IQ4_XS => IQ4_NL,
        Q4_K => Q5_0,
        Q5_K => Q5_1,
        Q6_K => Q8_0,
        _ => F16,
    };
    if fits(alt) {
        alt
    } else {
        F16
    }
}

/// llama.cpp's `general.file_type` (`llama_ftype`) for a file whose matrices are mostly `dtype`.
fn file_type(dtype: GgmlType) -> u32 {
    use GgmlType::*;
    match dtype {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 11,
        Q4_K => 14,
        Q5_K => 16,
        Q6_K => 18,
        IQ4_NL => 25,
        IQ4_XS => 30,
        BF16 => 32,
        MXFP4 => 38,
        _ => 0,
    }
}

/// The GPT-2 byte-to-unicode map: printable Latin-1 bytes stand for themselves, the other 68
/// bytes for code points 256 and up, in byte order.
fn byte_token(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("256..324 are valid code points")
}

struct PlanBuilder<'a> {
    s: &'a SynthShape,
    o: &'a SynthOptions,
    tensors: Vec<SynthTensor>,
}

impl PlanBuilder<'_> {
    fn push(&mut self, name: String, shape: &[usize], dtype: GgmlType, init: Init) {
        let key = mix64(self.o.seed ^ mix64(fnv1a(name.as_bytes())));
        let zero_mean = matches!(init, Init::Normal { mean, .. } if mean == 0.0);
        let direct = !self.o.exact_quantization && zero_mean && has_direct_blocks(dtype);
        let shape = shape.iter().map(|&d| d as u64).collect();
        self.tensors.push(SynthTensor { name, shape, dtype, init, key, direct });
    }

    /// A weight matrix (or stack), N(0, 1/fan_in), in the requested type.
    fn matrix_fan(&mut self, name: String, shape: &[usize], fan_in: usize) {
        let dtype = fallback_type(self.o.dtype, shape[0]);
        self.push(name, shape, dtype, Init::Normal { mean: 0.0, std: 1.0 / (fan_in as f32).sqrt() });
    }

    fn matrix(&mut self, name: String, shape: &[usize]) {
        self.matrix_fan(name, shape, shape[0]);
    }

    /// A projection that writes into the residual stream (attention output, FFN and expert down):
    /// N(0, 1/(2 n_layer fan_in)), so the 2 n_layer blocks together add about unit RMS to the
    /// unit-RMS embedding and each token's own embedding stays a large part of every layer's
    /// input. At the plain 1/fan_in, the near-uniform attention of random weights added an
    /// average over the context that changes little from one token to the next and outweighed
    /// the token; the routers then chose nearly the same experts every step (a 21% expert cache
    /// hit 67-92% of the time instead of ~21%, seventh session).
    /// Models with a tied output keep the plain law here and their small embedding (see
    /// `embeddings`): their routing was not the problem, and greedy decoding of the random model
    /// then still moves from token to token.
    fn residual_out(&mut self, name: String, shape: &[usize]) {
        let scale = if self.untied() { 2 * self.s.n_layer.max(1) } else { 1 };
        self.matrix_fan(name, shape, shape[0] * scale);
    }

    /// Whether the output projection is its own matrix (`output.weight`), not the embedding.
    fn untied(&self) -> bool {
        !self.s.tied || self.s.arch == "gpt-oss"
    }

    fn gain(&mut self, name: String, n: usize) {
        self.push(name, &[n], GgmlType::F32, Init::Normal { mean: 1.0, std: 0.02 });
    }

    fn bias(&mut self, name: String, shape: &[usize], std: f32) {
        self.push(name, shape, GgmlType::F32, Init::Normal { mean: 0.0, std });
    }

    fn router(&mut self, il: usize) {
        let (n_embd, ne) = (self.s.n_embd, self.s.n_expert);
        let init = Init::Router { std: 1.0 / (n_embd as f32).sqrt(), layer: il, skew: self.o.routing_skew };
        self.push(blk(il, "ffn_gate_inp.weight"), &[n_embd, ne], GgmlType::F32, init);
    }

    /// Standard q/k/v/o projections of one layer.
    fn attention(&mut self, il: usize, biases: bool) {
        let s = self.s;
        let (qw, kvw) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
        self.matrix(blk(il, "attn_q.weight"), &[s.n_embd, qw]);
        self.matrix(blk(il, "attn_k.weight"), &[s.n_embd, kvw]);
        self.matrix(blk(il, "attn_v.weight"), &[s.n_embd, kvw]);
        self.residual_out(blk(il, "attn_output.weight"), &[qw, s.n_embd]);
        if biases {
            self.bias(blk(il, "attn_q.bias"), &[qw], 0.02);
            self.bias(blk(il, "attn_k.bias"), &[kvw], 0.02);
            self.bias(blk(il, "attn_v.bias"), &[kvw], 0.02);
        }
    }

    /// gate/up/down of width `n_ff` with name suffix "" (dense) or "_shexp" (shared expert).
    fn ffn(&mut self, il: usize, suffix: &str, n_ff: usize) {
        let n_embd = self.s.n_embd;
        self.matrix(blk(il, &format!("ffn_gate{suffix}.weight")), &[n_embd, n_ff]);
        self.matrix(blk(il, &format!("ffn_up{suffix}.weight")), &[n_embd, n_ff]);
        self.residual_out(blk(il, &format!("ffn_down{suffix}.weight")), &[n_ff, n_embd]);
    }

    /// Router and stacked experts.
    fn experts(&mut self, il: usize) {
        let s = self.s;
        let (n_embd, ff, ne) = (s.n_embd, s.n_ff_exp, s.n_expert);
        self.router(il);
        self.matrix(blk(il, "ffn_gate_exps.weight"), &[n_embd, ff, ne]);
        self.matrix(blk(il, "ffn_up_exps.weight"), &[n_embd, ff, ne]);
        self.residual_out(blk(il, "ffn_down_exps.weight"), &[ff, n_embd, ne]);
    }

    fn embeddings(&mut self, untied: bool) {
        let s = self.s;
        if s.arch == "gemma3" {
            // Gemma scales the input embedding by sqrt(n_embd). Drawn at the usual std, the
            // token's own row would then dominate the tied output projection and greedy decoding
            // would repeat its input forever; drawn sqrt(n_embd) times smaller, the input has the
            // RMS other architectures get, and a final gain of sqrt(n_embd) restores logits of
            // std 1.
            let n = s.n_embd as f32;
            let dtype = fallback_type(self.o.dtype, s.n_embd);
            self.push(TOKEN_EMBD.to_string(), &[s.n_embd, s.n_vocab], dtype, Init::Normal { mean: 0.0, std: 1.0 / n });
            let gain = n.sqrt();
            self.push(
                OUTPUT_NORM.to_string(),
                &[s.n_embd],
                GgmlType::F32,
                Init::Normal { mean: gain, std: 0.02 * gain },
            );
        } else {
            // Untied: unit RMS per token (N(0, 1)), so the token is a large part of every layer's
            // input (see `residual_out`). Tied, the output projection is this matrix, and a
            // token whose row dominated the last hidden state would be its own argmax (greedy
            // decoding would repeat it, as Gemma's note above says): N(0, 1/n_embd) there.
            if untied {
                self.matrix_fan(TOKEN_EMBD.to_string(), &[s.n_embd, s.n_vocab], 1);
            } else {
                self.matrix(TOKEN_EMBD.to_string(), &[s.n_embd, s.n_vocab]);
            }
            self.gain(OUTPUT_NORM.to_string(), s.n_embd);
        }
        if untied {
            self.matrix(OUTPUT.to_string(), &[s.n_embd, s.n_vocab]);
        }
    }

    fn build(mut self) -> Vec<SynthTensor> {
        let s = self.s;
        let arch = s.arch.as_str();
        self.embeddings(self.untied());
        for il in 0..s.n_layer {
            self.gain(blk(il, "attn_norm.weight"), s.n_embd);
            match arch {
                "llama" | "qwen2" | "qwen3" | "qwen3moe" | "olmoe" => {
                    self.attention(il, arch == "qwen2");
                    match arch {
                        "qwen3" | "qwen3moe" => {
                            self.gain(blk(il, "attn_q_norm.weight"), s.head_dim);
                            self.gain(blk(il, "attn_k_norm.weight"), s.head_dim);
                        }
                        // OLMoE normalises the whole projection, not each head.
                        "olmoe" => {
                            self.gain(blk(il, "attn_q_norm.weight"), s.n_head * s.head_dim);
                            self.gain(blk(il, "attn_k_norm.weight"), s.n_head_kv * s.head_dim);
                        }
                        _ => {}
                    }
                    self.gain(blk(il, "ffn_norm.weight"), s.n_embd);
                    if s.is_moe() {
                        self.experts(il);
                    } else {
                        self.ffn(il, "", s.n_ff);
                    }
                }
                "gemma3" => {
                    self.attention(il, false);
                    self.gain(blk(il, "attn_q_norm.weight"), s.head_dim);
                    self.gain(blk(il, "attn_k_norm.weight"), s.head_dim);
                    self.gain(blk(il, "post_attention_norm.weight"), s.n_embd);
                    self.gain(blk(il, "ffn_norm.weight"), s.n_embd);
                    self.ffn(il, "", s.n_ff);
                    self.gain(blk(il, "post_ffw_norm.weight"), s.n_embd);
                }
                "gpt-oss" => {
                    self.attention(il, true);
                    self.bias(blk(il, "attn_output.bias"), &[s.n_embd], 0.02);
                    self.bias(blk(il, "attn_sinks.weight"), &[s.n_head], 0.1);
                    // gpt-oss's pre-FFN norm is stored under this name.
                    self.gain(blk(il, "post_attention_norm.weight"), s.n_embd);
                    self.experts(il);
                    self.bias(blk(il, "ffn_gate_inp.bias"), &[s.n_expert], 0.02);
                    self.bias(blk(il, "ffn_gate_exps.bias"), &[s.n_ff_exp, s.n_expert], 0.02);
                    self.bias(blk(il, "ffn_up_exps.bias"), &[s.n_ff_exp, s.n_expert], 0.02);
                    self.bias(blk(il, "ffn_down_exps.bias"), &[s.n_embd, s.n_expert], 0.02);
                }
                "deepseek2" => {
                    let qk = s.qk_nope_dim + s.qk_rope_dim;
                    if s.q_lora_rank > 0 {
                        self.matrix(blk(il, "attn_q_a.weight"), &[s.n_embd, s.q_lora_rank]);
                        self.gain(blk(il, "attn_q_a_norm.weight"), s.q_lora_rank);
                        self.matrix(blk(il, "attn_q_b.weight"), &[s.q_lora_rank, s.n_head * qk]);
                    } else {
                        self.matrix(blk(il, "attn_q.weight"), &[s.n_embd, s.n_head * qk]);
                    }
                    self.matrix(blk(il, "attn_kv_a_mqa.weight"), &[s.n_embd, s.kv_lora_rank + s.qk_rope_dim]);
                    self.gain(blk(il, "attn_kv_a_norm.weight"), s.kv_lora_rank);
                    // k_b maps a head's latent (kv_lora_rank) to its non-rotary key, as HF's
                    // kv_b_proj does: its fan-in is the latent width, not its row length.
                    self.matrix_fan(
                        blk(il, "attn_k_b.weight"),
                        &[s.qk_nope_dim, s.kv_lora_rank, s.n_head],
                        s.kv_lora_rank,
                    );
                    self.matrix(blk(il, "attn_v_b.weight"), &[s.kv_lora_rank, s.v_head_dim, s.n_head]);
                    self.residual_out(blk(il, "attn_output.weight"), &[s.n_head * s.v_head_dim, s.n_embd]);
                    self.gain(blk(il, "ffn_norm.weight"), s.n_embd);
                    if il < s.n_dense_lead {
                        self.ffn(il, "", s.n_ff);
                    } else {
                        self.experts(il);
                        self.bias(blk(il, "exp_probs_b.bias"), &[s.n_expert], 0.01);
                        if s.n_expert_shared > 0 {
                            self.ffn(il, "_shexp", s.n_ff_exp * s.n_expert_shared);
                        }
                    }
                }
                _ => unreachable!("validate() admits only SYNTH_ARCHITECTURES"),
            }
        }
        self.tensors
    }
}

fn metadata(s: &SynthShape, o: &SynthOptions, name: &str) -> Vec<(String, Value)> {
    let a = s.arch.as_str();
    let mut md: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| md.push((k.to_string(), v));
    let u = |v: usize| Value::U32(v as u32);
    let key = |tail: &str| format!("{a}.{tail}");
    put("general.architecture", Value::String(a.to_string()));
    put("general.type", Value::String("model".into()));
    put("general.name", Value::String(format!("diskformer synthetic {name}")));
    put("general.file_type", Value::U32(file_type(o.dtype)));
    put("general.quantization_version", Value::U32(2));
    put("diskformer.synth.seed", Value::U64(o.seed));
    put("diskformer.synth.routing_skew", Value::F32(o.routing_skew));
    put(&key("vocab_size"), u(s.n_vocab));
    put(&key("context_length"), u(s.n_ctx));
    put(&key("embedding_length"), u(s.n_embd));
    put(&key("block_count"), u(s.n_layer));
    put(&key("attention.head_count"), u(s.n_head));
    put(&key("rope.freq_base"), Value::F32(s.rope_base));
    put(&key("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps));
    if a == "deepseek2" {
        // llama.cpp's MLA layout: the cache holds the latent (kv_lora_rank) plus the rope part
        // in one head; the *_mla keys give the decompressed head sizes.
        put(&key("feed_forward_length"), u(s.n_ff));
        put(&key("attention.head_count_kv"), u(1));
        put(&key("attention.key_length"), u(s.kv_lora_rank + s.qk_rope_dim));
        put(&key("attention.value_length"), u(s.kv_lora_rank));
        put(&key("attention.key_length_mla"), u(s.qk_nope_dim + s.qk_rope_dim));
        put(&key("attention.value_length_mla"), u(s.v_head_dim));
        if s.q_lora_rank > 0 {
            put(&key("attention.q_lora_rank"), u(s.q_lora_rank));
        }
        put(&key("attention.kv_lora_rank"), u(s.kv_lora_rank));
        put(&key("rope.dimension_count"), u(s.qk_rope_dim));
        put(&key("leading_dense_block_count"), u(s.n_dense_lead));
        put(&key("expert_shared_count"), u(s.n_expert_shared));
        put(&key("expert_group_count"), u(s.n_group));
        put(&key("expert_group_used_count"), u(s.n_group_used));
        put(&key("expert_weights_scale"), Value::F32(s.routed_scale));
        put(&key("expert_weights_norm"), Value::Bool(true));
        // 2 = sigmoid (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID), as DeepSeek-V3.
        put(&key("expert_gating_func"), Value::U32(2));
    } else {
        // Mixtral (llama) and OLMoE store the expert width as feed_forward_length.
        let ff = if s.is_moe() && matches!(a, "llama" | "olmoe") { s.n_ff_exp } else { s.n_ff };
        put(&key("feed_forward_length"), u(ff));
        put(&key("attention.head_count_kv"), u(s.n_head_kv));
        put(&key("attention.key_length"), u(s.head_dim));
        put(&key("attention.value_length"), u(s.head_dim));
        put(&key("rope.dimension_count"), u(s.head_dim));
    }
    if s.is_moe() {
        put(&key("expert_count"), u(s.n_expert));
        put(&key("expert_used_count"), u(s.n_expert_used));
        if matches!(a, "qwen3moe" | "gpt-oss" | "deepseek2") {
            put(&key("expert_feed_forward_length"), u(s.n_ff_exp));
        }
    }
    if s.sliding_window > 0 && matches!(a, "gemma3" | "gpt-oss") {
        put(&key("attention.sliding_window"), u(s.sliding_window));
    }
    if a == "gemma3" {
        put(&key("rope.freq_base_swa"), Value::F32(10000.0));
    }
    if s.yarn_factor > 0.0 {
        put(&key("rope.scaling.type"), Value::String("yarn".into()));
        put(&key("rope.scaling.factor"), Value::F32(s.yarn_factor));
        put(&key("rope.scaling.original_context_length"), u(s.yarn_orig_ctx.max(1)));
        put(&key("rope.scaling.yarn_beta_fast"), Value::F32(32.0));
        put(&key("rope.scaling.yarn_beta_slow"), Value::F32(1.0));
        if a == "deepseek2" {
            // The converter stores 0.1 * mscale_all_dim (1.0 for DeepSeek-V3).
            put(&key("rope.scaling.yarn_log_multiplier"), Value::F32(0.1));
        }
    }
    // The tokenizer.
    let mut tokens: Vec<Value> = Vec::with_capacity(s.n_vocab);
    let mut types: Vec<Value> = Vec::with_capacity(s.n_vocab);
    for b in 0..=255u8 {
        tokens.push(Value::String(byte_token(b).to_string()));
        types.push(Value::I32(1)); // normal
    }
    for special in ["<|begin_of_text|>", "<|end_of_text|>"] {
        tokens.push(Value::String(special.to_string()));
        types.push(Value::I32(3)); // control
    }
    for id in 258..s.n_vocab {
        tokens.push(Value::String(format!("[t{id}]")));
        types.push(Value::I32(1));
    }
    put("tokenizer.ggml.model", Value::String("gpt2".into()));
    put("tokenizer.ggml.pre", Value::String("default".into()));
    put("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens));
    put("tokenizer.ggml.token_type", Value::Array(ValueType::I32, types));
    put("tokenizer.ggml.merges", Value::Array(ValueType::String, Vec::new()));
    put("tokenizer.ggml.bos_token_id", Value::U32(BOS_ID));
    put("tokenizer.ggml.eos_token_id", Value::U32(EOS_ID));
    put("tokenizer.ggml.add_bos_token", Value::Bool(true));
    put("tokenizer.ggml.add_eos_token", Value::Bool(false));
    md
}

impl SynthPlan {
    /// Metadata and tensor list of `shape` with `options`; `name` goes into `general.name`.
    ///
    /// # Errors
    /// [`SynthError::BadShape`]/[`SynthError::UnknownArch`] from [`SynthShape::validate`], or
    /// [`SynthError::Type`] for a type without quantizer.
    pub fn new(shape: &SynthShape, options: &SynthOptions, name: &str) -> Result<SynthPlan> {
        shape.validate()?;
        if !quant::can_quantize(options.dtype) || options.dtype == GgmlType::Q8_K {
            let supported = gguf::ALL_TYPES
                .iter()
                .filter(|&&t| quant::can_quantize(t) && t != GgmlType::Q8_K)
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(SynthError::Type { dtype: options.dtype, supported });
        }
        if !options.routing_skew.is_finite() || options.routing_skew < 0.0 {
            return Err(SynthError::BadParam {
                key: "routing_skew".into(),
                value: options.routing_skew.to_string(),
                why: "must be a finite number >= 0".into(),
            });
        }
        let tensors = PlanBuilder { s: shape, o: options, tensors: Vec::new() }.build();
        Ok(SynthPlan {
            metadata: metadata(shape, options, name),
            tensors,
            shape: shape.clone(),
            options: options.clone(),
        })
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&SynthTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of tensor data (without header and alignment padding).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(SynthTensor::size_bytes).sum()
    }

    /// Parameter count.
    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(|t| t.shape.iter().product::<u64>()).sum()
    }

    /// The GGUF writer with every key and tensor declared.
    ///
    /// # Errors
    /// A tensor the writer refuses (cannot happen for a validated shape).
    pub fn writer(&self) -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.set(k, v.clone());
        }
        for t in &self.tensors {
            w.add_tensor(&t.name, t.dtype, &t.shape)?;
        }
        Ok(w)
    }

    /// Streams every tensor's data into `sink` in chunks of about
    /// [`SynthOptions::chunk_bytes`] (whole rows, at least one), rows made in parallel on the
    /// current rayon pool. `progress` gets the bytes of each chunk after it is written.
    ///
    /// # Errors
    /// I/O errors from the sink.
    pub fn write<W: Write>(&self, sink: &mut TensorDataSink<W>, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let mut buf: Vec<u8> = Vec::new();
        for t in &self.tensors {
            let row_bytes = t.row_bytes();
            let rows_per_chunk = (self.options.chunk_bytes / row_bytes).max(1) as u64;
            let n_rows = t.n_rows();
            let mut row = 0u64;
            while row < n_rows {
                let n = rows_per_chunk.min(n_rows - row);
                let len = n as usize * row_bytes;
                buf.resize(len, 0);
                t.encode_rows(row, &mut buf[..len])?;
                sink.write_data(&buf[..len])?;
                progress(len as u64);
                row += n;
            }
        }
        Ok(())
    }

    /// Writes the whole file to `path` (through `path.part`, renamed when complete).
    ///
    /// # Errors
    /// I/O errors naming the file.
    pub fn write_file(&self, path: &Path, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let mut part = path.as_os_str().to_owned();
        part.push(".part");
        let part = std::path::PathBuf::from(part);
        let mut sink = self.writer()?.create(&part)?;
        self.write(&mut sink, progress)?;
        sink.finish().map_err(|e| e.in_file(&part))?;
        std::fs::rename(&part, path).map_err(|source| GgufError::Io { what: "rename", source }.in_file(path))?;
        Ok(())
    }
}

/// FNV-1a over bytes: a stable hash of tensor names (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 (Steele, Lea, Flood 2014): small state, passes BigCrush, seedable from any value.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// A uniform in (0, 1): 53 random bits, offset by half a step so 0 never occurs.
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// Two independent N(0, 1) draws (Box-Muller).
    fn normal_pair(&mut self) -> (f64, f64) {
        let r = (-2.0 * self.unit().ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * self.unit()).sin_cos();
        (r * c, r * s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_follow_gpt2() {
        // Values from GPT-2's bytes_to_unicode (openai/gpt-2 src/encoder.py).
        assert_eq!(byte_token(b'A'), 'A');
        assert_eq!(byte_token(b' '), 'Ġ');
        assert_eq!(byte_token(b'\n'), 'Ċ');
        assert_eq!(byte_token(0), 'Ā');
        assert_eq!(byte_token(0xAD), 'Ń');
        assert_eq!(byte_token(0x7F), 'ġ');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_token).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn fallback_matches_llama_quantize() {
        assert_eq!(fallback_type(GgmlType::Q4_K, 2880), GgmlType::Q5_0);
        assert_eq!(fallback_type(GgmlType::Q6_K, 128), GgmlType::Q8_0);
        assert_eq!(fallback_type(GgmlType::Q4_0, 2880), GgmlType::Q4_0);
        assert_eq!(fallback_type(GgmlType::Q4_0, 100), GgmlType::F16);
    }

    #[test]
    fn ranks_are_a_permutation_that_differs_per_layer() {
        let a = popularity_ranks(7, 0, 64);
        let b = popularity_ranks(7, 1, 64);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (1..=64).collect::<Vec<u32>>());
        assert_ne!(a, b);
    }
}
