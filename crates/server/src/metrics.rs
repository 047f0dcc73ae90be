//! [`Metrics`]: counters for `/metrics` in Prometheus' text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Server-wide counters, updated by generations as they end.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Generations started.
    pub requests: AtomicU64,
    /// Requests refused with 503 because a queue was full.
    pub rejected: AtomicU64,
    /// Generations ended by cancellation (client gone).
    pub cancelled: AtomicU64,
    /// Prompt tokens of finished generations.
    pub prompt_tokens: AtomicU64,
    /// Of those, taken from the KV cache.
    pub cached_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Microseconds spent evaluating prompts.
    pub prompt_us: AtomicU64,
    /// Microseconds spent generating.
    pub generate_us: AtomicU64,
}

impl Metrics {
    /// Adds a finished generation.
    pub fn record(&self, f: &plan::Finish) {
        self.prompt_tokens.fetch_add(f.n_prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(f.n_cached_tokens as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(f.n_generated as u64, Ordering::Relaxed);
        self.prompt_us.fetch_add((f.prompt_ms * 1e3) as u64, Ordering::Relaxed);
        self.generate_us.fetch_add((f.generate_ms * 1e3) as u64, Ordering::Relaxed);
    }

    /// The Prometheus exposition; `models` gives (name, in-flight requests) of loaded models,
    /// `expert_caches` the counters of the models whose experts are paged through RAM,
    /// `expert_tiers` those of the models on the GPU expert tier.
    pub fn render(
        &self,
        models: &[(String, usize)],
        expert_caches: &[(String, pager::LayerStats)],
        expert_tiers: &[(String, plan::ExpertTierStats)],
        resident_bytes: u64,
    ) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ =
                writeln!(s, "# HELP diskformer_{name} {help}\n# TYPE diskformer_{name} counter\ndiskformer_{name} {v}");
        };
        counter("requests_total", "Generations started.", get(&self.requests));
        counter("requests_rejected_total", "Requests refused with 503 (queue full).", get(&self.rejected));
        counter("requests_cancelled_total", "Generations cancelled by the client.", get(&self.cancelled));
        counter("prompt_tokens_total", "Prompt tokens.", get(&self.prompt_tokens));
        counter("prompt_tokens_cached_total", "Prompt tokens served from the KV cache.", get(&self.cached_tokens));
        counter("tokens_generated_total", "Tokens generated.", get(&self.generated_tokens));
        let rate = |tokens: u64, us: u64| if us == 0 { 0.0 } else { tokens as f64 / (us as f64 / 1e6) };
        let _ = writeln!(
            s,
            "# HELP diskformer_prompt_tokens_per_second Prompt evaluation speed over all requests.\n\
             # TYPE diskformer_prompt_tokens_per_second gauge\ndiskformer_prompt_tokens_per_second {:.3}",
            rate(get(&self.prompt_tokens) - get(&self.cached_tokens), get(&self.prompt_us))
        );
        let _ = writeln!(
            s,
            "# HELP diskformer_generation_tokens_per_second Generation speed over all requests.\n\
             # TYPE diskformer_generation_tokens_per_second gauge\ndiskformer_generation_tokens_per_second {:.3}",
            rate(get(&self.generated_tokens), get(&self.generate_us))
        );
        let _ = writeln!(
            s,
            "# HELP diskformer_requests_in_flight Requests running or queued, per model.\n# TYPE diskformer_requests_in_flight gauge"
        );
        for (name, n) in models {
            let _ = writeln!(s, "diskformer_requests_in_flight{{model=\"{}\"}} {n}", label(name));
        }
        let per_model: [(&str, &str, StatField); 5] = [
            ("selections", "Experts the router selected (distinct per call), per paged model.", |t| t.selections),
            ("hits", "Selected experts found in the expert cache, per paged model.", |t| t.hits),
            ("misses", "Selected experts read from disk by the call that needed them, per paged model.", |t| t.misses),
            ("evictions", "Cached experts dropped to make room, per paged model.", |t| t.evictions),
            ("read_bytes", "Bytes of experts read from the model files, prefetch included, per paged model.", |t| {
                t.bytes_read
            }),
        ];
        per_model_counters(&mut s, "expert_cache", &per_model, expert_caches);
        let per_tier: [(&str, &str, TierField); 8] = [
            ("selections", "Experts the router selected (distinct per call), per model on the GPU expert tier.", |t| {
                t.selections
            }),
            ("hits", "Selected experts found in a GPU slot, per model on the GPU expert tier.", |t| t.hits),
            ("misses", "Selected experts not in a GPU slot, per model on the GPU expert tier.", |t| t.misses),
            ("host_reads", "Misses the GPU read from the host copy, per model on the GPU expert tier.", |t| {
                t.host_reads
            }),
            ("cpu_experts", "Misses computed on the CPU, per model on the GPU expert tier.", |t| t.cpu_computed),
            ("uploads", "Experts copied into GPU slots, per model on the GPU expert tier.", |t| t.uploads),
            ("uploaded_bytes", "Bytes of those copies, per model on the GPU expert tier.", |t| t.bytes_uploaded),
            ("evictions", "GPU slots whose expert a copy replaced, per model on the GPU expert tier.", |t| t.evictions),
        ];
        per_model_counters(&mut s, "gpu_tier", &per_tier, expert_tiers);
        let _ = writeln!(
            s,
            "# HELP diskformer_resident_memory_bytes Resident memory of the server.\n\
             # TYPE diskformer_resident_memory_bytes gauge\ndiskformer_resident_memory_bytes {resident_bytes}"
        );
        s
    }
}

/// Counters `diskformer_{family}_{what}_total{model="NAME"}` of each model in `rows`, one
/// (name, help, read) per counter in `fields`; nothing when no model has them.
fn per_model_counters<T>(s: &mut String, family: &str, fields: &[Counter<T>], rows: &[(String, T)]) {
    if rows.is_empty() {
        return;
    }
    for (what, help, get) in fields {
        let _ = writeln!(
            s,
            "# HELP diskformer_{family}_{what}_total {help}\n# TYPE diskformer_{family}_{what}_total counter"
        );
        for (name, t) in rows {
            let _ = writeln!(s, "diskformer_{family}_{what}_total{{model=\"{}\"}} {}", label(name), get(t));
        }
    }
}

/// One per-model counter: its name within the family, its help, and how to read it.
type Counter<'a, T> = (&'a str, &'a str, fn(&T) -> u64);

/// Reads one counter of an expert cache.
type StatField = fn(&pager::LayerStats) -> u64;

/// Reads one counter of a GPU expert tier.
type TierField = fn(&plan::ExpertTierStats) -> u64;

/// A model name as a Prometheus label value (quotes, backslashes and newlines replaced).
fn label(name: &str) -> String {
    name.replace(['"', '\\', '\n'], "_")
}
