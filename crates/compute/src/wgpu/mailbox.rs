//! Host-mapped mailboxes: a buffer in host memory that kernels read and write while the host
//! reads and writes it too, through a mapping kept for the buffer's whole life.
//!
//! Why: the split miss mode (experts/split.rs) crosses between the GPU and the CPU twice per
//! MoE layer, and through wgpu each crossing is a submission's round trip: the ids come back
//! when the fence of the submission that copied them signals and a `map_async` callback runs
//! (~60 us per layer on the H200, measured by `perf_moe_attention_section`), and the CPU's sum
//! goes up in the next submission, which the host can only make once the sum exists (its submit
//! and the GPU's start, ~40 us). WebGPU forbids a buffer mapped while the GPU uses it; Vulkan
//! does not. A mailbox is that Vulkan buffer (made with `ash` on wgpu's own device, handed to
//! wgpu through its hal interop): a kernel writes the ids and then a flag, which the host sees
//! by polling memory; a kernel waits for a flag the host writes when the CPU's sum is in place,
//! so the next layer's work can be submitted before the sum exists.
//!
//! Visibility: the memory is `HOST_VISIBLE | HOST_COHERENT` (system memory, host-cached when
//! offered); every word the two sides exchange while the GPU runs is read and written as an
//! atomic on both sides, and a flag is written after the data it announces (the host fences
//! between them, for write-combined memory). Vulkan's memory model promises this only at
//! submission boundaries; `perf_mailbox` checks on a device that it holds within one.
//!
//! Only on Vulkan: elsewhere [`Mailbox::new`] returns `None` and callers keep their
//! submission-based path.

use std::sync::atomic::{AtomicU32, Ordering};

/// Which way a mailbox carries data, which decides its memory (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Toward {
    /// Kernels write, the host reads: system memory, cached by the host.
    Host,
    /// The host writes, kernels read: device-local host-visible memory when the device has it
    /// (a GPU caches system memory in its L2, which the host's writes do not update).
    Gpu,
}

/// A Vulkan buffer in host-visible memory, made with `ash` on wgpu's device and handed to wgpu,
/// with its memory mapped for the buffer's whole life (the mailboxes, and the expert tier's
/// host copies, which the host fills straight through the mapping).
pub(crate) struct MappedHostBuffer {
    /// wgpu's view: a storage buffer that copies may read and write.
    pub(crate) buffer: wgpu::Buffer,
    /// The mapping's first byte; valid for `buffer.size()` bytes while `buffer` lives (wgpu-hal
    /// frees the memory, which unmaps it, only when the buffer is destroyed, after every
    /// submission using it finished).
    pub(crate) ptr: std::ptr::NonNull<u8>,
}

// SAFETY: the mapping is plain host memory owned by `buffer`, which wgpu lets any thread hold;
// what is written through `ptr` and by whom is up to its users (each states its rule).
unsafe impl Send for MappedHostBuffer {}
// SAFETY: as for `Send`.
unsafe impl Sync for MappedHostBuffer {}

