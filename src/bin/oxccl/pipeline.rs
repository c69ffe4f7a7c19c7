//! `oxccl pipeline`: a pipeline schedule's timeline, printed as text or drawn as SVG, with its
//! bubble against the theory and the simulator's verdict (no communicator needed).
//!
//! ```text
//! oxccl pipeline --schedule 1f1b -p 4 -m 8
//! oxccl pipeline --schedule interleaved -p 4 -m 8 -v 2 --plot timeline.svg
//! oxccl pipeline --schedule zb-h1 -p 4 -m 8 --actions
//! ```

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use oxccl_pipeline::{simulate, timeline, Action, Costs, Schedule, ScheduleKind, Timeline};

#[derive(Debug, Args)]
pub struct PipelineArgs {
    /// gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Ranks (pipeline stages, or ranks of v chunks each).
    #[arg(short = 'p', long, default_value_t = 4)]
    ranks: usize,
    /// Micro-batches per step.
    #[arg(short = 'm', long, default_value_t = 8)]
    micro: usize,
    /// Model chunks per rank (interleaved).
    #[arg(short = 'v', long, default_value_t = 1)]
    chunks: usize,
    /// Relative costs of a forward, an input-gradient and a weight-gradient backward.
    #[arg(long, default_value = "1,1,1", value_parser = parse_costs)]
    costs: Costs,
    /// Draw the timeline into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also print each rank's action list, exchanges included.
    #[arg(long)]
    actions: bool,
}

fn parse_costs(s: &str) -> Result<Costs, String> {
    let v: Vec<u32> = s
        .split(',')
        .map(|x| x.trim().parse::<u32>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [f, b, w] if f > 0 && b > 0 && w > 0 => Ok(Costs {
            forward: f,
            backward_input: b,
            weight: w,
        }),
        _ => Err(format!("{s:?}: three positive integers F,B,W")),
    }
}

/// A computation's label: kind letter, micro-batch, and chunk when there are several.
fn label(a: &Action, chunks: usize) -> String {
    let (k, st) = match a {
        Action::Forward(s) => ('F', s),
        Action::Backward(s) => ('B', s),
        Action::BackwardInput(s) => ('b', s),
        Action::BackwardWeight(s) => ('W', s),
        Action::Exchange(_) => return String::new(),
    };
    if chunks > 1 {
        format!("{k}{}.{}", st.mb, st.chunk)
    } else {
        format!("{k}{}", st.mb)
    }
}

/// One row per rank, one cell per time unit.
fn text(s: &Schedule, t: &Timeline) -> String {
    let width = t
        .ranks
        .iter()
        .flatten()
        .map(|(a, _, _)| label(a, s.v).len())
        .max()
        .unwrap_or(1)
        + 1;
    let mut out = String::new();
    for (r, row) in t.ranks.iter().enumerate() {
        let mut cells = vec![".".to_string(); t.total as usize];
        for (a, start, end) in row {
            for c in &mut cells[*start as usize..*end as usize] {
                *c = label(a, s.v);
            }
        }
        let _ = write!(out, "rank {r:>2} |");
        for c in cells {
            let _ = write!(out, "{c:>width$}");
        }
        out.push('\n');
    }
    out
}

/// The timeline as an SVG drawing.
fn svg(s: &Schedule, t: &Timeline, title: &str) -> String {
    let (unit, row, top, left) = (28.0, 26.0, 30.0, 60.0);
    let w = left + unit * t.total as f64 + 10.0;
    let h = top + row * s.p as f64 + 10.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"monospace\" font-size=\"11\">\n<text x=\"4\" y=\"18\">{title}</text>\n"
    );
    for (r, line) in t.ranks.iter().enumerate() {
        let y = top + row * r as f64;
        let _ = writeln!(out, "<text x=\"4\" y=\"{}\">rank {r}</text>", y + 16.0);
        for (a, start, end) in line {
            let hue = match a {
                Action::Forward(_) => 210,
                Action::Backward(_) => 130,
                Action::BackwardInput(_) => 30,
                _ => 280,
            };
            let light = 75 - 15 * a.step().map_or(0, |st| st.chunk % 3) as i32;
            let x = left + unit * *start as f64;
            let width = unit * (end - start) as f64;
            let _ = writeln!(
                out,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"hsl({hue},60%,{light}%)\" stroke=\"#333\"/><text x=\"{}\" y=\"{}\">{}</text>",
                width - 1.0,
                row - 4.0,
                x + 3.0,
                y + 15.0,
                label(a, s.v)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

/// Runs `oxccl pipeline`; returns the exit code.
pub fn run(a: PipelineArgs) -> u8 {
    let s = match Schedule::with_costs(a.schedule, a.ranks, a.micro, a.chunks, a.costs) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("oxccl pipeline: {e}");
            return 2;
        }
    };
    let t = match timeline(&s, a.costs) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("oxccl pipeline: {e}");
            return 1;
        }
    };
    let verdict = match simulate(&s) {
        Ok(_) => "deadlock-free and complete (simulated with rendezvous sends)".to_string(),
        Err(e) => format!("FAILS in the simulator: {e}"),
    };
    let title = format!(
        "{} p {} m {} v {} costs F {} B {} W {}",
        s.kind, s.p, s.m, s.v, a.costs.forward, a.costs.backward_input, a.costs.weight
    );
    println!("{title}");
    print!("{}", text(&s, &t));
    println!(
        "F forward, B backward, b input gradient, W weight gradient{}; . idle",
        if s.v > 1 { ", .c chunk" } else { "" }
    );
    println!(
        "time {} units, bubble {:.3} (theory {:.3}); {verdict}",
        t.total,
        t.bubble(),
        s.kind.theory_bubble(s.p, s.m, s.v, a.costs)
    );
    if a.actions {
        for (r, list) in s.ranks.iter().enumerate() {
            println!("rank {r}:");
            for act in list {
                match act {
                    Action::Exchange(ops) => println!("  exchange {ops:?}"),
                    other => println!("  {}", label(other, s.v)),
                }
            }
        }
    }
    if let Some(path) = a.plot {
        if let Err(e) = std::fs::write(&path, svg(&s, &t, &title)) {
            eprintln!("oxccl pipeline: writing {}: {e}", path.display());
            return 1;
        }
        println!("timeline drawn in {}", path.display());
    }
    u8::from(verdict.starts_with("FAILS"))
}
