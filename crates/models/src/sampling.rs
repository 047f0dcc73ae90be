//! Choosing the next token from logits: greedy, or a chain of filters then a seeded draw.
//!
//! The chain runs in llama.cpp's default order (`common/sampling.cpp`): repetition penalty,
//! top-k, top-p, min-p, temperature, draw. Greedy (temperature 0) is argmax with the lowest id
//! winning ties, the rule the fixtures' greedy references use. The same seed and inputs give the
//! same tokens.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters. The defaults are llama.cpp's.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recently seen tokens (1: off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the draw.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }
}

/// A sampler with its random state.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng, candidates: Vec::new() }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks a token from `logits`, given the tokens of the sequence so far (`history`).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits_owned;
        let mut logits = logits;
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            logits_owned = logits.to_vec();
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = logits_owned.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                }
            }
            logits = &logits_owned;
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // Sort by logit, descending; ties by id so the order never depends on the sort algorithm.
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < c.len() {
            c.truncate(p.top_k);
        }
        // Probabilities at temperature 1 for the top-p / min-p filters, as llama.cpp does.
        let max = c[0].1;
        let mut probs: Vec<f32> = c.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = c.len();
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let threshold = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&q| q >= threshold).count().max(1);
            c.truncate(keep);
        }
        let weights: Vec<f64> = c.iter().map(|&(_, l)| (((l - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if r < *w {
                return c[i].0;
            }
            r -= w;
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_draws_and_other_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        let params =
            SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 7, ..Default::default() };
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params.clone() });
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams { top_k: 1, temperature: 5.0, ..Default::default() });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits, &[]), 1);
        }
    }

    #[test]
    fn min_p_and_top_p_exclude_unlikely_tokens() {
        // Token 0 has probability ~0.88 at temperature 1; min_p 0.5 leaves only it.
        let logits = [4.0, 2.0, 1.0, 0.0];
        let mut s =
            Sampler::new(SamplingParams { top_k: 0, top_p: 1.0, min_p: 0.5, temperature: 1.0, ..Default::default() });
        assert!((0..50).all(|_| s.sample(&logits, &[]) == 0));
        let mut s =
            Sampler::new(SamplingParams { top_k: 0, top_p: 0.5, min_p: 0.0, temperature: 1.0, ..Default::default() });
        assert!((0..50).all(|_| s.sample(&logits, &[]) == 0));
    }

    #[test]
    fn repeat_penalty_demotes_seen_tokens() {
        // Token 1 leads by a little; once seen, the penalty (divide 2.0 by 1.3) hands the lead to 2.
        let logits = [0.0, 2.0, 1.8];
        let mut s = Sampler::new(SamplingParams { repeat_penalty: 1.3, ..SamplingParams::greedy() });
        assert_eq!(s.sample(&logits, &[]), 1);
        assert_eq!(s.sample(&logits, &[1]), 2);
    }
}
