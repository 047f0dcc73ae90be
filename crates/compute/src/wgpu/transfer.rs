//! A second Vulkan queue on wgpu's device, from a transfer-only queue family (the GPU's copy
//! engines), for copies that must run beside the compute queue rather than in line with it.
//!
//! Why: wgpu gives a device one queue, and on it a copy recorded between two dependent compute
//! dispatches waits for the first and holds up the second (a pipeline barrier waits for all
//! earlier work). The split miss mode (experts/split.rs) leaves the host's RAM and the PCIe link
//! idle for ~80-100 us a layer while the GPU runs the chain of small kernels from one layer's
//! experts to the next layer's routing; copies on the compute queue there were measured to cost
//! the link time they saved (fifteenth session). On a queue of their own, served by the copy
//! engines, they overlap that chain (`split::prefetch`).
//!
//! How: [`open_device`] opens the device through wgpu-hal's `open_with_callback`, adding one
//! queue of a family that has `TRANSFER` and neither `GRAPHICS` nor `COMPUTE` (NVIDIA exposes
//! one), then hands the device to wgpu (`create_device_from_hal`). [`TransferQueue::copy_then_tag`]
//! records raw `vkCmdCopyBuffer`s between wgpu's buffers and then `vkCmdUpdateBuffer`s of tag
//! words, ordered after the copies by a barrier, and submits them with a fence of a small ring.
//! Consumers on the compute queue poll the tags (atomically, in kernels) and read a copy's
//! destination only once its tag says it landed; they never wait for it.
//!
//! What is outside Vulkan's promises: no semaphore orders the two queues, and the buffers are
//! exclusive to wgpu's queue family (no ownership transfer is recorded). For buffers, NVIDIA's
//! driver keeps no per-family state, and a tag written after a barrier on the copy queue is seen
//! by a kernel only after the bytes it announces (both go through the GPU's L2). Consumers must
//! be correct whatever a tag reads (the split reads the same bytes from host memory instead).
//! The queue is opened only when something asks for it ([`wanted`]); otherwise, or with
//! `DISKFORMER_TRANSFER_QUEUE=0`, the device opens without it ([`open_device`] may still add
//! the host-import extension).

use ash::vk;
use std::sync::Mutex;

/// Command buffers (and fences) in the ring: a submission waits for nothing, so a ring slot
/// whose fence is still unsignalled is skipped (the copies are an optimization).
const RING: usize = 16;

/// The transfer queue and the means to record and submit on it.
pub(crate) struct TransferQueue {
    /// Keeps wgpu's device (and so the raw device below) alive while this lives.
    _device: wgpu::Device,
    raw: ash::Device,
    queue: vk::Queue,
    /// The queue family's index, for the `--stats` line.
    pub(crate) family: u32,
    ring: Mutex<Ring>,
}

struct Ring {
    pool: vk::CommandPool,
    buffers: Vec<vk::CommandBuffer>,
    fences: Vec<vk::Fence>,
    next: usize,
}

impl std::fmt::Debug for TransferQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferQueue").field("family", &self.family).finish()
    }
}

/// One buffer-to-buffer copy, in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyRegion {
    pub(crate) src_offset: u64,
    pub(crate) dst_offset: u64,
    pub(crate) size: u64,
}

/// The raw Vulkan buffer behind a wgpu buffer (`None` off Vulkan).
pub(crate) fn raw_buffer(buffer: &wgpu::Buffer) -> Option<vk::Buffer> {
    // SAFETY: only the handle is read; the buffer stays owned and tracked by wgpu.
    unsafe { buffer.as_hal::<wgpu::hal::api::Vulkan>().map(|b| b.raw_handle()) }
}

/// The index of a queue family with `TRANSFER` and neither `GRAPHICS` nor `COMPUTE`.
fn transfer_family(families: &[vk::QueueFamilyProperties]) -> Option<u32> {
    families
        .iter()
        .position(|f| {
            f.queue_count > 0
                && f.queue_flags.contains(vk::QueueFlags::TRANSFER)
                && !f.queue_flags.intersects(vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE)
        })
        .map(|i| i as u32)
}

