//! Per-sequence state: the KV cache of attention layers and the recurrent state of conv/SSM
//! layers, kept together so that reset and checkpoints cover both.

use compute::Backend;

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
