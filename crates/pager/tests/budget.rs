//! The RAM budget is never exceeded: a counting allocator measures the heap a paged run holds
//! at its peak against the same run with resident (memory-mapped) experts, for several budgets
//! on a MoE fixture whose experts are larger than each budget. The difference — what paging
//! adds — must stay within the budget. (Alone in its test binary: the counter is global.)

use compute::cpu::CpuBackend;
use gguf::GgufModel;
use models::refcheck::{fixture_root, greedy};
use models::{load_on, LoadOptions};
use pager::{CachePolicy, Pager, PagerOptions};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = LIVE.fetch_add(new_size - layout.size(), Ordering::SeqCst) + new_size - layout.size();
                PEAK.fetch_max(now, Ordering::SeqCst);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak heap above the level at the start, while `f` runs.
fn peak_during(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    f();
    PEAK.load(Ordering::SeqCst) - base
}

#[test]
fn paged_runs_hold_no_more_heap_than_the_budget() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    // qwen3_moe q8_0 where present (the full set), else the compact subset's q4_0.
    let path = ["model-q8_0.gguf", "model-q4_0.gguf"]
        .iter()
        .map(|f| root.join("qwen3_moe").join(f))
        .find(|p| p.is_file())
        .expect("a qwen3_moe fixture");
    println!("fixture: {} ({})", path.display(), if full { "full shared set" } else { "compact committed subset" });
    let model = Arc::new(GgufModel::open(&path).expect("opens"));
    let prompt = [1u32, 17, 42, 7, 99, 3, 250, 11];
    let n_gen = 8;
    let mut want = Vec::new();
    let resident_peak = peak_during(|| {
        let mut r = load_on(CpuBackend::default(), &model, &LoadOptions::default()).expect("loads");
        want = greedy(r.as_mut(), &prompt, n_gen).expect("runs");
    });
    for n_slots in [1, 3, 8] {
        let budget = Pager::budget_for_slots(&model, n_slots).expect("indexed");
        let mut misses = 0;
        let mut experts_total = 0;
        let mut got = Vec::new();
        let paged_peak = peak_during(|| {
            let pager = Arc::new(Pager::open(&model, &PagerOptions::new(budget, CachePolicy::Lfu)).expect("opens"));
            experts_total = pager.expert_bytes_total();
            let b = CpuBackend::default().with_expert_store(pager.clone());
            let mut r = load_on(b, &model, &LoadOptions::default()).expect("loads");
            got = greedy(r.as_mut(), &prompt, n_gen).expect("runs");
            misses = pager.total_stats().misses;
        });
        let added = paged_peak.saturating_sub(resident_peak);
        println!(
            "{n_slots:>2} slot(s): budget {budget} B, experts {experts_total} B, peak heap {paged_peak} B vs resident {resident_peak} B: paging added {added} B, {misses} misses"
        );
        assert!(experts_total > budget, "the experts ({experts_total} B) must not fit the budget ({budget} B)");
        assert!(misses > 0);
        assert_eq!(got, want, "greedy ids with {n_slots} slot(s)");
        assert!(added as u64 <= budget, "paging added {added} B of heap, over the budget of {budget} B");
    }
}