/// Whether to open the device with a transfer queue: when something asks for one (the split's
/// prefetch, `DISKFORMER_SPLIT_PREFETCH` above 0, or its copy-queue replacements,
/// `DISKFORMER_SPLIT_COPY_REFILLS=1`; both off by default, measured no faster on the H200), or
/// `DISKFORMER_TRANSFER_QUEUE=1` (its device test); never with `DISKFORMER_TRANSFER_QUEUE=0`.
/// Otherwise the device has no second queue.
fn wanted() -> bool {
    let var = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string());
    match var("DISKFORMER_TRANSFER_QUEUE").as_deref() {
        Some("0") => false,
        Some("1") => true,
        _ => {
            var("DISKFORMER_SPLIT_PREFETCH").and_then(|v| v.parse::<usize>().ok()).is_some_and(|n| n > 0)
                || var("DISKFORMER_SPLIT_COPY_REFILLS").as_deref() == Some("1")
        }
    }
}

/// A device opened through [`open_device`], with what it was opened with.
pub(crate) struct OpenedDevice {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    /// The second queue, where something asked for it ([`wanted`]) and the adapter has a
    /// transfer-only family.
    pub(crate) transfer: Option<TransferQueue>,
    /// `VK_EXT_external_memory_host`, where the adapter can import host memory into storage
    /// buffers (the expert tier's host copies, host_import.rs).
    pub(crate) host_import: Option<super::host_import::HostImport>,
}

/// Opens `adapter` as `request_device` would, plus what diskformer's raw Vulkan paths use where
/// the adapter is a Vulkan one offering it: a transfer queue (see the module docs) and the
/// extension that imports host memory (host_import.rs). `None` when it offers neither, when
/// it is not Vulkan, or when opening that way failed (the caller then opens the device as
/// before). An extension added changes nothing else: wgpu-hal's own `open` is
/// `open_with_callback` without a callback.
pub(crate) fn open_device(adapter: &wgpu::Adapter, desc: &wgpu::DeviceDescriptor<'_>) -> Option<OpenedDevice> {
    static PRIORITY: [f32; 1] = [1.0];
    // SAFETY: the device is opened from this adapter with the features and limits the
    // descriptor asks for (what `request_device` does), the callback only adds a queue create
    // info of a family the adapter reports and an extension it reports, and the opened device
    // goes to `create_device_from_hal` of the same adapter. The queue handle is taken from the
    // raw device before wgpu owns it; wgpu never touches that family.
    unsafe {
        let (open, family, import) = {
            let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
            let shared = hal.shared_instance();
            let instance = shared.raw_instance();
            let physical = hal.raw_physical_device();
            let family = if wanted() {
                transfer_family(&instance.get_physical_device_queue_family_properties(physical))
            } else {
                None
            };
            let extension = ash::ext::external_memory_host::NAME;
            let alignment = super::host_import::import_alignment(
                instance,
                shared.instance_api_version(),
                physical,
                hal.physical_device_capabilities().supports_extension(extension),
            );
            if family.is_none() && alignment.is_none() {
                return None;
            }
            let open = hal
                .open_with_callback(
                    desc.required_features,
                    &desc.required_limits,
                    &desc.memory_hints,
                    Some(Box::new(move |args: wgpu::hal::vulkan::CreateDeviceCallbackArgs<'_, '_, '_>| {
                        if let Some(family) = family {
                            args.queue_create_infos.push(
                                vk::DeviceQueueCreateInfo::default()
                                    .queue_family_index(family)
                                    .queue_priorities(&PRIORITY),
                            );
                        }
                        if alignment.is_some() && !args.extensions.contains(&extension) {
                            args.extensions.push(extension);
                        }
                    })),
                )
                .ok()?;
            let import =
                alignment.map(|a| super::host_import::HostImport::new(instance, physical, open.device.raw_device(), a));
            (open, family, import)
        };
        let raw = open.device.raw_device().clone();
        let (device, queue) = adapter.create_device_from_hal(open, desc).ok()?;
        let transfer = match family {
            Some(family) => {
                let transfer_queue = raw.get_device_queue(family, 0);
                let ring = Ring::new(&raw, family).ok()?;
                Some(TransferQueue {
                    _device: device.clone(),
                    raw,
                    queue: transfer_queue,
                    family,
                    ring: Mutex::new(ring),
                })
            }
            None => None,
        };
        Some(OpenedDevice { device, queue, transfer, host_import: import })
    }
}

