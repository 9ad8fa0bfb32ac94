//! Page-locked host memory, pinned fast: the offloader's pool and pause's kept contents.
//!
//! Why not `cuMemHostAlloc` alone: the driver zeroes and pins the pages on the calling
//! thread while it holds a lock that kernel launches from other threads also wait on. On an
//! H100 host 16 GiB took 6.7-8.2 s (2.1-2.5 GB/s), and a launch loop on another thread
//! waited the whole time (`python/bench/pin_bench.py`, BENCHMARKS.md session 17); GPT-2 XL's
//! first budgeted iteration pinned 20 GiB of offload buffers and took 10-21 s.
//!
//! Here ([`PinnedHost`] by [`crate::CudaDevice::alloc_pinned`]):
//! 1. the bytes are checked against what the host can still give ([`host_available_bytes`]:
//!    `MemAvailable`, and the cgroup v2 limit less its usage): faulting in more would end in
//!    the kernel's OOM killer, not in an error the caller can handle (a check, not a
//!    reservation: memory other processes take meanwhile is not foreseen);
//! 2. an anonymous private mapping (`memmap2`), advised for transparent huge pages (a 2 MiB
//!    page is one fault and one page-table entry instead of 512) and not to be inherited by
//!    forked children (as the driver's own pinned memory);
//! 3. its pages faulted in by [`pin_threads`] threads at once (each writes zeroes over its
//!    contiguous share: [`touch`]); the kernel's page zeroing is the cost, and it scales with
//!    threads up to the memory bandwidth;
//! 4. `cuMemHostRegister` (portable: pinned for every context), which then only locks and
//!    maps pages that exist.
//!
//! Same host, same sizes: 16 GiB in 0.88 s (19.5 GB/s, 16 threads, huge pages), 1.04 s with
//! 8 threads, 1.48 s with 16 threads without huge pages; device-to-host copies into it ran
//! at 41-55 GB/s, as into `cudaHostAlloc`'s. `STWEAVER_PIN_THREADS=0` keeps `cuMemHostAlloc` (the A/B control); where the
//! mapping or the registration fails for another reason than memory, the driver's
//! allocation is tried instead. Cost: O(bytes / threads) of page faults, one driver call.

use std::fmt;

/// At most this many threads fault pages in (beyond it the memory bandwidth is the limit:
/// 16 threads gave 19.5 GB/s on the H100 host, 8 gave 16.5).
pub const MAX_PIN_THREADS: usize = 16;

/// What the host can still give, in bytes: the least of `/proc/meminfo`'s `MemAvailable`
/// and, under a cgroup v2 memory limit, the limit less the usage. None when neither can be
/// read (not Linux): no check then.
pub fn host_available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| meminfo_available(&s));
    let cgroup = cgroup_v2_dir().and_then(|dir| {
        let max = std::fs::read_to_string(format!("{dir}/memory.max")).ok()?;
        let current = std::fs::read_to_string(format!("{dir}/memory.current")).ok()?;
        cgroup_headroom(&max, &current)
    });
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub(crate) fn meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

/// The limit less the usage of a cgroup v2 (`memory.max`, `memory.current` texts); None
/// when unlimited (`max`) or unreadable.
pub(crate) fn cgroup_headroom(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?; // "max": no limit
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// This process's cgroup v2 directory (`0::/path` in `/proc/self/cgroup`).
fn cgroup_v2_dir() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_v2_path(&text).map(|p| format!("/sys/fs/cgroup{}", p.trim_end_matches('/')))
}

pub(crate) fn cgroup_v2_path(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

/// How many threads fault a new pinned buffer's pages in: `STWEAVER_PIN_THREADS` when set
/// (`0`: no fast path, `cuMemHostAlloc`), else the CPUs this process may use, at most
/// [`MAX_PIN_THREADS`]. An unreadable value is refused by name.
pub fn pin_threads() -> Result<usize, HostError> {
    pin_threads_from(std::env::var("STWEAVER_PIN_THREADS").ok().as_deref())
}

pub(crate) fn pin_threads_from(var: Option<&str>) -> Result<usize, HostError> {
    match var.map(str::trim) {
        None | Some("") => Ok(std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_PIN_THREADS)),
        Some(v) => v
            .parse::<usize>()
            .map(|n| n.min(256))
            .map_err(|_| HostError::BadSetting(v.to_string())),
    }
}

/// Faults every page of `buf` in with `threads` threads (at least one), each writing zeroes
/// over its contiguous share (shares rounded to 2 MiB, so a huge page is one thread's).
pub(crate) fn touch(buf: &mut [u8], threads: usize) {
    const HUGE: usize = 2 << 20;
    let threads = threads.max(1);
    let share = buf.len().div_ceil(threads).div_ceil(HUGE).max(1) * HUGE;
    if threads == 1 || buf.len() <= share {
        buf.fill(0);
        return;
    }
    std::thread::scope(|s| {
        for chunk in buf.chunks_mut(share) {
            s.spawn(move || chunk.fill(0));
        }
    });
}