impl MappedHostBuffer {
    /// A buffer of `bytes` (a multiple of 4) in the memory `toward` asks for, not zeroed
    /// (Vulkan leaves new memory's contents undefined; the kernel hands out zeroed pages);
    /// `Ok(None)` when the device is not Vulkan or has no host-visible coherent memory.
    ///
    /// Safe to call from several threads at once: it takes none of wgpu's locks (only
    /// `vkAllocateMemory`, which Vulkan lets threads call concurrently).
    ///
    /// # Errors
    /// A Vulkan call failed (out of memory, usually), with the call and the size.
    pub(crate) fn new(
        device: &wgpu::Device,
        bytes: u64,
        toward: Toward,
        label: &'static str,
    ) -> Result<Option<MappedHostBuffer>, String> {
        use ash::vk;
        // SAFETY: the hal device is only used to create, bind and map one buffer that wgpu then
        // owns (`from_raw_managed`); nothing wgpu tracks is destroyed or changed.
        let made = unsafe {
            let Some(hal) = device.as_hal::<wgpu::hal::api::Vulkan>() else { return Ok(None) };
            let raw = hal.raw_device();
            let instance = hal.shared_instance().raw_instance();
            let props = instance.get_physical_device_memory_properties(hal.raw_physical_device());
            let info = vk::BufferCreateInfo::default()
                .size(bytes)
                .usage(
                    vk::BufferUsageFlags::STORAGE_BUFFER
                        | vk::BufferUsageFlags::TRANSFER_SRC
                        | vk::BufferUsageFlags::TRANSFER_DST,
                )
                .sharing_mode(vk::SharingMode::EXCLUSIVE);
            let buffer = raw.create_buffer(&info, None).map_err(|e| format!("vkCreateBuffer of {bytes} bytes: {e}"))?;
            let req = raw.get_buffer_memory_requirements(buffer);
            let want = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let types = &props.memory_types[..props.memory_type_count as usize];
            let usable = |i: usize| req.memory_type_bits & (1 << i) != 0 && types[i].property_flags.contains(want);
            let rank = |i: usize| {
                let f = types[i].property_flags;
                let device_local = f.contains(vk::MemoryPropertyFlags::DEVICE_LOCAL);
                let cached = f.contains(vk::MemoryPropertyFlags::HOST_CACHED);
                match toward {
                    // System memory (not ReBAR, which is the GPU's), host-cached: the host reads it.
                    Toward::Host => (device_local, !cached),
                    // The GPU's memory seen through the BAR: the GPU's L2 sees every write to it.
                    Toward::Gpu => (!device_local, cached),
                }
            };
            let Some(type_index) = (0..types.len()).filter(|&i| usable(i)).min_by_key(|&i| rank(i)) else {
                raw.destroy_buffer(buffer, None);
                return Ok(None);
            };
            let alloc =
                vk::MemoryAllocateInfo::default().allocation_size(req.size).memory_type_index(type_index as u32);
            let memory = match raw.allocate_memory(&alloc, None) {
                Ok(m) => m,
                Err(e) => {
                    raw.destroy_buffer(buffer, None);
                    return Err(format!("vkAllocateMemory of {} bytes: {e}", req.size));
                }
            };
            // Which of allocating and mapping takes the time (NVIDIA: ~78 ms for 340 MB in all).
            super::trace::mark("host memory allocated", None);
            let mapped = raw
                .bind_buffer_memory(buffer, memory, 0)
                .and_then(|()| raw.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()));
            let ptr = match mapped {
                Ok(p) => p,
                Err(e) => {
                    raw.destroy_buffer(buffer, None);
                    raw.free_memory(memory, None);
                    return Err(format!("binding or mapping {} bytes of host memory: {e}", req.size));
                }
            };
            let hal_buffer = wgpu::hal::vulkan::Buffer::from_raw_managed(buffer, memory, 0, req.size);
            let desc = wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            };
            drop(hal);
            let wrapped = device.create_buffer_from_hal::<wgpu::hal::api::Vulkan>(hal_buffer, &desc);
            (wrapped, ptr.cast::<u8>())
        };
        let (buffer, ptr) = made;
        let ptr = std::ptr::NonNull::new(ptr).ok_or("vkMapMemory returned a null pointer")?;
        Ok(Some(MappedHostBuffer { buffer, ptr }))
    }
}

/// A buffer in host-visible memory mapped for its whole life (see the module docs).
pub(crate) struct Mailbox {
    /// The GPU's view of the mapping; `None` for a mailbox in plain host memory (unit tests of
    /// the host side, `in_host_memory`).
    buffer: Option<wgpu::Buffer>,
    /// The mapping's first word.
    words: std::ptr::NonNull<AtomicU32>,
    len: usize,
    /// The words of a mailbox in plain host memory, which `words` points into.
    #[cfg(test)]
    _host: Option<Box<[AtomicU32]>>,
}

