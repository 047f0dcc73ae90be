//! Per-sequence state: the KV cache of attention layers and the recurrent state of conv/SSM
//! layers, kept together so that reset and checkpoints cover both.
//!
//! # Checkpoints
//! A [`Checkpoint`] lets a caller keep a prefix (a system prompt) and come back to it:
//! `prime(system)`, `checkpoint`, answer one request, `restore`, answer the next. Recurrent
//! layers (conv windows, SSM states) are overwritten at every step, so the checkpoint copies
//! them. Attention layers are not copied: a KV row at position p is written once when p is
//! consumed and read afterwards, so the rows below the checkpoint's position stay valid until
//! something is written there again (after a restore to an earlier point, or a reset). A
//! [`WriteLog`] records the step that last wrote each position, and `restore` refuses a
//! checkpoint whose rows have been overwritten since, instead of silently attending to the wrong
//! keys. The copy costs the recurrent state only (tens of KB per layer), never the KV cache.

use crate::error::{ModelError, Result};
use compute::Backend;
use std::sync::atomic::{AtomicU64, Ordering};

/// What one layer remembers between steps.
pub enum LayerState<B: Backend> {
    /// Nothing (a layer without sequence state).
    None,
    /// An attention layer's KV cache.
    Attention(B::Cache),
    /// A recurrent layer's state tensors (conv window, SSM state), replaced every step.
    Recurrent(Vec<B::Tensor>),
}

/// The state of one sequence.
pub struct State<B: Backend> {
    /// One entry per layer.
    pub layers: Vec<LayerState<B>>,
    /// Positions consumed so far.
    pub n_past: usize,
    /// Capacity in positions.
    pub n_ctx: usize,
}

/// A host copy of one tensor.
#[derive(Clone, Debug, PartialEq)]
struct HostTensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// A sequence state at one position, to return to with [`State::restore`] (through
/// `Runner::restore`). Holds copies of the recurrent tensors; KV rows are shared with the live
/// state (see the module docs).
#[derive(Clone, Debug)]
pub struct Checkpoint {
    n_past: usize,
    /// Per layer: the recurrent tensors (empty for attention and stateless layers).
    recurrent: Vec<Vec<HostTensor>>,
    /// Which state's log, and its step count, when taken (see [`WriteLog`]).
    log_serial: u64,
    log_step: u64,
}

impl Checkpoint {
    /// Positions consumed at the checkpoint.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Bytes of recurrent state held.
    pub fn size_bytes(&self) -> usize {
        self.recurrent.iter().flatten().map(|t| t.data.len() * 4).sum()
    }
}

impl<B: Backend> LayerState<B> {
    /// An attention layer's empty KV cache of `n_ctx` positions, keys and values `widths` wide.
    ///
    /// # Errors
    /// The back end cannot allocate it.
    pub fn kv_cache(b: &B, n_ctx: usize, widths: (usize, usize)) -> Result<Self> {
        Ok(LayerState::Attention(b.new_cache(n_ctx, widths.0, widths.1)?))
    }
}

impl<B: Backend> State<B> {
    /// A fresh state of `n_ctx` positions for `layers`, each its own state.
    pub fn new(layers: Vec<LayerState<B>>, n_ctx: usize) -> Self {
        State { layers, n_past: 0, n_ctx }
    }

    /// A fresh state of `n_ctx` positions for a decoder whose every layer attends: one KV cache a
    /// layer, keys and values of the given widths.
    ///
    /// # Errors
    /// The back end cannot allocate a cache.
    pub fn kv_caches(b: &B, n_ctx: usize, widths: impl IntoIterator<Item = (usize, usize)>) -> Result<Self> {
        let layers = widths.into_iter().map(|w| LayerState::kv_cache(b, n_ctx, w)).collect::<Result<_>>()?;
        Ok(State::new(layers, n_ctx))
    }

