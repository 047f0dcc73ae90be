//! Embeddings: a model whose metadata has `{arch}.pooling_type` (llama.cpp's convention; e.g.
//! Qwen3-Embedding is the qwen3 architecture with pooling `last`) is an embedding model. Its
//! final-norm hidden states are pooled (mean over tokens, the first token, or the last) and
//! L2-normalized, as llama.cpp's `llama-embedding` and `llama-server --embeddings` do by default.
//!
//! The planner serves text generation only, so an embedding model is loaded as a plain
//! [`models::Runner`] on the CPU instead of `plan::Session`s; it runs on a blocking thread
//! (never on async workers), one request at a time, admitted by the model's bounded queue.

use crate::error::{ApiError, ErrorKind};
use std::path::Path;
use std::sync::Arc;

/// How token hidden states become one vector (llama.cpp's `LLAMA_POOLING_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the tokens (1).
    Mean,
    /// The first token (2).
    Cls,
    /// The last token (3).
    Last,
}

impl Pooling {
    /// The pooling of a model: `Ok(None)` for a generative model (no `{arch}.pooling_type`, or
    /// 0, llama.cpp's "none"); an error for kinds this server does not serve (rank, unknown).
    ///
    /// # Errors
    /// A pooling type other than none, mean, cls or last, with the number found.
    pub fn of(md: &gguf::Metadata) -> Result<Option<Pooling>, String> {
        let Ok(arch) = md.str("general.architecture") else { return Ok(None) };
        let key = format!("{arch}.pooling_type");
        match md.u32_opt(&key) {
            Ok(None) | Ok(Some(0)) => Ok(None),
            Ok(Some(1)) => Ok(Some(Pooling::Mean)),
            Ok(Some(2)) => Ok(Some(Pooling::Cls)),
            Ok(Some(3)) => Ok(Some(Pooling::Last)),
            Ok(Some(4)) => Err(format!("{key} = 4 (rank): reranking models are not served")),
            Ok(Some(n)) => Err(format!("{key} = {n}: not a pooling type (0 none, 1 mean, 2 cls, 3 last, 4 rank)")),
            Err(e) => Err(format!("{key}: {e}")),
        }
    }

    /// The name used in `/v1/models`.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }
}

/// Pools `hidden` (`[n_tokens, n_embd]`, row-major) and L2-normalizes the result (a zero
/// vector stays zero, as in llama.cpp's `common_embd_normalize`).
pub fn pool_normalized(hidden: &[f32], n_embd: usize, pooling: Pooling) -> Vec<f32> {
    let n_tokens = hidden.len() / n_embd;
    let mut v: Vec<f64> = match pooling {
        Pooling::Cls => hidden[..n_embd].iter().map(|&x| f64::from(x)).collect(),
        Pooling::Last => hidden[(n_tokens - 1) * n_embd..n_tokens * n_embd].iter().map(|&x| f64::from(x)).collect(),
        Pooling::Mean => {
            let mut sum = vec![0f64; n_embd];
            for row in hidden.chunks_exact(n_embd) {
                for (s, &x) in sum.iter_mut().zip(row) {
                    *s += f64::from(x);
                }
            }
            sum.iter_mut().for_each(|s| *s /= n_tokens as f64);
            sum
        }
    };
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
    v.iter_mut().for_each(|x| *x *= scale);
    v.into_iter().map(|x| x as f32).collect()
}

/// An embedding model's runner (CPU), used by one request at a time.
pub struct Embedder {
    runner: std::sync::Mutex<Box<dyn models::Runner>>,
    /// How hidden states are pooled.
    pub pooling: Pooling,
    /// Context length: the longest input in tokens.
    pub n_ctx: usize,
}

impl Embedder {
    /// Loads the model at `path` on the CPU with a context of `n_ctx` tokens (0: the model's,
    /// capped at 4096). Blocking.
    ///
    /// # Errors
    /// The file or the architecture cannot be loaded.
    pub fn load(path: &Path, n_ctx: usize, pooling: Pooling) -> Result<Embedder, plan::PlanError> {
        let file = Arc::new(gguf::GgufModel::open(path)?);
        let opts = models::LoadOptions { n_ctx, matmul: plan::MatmulMode::QuantizedActivations };
        let runner = models::load(&file, &opts)?;
        Ok(Embedder { n_ctx: runner.n_ctx(), runner: std::sync::Mutex::new(runner), pooling })
    }

    /// Embeds each token sequence of `inputs`, each from an empty state. Blocking: call from a
    /// blocking thread.
    ///
    /// # Errors
    /// An empty input; an input longer than the context; the engine failing.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ApiError> {
        let mut runner = self.runner.lock().unwrap_or_else(|p| p.into_inner());
        let n_embd = runner.hparams().embedding_length;
        let mut out = Vec::with_capacity(inputs.len());
        for (i, ids) in inputs.iter().enumerate() {
            if ids.is_empty() {
                return Err(ApiError::invalid_param("input", format!("input {i} has no tokens")));
            }
            if ids.len() > self.n_ctx {
                return Err(ApiError::invalid_param(
                    "input",
                    format!("input {i} has {} tokens but the context holds {}; shorten it", ids.len(), self.n_ctx),
                ));
            }
            runner.reset().map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))?;
            let hidden = runner.hidden_states(ids).map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))?;
            out.push(pool_normalized(&hidden, n_embd, self.pooling));
        }
        Ok(out)
    }
}

/// Standard base64 (RFC 4648, padded) of `bytes`: OpenAI's `encoding_format: "base64"` sends
/// the little-endian f32 bytes this way (the official Python client asks for it by default).
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                s.push(ALPHABET[(n >> shift) as usize & 63] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        // RFC 4648 section 10.
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), enc);
        }
    }

    #[test]
    fn pooling_picks_rows_and_normalizes() {
        // Two tokens of width 2: [3, 4] and [0, 2].
        let h = [3.0, 4.0, 0.0, 2.0];
        assert_eq!(pool_normalized(&h, 2, Pooling::Cls), vec![0.6, 0.8]);
        assert_eq!(pool_normalized(&h, 2, Pooling::Last), vec![0.0, 1.0]);
        // Mean [1.5, 3] has norm 1.5 * sqrt(5).
        let m = pool_normalized(&h, 2, Pooling::Mean);
        assert!((m[0] - 1.0 / 5f32.sqrt()).abs() < 1e-6 && (m[1] - 2.0 / 5f32.sqrt()).abs() < 1e-6);
        assert_eq!(pool_normalized(&[0.0, 0.0], 2, Pooling::Mean), vec![0.0, 0.0]);
    }
}