// SAFETY: the mapping is plain host memory that stays valid while `buffer` lives (wgpu-hal frees
// the memory only when the buffer is destroyed, which `buffer`'s drop starts after every
// submission using it finished), or while `_host` does, and every access goes through
// `AtomicU32`, so sharing it between threads is as sound as sharing a `[AtomicU32]`.
unsafe impl Send for Mailbox {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mailbox {}

impl std::fmt::Debug for Mailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailbox").field("words", &self.len).finish()
    }
}

impl Mailbox {
    /// A mailbox of `words` 32-bit words, zeroed; `Ok(None)` when the device is not Vulkan or
    /// has no host-visible coherent memory outside the GPU.
    ///
    /// # Errors
    /// A Vulkan call failed (out of memory, usually).
    pub(crate) fn new(device: &wgpu::Device, words: usize, toward: Toward) -> Result<Option<Mailbox>, String> {
        let bytes = (4 * words.max(4) as u64).next_multiple_of(256);
        let Some(mapped) = MappedHostBuffer::new(device, bytes, toward, "host mailbox")? else { return Ok(None) };
        // SAFETY: the mapping is `bytes` long and nothing else writes it yet.
        unsafe { std::ptr::write_bytes(mapped.ptr.as_ptr(), 0, bytes as usize) };
        Ok(Some(Mailbox {
            words: mapped.ptr.cast::<AtomicU32>(),
            buffer: Some(mapped.buffer),
            len: (bytes / 4) as usize,
            #[cfg(test)]
            _host: None,
        }))
    }

    /// A mailbox of `words` zeroed words in plain host memory, with no GPU buffer: for tests of
    /// the host side, where a thread plays the GPU.
    #[cfg(test)]
    pub(crate) fn in_host_memory(words: usize) -> Mailbox {
        let host: Box<[AtomicU32]> = (0..words.max(1)).map(|_| AtomicU32::new(0)).collect();
        let words_ptr = std::ptr::NonNull::from(&host[0]);
        Mailbox { buffer: None, words: words_ptr, len: words, _host: Some(host) }
    }

    /// The buffer, to bind or copy into.
    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("a mailbox made by `Mailbox::new` (host-memory ones exist only in unit tests)")
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.len, "mailbox word {i} of {}", self.len);
        // SAFETY: `i` is within the mapping, which lives as long as `self` (see `Send`).
        unsafe { &*self.words.as_ptr().add(i) }
    }

    /// Word `i` as the GPU last wrote it (acquire: reads after it see what was written before).
    pub(crate) fn load(&self, i: usize) -> u32 {
        self.word(i).load(Ordering::Acquire)
    }

    /// Writes word `i` after everything written before it is out (a flag for data).
    pub(crate) fn store(&self, i: usize, v: u32) {
        store_fence();
        self.word(i).store(v, Ordering::Release);
    }

    /// Words `at..at + out.len()` into `out`.
    pub(crate) fn read(&self, at: usize, out: &mut [u32]) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.word(at + k).load(Ordering::Relaxed);
        }
    }

    /// Writes `data` at word `at` (no ordering: a later [`store`](Self::store) of a flag orders it).
    pub(crate) fn write(&self, at: usize, data: &[u32]) {
        for (k, &v) in data.iter().enumerate() {
            self.word(at + k).store(v, Ordering::Relaxed);
        }
    }

    /// Spins until word `i` equals `want` or `timeout` passes; the value last seen on timeout.
    pub(crate) fn wait_for(&self, i: usize, want: u32, timeout: std::time::Duration) -> Result<(), u32> {
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            let v = self.load(i);
            if v == want {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && start.elapsed() > timeout {
                return Err(v);
            }
            std::hint::spin_loop();
        }
    }
}

/// Orders the host's earlier stores before its later ones as a device sees them: x86 keeps
/// ordinary stores in order, but not stores to write-combined memory, which a driver may give
/// host-visible memory; `sfence` drains them.
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE, part of x86-64's baseline).
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(Ordering::SeqCst);
}
