//! The progress line (`\r[perf] all-reduce float sum 1048576 B (12/24)`), shown by rank 0 only
//! when a person is watching: its own stderr is a terminal, or the `oxccl perf --np` parent's
//! stderr was (the parent sets `OXCCL_PERF_PROGRESS=1` and rank 0 writes to `/dev/tty`, since its
//! own stderr is the launcher's pipe, which forwards whole lines only).
//!
//! A background thread draws the line once a step has run for [`SHOW_AFTER`], so quick steps do
//! not flicker and table rows (which may travel through the launcher's pipe) have long reached
//! the terminal before the line is drawn. Printing a row first erases the line, under the same
//! lock.

use std::fs::OpenOptions;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a step runs before the line shows it.
pub const SHOW_AFTER: Duration = Duration::from_millis(300);

/// Environment variable the `--np` parent sets when its stderr is a terminal.
pub const PROGRESS_ENV: &str = "OXCCL_PERF_PROGRESS";

struct State {
    sink: Box<dyn Write + Send>,
    msg: String,
    since: Instant,
    shown: Option<String>,
}

/// The progress line; a no-op when nobody watches.
pub struct Progress {
    state: Option<Arc<Mutex<State>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// A progress line if stderr (or the parent's) is a terminal, else a no-op.
    pub fn new(enabled: bool) -> Progress {
        let sink: Option<Box<dyn Write + Send>> = if !enabled {
            None
        } else if std::io::stderr().is_terminal() {
            Some(Box::new(std::io::stderr()))
        } else if std::env::var_os(PROGRESS_ENV).is_some_and(|v| v == "1") {
            OpenOptions::new()
                .write(true)
                .open("/dev/tty")
                .ok()
                .map(|f| Box::new(f) as Box<dyn Write + Send>)
        } else {
            None
        };
        let stop = Arc::new(AtomicBool::new(false));
        let Some(sink) = sink else {
            return Progress {
                state: None,
                stop,
                thread: None,
            };
        };
        let state = Arc::new(Mutex::new(State {
            sink,
            msg: String::new(),
            since: Instant::now(),
            shown: None,
        }));
        let (st, stp) = (Arc::clone(&state), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("oxccl-perf-progress".into())
            .spawn(move || {
                while !stp.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
                    if s.msg.is_empty()
                        || s.since.elapsed() < SHOW_AFTER
                        || s.shown.as_deref() == Some(s.msg.as_str())
                    {
                        continue;
                    }
                    let line = format!("\r[perf] {}\x1b[K", s.msg);
                    let _ = s.sink.write_all(line.as_bytes());
                    let _ = s.sink.flush();
                    s.shown = Some(s.msg.clone());
                }
            })
            .ok();
        Progress {
            state: Some(state),
            stop,
            thread,
        }
    }

    /// Starts a new step.
    pub fn set(&self, msg: String) {
        if let Some(st) = &self.state {
            let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
            s.msg = msg;
            s.since = Instant::now();
        }
    }

    /// Erases the line (if shown) and runs `f` (which prints table output) before it can be
    /// drawn again.
    pub fn print<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some(st) = &self.state else { return f() };
        let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
        if s.shown.take().is_some() {
            let _ = s.sink.write_all(b"\r\x1b[K");
            let _ = s.sink.flush();
        }
        let r = f();
        s.since = Instant::now();
        r
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.print(|| ());
        if let Some(st) = &self.state {
            st.lock().unwrap_or_else(|p| p.into_inner()).msg.clear();
        }
    }
}
