//! Loading the CUDA driver, turning `CUresult` codes into errors, and the primary context.
//!
//! cudarc's `dynamic-loading` mode `dlopen`s libcuda on first use and **panics** when the
//! library or a symbol is missing. Every entry point here first asks
//! [`sys::is_culib_present`] (which does not panic) and runs driver calls under
//! `catch_unwind`, so a machine without a driver gets [`CudaError::NoDriver`], never a panic.

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

/// Everything that can go wrong talking to the CUDA driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no NVIDIA driver: libcuda.so / libcuda.so.1 could not be loaded on this machine \
         (stweaver needs a CUDA driver to allocate device memory)"
    )]
    NoDriver,
    /// A driver call returned an error code.
    #[error("{call} failed: {name} ({code}): {description}")]
    Driver {
        call: &'static str,
        code: u32,
        name: String,
        description: String,
    },
    /// The driver bindings panicked (for example a symbol missing from an old driver).
    #[error("CUDA driver call {call} could not be made: {message}")]
    Unavailable { call: &'static str, message: String },
    /// A caller passed something the driver must never see.
    #[error("invalid argument to {call}: {message}")]
    InvalidArgument { call: &'static str, message: String },
    /// Host memory for a pinned buffer could not be had before any driver call.
    #[error(transparent)]
    Host(#[from] crate::host::HostError),
}

impl CudaError {
    /// Whether the driver reported `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Driver { code, .. }
            if *code == CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32)
            || matches!(
                self,
                CudaError::Host(crate::host::HostError::OutOfMemory { .. })
            )
    }

    pub(crate) fn invalid(call: &'static str, message: impl Into<String>) -> CudaError {
        CudaError::InvalidArgument {
            call,
            message: message.into(),
        }
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Runs one raw driver call: catches a panic of the bindings (missing symbol) and maps a
/// non-success code to [`CudaError::Driver`] with the driver's own name and description.
pub(crate) fn call(name: &'static str, f: impl FnOnce() -> CUresult) -> Result<()> {
    let code = catch_unwind(AssertUnwindSafe(f)).map_err(|p| CudaError::Unavailable {
        call: name,
        message: panic_message(&p),
    })?;
    check(name, code)
}

/// Like [`call`] but hands back the raw code for calls where a non-success code is an
/// answer (`cuEventQuery` → `CUDA_ERROR_NOT_READY`).
pub(crate) fn call_raw(name: &'static str, f: impl FnOnce() -> CUresult) -> Result<CUresult> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| CudaError::Unavailable {
        call: name,
        message: panic_message(&p),
    })
}

pub(crate) fn check(name: &'static str, code: CUresult) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Driver {
        call: name,
        code: code as u32,
        name: error_string(code, true),
        description: error_string(code, false),
    })
}

fn error_string(code: CUresult, name: bool) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    let r = catch_unwind(AssertUnwindSafe(|| {
        // Safety: `p` is a valid out-pointer; the driver stores a pointer to a static,
        // NUL-terminated string (or leaves it null on an unknown code).
        unsafe {
            if name {
                sys::cuGetErrorName(code, &mut p)
            } else {
                sys::cuGetErrorString(code, &mut p)
            }
        }
    }));
    match r {
        Ok(CUresult::CUDA_SUCCESS) if !p.is_null() => {
            // Safety: non-null and NUL-terminated, owned by the driver for the process life.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
        _ => format!("{code:?}"),
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Proof that libcuda is loaded and `cuInit(0)` succeeded.
#[derive(Debug)]
pub struct Driver {
    device_count: i32,
    version: i32,
}

static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();

impl Driver {
    /// Loads libcuda and initialises the driver once per process. On a machine without a
    /// driver this returns [`CudaError::NoDriver`] (and keeps returning it).
    pub fn get() -> Result<&'static Driver> {
        DRIVER
            .get_or_init(Driver::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether libcuda can be loaded, without initialising anything.
    pub fn is_present() -> bool {
        // Safety: only tries `dlopen` on candidate names; never panics, never calls into
        // the library.
        catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
    }

    fn load() -> Result<Driver> {
        if !Driver::is_present() {
            return Err(CudaError::NoDriver);
        }
        // Safety: plain driver entry point; the library is present (checked above).
        call("cuInit", || unsafe { sys::cuInit(0) })?;
        let mut version = 0;
        // Safety: valid out-pointer.
        call("cuDriverGetVersion", || unsafe {
            sys::cuDriverGetVersion(&mut version)
        })?;
        let mut device_count = 0;
        // Safety: valid out-pointer; cuInit succeeded.
        call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut device_count)
        })?;
        Ok(Driver {
            device_count,
            version,
        })
    }

    /// Number of CUDA devices the driver sees.
    pub fn device_count(&self) -> i32 {
        self.device_count
    }

    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub fn version(&self) -> i32 {
        self.version
    }
}

/// Makes a context current on this thread for the guard's lifetime (push/pop), so driver
/// calls that need a context (event creation, reservations) work from any thread —
/// autograd and NCCL threads included — without touching the runtime's current device.
pub(crate) struct CtxGuard(std::marker::PhantomData<*const ()>);

impl CtxGuard {
    pub(crate) fn push(ctx: sys::CUcontext) -> Result<CtxGuard> {
        // Safety: `ctx` is a primary context retained by the owning `CudaDevice`, which
        // outlives every guard it creates.
        call("cuCtxPushCurrent", || unsafe {
            sys::cuCtxPushCurrent_v2(ctx)
        })?;
        Ok(CtxGuard(std::marker::PhantomData))
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut old: sys::CUcontext = std::ptr::null_mut();
        // Safety: pops the context this guard pushed on this thread (guards are not Send:
        // they are created and dropped inside one method call).
        let _ = call("cuCtxPopCurrent", || unsafe {
            sys::cuCtxPopCurrent_v2(&mut old)
        });
    }
}
