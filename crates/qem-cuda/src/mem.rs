//! Raw device and pinned host buffers with explicit ownership, for the load pipeline.
//!
//! The pipeline orders its work with its own streams and events, so these buffers bypass
//! cudarc's per-slice event tracking: they are plain `cuMemAlloc`/`cuMemHostAlloc` allocations
//! freed on drop (after the owner has synchronized). Every allocation is counted in a
//! [`MemCounter`] so the process-allocated peak can be reported.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use qem_core::{Error, Result};

use crate::device::driver_error;

/// Current and peak bytes of device memory one operation has allocated.
#[derive(Debug, Default)]
pub struct MemCounter {
    current: AtomicU64,
    peak: AtomicU64,
}

impl MemCounter {
    fn add(&self, n: u64) {
        let now = self.current.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, n: u64) {
        self.current.fetch_sub(n, Ordering::Relaxed);
    }
    /// Bytes allocated now.
    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }
    /// Largest number of bytes allocated at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

/// The size [`STAGING`] is first allocated with.
const STAGING_BYTES: usize = 16 << 20;
/// The most [`STAGING`] grows to for one batch of [`fetch_all`].
const STAGING_MAX_BYTES: usize = 256 << 20;

/// The pinned host buffer through which batches of copies are queued on a stream and waited
/// for once ([`fetch_all`], the iDPC): only pinned memory makes a copy asynchronous. (Single
/// synchronous reads through it measured no faster than pageable ones, run 15: the cost was the
/// round trip per copy, not the DMA.) The host side of each copy is split over the cores.
static STAGING: Mutex<Option<PinnedBuf>> = Mutex::new(None);

/// `dst.copy_from_slice(src)` in 1 MiB pieces over the rayon pool.
pub(crate) fn par_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 20;
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Write one byte of each 4 KiB page of `dst`, in parallel. A fresh `vec![0; n]` is mapped by
/// the OS page by page on first write: copied into straight away, a 10 MB result took ~4 ms of
/// page faults against 0.4 ms for touched pages (measured on the 2-core VM, `dpc.rs`), so
/// [`fetch_all`] touches the destinations while the card's copies run. The bytes written are
/// overwritten by the copy.
fn pre_touch(dst: &mut [u8]) {
    use rayon::prelude::*;
    const PAGE: usize = 4096;
    if dst.len() >= 16 * PAGE {
        dst.par_chunks_mut(16 * PAGE).for_each(|c| {
            for p in c.chunks_mut(PAGE) {
                p[0] = 0;
            }
        });
    }
}

/// Run `f` with the staging buffer, at least `min_bytes` long (allocated on first use in `ctx`,
/// or again when an earlier one is smaller or belongs to another context). `None` when it
/// cannot be had: the caller copies directly.
pub(crate) fn with_staging<R>(
    ctx: &Arc<CudaContext>,
    min_bytes: usize,
    f: impl FnOnce(&mut PinnedBuf) -> Result<R>,
) -> Option<Result<R>> {
    let mut g = STAGING.lock().ok()?;
    if g.as_ref()
        .is_none_or(|b| !Arc::ptr_eq(&b.ctx, ctx) || b.bytes < min_bytes)
    {
        *g = None;
        let bytes = min_bytes.max(STAGING_BYTES);
        *g = Some(PinnedBuf::alloc(ctx, bytes, "staging buffer").ok()?);
    }
    g.as_mut().map(f)
}

/// One device→host copy of [`fetch_all`]: `dst.len()` bytes of `src` from byte `offset`.
pub(crate) struct Fetch<'a> {
    pub src: &'a DevBuf,
    pub offset: usize,
    pub dst: &'a mut [u8],
}

