//! The CPU back end's decode path allocates nothing once warm: a transformer layer's ops (norm,
//! q/k/v/o and gate/up/down products in Q4_0, Q4_1, Q8_0, Q4_K and Q6_K with quantized
//! activations, q/k/v and gate/up each through one `matmul_many`, rope, attention over a growing cache, SwiGLU, residual adds) run one token at a
//! time on a rayon pool worker, as `models::Session` runs a step, under a counting allocator.
//! After two warm-up tokens, the next tokens must not call the allocator at all.
//!
//! Its own test binary: the allocator counts every thread of the process, so no other test may
//! run beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use compute::cpu::{CpuBackend, CpuTensor};
use compute::quant::{GgmlType, MatmulMode};
use compute::spec::{Act, AttnSpec, Glu, RopeSpec};
use compute::{Backend, HostWeight};
use gguf::{GgufModel, GgufWriter, Value};

mod quant_common;
use quant_common::{random_rows, Rng};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// Sizes of the first allocations counted (for the failure message).
static SIZES: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

fn count(size: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let i = ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = SIZES.get(i) {
            slot.store(size, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counter has no
// effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's layout contract is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const N_EMBD: usize = 256;
const N_FF: usize = 512;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = N_EMBD / N_HEAD;

/// The layer's weights, written to a GGUF file and mapped back (the back end reads weights in
/// place from a model's memory map).
fn layer_weights() -> Vec<HostWeight> {
    let kv = N_HEAD_KV * HEAD_DIM;
    let tensors = [
        ("q", GgmlType::Q4_0, N_EMBD, N_EMBD),
        ("k", GgmlType::Q4_1, kv, N_EMBD),
        ("v", GgmlType::Q8_0, kv, N_EMBD),
        ("o", GgmlType::Q4_0, N_EMBD, N_EMBD),
        ("gate", GgmlType::Q4_K, N_FF, N_EMBD),
        ("up", GgmlType::Q4_K, N_FF, N_EMBD),
        ("down", GgmlType::Q6_K, N_EMBD, N_FF),
    ];
    let path = std::env::temp_dir().join(format!("diskformer-decode-allocations-{}.gguf", std::process::id()));
    let mut rng = Rng::new(5);
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("test".into()));
    let data: Vec<Vec<u8>> =
        tensors.iter().map(|&(_, dtype, n_out, k)| random_rows(dtype, n_out, k, &mut rng)).collect();
    for &(name, dtype, n_out, k) in &tensors {
        w.add_tensor(name, dtype, &[k as u64, n_out as u64]).unwrap();
    }
    let mut out = w.create(&path).unwrap();
    for bytes in &data {
        out.write_data(bytes).unwrap();
    }
    out.finish().unwrap();
    let model = Arc::new(GgufModel::open(&path).unwrap());
    std::fs::remove_file(&path).ok();
    tensors.iter().map(|&(name, ..)| HostWeight::from_model(&model, name).unwrap()).collect()
}

/// One decode token through the layer; returns the new hidden state.
fn step(
    b: &CpuBackend,
    w: &[HostWeight],
    norm: &CpuTensor,
    x: CpuTensor,
    cache: &mut <CpuBackend as Backend>::Cache,
    pos: usize,
) -> CpuTensor {
    let attn = AttnSpec {
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        head_dim_k: HEAD_DIM,
        head_dim_v: HEAD_DIM,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let positions = [pos as u32];
    let rope = RopeSpec::new(HEAD_DIM, 10000.0, false);
    let h = b.rms_norm(&x, Some(norm), 1e-6).unwrap();
    let [q, k, v] = b.matmul_many(&h, [&w[0], &w[1], &w[2]]).unwrap();
    let q = b.rope(&q, &positions, &rope).unwrap();
    let k = b.rope(&k, &positions, &rope).unwrap();
    let a = b.attention(&q, &k, &v, cache, pos, &attn, None).unwrap();
    let x = b.add(&x, &b.matmul(&a, &w[3]).unwrap()).unwrap();
    let h = b.rms_norm(&x, Some(norm), 1e-6).unwrap();
    let [gate, up] = b.matmul_many(&h, [&w[4], &w[5]]).unwrap();
    let ff = b.glu(&gate, &up, Glu::Plain(Act::Silu)).unwrap();
    let y = b.add(&x, &b.matmul(&ff, &w[6]).unwrap()).unwrap();
    b.scale(&y, 0.5).unwrap()
}

/// Runs parallel loops until every worker of the current pool has run a task taken from
/// another's queue, a few rounds over. rayon and its deques set a thread up (epoch
/// registration, queue blocks: 1520 and 2304 bytes here) the first time it steals, which on a
/// loaded machine can come after the warm-up tokens; that is the pool's one-time cost, not the
/// step's.
fn every_worker_has_stolen() {
    use rayon::prelude::*;
    let all = (1u64 << rayon::current_num_threads()) - 1;
    for _ in 0..20 {
        let seen = AtomicUsize::new(0);
        while seen.load(Ordering::SeqCst) as u64 != all {
            (0..64).into_par_iter().for_each(|_| {
                seen.fetch_or(1 << rayon::current_thread_index().unwrap_or(0), Ordering::SeqCst);
                std::hint::black_box((0..2000).sum::<u64>());
            });
        }
    }
}

#[test]
fn a_warm_decode_step_allocates_nothing() {
    let weights = layer_weights();
    let b = CpuBackend::new(MatmulMode::QuantizedActivations);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let (warm_tokens, counted_tokens) = (2, 6);
    let per_token = pool.install(|| {
        let mut rng = Rng::new(9);
        let x0: Vec<f32> = (0..N_EMBD).map(|_| rng.normal()).collect();
        let norm_values: Vec<f32> = (0..N_EMBD).map(|_| 1.0 + 0.1 * rng.normal()).collect();
        let norm = b.from_host(&norm_values, &[N_EMBD]).unwrap();
        let mut cache = b.new_cache(64, N_HEAD_KV * HEAD_DIM, N_HEAD_KV * HEAD_DIM).unwrap();
        let mut x = b.from_host(&x0, &[1, N_EMBD]).unwrap();
        let mut per_token = Vec::new();
        for pos in 0..warm_tokens + counted_tokens {
            if pos == warm_tokens {
                every_worker_has_stolen();
            }
            if pos >= warm_tokens {
                ALLOCATIONS.store(0, Ordering::SeqCst);
                COUNTING.store(true, Ordering::SeqCst);
            }
            x = step(&b, &weights, &norm, x, &mut cache, pos);
            COUNTING.store(false, Ordering::SeqCst);
            if pos >= warm_tokens {
                let n = ALLOCATIONS.load(Ordering::SeqCst);
                let sizes: Vec<usize> = SIZES.iter().take(n).map(|s| s.load(Ordering::SeqCst)).collect();
                per_token.push((n, sizes));
            }
        }
        assert!(x.data.iter().all(|v| v.is_finite()), "the layer produced non-finite values");
        per_token
    });
    println!("allocations per decode token after {warm_tokens} warm-up tokens: {per_token:?}");
    assert!(per_token.iter().all(|(n, _)| *n == 0), "allocations (count, first sizes) per token: {per_token:?}");
}