/// An anonymous private mapping of `len` bytes, advised for huge pages, faulted in by
/// `threads` threads: the host half of a fast pin. Checks `len` against
/// [`host_available_bytes`] first.
pub(crate) fn faulted_mapping(len: usize, threads: usize) -> Result<memmap2::MmapMut, HostError> {
    if let Some(avail) = host_available_bytes()
        && len as u64 > avail
    {
        return Err(HostError::OutOfMemory {
            requested: len as u64,
            available: avail,
        });
    }
    let mut map = memmap2::MmapOptions::new()
        .len(len)
        .map_anon()
        .map_err(|e| HostError::Map(e.to_string()))?;
    // Huge pages are an optimisation: a kernel without them (or with them off) still maps.
    // Not inherited by a forked child (a DataLoader worker): the kernel would otherwise
    // copy every pinned page into it at the fork, as it does for pages pinned for DMA
    // (cudaHostAlloc's memory is not inherited either).
    #[cfg(target_os = "linux")]
    {
        let _ = map.advise(memmap2::Advice::HugePage);
        let _ = map.advise(memmap2::Advice::DontFork);
    }
    touch(&mut map, threads);
    Ok(map)
}

/// Why host memory could not be had (before any driver call).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// More than the host (or this process's cgroup) can still give.
    #[error(
        "host memory: {} requested but only {} available (MemAvailable / cgroup limit)",
        Gib(*requested),
        Gib(*available)
    )]
    OutOfMemory { requested: u64, available: u64 },
    /// The anonymous mapping failed.
    #[error("host memory: mmap failed: {0}")]
    Map(String),
    /// `STWEAVER_PIN_THREADS` is not a number.
    #[error("STWEAVER_PIN_THREADS={0:?} is not a thread count (0 = cuMemHostAlloc)")]
    BadSetting(String),
}

struct Gib(u64);

impl fmt::Display for Gib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes ({:.2} GiB)",
            self.0,
            self.0 as f64 / (1u64 << 30) as f64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_cgroup_texts_parse() {
        let text =
            "MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   125829120 kB\n";
        assert_eq!(meminfo_available(text), Some(125_829_120 * 1024));
        assert_eq!(meminfo_available("MemTotal: 5 kB\n"), None);
        assert_eq!(meminfo_available("MemAvailable: x kB\n"), None);
        assert_eq!(cgroup_headroom("max\n", "100\n"), None);
        assert_eq!(cgroup_headroom("1000\n", "300\n"), Some(700));
        assert_eq!(cgroup_headroom("1000\n", "3000\n"), Some(0));
        assert_eq!(
            cgroup_v2_path("12:cpu:/a\n0::/user.slice/x.scope\n"),
            Some("/user.slice/x.scope")
        );
        assert_eq!(cgroup_v2_path("12:cpu:/a\n"), None);
    }

    #[test]
    fn this_host_reports_available_memory() {
        // The build machine and CI are Linux: the check is live there.
        if cfg!(target_os = "linux") {
            let avail = host_available_bytes().expect("MemAvailable readable");
            assert!(avail > 0);
        }
    }

    #[test]
    fn pin_threads_setting() {
        let default = pin_threads_from(None).unwrap();
        assert!((1..=MAX_PIN_THREADS).contains(&default));
        assert_eq!(pin_threads_from(Some("")).unwrap(), default);
        assert_eq!(pin_threads_from(Some("0")).unwrap(), 0);
        assert_eq!(pin_threads_from(Some(" 8 ")).unwrap(), 8);
        let err = pin_threads_from(Some("eight")).unwrap_err();
        assert!(
            err.to_string().contains("STWEAVER_PIN_THREADS=\"eight\""),
            "{err}"
        );
    }

    #[test]
    fn touch_writes_every_byte_with_any_thread_count() {
        for (len, threads) in [(1, 4), (4096, 1), (5 << 20, 3), ((8 << 20) + 17, 16)] {
            let mut buf = vec![0xAB_u8; len];
            touch(&mut buf, threads);
            assert!(buf.iter().all(|&b| b == 0), "len {len} threads {threads}");
        }
    }

    #[test]
    fn a_faulted_mapping_is_zeroed_and_an_impossible_one_is_refused() {
        let map = faulted_mapping(6 << 20, 2).expect("6 MiB");
        assert_eq!(map.len(), 6 << 20);
        assert!(map.iter().all(|&b| b == 0));
        if let Some(avail) = host_available_bytes() {
            let too_much = usize::try_from(avail + (1 << 30)).unwrap();
            let err = faulted_mapping(too_much, 2).unwrap_err();
            assert!(matches!(err, HostError::OutOfMemory { .. }), "{err:?}");
            assert!(err.to_string().contains("available"), "{err}");
        }
    }
}
