//! Forwarding of the ranks' stdout/stderr to the launcher's, one whole line at a time.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Longest line forwarded in one piece; longer lines are cut.
const MAX_LINE: u64 = 1 << 20;

/// Where a rank's pipe is forwarded to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sink {
    Stdout,
    Stderr,
}

/// Starts a thread that copies `src` line by line to `sink`, each line preceded by `prefix`.
pub(super) fn forward<R: Read + Send + 'static>(
    src: R,
    prefix: Vec<u8>,
    sink: Sink,
    name: String,
) -> io::Result<JoinHandle<()>> {
    thread::Builder::new()
        .name(name)
        .spawn(move || pump(src, &prefix, sink))
}

fn pump<R: Read>(src: R, prefix: &[u8], sink: Sink) {
    let mut reader = BufReader::with_capacity(64 * 1024, src);
    let mut line = Vec::with_capacity(256);
    let mut sink_ok = true;
    loop {
        line.clear();
        line.extend_from_slice(prefix);
        match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                // Keep draining the pipe after the sink broke (e.g. `| head`), so the rank never
                // blocks on a full pipe.
                if sink_ok {
                    if let Err(e) = emit(sink, &line) {
                        tracing::debug!("oxccl launch: cannot forward rank output: {e}");
                        sink_ok = false;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::debug!("oxccl launch: reading rank output failed: {e}");
                break;
            }
        }
    }
}

/// Writes one whole line while holding the stream's lock, so lines never interleave.
fn emit(sink: Sink, line: &[u8]) -> io::Result<()> {
    match sink {
        Sink::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(line)?;
            out.flush()
        }
        Sink::Stderr => {
            let mut err = io::stderr().lock();
            err.write_all(line)?;
            err.flush()
        }
    }
}

/// Joins the forwarding threads that finish within `timeout`; the others (pipes still held open
/// by a process that escaped the job) are detached.
pub(super) fn drain(readers: Vec<JoinHandle<()>>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while readers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
    for h in readers {
        if h.is_finished() {
            let _ = h.join();
        } else {
            tracing::warn!(
                "oxccl launch: a rank's output pipe is still open (held by a process outside the \
                 job?); no longer forwarding it"
            );
        }
    }
}
