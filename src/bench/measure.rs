//! What every benchmark measures with: the machine's context line, raw file write and read
//! baselines, process CPU time and memory (from `/proc`), and number formatting.

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub(super) fn context_line() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    let build = if cfg!(debug_assertions) {
        "DEBUG build: numbers are not meaningful, use --release"
    } else {
        "release build"
    };
    format!(
        "{cpus} cpus, linux {kernel}, load average {} (1/5/15 min), {build}",
        loadavg()
    )
}

/// Bytes this process read from and wrote to storage so far (`/proc/self/io`): shows whether a
/// read came from the page cache.
pub(super) fn proc_io() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (field("read_bytes:"), field("write_bytes:"))
}

/// Asks the kernel to drop a file's (clean) pages from the page cache, so the next read comes
/// from the device. Works without privileges on Linux for files already fsynced; elsewhere it
/// is a no-op and reads stay warm.
pub(super) fn drop_cached(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only takes a descriptor we own and plain integers.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        drop(f);
        false
    }
}

pub(super) fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// CPU time of the calling thread so far (zero if the clock cannot be read).
pub(super) fn thread_cpu() -> Duration {
    // SAFETY: clock_gettime fills the struct we pass; an all-zero timespec is a valid value.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time (user + system) of this process so far, all threads (the I/O threads too).
pub(super) fn process_cpu() -> Duration {
    // SAFETY: getrusage fills the struct we pass; an all-zero rusage is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Wall-clock and CPU time of one measurement. On a loaded machine the wall time stretches with
/// the share of the CPUs the process gets; the CPU time much less.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sample {
    pub(crate) wall: Duration,
    pub(crate) cpu: Duration,
}

pub(super) struct Meter(Instant, Duration);

impl Meter {
    pub(super) fn start() -> Self {
        Meter(Instant::now(), process_cpu())
    }
    pub(super) fn stop(&self) -> Sample {
        Sample {
            wall: self.0.elapsed(),
            cpu: process_cpu().saturating_sub(self.1),
        }
    }
}

/// Raw baseline write: one file, sequential writes of the given chunks, fsync of the file and
/// its directory (what a durable snapshot file needs at least).
pub(super) fn raw_write(path: &Path, chunks: &[Bytes]) -> Result<Sample> {
    let t = Meter::start();
    let mut f = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    for c in chunks {
        f.write_all(c)?;
    }
    f.sync_all()?;
    drop(f);
    if let Some(dir) = path.parent() {
        fsync_dir(dir)?;
    }
    Ok(t.stop())
}

/// Raw baseline read: the whole file into one buffer (like `std::fs::read`).
pub(super) fn raw_read(path: &Path, expect: u64) -> Result<Sample> {
    let t = Meter::start();
    let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut buf = Vec::with_capacity(expect as usize);
    f.read_to_end(&mut buf)?;
    let took = t.stop();
    if buf.len() as u64 != expect {
        bail!(
            "{} holds {} bytes, expected {expect}",
            path.display(),
            buf.len()
        );
    }
    std::hint::black_box(&buf);
    Ok(took)
}

/// `n` bytes of incompressible filler in 8 MiB chunks (shared buffer).
pub(super) fn filler(n: u64) -> Vec<Bytes> {
    const CHUNK: usize = 8 << 20;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut buf = Vec::with_capacity(CHUNK);
    while buf.len() < CHUNK {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        buf.extend_from_slice(&crate::job::generator::splitmix64(s).to_le_bytes());
    }
    let chunk = Bytes::from(buf);
    let mut out = Vec::new();
    let mut left = n as usize;
    while left > 0 {
        let k = left.min(CHUNK);
        out.push(chunk.slice(..k));
        left -= k;
    }
    out
}

pub(super) fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

pub(super) fn mibps(bytes: u64, d: Duration) -> f64 {
    mib(bytes) / d.as_secs_f64().max(1e-9)
}

pub(super) fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Bytes of state per key the benchmarks aim at (1 GiB is about 2.7M keys).
pub(super) const BYTES_PER_KEY: u64 = 400;

pub(super) fn keys_for(state_mib: u64) -> u64 {
    ((state_mib << 20) / BYTES_PER_KEY).max(1)
}

pub(super) fn prepare_dir(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let abs = std::fs::canonicalize(dir)?;
    let run = abs.join(format!("{name}-{}", std::process::id()));
    if run.exists() {
        std::fs::remove_dir_all(&run)?;
    }
    std::fs::create_dir_all(&run)?;
    Ok(run)
}

/// Keeps the best (shortest wall time) sample of each measurement over rounds.
#[derive(Default)]
pub(super) struct Best(Option<Sample>);

impl Best {
    pub(super) fn add(&mut self, s: Sample) {
        if self.0.is_none_or(|b| s.wall < b.wall) {
            self.0 = Some(s);
        }
    }
    pub(super) fn get(&self) -> Duration {
        self.0.unwrap_or_default().wall
    }
    pub(super) fn cpu(&self) -> Duration {
        self.0.unwrap_or_default().cpu
    }
}

// ---------------------------------------------------------------------------------------------
// Process memory and CPU time

/// Summed resident memory of processes, KiB: (peak, now).
pub(super) fn rss_kib(pids: &[u32]) -> (u64, u64) {
    pids.iter()
        .map(|p| memory_kib(*p))
        .fold((0, 0), |(a, b), (p, n)| (a + p, b + n))
}

/// Fields of a process's `/proc/PID/status`, in KiB (0 for a field missing, or a process gone).
pub(super) fn status_kib<const N: usize>(pid: u32, names: [&str; N]) -> [u64; N] {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    names.map(|name| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    })
}