    /// Copies the recurrent tensors and notes the position. The caller stamps it with
    /// `WriteLog::stamp`, as `Session` does.
    ///
    /// # Errors
    /// The back end cannot read a tensor back.
    pub fn checkpoint(&self, b: &B) -> Result<Checkpoint> {
        let recurrent = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Recurrent(ts) => ts
                    .iter()
                    .map(|t| Ok(HostTensor { shape: b.shape(t).to_vec(), data: b.to_host(t)? }))
                    .collect::<Result<Vec<_>>>(),
                _ => Ok(Vec::new()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Checkpoint { n_past: self.n_past, recurrent, log_serial: 0, log_step: 0 })
    }

    /// Puts the recurrent tensors and the position of `cp` back. The caller checks the KV rows
    /// with `WriteLog::check` first, as `Session` does.
    ///
    /// # Errors
    /// [`ModelError::Request`] when `cp` was taken from a state of another layout (another
    /// model); back-end errors.
    pub fn restore(&mut self, b: &B, cp: &Checkpoint) -> Result<()> {
        let mismatch = |why: String| ModelError::Request { why: format!("checkpoint does not fit this state: {why}") };
        if cp.recurrent.len() != self.layers.len() {
            return Err(mismatch(format!("{} layers, the state has {}", cp.recurrent.len(), self.layers.len())));
        }
        if cp.n_past > self.n_ctx {
            return Err(mismatch(format!("position {} beyond the context of {}", cp.n_past, self.n_ctx)));
        }
        // Check every layer before changing any, so a refused restore leaves the state as it was.
        for (il, (l, saved)) in self.layers.iter().zip(&cp.recurrent).enumerate() {
            let fits = match l {
                LayerState::Recurrent(ts) => {
                    ts.len() == saved.len() && ts.iter().zip(saved).all(|(t, s)| b.shape(t) == &s.shape[..])
                }
                _ => saved.is_empty(),
            };
            if !fits {
                return Err(mismatch(format!("layer {il} holds other tensors")));
            }
        }
        for (l, saved) in self.layers.iter_mut().zip(&cp.recurrent) {
            if let LayerState::Recurrent(ts) = l {
                for (t, s) in ts.iter_mut().zip(saved) {
                    *t = b.from_host(&s.data, &s.shape)?;
                }
            }
        }
        self.n_past = cp.n_past;
        Ok(())
    }
}

/// Source of distinct log serials, so a checkpoint is never applied to another state.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Which evaluation step last wrote each position of a state's KV cache: the evidence that a
/// checkpoint's KV rows are still intact (see the module docs). One u64 per position.
#[derive(Debug)]
pub struct WriteLog {
    serial: u64,
    step: u64,
    written_at: Vec<u64>,
}

impl WriteLog {
    /// A log for a fresh state of `n_ctx` positions.
    pub fn new(n_ctx: usize) -> WriteLog {
        WriteLog { serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed), step: 0, written_at: vec![0; n_ctx] }
    }

    /// Notes that positions `pos0..pos0 + n_tokens` are about to be written.
    pub fn record(&mut self, pos0: usize, n_tokens: usize) {
        self.step += 1;
        let end = (pos0 + n_tokens).min(self.written_at.len());
        if pos0 < end {
            self.written_at[pos0..end].iter_mut().for_each(|s| *s = self.step);
        }
    }

    /// Marks `cp` as taken now from the state this log belongs to.
    pub fn stamp(&self, cp: &mut Checkpoint) {
        cp.log_serial = self.serial;
        cp.log_step = self.step;
    }

    /// Whether the KV rows below `cp`'s position are still those it was taken with.
    ///
    /// # Errors
    /// [`ModelError::Request`] naming the first overwritten position, or saying the checkpoint
    /// belongs to another state (or to this one before a reset).
    pub fn check(&self, cp: &Checkpoint) -> Result<()> {
        if cp.log_serial != self.serial {
            return Err(ModelError::Request {
                why: "checkpoint was taken from another sequence state (or before a reset); take it again".into(),
            });
        }
        let end = cp.n_past.min(self.written_at.len());
        if let Some(p) = self.written_at[..end].iter().position(|&s| s > cp.log_step) {
            return Err(ModelError::Request {
                why: format!(
                    "checkpoint at position {} is stale: position {p} was rewritten after it was taken; take it again",
                    cp.n_past
                ),
            });
        }
        Ok(())
    }
}
