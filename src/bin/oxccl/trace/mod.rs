//! `oxccl trace`: reads the flight records that ranks write (`OXCCL_TRACE_DIR`,
//! `Communicator::dump_trace`) and says what they show: which rank fell behind or called
//! something else, where every rank was when the job stopped, and who the others waited for.
//!
//! ```text
//! OXCCL_TRACE_DIR=/tmp/trace oxccl launch -n 4 -- ./train     # or: oxccl launch --trace-dir /tmp/trace
//! oxccl trace /tmp/trace
//! oxccl trace --last 12 /tmp/trace     # and every rank's last 12 operations, on one time line
//! ```
//!
//! The reading itself ([`analyze()`]) is a pure function of the dumps, tested without processes.

mod analyze;
mod text;
mod timeline;

use std::path::{Path, PathBuf};

use clap::Args;
use oxccl_comm::TraceDump;

pub use analyze::analyze;
pub use timeline::timeline;

/// `oxccl trace` arguments.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Directories of flight records (every `*.json` in them) or single record files.
    #[arg(value_name = "PATH", required = true)]
    pub paths: Vec<PathBuf>,

    /// Only communicators whose id contains this text.
    #[arg(long, value_name = "TEXT")]
    pub comm: Option<String>,

    /// After the reading, list the last N operations of every rank on one time line per
    /// communicator: when each started (after the earliest listed) and how long it took.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub last: Option<u32>,
}

/// Reads every flight record under `paths` (directories: their `*.json` files; files: as they
/// are). Returns the dumps and one line per file that could not be read.
pub fn load(paths: &[PathBuf]) -> (Vec<TraceDump>, Vec<String>) {
    let mut dumps = Vec::new();
    let mut problems = Vec::new();
    let mut read = |p: &Path, problems: &mut Vec<String>| match TraceDump::read(p) {
        Ok(d) => dumps.push(d),
        Err(e) => problems.push(e.to_string()),
    };
    for path in paths {
        if path.is_dir() {
            let entries = match std::fs::read_dir(path) {
                Ok(e) => e,
                Err(e) => {
                    problems.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension().is_some_and(|x| x == "json")
                        && !p
                            .file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                })
                .collect();
            files.sort();
            for f in files {
                read(&f, &mut problems);
            }
        } else {
            read(path, &mut problems);
        }
    }
    (dumps, problems)
}

/// Runs `oxccl trace`: prints the reading of the records to stdout; returns the exit code (0;
/// 2 when nothing could be read).
pub fn run(args: TraceArgs) -> u8 {
    use std::io::Write as _;
    let (mut dumps, problems) = load(&args.paths);
    for p in &problems {
        let _ = writeln!(std::io::stderr(), "oxccl trace: skipped {p}");
    }
    if let Some(text) = &args.comm {
        dumps.retain(|d| d.comm.contains(text.as_str()));
    }
    if dumps.is_empty() {
        let where_ = args
            .paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            std::io::stderr(),
            "oxccl trace: no flight records in {where_}{} (ranks write them with OXCCL_TRACE_DIR \
             set, when a communicator fails or is dropped)",
            args.comm
                .as_deref()
                .map(|c| format!(" for communicators matching {c:?}"))
                .unwrap_or_default()
        );
        return 2;
    }
    let mut text = analyze(&dumps);
    if let Some(n) = args.last {
        text.push('\n');
        text.push_str(&timeline(&dumps, n as usize));
    }
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    0
}