impl Ring {
    /// # Safety
    /// `raw` is a live device with a queue of `family`.
    unsafe fn new(raw: &ash::Device, family: u32) -> Result<Ring, vk::Result> {
        // SAFETY: plain object creation on a live device (the caller's promise).
        unsafe {
            let pool = raw.create_command_pool(
                &vk::CommandPoolCreateInfo::default()
                    .queue_family_index(family)
                    .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                None,
            )?;
            let buffers = raw.allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default()
                    .command_pool(pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(RING as u32),
            )?;
            let mut fences = Vec::with_capacity(RING);
            for _ in 0..RING {
                fences.push(
                    raw.create_fence(&vk::FenceCreateInfo::default().flags(vk::FenceCreateFlags::SIGNALED), None)?,
                );
            }
            Ok(Ring { pool, buffers, fences, next: 0 })
        }
    }
}

impl TransferQueue {
    /// Submits `copies` from `src` to `dst`, then writes each `(word offset in bytes, value)` of
    /// `tags` into `tag_buffer`, after the copies (and after every copy submitted before).
    /// Returns the submission's place in the ring (for [`Self::done`]), or `None`, submitting
    /// nothing, when the ring's next command buffer is still in flight or a Vulkan call failed:
    /// the caller's consumers then never see the tags.
    ///
    /// The buffers must be wgpu buffers of this device that outlive the submission (the expert
    /// tier's pool, host copies and tag buffer live as long as the tier, whose drop waits for
    /// this queue); `src` with `COPY_SRC`, `dst` and `tag_buffer` with `COPY_DST`.
    pub(crate) fn copy_then_tag(
        &self,
        src: vk::Buffer,
        dst: vk::Buffer,
        copies: &[CopyRegion],
        tag_buffer: vk::Buffer,
        tags: &[(u64, u32)],
    ) -> Option<usize> {
        let mut ring = match self.ring.lock() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        let i = ring.next;
        let (cb, fence) = (ring.buffers[i], ring.fences[i]);
        let regions: Vec<vk::BufferCopy> = copies
            .iter()
            .map(|c| vk::BufferCopy { src_offset: c.src_offset, dst_offset: c.dst_offset, size: c.size })
            .collect();
        let transfer_barrier = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_WRITE | vk::AccessFlags::TRANSFER_READ)];
        // SAFETY: the command buffer and fence belong to this ring, used under its lock; the
        // fence is signalled (checked first), so the command buffer is not pending and may be
        // reset. The buffers are live wgpu buffers of this device with the usages the copies
        // need (the caller's promise); the queue is this device's and submitted to only here,
        // under the lock.
        unsafe {
            if self.raw.get_fence_status(fence) != Ok(true) {
                return None;
            }
            let recorded = (|| -> Result<(), vk::Result> {
                self.raw.reset_fences(&[fence])?;
                self.raw.reset_command_buffer(cb, vk::CommandBufferResetFlags::empty())?;
                self.raw.begin_command_buffer(
                    cb,
                    &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )?;
                let barrier = || {
                    self.raw.cmd_pipeline_barrier(
                        cb,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::DependencyFlags::empty(),
                        &transfer_barrier,
                        &[],
                        &[],
                    )
                };
                // After every copy submitted before (a destination reused two calls later).
                barrier();
                if !regions.is_empty() {
                    self.raw.cmd_copy_buffer(cb, src, dst, &regions);
                }
                // The tags only after the bytes they announce.
                barrier();
                for &(at, value) in tags {
                    self.raw.cmd_update_buffer(cb, tag_buffer, at, &value.to_le_bytes());
                }
                self.raw.end_command_buffer(cb)?;
                let cbs = [cb];
                self.raw.queue_submit(self.queue, &[vk::SubmitInfo::default().command_buffers(&cbs)], fence)
            })();
            if recorded.is_err() {
                // The fence may be unsignalled with nothing submitted: signal it by an empty
                // submission so the slot is usable again (ignored if that fails too).
                let _ = self.raw.queue_submit(self.queue, &[], fence);
                return None;
            }
        }
        ring.next = (i + 1) % RING;
        Some(i)
    }

    /// Whether the submission at ring place `i` has run (until the ring comes round to it).
    pub(crate) fn done(&self, i: usize) -> bool {
        let ring = match self.ring.lock() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        // SAFETY: the fence belongs to this ring and lives as long as it.
        ring.fences.get(i).is_some_and(|&f| unsafe { self.raw.get_fence_status(f) } == Ok(true))
    }

    /// Waits until everything submitted here has run.
    pub(crate) fn wait_idle(&self) {
        let _guard = self.ring.lock();
        // SAFETY: the queue is submitted to only under the ring's lock, held here.
        unsafe {
            let _ = self.raw.queue_wait_idle(self.queue);
        }
    }
}

