//! The interface every architecture file implements, and the type-erased runner built on it.

use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::state::{Checkpoint, State, WriteLog};
use compute::Backend;

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outputs {
    /// Only the last token's (generation).
    Last,
    /// Every token's (evaluation against references, perplexity).
    All,
}

/// One architecture's weights and forward pass, for back end `B`.
pub trait Architecture<B: Backend>: Send + Sync {
    /// The hyper-parameters read from the file.
    fn hparams(&self) -> &Hparams;
    /// A fresh sequence state for `n_ctx` positions.
    fn new_state(&self, b: &B, n_ctx: usize) -> Result<State<B>>;
    /// Runs `ids` at positions `state.n_past..`, advances the state, and returns logits
    /// `[rows, n_vocab]` for the rows `outputs` asks for.
    fn forward(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor>;
    /// Runs `ids` like [`Architecture::forward`] but returns every token's hidden state after
    /// the final norm, `[n, n_embd]`, instead of logits: what embedding models pool.
    ///
    /// # Errors
    /// By default: the architecture does not expose its hidden states.
    fn forward_hidden(&self, b: &B, state: &mut State<B>, ids: &[u32]) -> Result<B::Tensor> {
        let _ = (b, state, ids);
        Err(ModelError::Request { why: "this architecture does not return hidden states".into() })
    }
}

/// A loaded model with its back end and one sequence's state, behind an object-safe interface
/// (the CLI, planner and server hold `Box<dyn Runner>` and never name the back end).
pub trait Runner: Send {
    /// Hyper-parameters.
    fn hparams(&self) -> &Hparams;
    /// Name of the back end ("cpu", "wgpu").
    fn backend_name(&self) -> &'static str;
    /// Positions consumed.
    fn n_past(&self) -> usize;
    /// Context capacity.
    fn n_ctx(&self) -> usize;
    /// Feeds `ids` and returns their logits, row-major `[rows, n_vocab]`.
    fn eval(&mut self, ids: &[u32], outputs: Outputs) -> Result<Vec<f32>>;
    /// [`Runner::eval`] with the logits written into `logits` (replacing its values, keeping
    /// its memory): for loops that evaluate every step (see `Backend::to_host_into`).
    fn eval_into(&mut self, ids: &[u32], outputs: Outputs, logits: &mut Vec<f32>) -> Result<()> {
        *logits = self.eval(ids, outputs)?;
        Ok(())
    }
    /// Feeds `ids` and returns every token's final-norm hidden state, row-major `[n, n_embd]`
    /// (embedding models pool these).
    fn hidden_states(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let _ = ids;
        Err(ModelError::Request { why: "this runner does not return hidden states".into() })
    }
    /// Forgets the sequence.
    fn reset(&mut self) -> Result<()>;
    /// The sequence state at the current position, to come back to with [`Runner::restore`]
    /// (keep a system prompt's state; see `state.rs`).
    fn checkpoint(&self) -> Result<Checkpoint> {
        Err(ModelError::Request { why: "this runner cannot take checkpoints".into() })
    }
    /// Returns to `cp`, which must come from this runner since its last reset and have its KV
    /// rows intact (an error says otherwise).
    fn restore(&mut self, cp: &Checkpoint) -> Result<()> {
        let _ = cp;
        Err(ModelError::Request { why: "this runner cannot restore checkpoints".into() })
    }
}

/// [`Runner`] over a concrete back end and architecture.
pub struct Session<B: Backend, A: Architecture<B>> {
    b: B,
    arch: A,
    state: State<B>,
    log: WriteLog,
}

impl<B: Backend, A: Architecture<B>> Session<B, A> {
    /// A session with an empty state of `n_ctx` positions.
    pub fn new(b: B, arch: A, n_ctx: usize) -> Result<Self> {
        let state = arch.new_state(&b, n_ctx)?;
        Ok(Session { b, arch, state, log: WriteLog::new(n_ctx) })
    }
}

impl<B: Backend + 'static, A: Architecture<B> + 'static> Session<B, A> {
    /// Refuses an empty batch or one that overflows the context; records the positions written.
    fn admit(&mut self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(ModelError::Request { why: "no tokens to evaluate".into() });
        }
        if self.state.n_past + ids.len() > self.state.n_ctx {
            return Err(compute::OpError::ContextFull {
                pos: self.state.n_past,
                n_tokens: ids.len(),
                n_ctx: self.state.n_ctx,
            }
            .into());
        }
        self.log.record(self.state.n_past, ids.len());
        Ok(())
    }
}

