//! Host memory the process maps and fills itself, then lends to the GPU
//! (`VK_EXT_external_memory_host`): the expert tier's host copies.
//!
//! Why: the host tier of a split model is a copy of every expert in host memory the GPU can
//! read, made at each layer's first call (16 GB for the Qwen3-30B-A3B shape). Made by the
//! driver (`vkAllocateMemory` of host-visible memory), that took 72-117 ms per 340 MB layer on
//! the H200 (~4 GB/s, thirty-first session), one allocation at a time whatever the number of
//! threads asking, so the 48 layers took ~4 s in which the GPU idled and its clock fell
//! (docs/NOTES.md). Anonymous memory the process maps is made by the kernel at first touch, on
//! whichever thread touches it; the fill's threads touch it as they write the experts, so the
//! driver's part shrinks to pinning pages that already exist.
//!
//! How: [`HostImport`] is the extension's entry point on a device opened with it (`open.rs`).
//! [`PendingImport::new`] creates the buffer (declared importable) and maps anonymous pages for
//! it; the caller writes them through [`PendingImport::bytes_mut`]; [`PendingImport::finish`]
//! imports them (`VkImportMemoryHostPointerInfoEXT`), binds them and hands the buffer to wgpu
//! with a drop callback that destroys the buffer, frees the memory and only then unmaps the
//! pages: the specification requires the pages to outlive the memory object, and wgpu runs the
//! callback when it destroys the buffer, after the last submission using it finished.

use ash::vk;

const HANDLE: vk::ExternalMemoryHandleTypeFlags = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;

/// The usages the expert tier's host copies need (bound as storage, copied into the pool).
fn usage() -> vk::BufferUsageFlags {
    vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST
}

/// The extension's entry point and the device's import rules.
pub(crate) struct HostImport {
    fp: ash::ext::external_memory_host::Device,
    /// `minImportedHostPointerAlignment`: an imported range's start and size are multiples.
    alignment: u64,
    memory_types: Vec<vk::MemoryType>,
}

impl std::fmt::Debug for HostImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostImport").field("alignment", &self.alignment).finish()
    }
}

/// What an adapter offers for importing host memory into storage buffers, read before the
/// device is opened: the alignment, or `None` when it cannot.
///
/// # Safety
/// `instance` and `physical` are the adapter's live instance and physical device.
pub(crate) unsafe fn import_alignment(
    instance: &ash::Instance,
    instance_api_version: u32,
    physical: vk::PhysicalDevice,
    supports_extension: bool,
) -> Option<u64> {
    if !supports_extension || instance_api_version < vk::API_VERSION_1_1 {
        return None;
    }
    // SAFETY: queries on a live physical device (the caller's promise), through Vulkan 1.1
    // entry points the instance has (checked above).
    unsafe {
        let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
        let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut host);
        instance.get_physical_device_properties2(physical, &mut props);
        let alignment = host.min_imported_host_pointer_alignment;
        let info = vk::PhysicalDeviceExternalBufferInfo::default().usage(usage()).handle_type(HANDLE);
        let mut out = vk::ExternalBufferProperties::default();
        instance.get_physical_device_external_buffer_properties(physical, &info, &mut out);
        let importable = out
            .external_memory_properties
            .external_memory_features
            .contains(vk::ExternalMemoryFeatureFlags::IMPORTABLE);
        (importable && alignment > 0 && alignment.is_power_of_two()).then_some(alignment)
    }
}

impl HostImport {
    /// The entry point on `device`, opened with the extension.
    ///
    /// # Safety
    /// `device` was created from `physical` of `instance` with `VK_EXT_external_memory_host`
    /// enabled, and outlives the returned value's use.
    pub(crate) unsafe fn new(
        instance: &ash::Instance,
        physical: vk::PhysicalDevice,
        device: &ash::Device,
        alignment: u64,
    ) -> HostImport {
        // SAFETY: the caller's promise; loading entry points and reading properties only.
        unsafe {
            let props = instance.get_physical_device_memory_properties(physical);
            HostImport {
                fp: ash::ext::external_memory_host::Device::new(instance, device),
                alignment,
                memory_types: props.memory_types[..props.memory_type_count as usize].to_vec(),
            }
        }
    }
}

