//! How far a missed expert's LFU score must exceed a pooled one's before the host tier copies
//! it into that slot between steps ([`super::HOST_REPLACE_MARGIN`] to start with), moved by
//! what the replacements measurably earned.
//!
//! Why: a replacement costs one copy of the expert over PCIe (~2.7 MB for Qwen3-30B-A3B Q4_K,
//! on the GPU's one queue ahead of the next step's kernels) and pays back one miss's read for
//! every hit it brings that the evicted expert would not have. Under skewed routing, as real
//! models route, the popular experts earn several hits each and the evicted ones lose few; under
//! uniform routing the last selections say nothing of the next and a replacement gains about
//! what its victim loses. With the fixed margin of 1, uniform routing on the synthetic
//! Qwen3-30B-A3B at 4 GB still copied ~20 experts per token for 1.6 points of hit rate (20.8%
//! against 19.2% for the pool as first filled), ~1 ms of copies per token on the H200
//! (seventeenth session's trace), while margins 3 and 8 lost the skewed file 7-10 points.
//!
//! The measure: a hit on an expert within [`WINDOW`] steps of its copy is one gained, a miss on
//! an expert within [`WINDOW`] steps of its eviction is one lost. Gains, losses and
//! replacements are summed with a decay of [`DECAY`] per step; at each step their net yield per
//! replacement moves the margin up by [`STEP`] when below [`LOW_YIELD`] (replacements that do
//! not pay for their copy) and down when above [`HIGH_YIELD`], never below the starting margin.
//! With too few replacements to measure, the margin drifts back down slowly, so that a routing
//! that becomes skewed is noticed again.

/// Steps after a copy (an eviction) in which a hit (a miss) on that expert is counted for it.
pub(super) const WINDOW: u32 = 16;
/// Factor by which the sums shrink each step (a memory of ~20 steps).
pub(super) const DECAY: f32 = 0.95;
/// Decayed replacements below which the yield is not trusted.
pub(super) const MIN_REPLACED: f32 = 4.0;
/// Net hits per replacement below which the margin rises, above which it falls.
pub(super) const LOW_YIELD: f32 = 0.75;
pub(super) const HIGH_YIELD: f32 = 1.5;
/// How far the margin moves per step, and its ceiling.
pub(super) const STEP: f32 = 0.25;
pub(super) const MAX_MARGIN: f32 = 8.0;
/// How far it drifts back toward the start per step while too few replacements are measured.
pub(super) const DRIFT: f32 = 0.05;

const NEVER: u32 = u32::MAX;

/// The margin and what it is measured by (see the module documentation).
#[derive(Debug)]
pub(super) struct Admission {
    base: f32,
    margin: f32,
    adapt: bool,
    step: u32,
    /// Per layer, per expert: the step of its last copy into the pool, of its last eviction.
    copied_at: Vec<Vec<u32>>,
    evicted_at: Vec<Vec<u32>>,
    gained: f32,
    lost: f32,
    replaced: f32,
}

impl Admission {
    /// Starts at `margin`; `adapt` false keeps it there (a margin fixed for experiments).
    pub(super) fn new(margin: f32, adapt: bool) -> Admission {
        Admission {
            base: margin,
            margin,
            adapt,
            step: 0,
            copied_at: Vec::new(),
            evicted_at: Vec::new(),
            gained: 0.0,
            lost: 0.0,
            replaced: 0.0,
        }
    }

    /// The margin in force.
    pub(super) fn margin(&self) -> f32 {
        self.margin
    }

    /// Net hits per replacement over the recent steps, when enough were made to tell.
    pub(super) fn yield_per_replacement(&self) -> Option<f32> {
        (self.replaced >= MIN_REPLACED).then(|| (self.gained - self.lost) / self.replaced)
    }

    /// A step begins (before its refills): the sums decay and the margin follows their yield.
    pub(super) fn start_step(&mut self) {
        self.step = self.step.wrapping_add(1);
        if self.adapt {
            self.margin = match self.yield_per_replacement() {
                Some(y) if y < LOW_YIELD => (self.margin + STEP).min(MAX_MARGIN),
                Some(y) if y > HIGH_YIELD => (self.margin - STEP).max(self.base),
                Some(_) => self.margin,
                None => (self.margin - DRIFT).max(self.base),
            };
        }
        self.gained *= DECAY;
        self.lost *= DECAY;
        self.replaced *= DECAY;
    }

    fn within_window(&self, at: u32) -> bool {
        at != NEVER && self.step.wrapping_sub(at) <= WINDOW
    }

