//! One page-aligned allocation shared by the threads that read experts into it and the threads
//! that compute from it; who may touch which bytes is decided by the pager's lock, not here.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Alignment of the slab and of every slot region: `O_DIRECT` needs buffers, offsets and lengths
/// aligned to the device's logical block (512 B or 4 KiB).
pub(crate) const ALIGN: usize = 4096;

/// A zeroed, [`ALIGN`]-aligned buffer of fixed size.
pub(crate) struct Slab {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the slab is plain bytes; the pager gives each byte range to one writer (a slot marked
// loading) or to readers (pinned slots), never both, under its mutex.
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Slab {
    /// Allocates `size_bytes` (at least one byte is allocated).
    pub(crate) fn new(size_bytes: usize) -> std::io::Result<Slab> {
        let layout = Layout::from_size_align(size_bytes.max(1), ALIGN)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("allocating {size_bytes} bytes"))
        })?;
        Ok(Slab { ptr, layout })
    }

    fn check(&self, at: usize, len: usize) {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.layout.size()),
            "slab range {at}+{len} out of bounds"
        );
    }

    /// Bytes `at..at + len` for reading.
    ///
    /// # Safety
    /// No one writes these bytes while the result lives.
    pub(crate) unsafe fn bytes(&self, at: usize, len: usize) -> &[u8] {
        self.check(at, len);
        // SAFETY: in bounds (checked), initialized (zeroed at allocation), no writer (caller).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(at), len) }
    }

    /// Bytes `at..at + len` for writing.
    ///
    /// # Safety
    /// No one else reads or writes these bytes while the result lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, at: usize, len: usize) -> &mut [u8] {
        self.check(at, len);
        // SAFETY: in bounds (checked), initialized, exclusive (caller).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(at), len) }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