/// A buffer whose memory the caller is writing, not yet lent to the GPU.
pub(crate) struct PendingImport {
    /// Keeps the device (and `raw`) alive.
    device: wgpu::Device,
    raw: ash::Device,
    buffer: vk::Buffer,
    /// The caller's bytes (the buffer's size).
    bytes: usize,
    /// The pages, from `offset`: the buffer's memory requirement rounded up to the alignment
    /// (`None` once handed to the buffer's drop callback).
    pages: Option<memmap2::MmapMut>,
    offset: usize,
    import_bytes: u64,
}

// SAFETY: the Vulkan buffer handle is only used by the owner, and the pages are plain memory.
unsafe impl Send for PendingImport {}

impl PendingImport {
    /// A buffer of `bytes` and anonymous pages for it (zeroed by the kernel as they are
    /// first touched), on a Vulkan device opened with the extension (`import`).
    ///
    /// # Errors
    /// The device is not Vulkan, or a Vulkan call or the mapping failed, with its size.
    pub(crate) fn new(device: &wgpu::Device, import: &HostImport, bytes: u64) -> Result<PendingImport, String> {
        // SAFETY: the hal device only creates one buffer, which this value destroys or hands
        // to wgpu with its memory; nothing wgpu tracks is touched.
        let (raw, buffer, req) = unsafe {
            let hal = device.as_hal::<wgpu::hal::api::Vulkan>().ok_or("the device is not a Vulkan one")?;
            let raw = hal.raw_device().clone();
            let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(HANDLE);
            let info = vk::BufferCreateInfo::default()
                .size(bytes)
                .usage(usage())
                .sharing_mode(vk::SharingMode::EXCLUSIVE)
                .push_next(&mut external);
            let buffer = raw.create_buffer(&info, None).map_err(|e| format!("vkCreateBuffer of {bytes} bytes: {e}"))?;
            let req = raw.get_buffer_memory_requirements(buffer);
            (raw, buffer, req)
        };
        let align = import.alignment.max(req.alignment).max(4096);
        let import_bytes = req.size.next_multiple_of(align);
        // Over-mapped by one alignment where it is above the page size (mmap gives pages).
        let slack = if align > 4096 { align } else { 0 };
        let mapped = memmap2::MmapOptions::new().len((import_bytes + slack) as usize).map_anon();
        let pages = match mapped {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the buffer was made above and nothing uses it.
                unsafe { raw.destroy_buffer(buffer, None) };
                return Err(format!("mapping {import_bytes} bytes of anonymous memory: {e}"));
            }
        };
        // Larger pages: fewer faults while the fill writes, fewer for the driver to pin. Only a
        // hint (the kernel may have transparent huge pages off); `DISKFORMER_HOST_HUGEPAGES=0`
        // leaves it out, for comparisons.
        #[cfg(target_os = "linux")]
        if std::env::var("DISKFORMER_HOST_HUGEPAGES").map_or(true, |v| v.trim() != "0") {
            let _ = pages.advise(memmap2::Advice::HugePage);
        }
        let offset = (pages.as_ptr() as usize).next_multiple_of(align as usize) - pages.as_ptr() as usize;
        Ok(PendingImport {
            device: device.clone(),
            raw,
            buffer,
            bytes: bytes as usize,
            pages: Some(pages),
            offset,
            import_bytes,
        })
    }

    /// The buffer's bytes, to fill before [`Self::finish`].
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let (at, len) = (self.offset, self.bytes);
        match self.pages.as_mut() {
            Some(p) => &mut p[at..at + len],
            None => &mut [],
        }
    }

    /// Imports the pages, binds them to the buffer and hands it to wgpu (see the module docs).
    ///
    /// # Errors
    /// The driver refused the pages (no memory type for them, or the import failed).
    pub(crate) fn finish(mut self, import: &HostImport, label: &'static str) -> Result<wgpu::Buffer, String> {
        let buffer = std::mem::replace(&mut self.buffer, vk::Buffer::null());
        let Some(mut pages) = self.pages.take() else { return Err("the pages were already imported".into()) };
        let ptr = pages[self.offset..].as_mut_ptr().cast::<std::ffi::c_void>();
        // SAFETY: `ptr` is `import_bytes` of mapped memory aligned as the device asks (made
        // so in `new`), which the drop callback below keeps mapped until the memory is freed;
        // the buffer is this value's and unused.
        let memory = unsafe {
            let req = self.raw.get_buffer_memory_requirements(buffer);
            let mut host = vk::MemoryHostPointerPropertiesEXT::default();
            let got =
                (import.fp.fp().get_memory_host_pointer_properties_ext)(self.raw.handle(), HANDLE, ptr, &mut host);
            if got != vk::Result::SUCCESS {
                self.raw.destroy_buffer(buffer, None);
                return Err(format!("vkGetMemoryHostPointerPropertiesEXT of {} bytes: {got}", self.import_bytes));
            }
            let bits = req.memory_type_bits & host.memory_type_bits;
            // Memory the host caches first (the pages are the process's, cached whatever the
            // type says), never the GPU's own.
            let rank = |i: usize| {
                let f = import.memory_types[i].property_flags;
                (f.contains(vk::MemoryPropertyFlags::DEVICE_LOCAL), !f.contains(vk::MemoryPropertyFlags::HOST_CACHED))
            };
            let Some(type_index) =
                (0..import.memory_types.len()).filter(|&i| bits & (1 << i) != 0).min_by_key(|&i| rank(i))
            else {
                self.raw.destroy_buffer(buffer, None);
                return Err(format!(
                    "no memory type takes imported host memory for this buffer (buffer types {:#x}, host pointer types {:#x})",
                    req.memory_type_bits, host.memory_type_bits
                ));
            };
            let mut info = vk::ImportMemoryHostPointerInfoEXT::default().handle_type(HANDLE).host_pointer(ptr);
            let alloc = vk::MemoryAllocateInfo::default()
                .allocation_size(self.import_bytes)
                .memory_type_index(type_index as u32)
                .push_next(&mut info);
            let memory = match self.raw.allocate_memory(&alloc, None) {
                Ok(m) => m,
                Err(e) => {
                    self.raw.destroy_buffer(buffer, None);
                    return Err(format!(
                        "importing {} bytes of host memory (vkAllocateMemory): {e}",
                        self.import_bytes
                    ));
                }
            };
            if let Err(e) = self.raw.bind_buffer_memory(buffer, memory, 0) {
                self.raw.destroy_buffer(buffer, None);
                self.raw.free_memory(memory, None);
                return Err(format!("binding {} bytes of imported host memory: {e}", self.import_bytes));
            }
            memory
        };
        let raw = self.raw.clone();
        let free: wgpu::hal::DropCallback = Box::new(move || {
            // SAFETY: wgpu runs this once, when it destroys the buffer after the last
            // submission using it finished; the pages go only after the memory importing them.
            unsafe {
                raw.destroy_buffer(buffer, None);
                raw.free_memory(memory, None);
            }
            drop(pages);
        });
        let desc = wgpu::BufferDescriptor {
            label: Some(label),
            size: self.bytes as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        };
        // SAFETY: the buffer is bound to its memory and owned by the callback from here; wgpu
        // never maps it (external buffers cannot be mapped through wgpu).
        unsafe {
            let hal_buffer = wgpu::hal::vulkan::Buffer::from_raw_externally_owned(buffer, free);
            Ok(self.device.create_buffer_from_hal::<wgpu::hal::api::Vulkan>(hal_buffer, &desc))
        }
    }
}

impl Drop for PendingImport {
    fn drop(&mut self) {
        if self.buffer != vk::Buffer::null() {
            // SAFETY: a buffer never handed to wgpu (an error before `finish`, or in it before
            // the handle was taken); no submission uses it.
            unsafe { self.raw.destroy_buffer(self.buffer, None) };
        }
    }
}
