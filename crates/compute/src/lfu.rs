//! The frequency-with-decay score both expert caches rank by (the GPU tier's pool, the pager's
//! RAM slots), for calls of one token and of many.
//!
//! A cache keeps per expert a score that decays by a factor each time its layer runs and grows
//! when the router selects the expert. A call of one token is the classic update: every score
//! times `decay`, plus one for each expert the token chose. A call of `n` tokens (a prompt's
//! batch) counts as `n` such calls in which each expert was chosen by the fraction of the
//! batch's tokens that chose it: every score times `decay^n`, plus
//! `(c / n) * (1 - decay^n) / (1 - decay)` for an expert `c` tokens chose.
//!
//! Why not one point per call for a batch too: a 512-token prompt touches nearly every expert of
//! a layer, so one point each left their scores all alike, and the cache after a prompt ranked
//! its experts by chance; decode then had to learn the popular experts anew (~100-150 tokens on
//! the skewed synthetic Qwen3-30B-A3B, thirty-third session). Weighted by tokens, the prompt is
//! the routing's best sample at the start of a sequence.

/// Applies one call of `n_tokens` tokens to a layer's `scores`: `chosen` yields `(expert,
/// tokens that chose it)` for distinct experts (see the module documentation). With one token
/// it is `score * decay + 1` for each chosen expert, bit for bit.
pub fn note_call(scores: &mut [f32], chosen: impl Iterator<Item = (u32, u32)>, n_tokens: usize, decay: f32) {
    let n = n_tokens.max(1);
    let kept = decay.powi(n.min(i32::MAX as usize) as i32);
    // n one-token calls' worth of weight: 1 + decay + ... + decay^(n-1).
    let weight = if decay < 1.0 { (1.0 - kept) / (1.0 - decay) } else { n as f32 };
    scores.iter_mut().for_each(|s| *s *= kept);
    for (e, c) in chosen {
        if let Some(s) = scores.get_mut(e as usize) {
            *s += weight * c as f32 / n as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch's scores are those of its tokens one call each, every expert chosen by the
    /// batch's fraction of them (12 tokens: expert 0 by all, 1 by half, 2 by none, after one
    /// earlier call that chose 2); one token is the plain update, bit for bit.
    #[test]
    fn a_batch_scores_as_its_tokens_one_by_one() {
        let decay = 0.99f32;
        let mut scores = vec![0.0f32; 3];
        note_call(&mut scores, [(2, 1)].into_iter(), 1, decay);
        assert_eq!(scores, vec![0.0, 0.0, 1.0]);
        note_call(&mut scores, [(0, 12), (1, 6)].into_iter(), 12, decay);
        let (mut one_by_one, mut half) = (vec![0.0f32, 0.0, 1.0], 0.0f32);
        for _ in 0..12 {
            one_by_one.iter_mut().for_each(|s| *s *= decay);
            one_by_one[0] += 1.0;
            half = half * decay + 0.5;
        }
        one_by_one[1] = half;
        for (e, (got, want)) in scores.iter().zip(&one_by_one).enumerate() {
            assert!((got - want).abs() < 1e-4 * want.max(1.0), "expert {e}: {got} against {want}");
        }
        // One token: exactly the classic update.
        let mut a = vec![0.3f32, 2.5, 7.0];
        let want: Vec<f32> = a.iter().enumerate().map(|(e, &s)| s * 0.9 + if e == 1 { 1.0 } else { 0.0 }).collect();
        note_call(&mut a, [(1, 1)].into_iter(), 1, 0.9);
        assert_eq!(a, want);
        // An id past the layer's experts is ignored, not a panic.
        note_call(&mut a, [(9, 1)].into_iter(), 1, 0.9);
    }
}
