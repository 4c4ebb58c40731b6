//! Opening compute devices the way kvq uses them; on CUDA builds also the loader of kvq's own
//! kernels ([`kernels`]) and captured decode steps ([`graph`]).

use candle_core::{Device, Result};

#[cfg(feature = "cuda")]
pub mod graph;
#[cfg(feature = "cuda")]
pub(crate) mod kernels;

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

/// Memory the OS could give this process now (Linux `MemAvailable`), if it can be read.
pub fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// [`available_memory`], or 4 GiB where it cannot be read.
pub fn available_memory_bytes() -> usize {
    available_memory().map_or(4 << 30, |b| b as usize)
}

/// Device memory free on `dev` right now, where the device can tell: CUDA only.
pub fn free_bytes(dev: &Device) -> Option<u64> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (free, _) = d.cuda_stream().context().mem_get_info().ok()?;
            Some(free as u64)
        }
        _ => None,
    }
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
