//! The process's own resource figures for `/metrics`: resident memory, open file descriptors
//! and threads from `/proc/self`, and the tokio tasks alive. It only reads; where there is no
//! `/proc` (not Linux) the `/proc` figures are left out of the page.

use std::path::Path;

/// Resource figures of this process at one moment, from `/proc/self`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessStats {
    pub resident_memory_bytes: u64,
    pub open_fds: u64,
    pub threads: u64,
}

/// Why the figures could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("reading {path}: {source}")]
    Io {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("no {0} line in the process status")]
    Missing(&'static str),
    #[error("{field} in the process status is not a number of the expected unit: {line:?}")]
    Malformed { field: &'static str, line: String },
}

const STATUS: &str = "/proc/self/status";
const FD_DIR: &str = "/proc/self/fd";

/// Reads this process's figures from `/proc/self`.
pub fn read() -> Result<ProcessStats, ProcessError> {
    let status = std::fs::read_to_string(STATUS).map_err(|source| ProcessError::Io {
        path: STATUS,
        source,
    })?;
    let (resident_memory_bytes, threads) = parse_status(&status)?;
    let entries = count_entries(Path::new(FD_DIR)).map_err(|source| ProcessError::Io {
        path: FD_DIR,
        source,
    })?;
    Ok(ProcessStats {
        resident_memory_bytes,
        // Listing the folder opens a descriptor of its own, which the listing shows.
        open_fds: entries.saturating_sub(1),
        threads,
    })
}

/// The resident memory in bytes (`VmRSS`, which the kernel writes in kB) and the thread
/// count (`Threads`) in the text of a `/proc/<pid>/status`.
pub fn parse_status(text: &str) -> Result<(u64, u64), ProcessError> {
    let threads = field(text, "Threads")?;
    let threads = threads
        .parse::<u64>()
        .map_err(|_| malformed("Threads", threads))?;
    Ok((kb_field(text, "VmRSS")?, threads))
}

/// Resident memory by what backs it: private memory, and pages of mapped files, which
/// every process that maps the same file shares (a node's weight pack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentSplit {
    pub anon_bytes: u64,
    pub file_bytes: u64,
}

/// This process's [`ResidentSplit`], from `RssAnon` and `RssFile` in `/proc/self/status`.
pub fn resident_split() -> Result<ResidentSplit, ProcessError> {
    let status = std::fs::read_to_string(STATUS).map_err(|source| ProcessError::Io {
        path: STATUS,
        source,
    })?;
    Ok(ResidentSplit {
        anon_bytes: kb_field(&status, "RssAnon")?,
        file_bytes: kb_field(&status, "RssFile")?,
    })
}

/// The value of the status line `name`.
fn field<'t>(text: &'t str, name: &'static str) -> Result<&'t str, ProcessError> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
        .ok_or(ProcessError::Missing(name))
}

/// The status line `name`, which the kernel writes in kB, in bytes.
fn kb_field(text: &str, name: &'static str) -> Result<u64, ProcessError> {
    let value = field(text, name)?;
    value
        .strip_suffix("kB")
        .and_then(|n| n.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| malformed(name, value))
}

fn malformed(field: &'static str, line: &str) -> ProcessError {
    ProcessError::Malformed {
        field,
        line: line.to_string(),
    }
}

/// The number of entries in a folder.
fn count_entries(dir: &Path) -> std::io::Result<u64> {
    let mut n = 0;
    for entry in std::fs::read_dir(dir)? {
        entry?;
        n += 1;
    }
    Ok(n)
}

/// The tokio tasks alive in the runtime of the calling thread; `None` outside one.
pub fn tokio_alive_tasks() -> Option<usize> {
    tokio::runtime::Handle::try_current()
        .ok()
        .map(|h| h.metrics().num_alive_tasks())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head of a real `/proc/self/status` (Linux 6.x), trimmed.
    const STATUS_TEXT: &str = "Name:\ttandem-decode\nUmask:\t0022\nState:\tS (sleeping)\n\
        Tgid:\t4242\nPid:\t4242\nVmPeak:\t 1203400 kB\nVmSize:\t 1203396 kB\n\
        VmHWM:\t  190212 kB\nVmRSS:\t  183560 kB\nRssAnon:\t  120000 kB\n\
        VmSwap:\t       0 kB\nThreads:\t17\nSigQ:\t0/95431\n";

    #[test]
    fn parses_resident_memory_and_threads() {
        assert_eq!(parse_status(STATUS_TEXT).unwrap(), (183_560 * 1024, 17));
    }

    #[test]
    fn a_missing_or_odd_field_is_an_error() {
        let no_rss = STATUS_TEXT.replace("VmRSS:", "VmXXX:");
        assert!(matches!(
            parse_status(&no_rss),
            Err(ProcessError::Missing("VmRSS"))
        ));
        let in_mb = STATUS_TEXT.replace("183560 kB", "180 MB");
        assert!(matches!(
            parse_status(&in_mb),
            Err(ProcessError::Malformed { field: "VmRSS", .. })
        ));
        let threads = STATUS_TEXT.replace("Threads:\t17", "Threads:\tmany");
        assert!(matches!(
            parse_status(&threads),
            Err(ProcessError::Malformed {
                field: "Threads",
                ..
            })
        ));
        // A field whose name merely starts with the wanted one is not it.
        let prefixed = STATUS_TEXT.replace("Threads:", "ThreadsX:");
        assert!(matches!(
            parse_status(&prefixed),
            Err(ProcessError::Missing("Threads"))
        ));
    }

    #[test]
    fn counts_folder_entries() {
        let dir = std::env::temp_dir().join(format!("process-count-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..3 {
            std::fs::write(dir.join(i.to_string()), b"").unwrap();
        }
        assert_eq!(count_entries(&dir).unwrap(), 3);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let before = read().unwrap();
        assert!(before.resident_memory_bytes > 1 << 20, "{before:?}");
        assert!(before.threads >= 1, "{before:?}");
        // Other tests of this binary may open and close files meanwhile, so only a lower
        // bound holds: the 8 held here are counted.
        let held: Vec<std::fs::File> = (0..8)
            .map(|_| std::fs::File::open("/proc/self/status").unwrap())
            .collect();
        let during = read().unwrap();
        assert!(during.open_fds >= 8 + 3, "{during:?} with 8 files held");
        drop(held);
    }
}
