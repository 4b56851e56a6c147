//! The process's own figures for the metrics: the allocator's (jemalloc) and `/proc/self`'s,
//! read at each scrape.

use prometheus_client::registry::Unit;

/// The allocator's figures (jemalloc, `src/main.rs`), read afresh: bytes handed out and not
/// given back (`stats.allocated`), and bytes of the allocator's pages resident in memory
/// (`stats.resident`: the heap, its metadata and freed pages not yet returned). `None` when
/// they cannot be read (jemalloc without its `stats` feature). In a binary whose global
/// allocator is not jemalloc (the library's own tests), they are jemalloc's idle figures.
pub fn heap_bytes() -> Option<(u64, u64)> {
    // The figures are cached by jemalloc until its epoch advances.
    tikv_jemalloc_ctl::epoch::advance().ok()?;
    let allocated = tikv_jemalloc_ctl::stats::allocated::read().ok()?;
    let resident = tikv_jemalloc_ctl::stats::resident::read().ok()?;
    Some((allocated as u64, resident as u64))
}

/// The process's figures from `/proc/self` (Linux), read at each scrape.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProcessFigures {
    /// Resident set size, bytes (`/proc/self/statm`, pages × page size).
    pub resident_bytes: u64,
    /// Virtual memory size, bytes.
    pub virtual_bytes: u64,
    /// User and system CPU time, seconds (`/proc/self/stat` fields 14 and 15).
    pub cpu_seconds: f64,
    /// Open file descriptors (entries of `/proc/self/fd`).
    pub open_fds: u64,
    /// The soft limit on file descriptors (`RLIMIT_NOFILE`).
    pub max_fds: u64,
    /// When the process started, Unix seconds (boot time plus field 22 of `/proc/self/stat`).
    pub start_time_seconds: f64,
}

/// Reads [`ProcessFigures`]; `None` when `/proc` cannot be read.
pub fn process_figures() -> Option<ProcessFigures> {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)? as f64;
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .filter(|p| *p > 0)? as u64;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| rest.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let mut statm = statm.split_whitespace().map(|v| v.parse::<u64>().ok());
    let (size, resident) = (statm.next()??, statm.next()??);
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("btime ")
                .and_then(|v| v.trim().parse::<u64>().ok())
        })?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    let max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(0);
    Some(ProcessFigures {
        resident_bytes: resident * page,
        virtual_bytes: size * page,
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        open_fds,
        max_fds,
        start_time_seconds: boot as f64 + field(22)? as f64 / ticks,
    })
}

/// Exports [`ProcessFigures`] as the standard `process_*` metrics.
#[derive(Debug)]
pub(super) struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let Some(p) = process_figures() else {
            return Ok(());
        };
        let gauges: [(&str, &str, Option<Unit>, f64); 5] = [
            (
                "process_resident_memory",
                "Resident memory size",
                Some(Unit::Bytes),
                p.resident_bytes as f64,
            ),
            (
                "process_virtual_memory",
                "Virtual memory size",
                Some(Unit::Bytes),
                p.virtual_bytes as f64,
            ),
            (
                "process_open_fds",
                "Open file descriptors",
                None,
                p.open_fds as f64,
            ),
            (
                "process_max_fds",
                "The limit on open file descriptors",
                None,
                p.max_fds as f64,
            ),
            (
                "process_start_time",
                "Start time of the process since the Unix epoch",
                Some(Unit::Seconds),
                p.start_time_seconds,
            ),
        ];
        for (name, help, unit, v) in gauges {
            let g = ConstGauge::new(v);
            let e = encoder.encode_descriptor(name, help, unit.as_ref(), g.metric_type())?;
            g.encode(e)?;
        }
        let c = ConstCounter::new(p.cpu_seconds);
        let e = encoder.encode_descriptor(
            "process_cpu",
            "User and system CPU time spent",
            Some(&Unit::Seconds),
            c.metric_type(),
        )?;
        c.encode(e)
    }
}