impl Drop for TransferQueue {
    fn drop(&mut self) {
        self.wait_idle();
        let ring = match self.ring.get_mut() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        // SAFETY: the queue is idle, so no command buffer or fence of the ring is in use; the
        // device is alive (`_device` is dropped after this).
        unsafe {
            for &f in &ring.fences {
                self.raw.destroy_fence(f, None);
            }
            self.raw.destroy_command_pool(ring.pool, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transfer_family_has_transfer_and_no_graphics_or_compute() {
        let f = |flags: vk::QueueFlags, n: u32| vk::QueueFamilyProperties {
            queue_flags: flags,
            queue_count: n,
            ..Default::default()
        };
        let all = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE | vk::QueueFlags::TRANSFER;
        assert_eq!(transfer_family(&[f(all, 16)]), None);
        assert_eq!(transfer_family(&[f(all, 16), f(vk::QueueFlags::TRANSFER, 2)]), Some(1));
        assert_eq!(
            transfer_family(&[f(all, 16), f(vk::QueueFlags::TRANSFER, 0), f(vk::QueueFlags::TRANSFER, 1)]),
            Some(2)
        );
        assert_eq!(transfer_family(&[f(vk::QueueFlags::COMPUTE | vk::QueueFlags::TRANSFER, 8)]), None);
    }

    /// On a device with a transfer-only family, run with `DISKFORMER_TRANSFER_QUEUE=1` (the
    /// H200, where it passed; lavapipe has one queue family with one queue, so there, as
    /// without the variable, it prints "skipped"): regions copied between two wgpu buffers land
    /// where asked and nowhere else, the tags hold their values once the fence says done, and
    /// a later submission's barrier orders it after the earlier one (the same region copied
    /// over, then read back).
    #[test]
    fn copies_land_and_the_tags_follow_them() {
        use crate::wgpu::{le_u32s, WgpuBackend, WgpuOptions};
        let Ok(g) = WgpuBackend::new(WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let Some(q) = g.ctx.transfer.clone() else {
            eprintln!("no transfer-only queue family on {}: skipped", g.ctx.adapter.name);
            return;
        };
        let words = 1 << 20;
        let src_a: Vec<u32> = (0..words as u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let src_b: Vec<u32> = (0..words as u32).map(|i| !i).collect();
        let upload = |label, w: &[u32]| g.upload(label, bytemuck::cast_slice(w)).unwrap();
        let (a, b) = (upload("test src a", &src_a), upload("test src b", &src_b));
        let dst = upload("test dst", &vec![7u32; words]);
        let tags = upload("test tags", &[0u32; 64]);
        g.sync();
        let raw = |buf: &wgpu::Buffer| raw_buffer(buf).unwrap();
        let region = |from: usize, to: usize, n: usize| CopyRegion {
            src_offset: 4 * from as u64,
            dst_offset: 4 * to as u64,
            size: 4 * n as u64,
        };
        // a: two regions; then b over the first of them.
        let first = q
            .copy_then_tag(
                raw(&a.buffer),
                raw(&dst.buffer),
                &[region(0, 1000, 5000), region(300_000, 600_000, 70_000)],
                raw(&tags.buffer),
                &[(4 * 3, 11)],
            )
            .unwrap();
        let second = q
            .copy_then_tag(
                raw(&b.buffer),
                raw(&dst.buffer),
                &[region(10, 1000, 100)],
                raw(&tags.buffer),
                &[(4 * 5, 22), (4 * 6, 33)],
            )
            .unwrap();
        let t0 = std::time::Instant::now();
        while !(q.done(first) && q.done(second)) {
            assert!(t0.elapsed().as_secs() < 10, "copies not done in 10 s");
        }
        let mut want = vec![7u32; words];
        want[1000..6000].copy_from_slice(&src_a[..5000]);
        want[600_000..670_000].copy_from_slice(&src_a[300_000..370_000]);
        want[1000..1100].copy_from_slice(&src_b[10..110]);
        let got = le_u32s(&g.read_back(&dst.buffer, 4 * words as u64).unwrap());
        assert!(got == want, "copied words differ");
        let t = le_u32s(&g.read_back(&tags.buffer, 256).unwrap());
        assert_eq!((t[3], t[5], t[6], t[4]), (11, 22, 33, 0));
    }
}
