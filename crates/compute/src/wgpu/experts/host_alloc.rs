//! The host tier's buffers allocated ahead, on background threads, from the tier's creation.
//!
//! Why: the host tier copies every expert of a layer into a buffer in host memory on the
//! layer's first call (`ensure_host_layer`). On the H200 (thirty-first session's trace, the
//! Qwen3-30B-A3B shape at 4G) that fill took 4.7 s for 48 layers, and 72 ms of each layer's
//! ~98 ms was making its 340 MB buffer: the driver allocates and pins system memory at ~4.7
//! GB/s on one thread. While the fill runs the GPU is nearly idle, its clock drops to 345 MHz,
//! and the first decode steps run at that clock (docs/PAGING.md). Allocating on other threads
//! from the tier's creation overlaps the allocations with the model's load, with the copies
//! into buffers already made, and with each other.
//!
//! The buffers are [`MappedHostBuffer`]s (raw Vulkan memory handed to wgpu): wgpu-hal's own
//! `create_buffer` allocates under one lock for the whole device, so threads calling it would
//! take turns; `vkAllocateMemory` itself may be called from several threads. Layers take the
//! buffers in the order of their first calls (all have the same size).
//!
//! Budget: the caller reserves every buffer it asks for against `--ram-budget` before any is
//! made; the tier counts the ones not yet taken in its host bytes
//! ([`HostPrealloc::untaken_bytes`]), so the reported figure never trails the memory held.

use super::super::mailbox::{MappedHostBuffer, Toward};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Buffers of one size being allocated on background threads for the host tier's layers.
pub(super) struct HostPrealloc {
    /// Bytes of each buffer.
    pub(super) bytes_each: u64,
    /// Buffers asked for.
    count: usize,
    /// The next buffer a worker makes (claimed with `fetch_add`).
    next: AtomicUsize,
    /// Set when the tier is dropped: workers stop after the buffer they are making.
    stop: AtomicBool,
    state: Mutex<PreallocState>,
    made: Condvar,
}

#[derive(Default)]
struct PreallocState {
    /// Made and not yet taken.
    ready: Vec<MappedHostBuffer>,
    /// Taken by layers.
    taken: usize,
    /// Workers still running.
    workers: usize,
    /// The first failure: no more buffers come after it.
    error: Option<String>,
}

impl std::fmt::Debug for HostPrealloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPrealloc").field("bytes_each", &self.bytes_each).field("count", &self.count).finish()
    }
}

impl HostPrealloc {
    /// Starts `threads` threads making `count` buffers of `bytes_each` on `device`; they stop
    /// when the handle is dropped (after the buffer each is making).
    pub(super) fn start(device: &wgpu::Device, count: usize, bytes_each: u64, threads: usize) -> PreallocHandle {
        let threads = threads.clamp(1, count.max(1));
        let p = Arc::new(HostPrealloc {
            bytes_each,
            count,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            state: Mutex::new(PreallocState { workers: threads, ..PreallocState::default() }),
            made: Condvar::new(),
        });
        for i in 0..threads {
            let (worker, device) = (p.clone(), device.clone());
            let spawned =
                std::thread::Builder::new().name(format!("host-tier-alloc-{i}")).spawn(move || worker.work(&device));
            if spawned.is_err() {
                // No thread: one fewer worker; `take` then makes what is missing itself.
                let mut st = super::lock(&p.state);
                st.workers -= 1;
                drop(st);
                p.made.notify_all();
            }
        }
        PreallocHandle(p)
    }

    fn work(&self, device: &wgpu::Device) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.count || self.stop.load(Ordering::Relaxed) {
                break;
            }
            let made = MappedHostBuffer::new(device, self.bytes_each, Toward::Host, "expert host tier");
            let mut st = super::lock(&self.state);
            match made {
                Ok(Some(b)) => st.ready.push(b),
                Ok(None) => {
                    st.error.get_or_insert_with(|| "the device has no host-visible memory for it".into());
                }
                Err(e) => {
                    st.error.get_or_insert(e);
                }
            }
            let failed = st.error.is_some();
            drop(st);
            self.made.notify_all();
            if failed {
                self.stop.store(true, Ordering::Relaxed);
                break;
            }
        }
        super::lock(&self.state).workers -= 1;
        self.made.notify_all();
    }

    /// The next buffer made, waiting for one while workers still run; `Ok(None)` once none is
    /// left to come (all taken, or the workers stopped), `Err` with the allocation's failure
    /// when that is why.
    pub(super) fn take(&self) -> Result<Option<MappedHostBuffer>, String> {
        let mut st = super::lock(&self.state);
        loop {
            if let Some(b) = st.ready.pop() {
                st.taken += 1;
                return Ok(Some(b));
            }
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
            if st.workers == 0 || st.taken >= self.count {
                return Ok(None);
            }
            st = self.made.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Bytes reserved and not yet taken by a layer: made, being made or still to come (none
    /// after a failure or a stop, where no more will be made).
    pub(super) fn untaken_bytes(&self) -> u64 {
        let st = super::lock(&self.state);
        let to_come = if st.error.is_some() || self.stop.load(Ordering::Relaxed) {
            st.ready.len()
        } else {
            self.count - st.taken
        };
        to_come as u64 * self.bytes_each
    }
}

/// The tier's hold on a [`HostPrealloc`]: the workers hold it too, so the stop comes from here.
#[derive(Debug)]
pub(super) struct PreallocHandle(Arc<HostPrealloc>);

impl std::ops::Deref for PreallocHandle {
    type Target = HostPrealloc;
    fn deref(&self) -> &HostPrealloc {
        &self.0
    }
}

impl Drop for PreallocHandle {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Relaxed);
    }
}
