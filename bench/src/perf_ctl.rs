//! `perf record --control fifo:CTL,ACK`: a run turns perf's sampling on and off around
//! what it measures (`perf record -D -1` starts with it off), each command acknowledged
//! before the run goes on, so the samples are of that part alone.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;

/// The two FIFOs `perf record --control` was given.
pub struct PerfControl {
    ctl: File,
    ack: BufReader<File>,
}

impl PerfControl {
    /// Opens perf's command FIFO `ctl` and its acknowledgement FIFO `ack`.
    pub fn open(ctl: &Path, ack: &Path) -> io::Result<Self> {
        Ok(Self {
            ctl: OpenOptions::new().write(true).open(ctl)?,
            ack: BufReader::new(File::open(ack)?),
        })
    }

    /// Sampling on.
    pub fn enable(&mut self) -> io::Result<()> {
        self.send("enable")
    }

    /// Sampling off.
    pub fn disable(&mut self) -> io::Result<()> {
        self.send("disable")
    }

    /// Sends `command` and waits for perf's `ack`.
    fn send(&mut self, command: &str) -> io::Result<()> {
        writeln!(self.ctl, "{command}")?;
        self.ctl.flush()?;
        let mut line = String::new();
        self.ack.read_line(&mut line)?;
        if !is_ack(&line) {
            return Err(io::Error::other(format!(
                "perf answered {line:?} to {command:?}, not \"ack\""
            )));
        }
        Ok(())
    }
}

/// Whether `line` is perf's acknowledgement: perf writes "ack\n" and the string's NUL,
/// which the next line read begins with.
fn is_ack(line: &str) -> bool {
    line.trim_matches(['\n', '\0']) == "ack"
}

#[cfg(test)]
mod tests {
    use super::is_ack;

    #[test]
    fn reads_perfs_acknowledgements_with_their_nul() {
        assert!(is_ack("ack\n"));
        assert!(is_ack("\0ack\n"));
        assert!(!is_ack(""), "perf closed the FIFO");
        assert!(!is_ack("nack\n"));
    }
}
