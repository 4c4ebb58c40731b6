//! Opening compute devices the way kvq uses them.

use candle_core::{Device, Result};

/// CUDA device `ordinal`, without cudarc's per-tensor event tracking.
///
/// Event tracking makes every kernel launch wait on and record a CUDA event per buffer argument
/// (and every allocation create two events): a dozen driver calls per launch, which cost more
/// than a short decode kernel runs. It only matters when several streams share buffers; candle
/// runs all work of a device on one stream, where stream order already serialises kernels,
/// copies and the stream-ordered frees.
pub fn open_cuda(ordinal: usize) -> Result<Device> {
    let dev = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        // SAFETY: kvq never creates a second stream (see above), and this runs before any
        // tensor exists on the device.
        unsafe { d.disable_event_tracking() };
    }
    Ok(dev)
}

/// Device memory in use on `dev` right now (the whole GPU: this process's allocations, its
/// context and any other process's), where the device can tell: CUDA only.
pub fn used_bytes(dev: &Device) -> Option<u64> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
            Some(total.saturating_sub(free) as u64)
        }
        _ => None,
    }
}