    fn mark(table: &mut Vec<Vec<u32>>, layer: usize, e: usize, step: u32) {
        if table.len() <= layer {
            table.resize_with(layer + 1, Vec::new);
        }
        if table[layer].len() <= e {
            table[layer].resize(e + 1, NEVER);
        }
        table[layer][e] = step;
    }

    fn at(table: &[Vec<u32>], layer: usize, e: usize) -> u32 {
        table.get(layer).and_then(|l| l.get(e)).copied().unwrap_or(NEVER)
    }

    /// Expert `e` of `layer` was selected: a hit on it (it holds a slot) or a miss.
    pub(super) fn selected(&mut self, layer: usize, e: usize, hit: bool) {
        if hit && self.within_window(Self::at(&self.copied_at, layer, e)) {
            self.gained += 1.0;
        } else if !hit && self.within_window(Self::at(&self.evicted_at, layer, e)) {
            self.lost += 1.0;
        }
    }

    /// Expert `e` of `layer` was copied into a slot, evicting `evicted` (layer, expert) if the
    /// slot held one. A copy into an empty slot counts its hits as gains too, though it is no
    /// replacement: while the pool is young that keeps the margin low, so that the experts the
    /// routing favours can still displace those of the first fill, whose replacements' gains
    /// only show over the following steps (the measured version; not counting them is untried).
    pub(super) fn copied(&mut self, layer: usize, e: usize, evicted: Option<(usize, usize)>) {
        Self::mark(&mut self.copied_at, layer, e, self.step);
        if let Some((ol, oe)) = evicted {
            Self::mark(&mut self.evicted_at, ol, oe, self.step);
            self.replaced += 1.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of `replacements` each, where every copied expert then hits `hits_each` times and
    /// every evicted one misses `misses_each` times within the window; the margin after `steps`.
    fn run(steps: usize, replacements: usize, hits_each: usize, misses_each: usize, adapt: bool) -> Admission {
        let mut a = Admission::new(1.0, adapt);
        let mut next = 0usize;
        for _ in 0..steps {
            a.start_step();
            for _ in 0..replacements {
                let (e, victim) = (next, next + 1_000_000);
                next += 1;
                a.copied(0, e % 128, Some((1, victim % 128)));
                for _ in 0..hits_each {
                    a.selected(0, e % 128, true);
                }
                for _ in 0..misses_each {
                    a.selected(1, victim % 128, false);
                }
            }
        }
        a
    }

    /// Replacements that gain what they lose (uniform routing) raise the margin to its ceiling;
    /// those that gain several hits each (skewed routing) keep it at the start.
    #[test]
    fn the_margin_rises_when_replacements_do_not_pay_and_stays_when_they_do() {
        let uniform = run(200, 20, 1, 1, true);
        assert_eq!(uniform.margin(), MAX_MARGIN);
        assert!(uniform.yield_per_replacement().is_some_and(|y| y.abs() < 1e-3));
        let skewed = run(200, 20, 4, 1, true);
        assert_eq!(skewed.margin(), 1.0);
        assert!(skewed.yield_per_replacement().is_some_and(|y| y > HIGH_YIELD));
        // Fixed: never moves.
        assert_eq!(run(200, 20, 1, 1, false).margin(), 1.0);
    }

    /// With no replacements to measure, a raised margin drifts back to where it started.
    #[test]
    fn without_replacements_the_margin_drifts_back() {
        let mut a = run(100, 20, 0, 1, true);
        assert_eq!(a.margin(), MAX_MARGIN);
        for _ in 0..400 {
            a.start_step();
        }
        assert!(a.yield_per_replacement().is_none());
        assert_eq!(a.margin(), 1.0);
    }

    /// Hits and misses count only within the window after the copy or the eviction.
    #[test]
    fn gains_and_losses_count_within_the_window_only() {
        let mut a = Admission::new(1.0, false);
        a.start_step();
        a.copied(2, 5, Some((3, 7)));
        a.selected(2, 5, true);
        a.selected(3, 7, false);
        a.selected(2, 6, true); // never copied
        assert_eq!((a.gained, a.lost, a.replaced), (1.0, 1.0, 1.0));
        for _ in 0..=WINDOW {
            a.start_step();
        }
        let (g, l) = (a.gained, a.lost);
        a.selected(2, 5, true);
        a.selected(3, 7, false);
        assert_eq!((a.gained, a.lost), (g, l), "past the window nothing is counted");
    }
}