/// Wait for the work queued on `stream` and bring every fetch to the host, with one wait: the
/// copies are queued on `stream` into the pinned staging buffer and the stream synchronised
/// once (each synchronous copy is a round trip through the driver: run 15 measured ~2 ms for
/// four 2 MB reads through the staging buffer one at a time). Falls back to one synchronous read
/// per fetch when the batch does not fit [`STAGING_MAX_BYTES`].
pub(crate) fn fetch_all(
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    fetches: &mut [Fetch<'_>],
) -> Result<()> {
    const ALIGN: usize = 256;
    for f in fetches.iter() {
        if !range_fits(f.offset, f.dst.len(), f.src.bytes) {
            return Err(Error::internal(
                "download",
                "read past the end of a device buffer",
            ));
        }
    }
    let total: usize = fetches
        .iter()
        .map(|f| f.dst.len().next_multiple_of(ALIGN))
        .sum();
    if total > 0 && total <= STAGING_MAX_BYTES {
        let staged = with_staging(ctx, total, |pin| {
            queue_then_wait(stream, "synchronize downloads", || {
                let mut at = 0usize;
                for f in fetches.iter() {
                    pin.copy_range_from_device_async(at, f.src, f.offset, f.dst.len(), stream)?;
                    at += f.dst.len().next_multiple_of(ALIGN);
                }
                // While the card copies: map the destinations' pages.
                for f in fetches.iter_mut() {
                    pre_touch(f.dst);
                }
                Ok(())
            })?;
            let mut at = 0usize;
            for f in fetches.iter_mut() {
                let n = f.dst.len();
                par_copy(f.dst, &pin.as_slice()[at..at + n]);
                at += n.next_multiple_of(ALIGN);
            }
            Ok(())
        });
        if let Some(r) = staged {
            return r;
        }
    }
    stream
        .synchronize()
        .map_err(|e| driver_error("synchronize downloads", e))?;
    for f in fetches.iter_mut() {
        f.src.read(f.offset, f.dst)?;
    }
    Ok(())
}

/// Run `queue` (which queues work on `stream`), then synchronize `stream` whatever `queue`
/// returned: also after a failure no queued copy may still use a staging buffer once it is
/// released. The queueing error comes first, then the synchronize error (named `what`).
pub(crate) fn queue_then_wait(
    stream: &CudaStream,
    what: &str,
    queue: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let queued = queue();
    let waited = stream.synchronize().map_err(|e| driver_error(what, e));
    queued?;
    waited
}

/// Whether `offset .. offset + bytes` lies inside a buffer of `len` bytes.
fn range_fits(offset: usize, bytes: usize, len: usize) -> bool {
    offset.checked_add(bytes).is_some_and(|end| end <= len)
}

/// One device allocation (freed on drop).
#[derive(Debug)]
pub struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
    counter: Option<Arc<MemCounter>>,
}

impl DevBuf {
    /// Allocate `bytes` (at least 256) of device memory in `ctx`, counted in `counter`.
    pub fn alloc(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        counter: Option<&Arc<MemCounter>>,
        what: &str,
    ) -> Result<DevBuf> {
        let bytes = bytes.max(256);
        ctx.bind_to_thread()
            .map_err(|e| driver_error("bind CUDA context", e))?;
        // SAFETY: the context is current on this thread; the result is an owned allocation of
        // `bytes` bytes released exactly once in `Drop`.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| driver_error(&format!("allocate {what} ({bytes} bytes)"), e))?;
        if let Some(c) = counter {
            c.add(bytes as u64);
        }
        Ok(DevBuf {
            ctx: ctx.clone(),
            ptr,
            bytes,
            counter: counter.cloned(),
        })
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Before a synchronous copy `op` of `bytes` bytes at byte `offset`: an error (`what` of a
    /// device buffer) when the range leaves this buffer, else bind the context to this thread
    /// and say whether there is anything to copy.
    fn sync_copy_to_do(&self, offset: usize, bytes: usize, op: &str, what: &str) -> Result<bool> {
        if !range_fits(offset, bytes, self.bytes) {
            return Err(Error::internal(op, format!("{what} of a device buffer")));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("bind CUDA context", e))?;
        Ok(bytes > 0)
    }

    /// Copy `dst.len()` bytes starting at byte `offset` to the host (synchronous).
    ///
    /// The copy runs on the legacy stream, which does not wait for this crate's non-blocking
    /// streams: the caller must first synchronize every stream whose queued work writes the
    /// range.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if !self.sync_copy_to_do(offset, dst.len(), "download", "read past the end")? {
            return Ok(());
        }
        // SAFETY: the source range lies inside this allocation (checked above) and `dst` is a
        // valid host slice of the same length; the copy is synchronous.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }
            .map_err(|e| driver_error("download from the GPU", e))
    }