impl<B: Backend + 'static, A: Architecture<B> + 'static> Runner for Session<B, A> {
    fn hparams(&self) -> &Hparams {
        self.arch.hparams()
    }
    fn backend_name(&self) -> &'static str {
        self.b.name()
    }
    fn n_past(&self) -> usize {
        self.state.n_past
    }
    fn n_ctx(&self) -> usize {
        self.state.n_ctx
    }
    fn eval(&mut self, ids: &[u32], outputs: Outputs) -> Result<Vec<f32>> {
        self.admit(ids)?;
        // The whole step runs on a worker of the thread pool: the back end's parallel loops then
        // split work from inside the pool instead of handing every op from this thread to the pool
        // and sleeping until it is done. Measured on SmolLM2-135M, 1 thread: half the decode time
        // went to those wake-ups (perf: try_to_wake_up, futex waits in rayon's LockLatch).
        let (arch, b, state) = (&self.arch, &self.b, &mut self.state);
        on_pool(b, || -> Result<Vec<f32>> {
            let logits = arch.forward(b, state, ids, outputs)?;
            Ok(b.to_host(&logits)?)
        })
    }
    fn eval_into(&mut self, ids: &[u32], outputs: Outputs, logits: &mut Vec<f32>) -> Result<()> {
        self.admit(ids)?;
        // On a pool worker, as in `eval`.
        let (arch, b, state) = (&self.arch, &self.b, &mut self.state);
        on_pool(b, || -> Result<()> {
            let t = arch.forward(b, state, ids, outputs)?;
            Ok(b.to_host_into(&t, logits)?)
        })
    }
    fn hidden_states(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.admit(ids)?;
        // On a pool worker, as in `eval`.
        let (arch, b, state) = (&self.arch, &self.b, &mut self.state);
        on_pool(b, || -> Result<Vec<f32>> {
            let hidden = arch.forward_hidden(b, state, ids)?;
            Ok(b.to_host(&hidden)?)
        })
    }
    fn reset(&mut self) -> Result<()> {
        self.state = self.arch.new_state(&self.b, self.state.n_ctx)?;
        self.log = WriteLog::new(self.state.n_ctx);
        Ok(())
    }
    fn checkpoint(&self) -> Result<Checkpoint> {
        let mut cp = self.state.checkpoint(&self.b)?;
        self.log.stamp(&mut cp);
        Ok(cp)
    }
    fn restore(&mut self, cp: &Checkpoint) -> Result<()> {
        self.log.check(cp)?;
        self.state.restore(&self.b, cp)
    }
}

/// Runs a model step on a worker of the thread pool. Where the back end's step feeds the pool
/// ([`Backend::step_feeds_thread_pool`]: the CPU back end, a GPU whose expert tier computes
/// misses on the CPU), the other workers poll for its parallel tasks until it ends instead of
/// parking between them ([`compute::cpu::warm::run_step`], which says why); other back ends wait
/// on the device between their few host-side parallel loops, where polling threads would only
/// burn cores. `DISKFORMER_GPU_CPU_POLL=0` lets a GPU step's workers park, for A/B runs.
fn on_pool<B: Backend, R: Send>(b: &B, step: impl FnOnce() -> R + Send) -> R {
    static GPU_PARK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let gpu_park = *GPU_PARK.get_or_init(|| std::env::var("DISKFORMER_GPU_CPU_POLL").is_ok_and(|v| v.trim() == "0"));
    if b.step_feeds_thread_pool() && (b.name() == "cpu" || !(gpu_park || compute::ab::is_b("park"))) {
        compute::cpu::warm::run_step(step)
    } else {
        rayon::scope(|_| step())
    }
}

/// Positions `n_past..n_past + n` as u32.
pub fn positions(n_past: usize, n: usize) -> Vec<u32> {
    (n_past..n_past + n).map(|p| p as u32).collect()
}

/// The rows of hidden state whose logits `outputs` asks for.
pub fn output_rows<B: Backend>(b: &B, x: &B::Tensor, n: usize, outputs: Outputs) -> Result<B::Tensor> {
    Ok(match outputs {
        Outputs::All => b.slice_rows(x, 0, n)?,
        Outputs::Last => b.slice_rows(x, n - 1, 1)?,
    })
}