/// Peak and current resident memory of a process, in KiB (`VmHWM`, `VmRSS`).
pub(super) fn memory_kib(pid: u32) -> (u64, u64) {
    let [hwm, rss] = status_kib(pid, ["VmHWM:", "VmRSS:"]);
    (hwm, rss)
}

/// Private memory of a process, in KiB: its resident anonymous and shared-memory pages
/// (`RssAnon` + `RssShmem`), without the file pages it maps. Those are mostly the binary's
/// code (about 17 MiB resident in each worker), which every worker process on the machine
/// shares and the page cache holds once: summing resident memory over 12 workers counts it 12
/// times.
pub(super) fn private_kib(pid: u32) -> u64 {
    status_kib(pid, ["RssAnon:", "RssShmem:"]).iter().sum()
}

/// Numeric fields of a process's `/proc/PID/stat`, counted from the one after the command
/// name (which may hold spaces): 0 is the state, 1 the parent's pid, 11 and 12 utime and stime
/// (fields 3, 4, 14 and 15 of the whole line). `None` for a field missing, or a process gone.
pub(super) fn stat_fields<const N: usize>(pid: u32, at: [usize; N]) -> [Option<u64>; N] {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    at.map(|i| fields.get(i).and_then(|v| v.parse().ok()))
}

/// The processes whose parent is `parent`.
pub(super) fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| stat_fields(*pid, [1]) == [Some(u64::from(parent))])
        .collect()
}

/// The peak of the summed private memory ([`private_kib`]) of this process's children (the
/// worker processes), sampled every 10 ms on a thread of its own until [`finish`](Self::finish).
pub(super) struct ChildrenPeak {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl ChildrenPeak {
    pub(super) fn start() -> Self {
        use std::sync::atomic::Ordering;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let me = std::process::id();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            loop {
                let now = children_of(me).into_iter().map(private_kib).sum();
                peak = u64::max(peak, now);
                if flag.load(Ordering::Relaxed) {
                    return peak;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Self { stop, thread }
    }

    /// The peak seen, KiB (one last sample included).
    pub(super) fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// CPU time (user + system) a process has used so far.
pub(super) fn cpu_time(pid: u32) -> Duration {
    let [utime, stime] = stat_fields(pid, [11, 12]).map(|t| t.unwrap_or(0));
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_nanos((utime + stime) * 1_000_000_000 / hz)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory sampler sees a child process and its private memory, and leaves out the
    /// child's file pages: its private memory is below its resident memory.
    #[test]
    fn a_child_and_its_private_memory_are_found() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        // Read it once it sleeps: between the spawn and the exec of `sleep` (and its loader
        // mapping libc), it has no file pages yet.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|t| t.contains("(sleep) S"))
        {
            assert!(Instant::now() < deadline, "sleep {pid} never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        let found = children_of(std::process::id()).contains(&pid);
        let private = private_kib(pid);
        let (_, rss) = memory_kib(pid);
        let sampler = ChildrenPeak::start();
        std::thread::sleep(Duration::from_millis(30));
        let peak = sampler.finish();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found,
            "child {pid} not among {:?}",
            children_of(std::process::id())
        );
        assert!(
            private > 0 && private < rss,
            "private {private} KiB, resident {rss} KiB"
        );
        assert!(
            peak >= private,
            "peak {peak} KiB below one child's {private} KiB"
        );
        assert!(
            private_kib(u32::MAX) == 0,
            "a process that is gone has none"
        );
    }

    /// A process's CPU time, read from the same `/proc/PID/stat` fields as its parent: it
    /// counts this process's own spinning, and is zero for a process that is gone.
    #[test]
    fn cpu_time_counts_a_spin() {
        let me = std::process::id();
        let before = cpu_time(me);
        let start = Instant::now();
        let mut x = 0u64;
        // Spin until the count says 50 ms of CPU were spent. Not a fixed wall time: on a loaded
        // machine (hack/test.sh runs several test binaries at once) a 100 ms spin may get 40 ms
        // of a core. A count that does not grow with spinning never gets there.
        while cpu_time(me).saturating_sub(before) < Duration::from_millis(50) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{:?} of CPU counted after a {:?} spin",
                cpu_time(me).saturating_sub(before),
                start.elapsed()
            );
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        // And no more than the process's threads could have spent in that time on every core.
        let spent = cpu_time(me) - before;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let most = start.elapsed() * cores + Duration::from_millis(20);
        assert!(
            spent <= most,
            "{spent:?} of CPU counted in {:?}",
            start.elapsed()
        );
        assert_eq!(cpu_time(u32::MAX), Duration::ZERO);
    }
}
