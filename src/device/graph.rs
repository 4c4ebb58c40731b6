//! CUDA graphs of decode steps: a step's kernels are recorded once (stream capture) and replayed
//! with one launch, so a step costs the GPU's time, not hundreds of host-side launches.
//!
//! A captured graph keeps every address it was recorded with. Its inputs therefore live in
//! device buffers that outlast it and are rewritten in place before each replay
//! ([`write_u32`]); its outputs are copied into such buffers inside the graph; and everything
//! the step allocates is allocated and freed inside the capture (candle allocates with
//! `cuMemAllocAsync`, which a capture records as graph memory nodes). Nothing may copy from
//! host memory or read back to it while capturing: a recorded copy would read the host buffer's
//! old address at every replay. Candle uploads small parameter vectors for some kernels; with
//! its `enable_cuda_graph_htod_cache` on, an eager run of the same step before the capture
//! leaves those on the device and the capture reuses them.

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{result, CudaGraph, DevicePtr};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Result, Storage, Tensor};

fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuda graph: {}", msg.into()))
}

/// Copies `host` into the u32 tensor `dst` (contiguous, on a CUDA device, `host.len()`
/// elements) in place, in stream order: the buffer keeps its address, so graphs that read it
/// see the new values at their next replay. The host data may be dropped on return.
pub fn write_u32(dst: &Tensor, host: &[u32]) -> Result<()> {
    if dst.dtype() != DType::U32 || dst.elem_count() != host.len() {
        return Err(err(format!(
            "write_u32: {} values into a {:?} tensor of {}",
            host.len(),
            dst.dtype(),
            dst.elem_count()
        )));
    }
    let (st, l) = dst.storage_and_layout();
    let Storage::Cuda(c) = &*st else {
        return Err(err("write_u32: not a CUDA tensor"));
    };
    let (o1, _) = l
        .contiguous_offsets()
        .ok_or_else(|| err("write_u32: non-contiguous destination"))?;
    let slice = c.as_cuda_slice::<u32>()?;
    let stream = c.device.cuda_stream();
    let (base, _guard) = slice.device_ptr(&stream);
    let at = base + (o1 * std::mem::size_of::<u32>()) as u64;
    // SAFETY: `at..at + 4 * host.len()` lies inside `slice` (offsets checked by the layout and
    // the element count above); the copy is ordered on the device's only stream, and the
    // driver stages pageable host memory before returning.
    unsafe { result::memcpy_htod_async(at, host, stream.cu_stream()) }.w()
}

/// Records the kernels `f` launches on `dev`'s stream into a graph instead of running them.
/// `f` must neither copy from the host nor read back, and must drop every tensor it creates
/// before returning (see the module doc). On an error inside `f` the capture is ended and
/// discarded.
pub fn capture<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<(CudaGraph, T)> {
    let Device::Cuda(d) = dev else {
        return Err(err("capture needs a CUDA device"));
    };
    let stream = d.cuda_stream();
    stream.synchronize().w()?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .w()?;
    let out = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    let out = out?;
    let graph = graph
        .w()?
        .ok_or_else(|| err("the capture was invalidated"))?;
    graph.upload().w()?;
    Ok((graph, out))
}

/// Kernel nodes in `g`: the kernels one replay launches (counted from the graph itself, for
/// `bench-batch`'s launches-per-step figure).
pub fn kernel_nodes(g: &CudaGraph) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let graph = g.cu_graph();
    let mut n: usize = 0;
    // SAFETY: `graph` is alive while `g` is; a null node array asks for the count only.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
        .result()
        .w()?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` has room for the `n` nodes just counted.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        .result()
        .w()?;
    let mut kernels = 0;
    for node in nodes.into_iter().take(n) {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to `graph`.
        unsafe { sys::cuGraphNodeGetType(node, &mut ty) }
            .result()
            .w()?;
        if ty == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            kernels += 1;
        }
    }
    Ok(kernels)
}

/// Replays `g` on its stream (asynchronous, like any launch).
pub fn replay(g: &CudaGraph) -> Result<()> {
    g.launch().w()
}
