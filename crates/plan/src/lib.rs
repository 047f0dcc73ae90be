//! Describe a model, probe the machine, choose the back end that runs it (saying why every
//! other would not), and run it as a streaming session.
//!
//! - [`describe`] reads a GGUF file, a split set or a Hugging Face folder (headers only):
//!   formats, architecture, task, files, tensor types, parameters, context, chat template,
//!   think markers, and which back ends can read it ([`ModelDescription`]).
//! - [`probe`] looks at the machine: GPUs through wgpu, CPU and SIMD, RAM, free disk, and
//!   memory bandwidths, measured or from a table of measured devices ([`Machine`]).
//! - [`plan`] asks every back end (cpu, gpu resident, gpu paged, hybrid) for an [`Estimate`]
//!   (GPU, RAM and disk bytes, tokens per second) or a coded [`Refusal`] with the bytes that
//!   would make it fit, and chooses the fastest ([`Plan`]). [`plan_with`] is the pure core.
//! - [`load`] builds the chosen back end and returns a [`Session`]: `generate` streams
//!   [`Chunk`]s (answer and reasoning apart), can be aborted, queues concurrent calls;
//!   `prime` keeps a system prompt's KV cache; `reset` forgets.
//!
//! The JSON forms of [`ModelDescription`], [`Machine`] and [`Plan`] are documented in
//! docs/PLAN.md and kept stable.
//!
//! # Examples
//! ```no_run
//! use plan::{load, GenerateOptions, LoadOptions, PlanOptions};
//! let p = plan::plan(std::path::Path::new("model.gguf"), &PlanOptions::default())?;
//! println!("{}", p.summary_line());
//! let session = load(std::path::Path::new("model.gguf"), LoadOptions::default())?;
//! for chunk in session.generate("Once upon a time", GenerateOptions::default()) {
//!     print!("{}", chunk.text);
//! }
//! # Ok::<(), plan::PlanError>(())
//! ```
//!
//! # Design
//! The planner is a pure function of a description and a machine ([`plan_with`]), so tests
//! build machines with chosen budgets and bandwidths and check each back end wins or is refused
//! for the right reason. Speeds come from one model (memory-bound decoding: bandwidth over bytes
//! read per token) rather than per-device guesses, and every estimate names where its bandwidth
//! came from. The GPU expert tier (gpu paged) has a speed when the GPU's host read rate is known
//! (its misses cross that link) and is then chosen like any other, started with
//! [`Plan::gpu_tier_budget`]; without one it answers with memory only and runs when asked for.
//! Hybrid is not a back end of its own and answers
//! "unimplemented", so a plan never pretends. The session runs the model on one thread that
//! owns it: compute never runs on callers' threads, and ordering of concurrent calls is the
//! channel's order.
#![deny(missing_docs)]

mod bytes;
mod describe;
mod error;
mod plan;
mod probe;
mod session;
mod tier;

pub use bytes::{format_bytes, parse_bytes};
pub use compute::quant::MatmulMode;
pub use compute::ExpertTierStats;
pub use describe::{
    describe, FileEntry, Format, ModelDescription, QuantUse, Readability, SourceKind, Task, ThinkMarkers, WeightFacts,
};
pub use error::{PlanError, Result};
pub use plan::{
    plan_with, BackendKind, BackendPlan, Budget, Code, Estimate, Plan, PlanOptions, Refusal, DEFAULT_MAX_CTX,
    HOST_OVERHEAD_BYTES, N_BATCH,
};
pub use probe::{
    probe, CpuInfo, DiskInfo, GpuInfo, Machine, MemoryInfo, ProbeOptions, Source, BANDWIDTH_TABLE, HOST_READ_TABLE,
    READ_RATE_MIN_FILE_BYTES,
};
pub use session::{
    load, AbortHandle, Chunk, ChunkKind, Completion, Finish, GenerateOptions, Generation, Input, LoadOptions,
    PagingOptions, Primed, Progress, ProgressFn, Session, SessionInfo, Stage, StopReason, CHUNK_BUFFER,
};
#[cfg(feature = "gpu")]
pub use tier::{gpu_tier, GpuTier};
pub use tier::{GpuTierOptions, TierMiss};
pub use tokenizer::ChatMessage;

/// Describes the model at `path`, probes the machine (measuring bandwidths) and plans.
///
/// # Errors
/// As [`describe`].
pub fn plan(path: &std::path::Path, opts: &PlanOptions) -> Result<Plan> {
    let desc = describe(path)?;
    let dir = desc.gguf.as_deref().and_then(|g| g.parent()).unwrap_or(path).to_path_buf();
    let machine = probe(&ProbeOptions {
        disk_paths: vec![dir],
        measure_bandwidth: true,
        disk_rate_beyond_ram: disk_rate_beyond_ram(&desc, opts),
    });
    Ok(plan_with(&desc, &machine, opts))
}

/// What [`ProbeOptions::disk_rate_beyond_ram`] should say for planning `desc`: its weights'
/// bytes (the disk's rate matters only if they exceed the RAM), or `None` (always measure)
/// when a RAM budget below them is given, so the model will be paged whatever the RAM says.
pub fn disk_rate_beyond_ram(desc: &ModelDescription, opts: &PlanOptions) -> Option<u64> {
    let bytes = desc.weights.as_ref().map_or(0, |w| w.tensor_bytes);
    match opts.ram_budget_bytes {
        Some(budget) if budget < bytes => None,
        _ => Some(bytes),
    }
}
