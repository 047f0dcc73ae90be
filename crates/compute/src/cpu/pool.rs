//! Reused buffers for op outputs, so that a decode step allocates nothing once warm.
//!
//! Every op returns a fresh [`super::CpuTensor`]; its values and shape come from a per-thread
//! free list and go back to it when the tensor is dropped. A decode step creates and drops the
//! same few sizes (the model width, head widths, the FFN width, the vocabulary) layer after layer,
//! so after the first token every request is served from the list. Per thread, because ops run
//! and tensors die on the thread that drives the model: no lock, no contention with rayon's
//! workers.

use std::cell::RefCell;

/// Free buffers kept per thread. A decode step of any model here holds well under this many
/// tensors alive at once; prefill's larger buffers are kept too (best fit picks a small one for
/// a small request), and past the limit a returned buffer is simply freed.
const MAX_FREE: usize = 64;

thread_local! {
    static VALUES: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
    static SHAPES: RefCell<Vec<Vec<usize>>> = const { RefCell::new(Vec::new()) };
}

/// An empty vector with room for at least `len` values, from the free list when one fits (the
/// smallest that does), else newly allocated.
pub(crate) fn values(len: usize) -> Vec<f32> {
    VALUES
        .try_with(|free| {
            let mut free = free.borrow_mut();
            let mut best: Option<usize> = None;
            for (i, v) in free.iter().enumerate() {
                if v.capacity() >= len && best.is_none_or(|b| v.capacity() < free[b].capacity()) {
                    best = Some(i);
                }
            }
            best.map(|i| free.swap_remove(i))
        })
        .ok()
        .flatten()
        .map(|mut v| {
            v.clear();
            v
        })
        .unwrap_or_else(|| Vec::with_capacity(len))
}

/// `len` zeros in a pooled vector.
pub(crate) fn zeros(len: usize) -> Vec<f32> {
    let mut v = values(len);
    v.resize(len, 0.0);
    v
}

/// A copy of `src` in a pooled vector.
pub(crate) fn copy_of(src: &[f32]) -> Vec<f32> {
    let mut v = values(src.len());
    v.extend_from_slice(src);
    v
}

/// A shape vector holding `dims`, from the free list when it has one.
pub(crate) fn shape(dims: &[usize]) -> Vec<usize> {
    let mut v = SHAPES.try_with(|free| free.borrow_mut().pop()).ok().flatten().unwrap_or_default();
    v.clear();
    v.extend_from_slice(dims);
    v
}

/// Takes back a tensor's buffers (called from its `Drop`).
pub(crate) fn give_back(values: Vec<f32>, shape: Vec<usize>) {
    if values.capacity() > 0 {
        // `try_with` fails only while the thread's locals are being torn down; the buffer is
        // then freed normally.
        let _ = VALUES.try_with(|free| {
            let mut free = free.borrow_mut();
            if free.len() < MAX_FREE {
                free.push(values);
            }
        });
    }
    if shape.capacity() > 0 {
        let _ = SHAPES.try_with(|free| {
            let mut free = free.borrow_mut();
            if free.len() < MAX_FREE {
                free.push(shape);
            }
        });
    }
}