    /// Copy `src` to byte `offset` (synchronous).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        if !self.sync_copy_to_do(offset, src.len(), "upload", "write past the end")? {
            return Ok(());
        }
        // SAFETY: the destination range lies inside this allocation (checked above).
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }
            .map_err(|e| driver_error("upload to the GPU", e))?;
        // A "synchronous" copy from pageable memory returns once the bytes are staged, with
        // the DMA still queued on the legacy stream, and every stream of this crate is
        // non-blocking (cudarc's `new_stream`), so a kernel launched next on one of them may
        // read the buffer before the copy lands (issue 17: a BF mask upload raced its kernel,
        // which read stale classes from a freed DENSE load's memory and faulted; the H200 A/B
        // is `repro_before_fix` in bench/results/h100_reliability.json). Waiting for the legacy stream makes
        // `write` what its name says.
        // SAFETY: the null stream is the context's legacy stream; the context is current.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }
            .map_err(|e| driver_error("wait for an upload to the GPU", e))
    }

    /// Set every byte to zero (synchronous, like [`DevBuf::write`]: the memset runs on the
    /// legacy stream, which this crate's non-blocking streams do not wait for, so it is waited
    /// for here). No host buffer of zeros and no copy: a `write` of zeros staged `bytes` of
    /// host memory first.
    pub fn zero(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("bind CUDA context", e))?;
        // SAFETY: the range is this whole allocation; the context is current.
        unsafe { result::memset_d8_sync(self.ptr, 0, self.bytes) }
            .map_err(|e| driver_error("zero a device buffer", e))?;
        // SAFETY: the null stream is the context's legacy stream; the context is current.
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }
            .map_err(|e| driver_error("wait for a device memset", e))
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` is our allocation, freed once; owners synchronize their streams before
        // dropping buffers that queued work may still use.
        let _ = unsafe { result::free_sync(self.ptr) };
        if let Some(c) = &self.counter {
            c.sub(self.bytes as u64);
        }
    }
}

/// A new device buffer holding `v` (counted in `counter`).
pub(crate) fn upload<T: bytemuck::Pod>(
    ctx: &Arc<CudaContext>,
    v: &[T],
    counter: Option<&Arc<MemCounter>>,
    what: &str,
) -> Result<DevBuf> {
    let bytes: &[u8] = bytemuck::cast_slice(v);
    let b = DevBuf::alloc(ctx, bytes.len(), counter, what)?;
    b.write(0, bytes)?;
    Ok(b)
}

/// The first `n` values of type `T` in `b`.
pub(crate) fn read_vec<T: bytemuck::Pod + Default + Clone>(b: &DevBuf, n: usize) -> Result<Vec<T>> {
    let mut v = vec![T::default(); n];
    b.read(0, bytemuck::cast_slice_mut(&mut v))?;
    Ok(v)
}

/// One page-locked host buffer (normal cached memory, not write-combined: the reader threads
/// write it and the host may read it back).
#[derive(Debug)]
pub struct PinnedBuf {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
    /// Where the pages came from (how they are given back).
    backing: Backing,
}

/// How a [`PinnedBuf`]'s pages were made.
#[derive(Debug)]
enum Backing {
    /// `cuMemHostAlloc` (freed with `cuMemFreeHost`).
    Driver,
    /// An anonymous mapping (`base`, `len` bytes, 2 MiB aligned inside it at `ptr`) advised
    /// into transparent huge pages, then `cuMemHostRegister`ed (unregistered and unmapped).
    #[cfg(target_os = "linux")]
    Mapped { base: *mut libc::c_void, len: usize },
}

/// Huge-page size the mapped buffers are aligned to and rounded up to.
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// `bytes` of page-locked memory from an anonymous mapping in transparent huge pages, or
/// `None` when the kernel or the driver refuses (the caller falls back to `cuMemHostAlloc`).
///
/// Why not `cuMemHostAlloc` alone: it locks 4 KiB pages one by one, and the first load of a
/// process page-locks its three ~87 MB slots; on the lent H100 host three such slots took
/// 83–96 ms through `cuMemHostAlloc`, 33–44 ms mapped in huge pages and registered, 65 ms
/// registered in 4 KiB pages (a one-off probe; `h100_startup.json` records the loads' share).
#[cfg(target_os = "linux")]
fn map_and_register(bytes: usize) -> Option<(*mut u8, usize, Backing)> {
    let len = bytes.next_multiple_of(HUGE_PAGE);
    let map_len = len + HUGE_PAGE;
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let aligned = (base as usize).next_multiple_of(HUGE_PAGE) as *mut libc::c_void;
    // SAFETY: `aligned .. aligned + len` lies inside the mapping (at most HUGE_PAGE - 1 bytes
    // are skipped at its start). The advice is a hint: a kernel without THP keeps 4 KiB pages.
    unsafe { libc::madvise(aligned, len, libc::MADV_HUGEPAGE) };
    // SAFETY: the range is mapped, readable and writable, and stays mapped until Drop
    // unregisters it first; flags 0 = page-locked, used through the context's copies.
    let r = unsafe { sys::cuMemHostRegister_v2(aligned, len, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the mapping made above, not registered, unmapped once.
        unsafe { libc::munmap(base, map_len) };
        return None;
    }
    Some((
        aligned as *mut u8,
        len,
        Backing::Mapped { base, len: map_len },
    ))
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through `&mut self`
// (or disjoint sub-slices handed out from it), so moving it between threads is sound.
unsafe impl Send for PinnedBuf {}
// SAFETY: shared references only hand out `&[u8]` views.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// Allocate `bytes` (at least 256) of pinned host memory: on Linux, buffers of a huge page
    /// or more are mapped in huge pages and registered (`map_and_register`), the rest (and
    /// any the kernel or driver refuses there) come from `cuMemHostAlloc` with flags 0.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<PinnedBuf> {
        let bytes = bytes.max(256);
        ctx.bind_to_thread()
            .map_err(|e| driver_error("bind CUDA context", e))?;
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE {
            if let Some((ptr, bytes, backing)) = map_and_register(bytes) {
                return Ok(PinnedBuf {
                    ctx: ctx.clone(),
                    ptr,
                    bytes,
                    backing,
                });
            }
        }
        // SAFETY: flags 0 = portable-less, cached page-locked memory; freed once in Drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| driver_error(&format!("allocate pinned {what} ({bytes} bytes)"), e))?;
        if ptr.is_null() {
            return Err(Error::internal("allocate pinned memory", "null pointer"));
        }
        Ok(PinnedBuf {
            ctx: ctx.clone(),
            ptr: ptr as *mut u8,
            bytes,
            backing: Backing::Driver,
        })
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The whole buffer, mutable. The caller must have waited for every queued copy that reads
    /// it (the pipeline waits on the slot's H2D event first).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `bytes` bytes owned by `self`, and `&mut self`
        // guarantees no other host reference exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// The whole buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// Queue a copy of `bytes` bytes from byte `src_offset` of this buffer to byte
    /// `dst_offset` of `dst` on `stream`. The range must stay untouched until the copy is done.
    pub fn copy_range_to_device_async(
        &self,
        src_offset: usize,
        dst: &DevBuf,
        dst_offset: usize,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the buffer is page-locked and owned by `self`; the caller keeps it
        // untouched until the copy has completed.
        unsafe {
            h2d_range(
                self.ptr, self.bytes, src_offset, dst, dst_offset, bytes, stream,
            )
        }
    }

    /// Queue a copy of `bytes` bytes from byte `src_offset` of `src` to byte `dst_offset` of
    /// this buffer on `stream`; read it only after the stream has passed the copy.
    pub fn copy_range_from_device_async(
        &mut self,
        dst_offset: usize,
        src: &DevBuf,
        src_offset: usize,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        if !copy_to_do("D2H copy", self.bytes, dst_offset, src, src_offset, bytes)? {
            return Ok(());
        }
        // SAFETY: both ranges are inside their allocations (checked above); `&mut self` keeps
        // host readers away and the caller synchronises before reading.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.ptr.add(dst_offset) as *mut std::ffi::c_void,
                src.ptr + src_offset as u64,
                bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| driver_error("D2H copy", e))
    }

    /// Queue a copy of the first `bytes` bytes to device address `dst` on `stream`.
    ///
    /// The buffer must stay untouched until an event recorded after this call has completed.
    pub fn copy_to_device_async(
        &self,
        dst: &DevBuf,
        dst_offset: usize,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.copy_range_to_device_async(0, dst, dst_offset, bytes, stream)
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        match self.backing {
            Backing::Driver => {
                // SAFETY: our allocation, freed once; owners synchronize before dropping.
                let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
            }
            // SAFETY: registered and mapped by `map_and_register`, released once, in that
            // order; owners synchronize before dropping, so no copy still reads the pages.
            #[cfg(target_os = "linux")]
            Backing::Mapped { base, len } => unsafe {
                let _ = sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void);
                libc::munmap(base, len);
            },
        }
    }
}

/// Check a copy `op` of `bytes` bytes between byte `host_offset` of a host buffer of
/// `host_len` bytes and byte `dev_offset` of `dev`: an error when either range leaves its
/// buffer, else whether there is anything to copy.
fn copy_to_do(
    op: &str,
    host_len: usize,
    host_offset: usize,
    dev: &DevBuf,
    dev_offset: usize,
    bytes: usize,
) -> Result<bool> {
    if !range_fits(host_offset, bytes, host_len) || !range_fits(dev_offset, bytes, dev.bytes) {
        return Err(Error::internal(op, "copy out of bounds"));
    }
    Ok(bytes > 0)
}

/// Queue `bytes` bytes from byte `host_offset` of the host buffer `host .. host + host_len`
/// to byte `dst_offset` of `dst` on `stream` (both ranges checked; nothing for 0 bytes).
///
/// # Safety
/// `host .. host + host_len` must be one live host allocation, page-locked or registered, and
/// untouched until the stream has passed the copy.
unsafe fn h2d_range(
    host: *const u8,
    host_len: usize,
    host_offset: usize,
    dst: &DevBuf,
    dst_offset: usize,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    if !copy_to_do("H2D copy", host_len, host_offset, dst, dst_offset, bytes)? {
        return Ok(());
    }
    // SAFETY: both ranges lie inside their allocations (checked above); the host one is
    // page-locked or registered and untouched until the copy is done (the caller's contract).
    unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst.ptr + dst_offset as u64,
            host.add(host_offset) as *const std::ffi::c_void,
            bytes,
            stream.cu_stream(),
        )
    }
    .result()
    .map_err(|e| driver_error("H2D copy", e))
}

/// A host range this crate does not own, registered with the driver for DMA
/// (`cuMemHostRegister`) and unregistered on drop: e.g. a read-only mapping of a file, whose
/// pages are then copied to the card straight from the page cache (`read_probe` measures the
/// route against reads into [`PinnedBuf`] slots; the loader does not use it).
#[derive(Debug)]
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    ptr: *const u8,
    bytes: usize,
}

impl HostRegistration {
    /// Register `bytes` bytes at `ptr` (`read_only`: `CU_MEMHOSTREGISTER_READ_ONLY`, which a
    /// read-only mapping needs). The driver's refusal is the error.
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` must be mapped (and readable) until this value is dropped, and
    /// page-aligned as the driver requires.
    pub unsafe fn new(
        ctx: &Arc<CudaContext>,
        ptr: *const u8,
        bytes: usize,
        read_only: bool,
    ) -> Result<HostRegistration> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("bind CUDA context", e))?;
        let flags = if read_only {
            sys::CU_MEMHOSTREGISTER_READ_ONLY
        } else {
            0
        };
        // SAFETY: the caller keeps the range mapped until Drop unregisters it.
        unsafe { sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, bytes, flags) }
            .result()
            .map_err(|e| driver_error(&format!("register {bytes} host bytes"), e))?;
        Ok(HostRegistration {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Queue a copy of `bytes` bytes from byte `offset` of the range to byte `dst_offset` of
    /// `dst` on `stream`.
    pub fn copy_to_device_async(
        &self,
        offset: usize,
        dst: &DevBuf,
        dst_offset: usize,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: the range is registered and stays mapped while `self` lives (the contract of
        // `new`).
        unsafe { h2d_range(self.ptr, self.bytes, offset, dst, dst_offset, bytes, stream) }
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered once in `new`, unregistered once here.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}
