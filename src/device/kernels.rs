//! kvq's CUDA kernels (`kernels/*.cu`), built by build.rs as fat binaries: machine code for the
//! build's GPU (CUDA_COMPUTE_CAP) plus PTX that the driver compiles for newer ones. Shipping
//! machine code matters: the driver's JIT took over a minute on the decode kernels' PTX the
//! first time a process used them on a fresh machine.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, DeviceId, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Layout, Result, Shape, Storage, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A kernel file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Module {
    /// kernels/quant.cu: quantization into the pool's formats.
    Quant,
    /// kernels/decode.cu: decode attention over the paged pool.
    Decode,
    /// kernels/sample.cu: token picks on the device.
    Sample,
    /// kernels/fused.cu: fused decoder ops (model::fused).
    Fused,
    /// kernels/gemv.cu: projections of a few rows with their norm and epilogue (model::gemv).
    Gemv,
    /// kernels/ring.cu: the residual window's rows of a captured decode step (kv::cache::ring).
    Ring,
}

impl Module {
    fn image(self) -> &'static [u8] {
        match self {
            Module::Quant => include_bytes!(concat!(env!("OUT_DIR"), "/quant.fatbin")),
            Module::Decode => include_bytes!(concat!(env!("OUT_DIR"), "/decode.fatbin")),
            Module::Sample => include_bytes!(concat!(env!("OUT_DIR"), "/sample.fatbin")),
            Module::Fused => include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin")),
            Module::Gemv => include_bytes!(concat!(env!("OUT_DIR"), "/gemv.fatbin")),
            Module::Ring => include_bytes!(concat!(env!("OUT_DIR"), "/ring.fatbin")),
        }
    }
}

/// A loaded kernel and the device's stream it launches on.
#[derive(Clone)]
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// A launch that may begin while the kernel before it in the stream still runs
    /// (programmatic dependent launch, [`pdl`]): only for kernels that call `pdl_wait()`
    /// (kernels/common.cuh) before they read anything an earlier kernel wrote or write anything.
    pub(crate) fn pdl_builder(&self) -> pdl::Args<'_> {
        pdl::Args::new(&self.func, &self.stream)
    }
}

impl std::ops::Deref for Kernel {
    type Target = CudaFunction;
    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

pub(crate) mod pdl;

type Modules = HashMap<(DeviceId, Module), Arc<CudaModule>>;
type Kernels = HashMap<(DeviceId, Module, String), Kernel>;

/// Kernel `name` of `module` on `dev`; modules are loaded once per device and kernels looked up
/// once (launches then skip the driver's name lookup).
pub(crate) fn kernel(dev: &CudaDevice, module: Module, name: &str) -> Result<Kernel> {
    static MODULES: OnceLock<Mutex<Modules>> = OnceLock::new();
    static KERNELS: OnceLock<Mutex<Kernels>> = OnceLock::new();
    let key = (dev.id(), module, name.to_string());
    let mut kernels = KERNELS
        .get_or_init(Default::default)
        .lock()
        .expect("poisoned kernel cache");
    if let Some(k) = kernels.get(&key) {
        return Ok(k.clone());
    }
    let md = {
        let mut modules = MODULES
            .get_or_init(Default::default)
            .lock()
            .expect("poisoned module cache");
        match modules.get(&(dev.id(), module)) {
            Some(m) => m.clone(),
            None => {
                let stream = dev.cuda_stream();
                let m = stream
                    .context()
                    .load_module(Ptx::from_binary(module.image().to_vec()))
                    .w()?;
                modules.insert((dev.id(), module), m.clone());
                m
            }
        }
    };
    let k = Kernel {
        func: md.load_function(name).w()?,
        stream: dev.cuda_stream(),
    };
    kernels.insert(key, k.clone());
    Ok(k)
}

/// The kernel-name suffix of a float dtype (`f32`, `f16`, `bf16`); `None` for other dtypes.
pub(crate) fn dtype_suffix(dtype: candle_core::DType) -> Option<&'static str> {
    use candle_core::DType;
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// A contiguous tensor whose data starts 16-byte aligned (the kernels use vector loads);
/// copies only when the view starts mid-buffer at an unaligned offset.
pub(crate) fn aligned(t: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let t = t.contiguous()?;
    if (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16) {
        Ok(t)
    } else {
        t.copy()
    }
}

/// Which CUDA decode kernel family to force, from `KVQ_CUDA_DECODE` (read once per process):
/// `v1` the block-wide kernel, `v2` SIMT scores for every width; anything else the default
/// choice. For A/B runs and tests.
pub(crate) fn decode_override() -> &'static str {
    static CHOICE: OnceLock<String> = OnceLock::new();
    CHOICE.get_or_init(|| std::env::var("KVQ_CUDA_DECODE").unwrap_or_default())
}

fn launch_err(msg: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("kernel launch: {msg}"))
}

/// The device data of a contiguous tensor's storage `s` with layout `l`, as `T`.
pub(crate) fn view<'a, T: CudaDType>(s: &'a Storage, l: &Layout) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(c) = s else {
        return Err(launch_err("expected CUDA storage"));
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| launch_err("non-contiguous input"))?;
    Ok(c.as_cuda_slice::<T>()?.slice(a..b))
}

/// The CUDA device a tensor lives on.
pub(crate) fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        _ => Err(launch_err("expected a CUDA tensor")),
    }
}

/// A kernel's output buffer as a tensor of `shape`.
pub(crate) fn wrap<T: CudaDType>(
    s: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
        shape,
        BackpropOp::none(),
        false,
    )
}
