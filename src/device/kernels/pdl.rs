//! Programmatic dependent launch (Hopper and newer): a kernel launched with the
//! `PROGRAMMATIC_STREAM_SERIALIZATION` attribute may start while the kernel before it in the
//! stream is still running, once every block of that kernel has signalled
//! `griddepcontrol.launch_dependents` (`pdl_trigger()` in kernels/common.cuh); it then runs what
//! needs nothing from its predecessor (the projections fetch their weights) and waits at
//! `griddepcontrol.wait` (`pdl_wait()`) for the predecessor to finish and its writes to show.
//!
//! Why: a one-sequence decode step is ~180 short kernels in a row; with this, each may be
//! resident and fetching its weights while the one before it drains. CUDA graphs keep the edges
//! (stream capture records them as programmatic). Measured on an H100 (512 x 1 and 512 x 64,
//! default model, alternated runs) the effect is within run-to-run noise (±5%): the step is the
//! sum of the kernels' own latency chains, not of launch gaps (docs/ARCHITECTURE.md).
//!
//! cudarc's launch builder has no launch attributes, hence this small one: arguments are kept
//! as 8-byte words (a device pointer or a scalar in the low bytes) and passed to
//! `cuLaunchKernelEx`. Device pointers are taken without cudarc's event records, which kvq
//! turns off ([`crate::device::open_cuda`]). `KVQ_GPU_PDL=off` launches plainly (A/B runs); a driver
//! that refuses the attribute turns it off for the process.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::{
    result, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig,
};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether launches carry the attribute: unless `KVQ_GPU_PDL=off` (read once) or a launch with
/// it failed.
fn enabled() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| {
        matches!(
            std::env::var("KVQ_GPU_PDL").ok().as_deref().map(str::trim),
            Some("off" | "0")
        )
    });
    !off && !REFUSED.load(Ordering::Relaxed)
}

static REFUSED: AtomicBool = AtomicBool::new(false);

/// A kernel argument as the 8-byte word the launch passes by address.
pub(crate) trait Arg {
    fn word(&self, stream: &CudaStream) -> u64;
}

impl<T> Arg for CudaView<'_, T> {
    fn word(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> Arg for CudaSlice<T> {
    fn word(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl Arg for i32 {
    fn word(&self, _: &CudaStream) -> u64 {
        u64::from(*self as u32)
    }
}

impl Arg for u32 {
    fn word(&self, _: &CudaStream) -> u64 {
        u64::from(*self)
    }
}

impl Arg for f32 {
    fn word(&self, _: &CudaStream) -> u64 {
        u64::from(self.to_bits())
    }
}

/// A raw device pointer (0 for a null argument).
impl Arg for u64 {
    fn word(&self, _: &CudaStream) -> u64 {
        *self
    }
}

/// The arguments of one launch, in order.
pub(crate) struct Args<'a> {
    func: &'a CudaFunction,
    stream: &'a CudaStream,
    words: Vec<u64>,
}

impl<'a> Args<'a> {
    pub(super) fn new(func: &'a CudaFunction, stream: &'a CudaStream) -> Self {
        Args {
            func,
            stream,
            words: Vec::with_capacity(32),
        }
    }

    pub(crate) fn arg<A: Arg + ?Sized>(&mut self, a: &A) -> &mut Self {
        self.words.push(a.word(self.stream));
        self
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must be the kernel's, in its order and sizes (pointers 8 bytes, `int` /
    /// `float` / `unsigned` 4), and the buffers alive until the kernel has run; the kernel must
    /// call `pdl_wait()` before it touches what earlier kernels wrote.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> candle_core::Result<()> {
        let err = |e: result::DriverError| candle_core::Error::Msg(format!("kernel launch: {e}"));
        self.stream.context().bind_to_thread().map_err(err)?;
        let mut params: Vec<*mut c_void> = self
            .words
            .iter_mut()
            .map(|w| (w as *mut u64).cast::<c_void>())
            .collect();
        if enabled() {
            // SAFETY: zero is a valid value of this plain C struct/union.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: the caller vouches for the arguments; `params` and `attr` outlive the call.
            let r = unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    self.func.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            if r == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            // Older drivers refuse the attribute: launch plainly from now on.
            REFUSED.store(true, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe {
            result::launch_kernel(
                self.func.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(err)
    }
}
